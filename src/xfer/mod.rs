//! Transfers: validation and cutting of descriptor lists (prepXfer) into ring ops, each
//! request's state machine, and the driver that moves requests through the ring.

pub mod bind;
mod callers;
mod cut;
mod descriptors;
mod direction;
pub mod driver;
pub mod plan;
pub mod prep_pool;
pub mod profile;
pub mod progress;
pub mod recycle;
pub mod request;

pub use direction::XferOp;
pub use plan::{Plan, Planner};
