//! Embeddings handed from vision-svc to llm-svc inside one process (`vlm serve` runs the
//! three services in one): the vision tower's output tensors stay where they were computed,
//! vision-svc deposits them here, and llm-svc takes them by the number it was sent. Nothing
//! crosses to the host (llm-svc's step copies the rows on the device, onto its own stream),
//! and the rows keep the tower's own precision.
//!
//! Negotiated, as shared memory is (`vlm_proto::shm`): llm-svc names its [`domain`] (this
//! process and its device) in its response headers, the gateway passes it to vision-svc, and
//! vision-svc deposits only when the domain is its own. Numbers are random, so one cannot be
//! guessed from another. A deposit nobody takes (a gateway that failed between its two calls)
//! is dropped by [`sweep`] after [`TTL`], freeing its device memory.

use std::any::Any;
use std::collections::HashMap;
use std::hash::{BuildHasher, Hasher};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

/// How long a deposit waits to be taken: far longer than the hop through the gateway takes.
pub const TTL: Duration = Duration::from_secs(60);

/// A tensor of some backend's own type, `[rows, cols]`, type-erased so that it can travel in
/// [`crate::Embeddings`]; only a backend of that type reads it
/// ([`crate::Backend::upload_embeddings`]).
#[derive(Clone)]
pub struct DeviceRows {
    shape: Vec<usize>,
    tensor: Arc<dyn Any + Send + Sync>,
    identity: Vec<u8>,
}

impl DeviceRows {
    /// `tensor` (of shape `shape`) with `identity`, the bytes that stand for its content in
    /// the prefix cache (an encoding's cache key), since its values are not on the host.
    pub fn new<T: Any + Send + Sync>(shape: Vec<usize>, tensor: T, identity: Vec<u8>) -> Self {
        Self {
            shape,
            tensor: Arc::new(tensor),
            identity,
        }
    }

    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// The tensor, if it is a `T`.
    pub fn get<T: Any>(&self) -> Option<&T> {
        self.tensor.downcast_ref()
    }

    pub fn identity(&self) -> &[u8] {
        &self.identity
    }
}

impl std::fmt::Debug for DeviceRows {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceRows")
            .field("shape", &self.shape)
            .finish_non_exhaustive()
    }
}

impl PartialEq for DeviceRows {
    /// The same tensor (not merely equal values).
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.tensor, &other.tensor) && self.shape == other.shape
    }
}

type Deposits = HashMap<u64, (Instant, Box<dyn Any + Send>)>;

fn deposits() -> &'static Mutex<Deposits> {
    static DEPOSITS: OnceLock<Mutex<Deposits>> = OnceLock::new();
    DEPOSITS.get_or_init(Default::default)
}

fn lock() -> std::sync::MutexGuard<'static, Deposits> {
    deposits().lock().unwrap_or_else(|e| e.into_inner())
}

/// A random 64-bit number: the hash of nothing under a fresh `RandomState`, whose keys std
/// draws from the OS once per thread and steps for every new one.
fn random() -> u64 {
    std::collections::hash_map::RandomState::new()
        .build_hasher()
        .finish()
}

/// What identifies this process and `device` (e.g. "cuda:0"): equal only for two services of
/// one process on one device.
pub fn domain(device: &str) -> String {
    static PROCESS: OnceLock<String> = OnceLock::new();
    let process = PROCESS.get_or_init(|| format!("{:016x}{:016x}", random(), random()));
    format!("{process}/{device}")
}

/// Keeps `value` until it is taken, and returns its number (never 0).
pub fn deposit<T: Any + Send>(value: T) -> u64 {
    let mut held = lock();
    let id = loop {
        let id = random();
        if id != 0 && !held.contains_key(&id) {
            break id;
        }
    };
    held.insert(id, (Instant::now(), Box::new(value)));
    id
}

/// The value deposited as `id`, if it is still held and is a `T` (taken either way).
pub fn take<T: Any>(id: u64) -> Option<T> {
    let (_, value) = lock().remove(&id)?;
    value.downcast().ok().map(|v| *v)
}

/// Drops the deposits older than `ttl`; returns how many.
pub fn sweep(ttl: Duration) -> usize {
    let mut held = lock();
    let before = held.len();
    held.retain(|_, (at, _)| at.elapsed() <= ttl);
    before - held.len()
}

/// Deposits held now.
pub fn held() -> usize {
    lock().len()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One test: the deposits are process-wide, and a sweep in a parallel test would race.
    #[test]
    fn deposits_are_taken_once_as_their_own_type_and_old_ones_swept() {
        let a = deposit(vec![1u8, 2, 3]);
        let b = deposit(String::from("x"));
        assert_ne!(a, b);
        assert_eq!(
            take::<String>(a),
            None,
            "the wrong type is refused (and dropped)"
        );
        assert_eq!(take::<Vec<u8>>(a), None, "gone");
        assert_eq!(take::<String>(b).as_deref(), Some("x"));
        assert_eq!(take::<String>(b), None);

        let id = deposit(7u32);
        assert_eq!(sweep(Duration::from_secs(3600)), 0);
        std::thread::sleep(Duration::from_millis(5));
        assert!(sweep(Duration::from_millis(1)) >= 1);
        assert_eq!(take::<u32>(id), None);
        assert_eq!(domain("cuda:0"), domain("cuda:0"));
        assert_ne!(domain("cuda:0"), domain("cpu"));
        assert!(domain("cpu").ends_with("/cpu"));
    }
}
