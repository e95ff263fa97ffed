//! The paged KV cache: one pool of fixed-size blocks allocated once at start-up, handed to
//! sequences as they grow, and shared between sequences that begin with the same tokens.
//!
//! - [`PagedKv`]: the device memory, one key and one value cache per layer, each
//!   `[blocks * block_size, kv_heads, head_dim]` (f16 on a GPU; with `--kv-cache-dtype fp8`,
//!   e4m3 bytes and a scale per layer's keys and values, [`kv_formats`]). Slot
//!   `b * block_size + o` is offset `o` of block `b`.
//! - [`BlockPool`]: which blocks are free, which are referenced (and by how many sequences),
//!   and the prefix cache: a full block is keyed by a hash of the previous block's hash, its
//!   token ids and the identity of any image among them (vLLM's automatic prefix caching), so
//!   a chat that resends its history and images finds those blocks already computed.
//!
//! Block 0 is never handed out: padding rows of a recorded batch write there.
//! A block whose last reference goes keeps its contents and its hash until it is reused, so a
//! later request can still hit it; free blocks are reused least recently freed first.

use std::collections::HashMap;

use vlm_compute::kv::DEFAULT_FP8_SCALE;
use vlm_compute::{Backend, KvCacheDtype, KvFormat, WeightPrefix};

use crate::{Error, Result, TextConfig};

/// The block naming rule is shared with the gateway, which routes by it.
pub use vlm_proto::prefix::{block_hash, BlockHash};

/// The block no sequence owns; padding rows of a recorded step read and write it.
pub const NULL_BLOCK: u32 = 0;

/// Keys and values of every layer, in blocks.
pub struct PagedKv<B: Backend> {
    pub k: Vec<B::Cache>,
    pub v: Vec<B::Cache>,
    pub block_size: usize,
    pub num_blocks: usize,
}

impl<B: Backend> PagedKv<B> {
    /// Allocates `num_blocks` blocks of `block_size` slots for every layer (zeroed), layer
    /// `i`'s keys and values stored as `formats[i]` says ([`kv_formats`]).
    pub fn new(
        be: &B,
        cfg: &TextConfig,
        num_blocks: usize,
        block_size: usize,
        formats: &[LayerKvFormat],
    ) -> Result<Self> {
        let slots = num_blocks * block_size;
        let (heads, dim) = (cfg.num_key_value_heads, cfg.head_dim);
        if formats.len() != cfg.num_hidden_layers {
            return Err(Error::Config(format!(
                "{} KV cache formats for {} layers",
                formats.len(),
                cfg.num_hidden_layers
            )));
        }
        let (mut k, mut v) = (Vec::new(), Vec::new());
        for f in formats {
            k.push(be.zeros_cache(slots, heads, dim, f.k)?);
            v.push(be.zeros_cache(slots, heads, dim, f.v)?);
        }
        Ok(Self {
            k,
            v,
            block_size,
            num_blocks,
        })
    }

    /// Memory one cached token takes: keys and values of every layer, at the backend's
    /// cache width (f16 on a GPU, f32 on the CPU) or one byte an element for an FP8 cache.
    pub fn bytes_per_token(cfg: &TextConfig, dtype: KvCacheDtype) -> usize {
        let element = match dtype {
            KvCacheDtype::Auto => KvFormat::Native,
            KvCacheDtype::Fp8 => KvFormat::Fp8 {
                scale: DEFAULT_FP8_SCALE,
            },
        }
        .element_bytes(B::CACHE_BYTES);
        2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * element
    }
}

/// How one layer's keys and values are stored.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LayerKvFormat {
    pub k: KvFormat,
    pub v: KvFormat,
}

/// Where an FP8 cache's scales came from, for the start-up log.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ScaleSource {
    /// Not an FP8 cache.
    None,
    /// Every layer's `k_scale` and `v_scale` (or their other spellings) from the checkpoint.
    Checkpoint,
    /// [`DEFAULT_FP8_SCALE`] for every layer (the checkpoint has none).
    Default,
}

/// The names a checkpoint's per-layer KV cache scale goes by, under `self_attn.`, keys first
/// and values second, as vLLM reads them (`maybe_remap_kv_scale_name`): its own and
/// llm-compressor's current `k_scale`, ModelOpt's `k_proj.k_scale`, compressed-tensors' older
/// `k_proj.output_scale`, and the deprecated `kv_scale` for both.
const SCALE_NAMES: [(&str, &str); 4] = [
    ("k_scale", "v_scale"),
    ("k_proj.k_scale", "v_proj.v_scale"),
    ("k_proj.output_scale", "v_proj.output_scale"),
    ("kv_scale", "kv_scale"),
];

/// The scale stored under `name` in `attn` (a layer's `self_attn`), if there is one: a scalar,
/// `[1]`, or one per KV head (`[kv_heads]`), of which the largest is taken (a larger scale
/// never saturates where a smaller one would not; the heads with smaller ones lose a little
/// precision). A scale that is no positive finite number is an error naming the tensor.
fn stored_scale(attn: &WeightPrefix, name: &str, kv_heads: usize) -> Result<Option<f32>> {
    // Random weights have no stored tensors (and `contains` is true for any name there).
    let Ok(shape) = attn.shape_of(name) else {
        return Ok(None);
    };
    let n: usize = shape.iter().product();
    if shape.len() > 1 || !(n == 1 || n == kv_heads) {
        return Err(Error::Config(format!(
            "--kv-cache-dtype fp8: `{}` has shape {shape:?}; a KV cache scale is a scalar, [1] or one per KV head ([{kv_heads}])",
            attn.name(name)
        )));
    }
    let values = attn.get(name, &shape)?;
    let scale = values.data().iter().copied().fold(f32::NAN, f32::max);
    let format = KvFormat::Fp8 { scale };
    if format.check().is_err() || values.data().iter().any(|v| !v.is_finite()) {
        return Err(Error::Config(format!(
            "--kv-cache-dtype fp8: `{}` holds {:?}; a KV cache scale must be a positive finite number",
            attn.name(name),
            values.data()
        )));
    }
    Ok(Some(scale))
}

/// Logs the layers whose keys can leave e4m3's range at their scale. With a per-head RMSNorm
/// (Qwen3's `k_norm`) a key element is at most `sqrt(head_dim) * max|k_norm.weight|` (the normed
/// head has RMS 1 before the weight, and RoPE turns pairs without lengthening them), so the
/// bound is known at load; past `448 * scale` such keys are clamped (never NaN). Values, and
/// keys without a norm (Qwen2), have no such bound: docs/serving.md says where that matters.
fn warn_of_saturating_keys(layers: &WeightPrefix, cfg: &TextConfig, stored: &[Option<(f32, f32)>]) {
    if !cfg.qk_norm {
        return;
    }
    let limit = vlm_compute::quant::fp8::E4M3_MAX;
    for (i, scales) in stored.iter().enumerate() {
        let name = "self_attn.k_norm.weight";
        let Ok(w) = layers.pp(i).get(name, &[cfg.head_dim]) else {
            continue;
        };
        let bound =
            (cfg.head_dim as f32).sqrt() * w.data().iter().fold(0.0f32, |m, x| m.max(x.abs()));
        let scale = scales.map_or(DEFAULT_FP8_SCALE, |(k, _)| k);
        if bound > limit * scale {
            tracing::warn!(
                layer = i,
                key_bound = bound,
                scale,
                "--kv-cache-dtype fp8: this layer's keys can reach {bound:.0}, past e4m3's {:.0} at its scale; such keys are clamped",
                limit * scale
            );
        }
    }
}

/// How every layer's keys and values are stored for `dtype`: natively, or (FP8) e4m3 with the
/// checkpoint's per-layer scales where it has them for every layer ([`SCALE_NAMES`]), else
/// [`DEFAULT_FP8_SCALE`] throughout (a checkpoint with scales for some layers only is an
/// error: it is damaged or of a layout this does not know).
pub fn kv_formats(
    dtype: KvCacheDtype,
    layers: &WeightPrefix,
    cfg: &TextConfig,
) -> Result<(Vec<LayerKvFormat>, ScaleSource)> {
    let native = LayerKvFormat {
        k: KvFormat::Native,
        v: KvFormat::Native,
    };
    if dtype == KvCacheDtype::Auto {
        return Ok((vec![native; cfg.num_hidden_layers], ScaleSource::None));
    }
    let mut stored = Vec::with_capacity(cfg.num_hidden_layers);
    for i in 0..cfg.num_hidden_layers {
        let attn = layers.pp(i).pp("self_attn");
        let mut found = None;
        for (k, v) in SCALE_NAMES {
            let pair = (
                stored_scale(&attn, k, cfg.num_key_value_heads)?,
                stored_scale(&attn, v, cfg.num_key_value_heads)?,
            );
            if let (Some(k), Some(v)) = pair {
                found = Some((k, v));
                break;
            }
        }
        stored.push(found);
    }
    warn_of_saturating_keys(layers, cfg, &stored);
    let fp8 = |k, v| LayerKvFormat {
        k: KvFormat::Fp8 { scale: k },
        v: KvFormat::Fp8 { scale: v },
    };
    match stored.iter().position(Option::is_none) {
        None => Ok((
            stored.into_iter().flatten().map(|(k, v)| fp8(k, v)).collect(),
            ScaleSource::Checkpoint,
        )),
        Some(_) if stored.iter().all(Option::is_none) => Ok((
            vec![fp8(DEFAULT_FP8_SCALE, DEFAULT_FP8_SCALE); cfg.num_hidden_layers],
            ScaleSource::Default,
        )),
        Some(missing) => Err(Error::Config(format!(
            "--kv-cache-dtype fp8: the checkpoint has KV cache scales for some layers but none for layer {missing} (`{}`)",
            layers.pp(missing).pp("self_attn").name("k_scale")
        ))),
    }
}

/// Counts the prefix cache keeps, for metrics and logs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PrefixStats {
    /// Prompt tokens looked up, and how many of them were found computed.
    pub queried_tokens: u64,
    pub hit_tokens: u64,
}

/// A change to what the prefix cache can find, recorded for KV events ([`BlockPool::record_changes`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CacheChange {
    /// A full block was registered under this hash.
    Stored(BlockHash),
    /// The block registered under this hash was reused for other contents.
    Removed(BlockHash),
}

/// An end of the free list.
const NIL: u32 = u32::MAX;

/// Free blocks, references and the prefix cache. Not thread-safe: the engine loop owns it.
pub struct BlockPool {
    block_size: usize,
    /// Sequences holding each block.
    refs: Vec<u32>,
    /// The hash each cached block is registered under.
    hash: Vec<Option<BlockHash>>,
    /// Free blocks as a doubly linked list, least recently freed at `head`: O(1) to take
    /// the oldest, to append, and to pull a cached block back out when it is hit.
    prev: Vec<u32>,
    next: Vec<u32>,
    head: u32,
    tail: u32,
    free: usize,
    cached: HashMap<BlockHash, u32>,
    stats: PrefixStats,
    /// Changes since [`BlockPool::take_changes`], when someone listens (KV events).
    changes: Option<Vec<CacheChange>>,
}

impl BlockPool {
    /// A pool of `num_blocks` blocks (block 0 reserved) of `block_size` tokens.
    pub fn new(num_blocks: usize, block_size: usize) -> Self {
        assert!(
            num_blocks >= 2 && block_size > 0,
            "a pool needs a block to give"
        );
        let mut pool = Self {
            block_size,
            refs: vec![0; num_blocks],
            hash: vec![None; num_blocks],
            prev: vec![NIL; num_blocks],
            next: vec![NIL; num_blocks],
            head: NIL,
            tail: NIL,
            free: 0,
            cached: HashMap::new(),
            stats: PrefixStats::default(),
            changes: None,
        };
        // Block 0 holds a permanent reference: never free, never handed out.
        pool.refs[NULL_BLOCK as usize] = 1;
        for b in 1..num_blocks as u32 {
            pool.push_back(b);
        }
        pool
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Blocks a sequence could be given now (free, including cached ones not in use).
    pub fn num_free(&self) -> usize {
        self.free
    }

    /// Blocks sequences hold now.
    pub fn num_in_use(&self) -> usize {
        self.refs.len() - 1 - self.free
    }

    /// Blocks there are to give, in all.
    pub fn capacity(&self) -> usize {
        self.refs.len() - 1
    }

    pub fn stats(&self) -> PrefixStats {
        self.stats
    }

    /// From now on, keeps every block registered and every registered block reused, for
    /// [`BlockPool::take_changes`] (off unless KV events are published).
    pub fn record_changes(&mut self) {
        self.changes.get_or_insert_with(Vec::new);
    }

    /// The changes since the last call, in order.
    pub fn take_changes(&mut self) -> Vec<CacheChange> {
        self.changes
            .as_mut()
            .map(std::mem::take)
            .unwrap_or_default()
    }

    /// Blocks needed to hold `tokens` tokens.
    pub fn blocks_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.block_size)
    }

    fn push_back(&mut self, b: u32) {
        self.prev[b as usize] = self.tail;
        self.next[b as usize] = NIL;
        if self.tail == NIL {
            self.head = b;
        } else {
            self.next[self.tail as usize] = b;
        }
        self.tail = b;
        self.free += 1;
    }

    fn unlink(&mut self, b: u32) {
        let (p, n) = (self.prev[b as usize], self.next[b as usize]);
        if p == NIL {
            self.head = n;
        } else {
            self.next[p as usize] = n;
        }
        if n == NIL {
            self.tail = p;
        } else {
            self.prev[n as usize] = p;
        }
        self.prev[b as usize] = NIL;
        self.next[b as usize] = NIL;
        self.free -= 1;
    }

    /// `n` fresh blocks, least recently freed first (their cached contents are forgotten), or
    /// `None` (and nothing taken) if fewer are free.
    pub fn allocate(&mut self, n: usize) -> Option<Vec<u32>> {
        if n > self.free {
            return None;
        }
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            let b = self.head;
            self.unlink(b);
            if let Some(h) = self.hash[b as usize].take() {
                self.cached.remove(&h);
                if let Some(c) = &mut self.changes {
                    c.push(CacheChange::Removed(h));
                }
            }
            self.refs[b as usize] = 1;
            out.push(b);
        }
        Some(out)
    }

    /// Drops one reference to each block; a block no longer referenced becomes free, keeping
    /// its cached contents until reused. Blocks are queued for reuse in the order given, so
    /// callers pass a sequence's blocks last first: its tail, least likely to be shared, goes
    /// first.
    pub fn release(&mut self, blocks: impl IntoIterator<Item = u32>) {
        for b in blocks {
            let r = &mut self.refs[b as usize];
            debug_assert!(*r > 0 && b != NULL_BLOCK, "block {b} released twice");
            *r -= 1;
            if *r == 0 {
                self.push_back(b);
            }
        }
    }

    /// The longest run of `hashes` (a prompt's full blocks, in order) already computed: those
    /// blocks, each now referenced once more.
    pub fn lookup(&mut self, hashes: &[BlockHash]) -> Vec<u32> {
        let mut hit = Vec::new();
        for h in hashes {
            let Some(&b) = self.cached.get(h) else { break };
            if self.refs[b as usize] == 0 {
                self.unlink(b);
            }
            self.refs[b as usize] += 1;
            hit.push(b);
        }
        hit
    }

    /// How many leading `hashes` are cached, as [`BlockPool::lookup`] would find them, without
    /// taking them.
    pub fn cached_prefix(&self, hashes: &[BlockHash]) -> usize {
        hashes
            .iter()
            .take_while(|h| self.cached.contains_key(h))
            .count()
    }

    /// Counts one admitted prompt of `queried` tokens of which `hit` were found cached.
    pub fn count_lookup(&mut self, queried: usize, hit: usize) {
        self.stats.queried_tokens += queried as u64;
        self.stats.hit_tokens += hit as u64;
    }

    /// Records that `block`, now full and computed, holds the contents `hash` names. A block
    /// with the same contents already registered keeps the entry (this one stays private).
    pub fn register(&mut self, block: u32, hash: BlockHash) {
        if self.hash[block as usize].is_some() {
            return;
        }
        if let std::collections::hash_map::Entry::Vacant(e) = self.cached.entry(hash) {
            e.insert(block);
            self.hash[block as usize] = Some(hash);
            if let Some(c) = &mut self.changes {
                c.push(CacheChange::Stored(hash));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_are_handed_out_once_and_come_back_when_released() {
        let mut pool = BlockPool::new(5, 16);
        assert_eq!(pool.capacity(), 4);
        let a = pool.allocate(3).unwrap();
        assert!(!a.contains(&NULL_BLOCK));
        assert_eq!((pool.num_free(), pool.num_in_use()), (1, 3));
        assert!(pool.allocate(2).is_none(), "only one left");
        assert_eq!(pool.num_free(), 1, "a failed allocation takes nothing");
        let b = pool.allocate(1).unwrap();
        assert!(a.iter().all(|x| !b.contains(x)));
        pool.release(a.iter().rev().copied());
        pool.release(b);
        assert_eq!((pool.num_free(), pool.num_in_use()), (4, 0));
    }

    #[test]
    fn free_blocks_are_reused_least_recently_freed_first() {
        let mut pool = BlockPool::new(5, 4);
        let all = pool.allocate(4).unwrap();
        pool.release([all[2], all[0], all[3], all[1]]);
        assert_eq!(pool.allocate(4).unwrap(), [all[2], all[0], all[3], all[1]]);
    }

    #[test]
    fn the_prefix_cache_finds_registered_chains_until_their_blocks_are_reused() {
        let mut pool = BlockPool::new(4, 2);
        let h0 = block_hash(None, &[1, 2], &[]);
        let h1 = block_hash(Some(h0), &[3, 4], &[]);
        // Another prefix with the same second block's tokens hashes differently.
        let other = block_hash(Some(block_hash(None, &[9, 9], &[])), &[3, 4], &[]);
        assert_ne!(h1, other);
        // An image changes the hash of the block holding its tokens.
        assert_ne!(
            block_hash(None, &[7, 7], &[1]),
            block_hash(None, &[7, 7], &[2])
        );

        let seq = pool.allocate(2).unwrap();
        pool.register(seq[0], h0);
        pool.register(seq[1], h1);
        // Still referenced: a second sequence shares both blocks.
        assert_eq!(pool.cached_prefix(&[h0, h1, 77]), 2);
        assert_eq!(pool.lookup(&[h0, h1, 77]), seq);
        assert_eq!(pool.num_in_use(), 2);
        pool.release(seq.iter().rev().copied());
        pool.release(seq.iter().rev().copied());
        assert_eq!(pool.num_in_use(), 0);
        // Released but cached: a hit takes them back out of the free list.
        assert_eq!(pool.lookup(&[h0, other]), [seq[0]]);
        assert_eq!((pool.num_in_use(), pool.num_free()), (1, 2));
        pool.count_lookup(4, 2);
        assert_eq!(
            pool.stats(),
            PrefixStats {
                queried_tokens: 4,
                hit_tokens: 2
            }
        );
        pool.release([seq[0]]);
        // Reusing every block forgets what they held.
        let fresh = pool.allocate(3).unwrap();
        assert!(pool.lookup(&[h0]).is_empty());
        pool.release(fresh);
    }

    #[test]
    fn changes_are_recorded_only_when_asked_for() {
        let mut pool = BlockPool::new(3, 2);
        let (h0, h1) = (
            block_hash(None, &[1, 2], &[]),
            block_hash(None, &[3, 4], &[]),
        );
        let a = pool.allocate(1).unwrap();
        pool.register(a[0], h0);
        assert!(pool.take_changes().is_empty(), "off by default");
        pool.record_changes();
        let b = pool.allocate(1).unwrap();
        pool.register(b[0], h1);
        pool.register(b[0], h1);
        pool.release([a[0], b[0]]);
        // Both free and cached; a fresh block reuses the least recently freed, a[0].
        pool.allocate(1).unwrap();
        assert_eq!(
            pool.take_changes(),
            [CacheChange::Stored(h1), CacheChange::Removed(h0)]
        );
        assert!(pool.take_changes().is_empty());
    }

    #[test]
    fn a_duplicate_block_stays_private() {
        let mut pool = BlockPool::new(4, 2);
        let h = block_hash(None, &[1, 2], &[]);
        let a = pool.allocate(2).unwrap();
        pool.register(a[0], h);
        pool.register(a[1], h);
        pool.release([a[1], a[0]]);
        assert_eq!(pool.lookup(&[h]), [a[0]]);
    }
}
