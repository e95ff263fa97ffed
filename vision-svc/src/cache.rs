//! The image-embedding cache: an image sent again (a multi-turn chat resends its history with
//! its images; many clients send the same picture) gets its embeddings back without being
//! decoded, preprocessed or run through the ViT.
//!
//! Entries are whole `EncodeResponse`s, as packed for the wire (their tensors' bytes are
//! reference-counted, so a hit copies nothing), keyed by the SHA-256 of the image bytes, the
//! element type asked for and the preprocessing settings: a collision would hand one client's
//! image to another, so the hash is a cryptographic one. Least recently used entries go first
//! once the bytes held pass the budget.

use std::sync::Mutex;

use lru::LruCache;
use prometheus::{IntCounter, IntGauge, Opts, Registry};
use sha2::{Digest, Sha256};
use vlm_proto::pb::{Dtype, EncodeResponse};

use crate::PreprocessConfig;

/// What identifies an encoding: SHA-256 of the image bytes, the dtype and the settings.
pub type CacheKey = [u8; 32];

/// The key of `image` encoded as `dtype` under `settings`.
pub fn key(image: &[u8], dtype: Dtype, settings: &PreprocessConfig) -> CacheKey {
    let mut h = Sha256::new();
    // Settings first, each field separated, so no image bytes can pass for them.
    h.update(format!("{settings:?}|{}|", dtype as i32).as_bytes());
    h.update(image);
    h.finalize().into()
}

/// Bytes of embeddings an entry holds (what the budget counts).
fn held_bytes(r: &EncodeResponse) -> usize {
    r.tensors().map(|t| t.data.len()).sum()
}

pub struct EmbeddingCache {
    budget: usize,
    held: Mutex<Held>,
    metrics: CacheMetrics,
}

struct Held {
    entries: LruCache<CacheKey, EncodeResponse>,
    bytes: usize,
}

impl EmbeddingCache {
    /// A cache of at most `budget` bytes of embeddings (0: off), its counters in `registry`.
    pub fn new(budget: usize, registry: &Registry) -> Self {
        Self {
            budget,
            held: Mutex::new(Held {
                entries: LruCache::unbounded(),
                bytes: 0,
            }),
            metrics: CacheMetrics::new(registry),
        }
    }

    pub fn enabled(&self) -> bool {
        self.budget > 0
    }

    /// The entry for `key`, if held (counted as a hit or a miss).
    pub fn get(&self, key: &CacheKey) -> Option<EncodeResponse> {
        let found = self.lock().entries.get(key).cloned();
        match found {
            Some(_) => self.metrics.hits.inc(),
            None => self.metrics.misses.inc(),
        }
        found
    }

    /// Keeps `response` under `key`, dropping the least recently used entries until the budget
    /// holds. An entry larger than the whole budget is not kept.
    pub fn insert(&self, key: CacheKey, response: &EncodeResponse) {
        let bytes = held_bytes(response);
        if bytes > self.budget {
            return;
        }
        let mut held = self.lock();
        if let Some(old) = held.entries.put(key, response.clone()) {
            held.bytes -= held_bytes(&old);
        }
        held.bytes += bytes;
        while held.bytes > self.budget {
            let Some((_, old)) = held.entries.pop_lru() else {
                break;
            };
            held.bytes -= held_bytes(&old);
        }
        self.metrics.bytes.set(held.bytes as i64);
        self.metrics.entries.set(held.entries.len() as i64);
    }

    /// Hits so far (tests).
    #[cfg(test)]
    pub(crate) fn hits(&self) -> u64 {
        self.metrics.hits.get()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Held> {
        // The map is consistent between statements: a panic elsewhere leaves it usable.
        self.held.lock().unwrap_or_else(|e| e.into_inner())
    }
}

#[derive(Clone)]
struct CacheMetrics {
    hits: IntCounter,
    misses: IntCounter,
    bytes: IntGauge,
    entries: IntGauge,
}

impl CacheMetrics {
    fn new(registry: &Registry) -> Self {
        let counter = |name: &str, help: &str| IntCounter::with_opts(Opts::new(name, help));
        let gauge = |name: &str, help: &str| IntGauge::with_opts(Opts::new(name, help));
        let m = Self {
            hits: counter(
                "vlm_vision_embedding_cache_hits_total",
                "Images whose embeddings came from the cache (no ViT pass)",
            )
            .expect("valid"),
            misses: counter(
                "vlm_vision_embedding_cache_misses_total",
                "Images looked up in the embedding cache and not found",
            )
            .expect("valid"),
            bytes: gauge(
                "vlm_vision_embedding_cache_bytes",
                "Bytes of embeddings the cache holds",
            )
            .expect("valid"),
            entries: gauge(
                "vlm_vision_embedding_cache_entries",
                "Images the embedding cache holds",
            )
            .expect("valid"),
        };
        for c in [
            Box::new(m.hits.clone()) as Box<dyn prometheus::core::Collector>,
            Box::new(m.misses.clone()),
            Box::new(m.bytes.clone()),
            Box::new(m.entries.clone()),
        ] {
            registry.register(c).expect("metric names are unique");
        }
        m
    }
}

/// The default budget: 512 MiB holds ~80 images of 448x448 at 8B sizes in f16 (6.4 MB each),
/// or 9 of 1344x1344.
pub const DEFAULT_BUDGET_BYTES: usize = 512 << 20;

#[cfg(test)]
mod tests {
    use super::*;
    use vlm_proto::pb::Tensor;

    fn response(bytes: usize, fill: u8) -> EncodeResponse {
        EncodeResponse {
            embeddings: Some(Tensor {
                dtype: Dtype::F16 as i32,
                shape: vec![bytes as u64 / 2],
                data: vec![fill; bytes].into(),
                shm_offset: None,
            }),
            deepstack: vec![],
            grid_thw: vec![1, 2, 2],
            ..Default::default()
        }
    }

    #[test]
    fn evicts_least_recently_used_past_the_budget_and_counts() {
        let registry = Registry::new();
        let cache = EmbeddingCache::new(300, &registry);
        let k = |i: u8| [i; 32];
        cache.insert(k(1), &response(100, 1));
        cache.insert(k(2), &response(100, 2));
        cache.insert(k(3), &response(100, 3));
        // 1 is used, so 2 is now the least recent and goes when 4 arrives.
        assert!(cache.get(&k(1)).is_some());
        cache.insert(k(4), &response(100, 4));
        assert!(cache.get(&k(2)).is_none());
        for i in [1, 3, 4] {
            let r = cache.get(&k(i)).unwrap();
            assert_eq!(r.embeddings.unwrap().data[0], i);
        }
        // Too large for the whole budget: not kept, nothing evicted for it.
        cache.insert(k(5), &response(301, 5));
        assert!(cache.get(&k(5)).is_none());
        assert_eq!(cache.metrics.hits.get(), 4);
        assert_eq!(cache.metrics.misses.get(), 2);
        assert_eq!(cache.metrics.bytes.get(), 300);
        assert_eq!(cache.metrics.entries.get(), 3);
        // Replacing an entry counts its bytes once.
        cache.insert(k(4), &response(100, 9));
        assert_eq!(cache.metrics.bytes.get(), 300);
    }

    #[test]
    fn keys_differ_by_image_dtype_and_settings() {
        let dir = vlm_compute::golden::tiny_fixture(env!("CARGO_MANIFEST_DIR"));
        let settings = PreprocessConfig::from_dir(&dir).unwrap();
        let base = key(b"image", Dtype::F16, &settings);
        assert_eq!(base, key(b"image", Dtype::F16, &settings));
        assert_ne!(base, key(b"imagf", Dtype::F16, &settings));
        assert_ne!(base, key(b"image", Dtype::F32, &settings));
        let mut other = settings.clone();
        other.max_pixels += 1;
        assert_ne!(base, key(b"image", Dtype::F16, &other));
    }
}
