//! cuFile status codes (`CUfileOpError` of cufile.h) as readable names.

/// Human-readable cuFile status: every `CUfileOpError` of cufile.h, with a hint where one helps.
pub fn status_name(code: i32) -> String {
    let name = match code {
        0 => "SUCCESS",
        5001 => "DRIVER_NOT_INITIALIZED (nvidia-fs not loaded and compatibility mode off)",
        5002 => "DRIVER_INVALID_PROPS",
        5003 => "DRIVER_UNSUPPORTED_LIMIT",
        5004 => "DRIVER_VERSION_MISMATCH",
        5005 => "DRIVER_VERSION_READ_ERROR",
        5006 => "DRIVER_CLOSING",
        5007 => "PLATFORM_NOT_SUPPORTED",
        5008 => "IO_NOT_SUPPORTED",
        5009 => "DEVICE_NOT_SUPPORTED",
        5010 => "NVFS_DRIVER_ERROR",
        5011 => "CUDA_DRIVER_ERROR",
        5012 => "CUDA_POINTER_INVALID",
        5013 => "CUDA_MEMORY_TYPE_INVALID",
        5014 => "CUDA_POINTER_RANGE_ERROR",
        5015 => "CUDA_CONTEXT_MISMATCH",
        5016 => "INVALID_MAPPING_SIZE",
        5017 => "INVALID_MAPPING_RANGE",
        5018 => "INVALID_FILE_TYPE",
        5019 => "INVALID_FILE_OPEN_FLAG",
        5020 => "DIO_NOT_SET",
        5022 => "INVALID_VALUE",
        5023 => "MEMORY_ALREADY_REGISTERED",
        5024 => "MEMORY_NOT_REGISTERED",
        5025 => "PERMISSION_DENIED",
        5026 => "DRIVER_ALREADY_OPEN",
        5027 => {
            "HANDLE_NOT_REGISTERED (on machines without udevd cuFile finds no ID_FS_USAGE for the \
             disk; see ci/gpu/udev-shim.sh)"
        }
        5028 => "HANDLE_ALREADY_REGISTERED",
        5029 => "DEVICE_NOT_FOUND",
        5030 => "INTERNAL_ERROR",
        5031 => "GETNEWFD_FAILED",
        5033 => "NVFS_SETUP_ERROR",
        5034 => "IO_DISABLED (GPUDirect Storage disabled by cufile.json for this file)",
        5035 => "BATCH_SUBMIT_FAILED",
        5036 => "GPU_MEMORY_PINNING_FAILED",
        5037 => "BATCH_FULL",
        5038 => "ASYNC_NOT_SUPPORTED",
        5039..=5042 => "internal batch error",
        5043 => "NOMEM",
        5044 => "IO_ERROR",
        5045 => "INTERNAL_BUF_REGISTER_ERROR",
        5046 => "HASH_OPR_ERROR",
        5047 => "INVALID_CONTEXT",
        5048 => "NVFS_INTERNAL_DRIVER_ERROR",
        5049 => "BATCH_NOCOMPAT_ERROR",
        5050 => "IO_MAX_ERROR",
        _ => return format!("cuFile error {code}"),
    };
    format!("{code} {name}")
}
