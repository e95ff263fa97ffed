//! The `vlm` command line's library: the system composed in one process, on top of the gateway
//! and the two model stages (the gateway's own crate links neither).
//!
//! - [`pipeline`]: the whole request in one process (`vlm run`).
//! - [`stack`]: all three services in one process, on loopback (`vlm serve`, `vlm bench`'s
//!   through-the-gateway rows, `vlm load`), with device handoffs released in-process.
//! - [`bench`] and [`load`]: the measurements of `vlm bench` and `vlm load`; [`stand_in`]: an
//!   llm-svc without a model, to measure the gateway alone.

pub mod bench;
mod error;
pub mod footprint;
pub mod load;
pub mod pipeline;
pub mod stack;
pub mod stand_in;

pub use error::{Error, Result};
