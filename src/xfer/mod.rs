//! Transfers: validation and planning of descriptor lists (prepXfer) into ring ops.

pub mod cufile_exec;
pub mod plan;

pub use plan::{plan, Plan, XferOp};
