//! NIXL's transfer direction as the plugin reads it.

use crate::error::{Error, Result};

/// NIXL's transfer direction: READ = storage -> memory, WRITE = memory -> storage.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum XferOp {
    Read,
    Write,
}

impl XferOp {
    pub fn from_nixl(value: i32) -> Result<XferOp> {
        match value {
            0 => Ok(XferOp::Read),
            1 => Ok(XferOp::Write),
            v => Err(Error::invalid(format!(
                "unknown transfer operation {v} (expected NIXL_READ=0 or NIXL_WRITE=1)"
            ))),
        }
    }
}
