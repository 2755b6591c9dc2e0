//! HSA status codes: the one mapping from `hsa_status_t` to a name and an engine error kind.
//!
//! Numbers are those of ROCR-Runtime's `hsa.h` (0x0, 0x1, 0x1000..0x1026) and the AMD additions
//! in `hsa_ext_amd.h` (40..46). Every error message of the ROCm provider carries the name, so a
//! log line says which status HSA returned even where the runtime has no `hsa_status_string`.

use crate::error::{Error, ErrorKind};

/// `hsa_status_t` (a C enum: 32 bits).
pub type HsaStatus = u32;

pub const SUCCESS: HsaStatus = 0x0;
pub const INFO_BREAK: HsaStatus = 0x1;
pub const ERROR: HsaStatus = 0x1000;
pub const ERROR_INVALID_ARGUMENT: HsaStatus = 0x1001;
pub const ERROR_INVALID_ALLOCATION: HsaStatus = 0x1003;
pub const ERROR_INVALID_AGENT: HsaStatus = 0x1004;
pub const ERROR_OUT_OF_RESOURCES: HsaStatus = 0x1008;
pub const ERROR_NOT_INITIALIZED: HsaStatus = 0x100B;

/// The name of a status and the error kind the engine reports it as.
///
/// Kinds: statuses that blame the caller's memory or arguments (a VRAM registration that is not
/// a GPU allocation, a bad agent) are `InvalidParam`; "not initialized"/"wrong runtime state"
/// are `NotAllowed`; resources, device faults and everything unknown are `Backend`.
pub fn describe(code: HsaStatus) -> (&'static str, ErrorKind) {
    use ErrorKind::*;
    match code {
        0x0 => ("HSA_STATUS_SUCCESS", Backend),
        0x1 => ("HSA_STATUS_INFO_BREAK", Backend),
        0x1000 => ("HSA_STATUS_ERROR", Backend),
        0x1001 => ("HSA_STATUS_ERROR_INVALID_ARGUMENT", InvalidParam),
        0x1002 => ("HSA_STATUS_ERROR_INVALID_QUEUE_CREATION", Backend),
        0x1003 => ("HSA_STATUS_ERROR_INVALID_ALLOCATION", InvalidParam),
        0x1004 => ("HSA_STATUS_ERROR_INVALID_AGENT", InvalidParam),
        0x1005 => ("HSA_STATUS_ERROR_INVALID_REGION", InvalidParam),
        0x1006 => ("HSA_STATUS_ERROR_INVALID_SIGNAL", Backend),
        0x1007 => ("HSA_STATUS_ERROR_INVALID_QUEUE", Backend),
        0x1008 => ("HSA_STATUS_ERROR_OUT_OF_RESOURCES", Backend),
        0x1009 => ("HSA_STATUS_ERROR_INVALID_PACKET_FORMAT", Backend),
        0x100A => ("HSA_STATUS_ERROR_RESOURCE_FREE", Backend),
        0x100B => ("HSA_STATUS_ERROR_NOT_INITIALIZED", NotAllowed),
        0x100C => ("HSA_STATUS_ERROR_REFCOUNT_OVERFLOW", Backend),
        0x100D => ("HSA_STATUS_ERROR_INCOMPATIBLE_ARGUMENTS", InvalidParam),
        0x100E => ("HSA_STATUS_ERROR_INVALID_INDEX", InvalidParam),
        0x100F => ("HSA_STATUS_ERROR_INVALID_ISA", Backend),
        0x1010 => ("HSA_STATUS_ERROR_INVALID_CODE_OBJECT", Backend),
        0x1011 => ("HSA_STATUS_ERROR_INVALID_EXECUTABLE", Backend),
        0x1012 => ("HSA_STATUS_ERROR_FROZEN_EXECUTABLE", Backend),
        0x1013 => ("HSA_STATUS_ERROR_INVALID_SYMBOL_NAME", Backend),
        0x1014 => ("HSA_STATUS_ERROR_VARIABLE_ALREADY_DEFINED", Backend),
        0x1015 => ("HSA_STATUS_ERROR_VARIABLE_UNDEFINED", Backend),
        0x1016 => ("HSA_STATUS_ERROR_EXCEPTION", Backend),
        0x1017 => ("HSA_STATUS_ERROR_INVALID_ISA_NAME", Backend),
        0x1018 => ("HSA_STATUS_ERROR_INVALID_CODE_SYMBOL", Backend),
        0x1019 => ("HSA_STATUS_ERROR_INVALID_EXECUTABLE_SYMBOL", Backend),
        0x1020 => ("HSA_STATUS_ERROR_INVALID_FILE", InvalidParam),
        0x1021 => ("HSA_STATUS_ERROR_INVALID_CODE_OBJECT_READER", Backend),
        0x1022 => ("HSA_STATUS_ERROR_INVALID_CACHE", Backend),
        0x1023 => ("HSA_STATUS_ERROR_INVALID_WAVEFRONT", Backend),
        0x1024 => ("HSA_STATUS_ERROR_INVALID_SIGNAL_GROUP", Backend),
        0x1025 => ("HSA_STATUS_ERROR_INVALID_RUNTIME_STATE", NotAllowed),
        0x1026 => ("HSA_STATUS_ERROR_FATAL", Backend),
        40 => ("HSA_STATUS_ERROR_INVALID_MEMORY_POOL", InvalidParam),
        41 => ("HSA_STATUS_ERROR_MEMORY_APERTURE_VIOLATION", Backend),
        42 => ("HSA_STATUS_ERROR_ILLEGAL_INSTRUCTION", Backend),
        43 => ("HSA_STATUS_ERROR_MEMORY_FAULT", Backend),
        44 => ("HSA_STATUS_CU_MASK_REDUCED", Backend),
        45 => ("HSA_STATUS_ERROR_OUT_OF_REGISTERS", Backend),
        46 => ("HSA_STATUS_ERROR_RESOURCE_BUSY", Backend),
        _ => ("HSA status unknown to this build", Backend),
    }
}

/// "HSA_STATUS_ERROR_INVALID_ALLOCATION (0x1003)".
pub fn name(code: HsaStatus) -> String {
    format!("{} (0x{code:x})", describe(code).0)
}

/// Turns the status of `call` into a result; the error names the call and the status.
/// `INFO_BREAK` counts as success: it only says a traversal was stopped by its callback.
pub fn check(call: &str, code: HsaStatus) -> Result<(), Error> {
    match code {
        SUCCESS | INFO_BREAK => Ok(()),
        _ => Err(error(call, code)),
    }
}

/// The error for a failed `call`.
pub fn error(call: &str, code: HsaStatus) -> Error {
    Error::new(describe(code).1, format!("{call} failed: {}", name(code)))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every number of hsa.h and hsa_ext_amd.h, with the name the header gives it.
    const ALL: [(HsaStatus, &str); 45] = [
        (0x0, "SUCCESS"),
        (0x1, "INFO_BREAK"),
        (0x1000, "ERROR"),
        (0x1001, "ERROR_INVALID_ARGUMENT"),
        (0x1002, "ERROR_INVALID_QUEUE_CREATION"),
        (0x1003, "ERROR_INVALID_ALLOCATION"),
        (0x1004, "ERROR_INVALID_AGENT"),
        (0x1005, "ERROR_INVALID_REGION"),
        (0x1006, "ERROR_INVALID_SIGNAL"),
        (0x1007, "ERROR_INVALID_QUEUE"),
        (0x1008, "ERROR_OUT_OF_RESOURCES"),
        (0x1009, "ERROR_INVALID_PACKET_FORMAT"),
        (0x100A, "ERROR_RESOURCE_FREE"),
        (0x100B, "ERROR_NOT_INITIALIZED"),
        (0x100C, "ERROR_REFCOUNT_OVERFLOW"),
        (0x100D, "ERROR_INCOMPATIBLE_ARGUMENTS"),
        (0x100E, "ERROR_INVALID_INDEX"),
        (0x100F, "ERROR_INVALID_ISA"),
        (0x1010, "ERROR_INVALID_CODE_OBJECT"),
        (0x1011, "ERROR_INVALID_EXECUTABLE"),
        (0x1012, "ERROR_FROZEN_EXECUTABLE"),
        (0x1013, "ERROR_INVALID_SYMBOL_NAME"),
        (0x1014, "ERROR_VARIABLE_ALREADY_DEFINED"),
        (0x1015, "ERROR_VARIABLE_UNDEFINED"),
        (0x1016, "ERROR_EXCEPTION"),
        (0x1017, "ERROR_INVALID_ISA_NAME"),
        (0x1018, "ERROR_INVALID_CODE_SYMBOL"),
        (0x1019, "ERROR_INVALID_EXECUTABLE_SYMBOL"),
        (0x1020, "ERROR_INVALID_FILE"),
        (0x1021, "ERROR_INVALID_CODE_OBJECT_READER"),
        (0x1022, "ERROR_INVALID_CACHE"),
        (0x1023, "ERROR_INVALID_WAVEFRONT"),
        (0x1024, "ERROR_INVALID_SIGNAL_GROUP"),
        (0x1025, "ERROR_INVALID_RUNTIME_STATE"),
        (0x1026, "ERROR_FATAL"),
        (40, "ERROR_INVALID_MEMORY_POOL"),
        (41, "ERROR_MEMORY_APERTURE_VIOLATION"),
        (42, "ERROR_ILLEGAL_INSTRUCTION"),
        (43, "ERROR_MEMORY_FAULT"),
        (44, "CU_MASK_REDUCED"),
        (45, "ERROR_OUT_OF_REGISTERS"),
        (46, "ERROR_RESOURCE_BUSY"),
        (0x1027, "?"),
        (47, "?"),
        (0xdead_beef, "?"),
    ];

    #[test]
    fn every_hsa_status_has_its_header_name() {
        for (code, suffix) in ALL {
            let (name, _) = describe(code);
            if suffix == "?" {
                assert_eq!(name, "HSA status unknown to this build", "0x{code:x}");
            } else {
                assert_eq!(name, format!("HSA_STATUS_{suffix}"), "0x{code:x}");
            }
        }
    }

    #[test]
    fn every_failure_message_names_the_call_and_the_status() {
        for (code, _) in ALL {
            match check("hsa_amd_memory_lock(0x1000+4096)", code) {
                Ok(()) => assert!(
                    code == SUCCESS || code == INFO_BREAK,
                    "0x{code:x} must fail"
                ),
                Err(e) => {
                    assert!(
                        e.message
                            .starts_with("hsa_amd_memory_lock(0x1000+4096) failed: "),
                        "{}",
                        e.message
                    );
                    assert!(e.message.contains(describe(code).0), "{}", e.message);
                    assert!(e.message.contains(&format!("0x{code:x}")), "{}", e.message);
                }
            }
        }
    }

    #[test]
    fn statuses_blaming_the_registration_are_invalid_params() {
        for code in [0x1001, 0x1003, 0x1004, 0x1005, 0x100D, 0x100E, 0x1020, 40] {
            assert_eq!(describe(code).1, ErrorKind::InvalidParam, "{}", name(code));
        }
        for code in [0x100B, 0x1025] {
            assert_eq!(describe(code).1, ErrorKind::NotAllowed, "{}", name(code));
        }
        for code in [0x1000, 0x1008, 0x1026, 43, 46, 0x7777] {
            assert_eq!(describe(code).1, ErrorKind::Backend, "{}", name(code));
        }
        assert_eq!(
            error("x", 0x1008).to_status(),
            crate::error::status::ERR_BACKEND
        );
        assert_eq!(
            error("x", 0x1003).to_status(),
            crate::error::status::ERR_INVALID_PARAM
        );
    }
}
