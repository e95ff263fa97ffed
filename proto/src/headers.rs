//! The gRPC metadata our services add to the standard ones, each name defined here once.
//!
//! llm-svc names its domains in every `Generate` response's headers; the gateway passes them to
//! vision-svc, which takes a faster path for the embeddings only when the domain is its own.

/// The shared-memory domain ([`crate::shm::domain`]): segments written under it can be mapped
/// by llm-svc.
pub const SHM_DOMAIN: &str = "vlm-shm-domain";

/// The device domain (`vlm_compute::handoff::domain`): embeddings deposited on the device under
/// it can be taken by llm-svc in the same process.
pub const DEVICE_DOMAIN: &str = "vlm-device-domain";
