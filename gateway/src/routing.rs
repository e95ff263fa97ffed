//! Which replica a call goes to: cache-aware routing over the replicas of a stage.
//!
//! - **llm-svc** (Dynamo's KV-router cost): a replica's cost for a prompt is
//!   `overlap_weight × blocks it would have to prefill + blocks of the requests it is serving`;
//!   the cheapest healthy replica gets the request. The blocks are the prompt's KV-cache blocks
//!   named as llm-svc names them ([`vlm_proto::prefix`]: the same block size, token ids, and an
//!   identity for each image in a block).
//! - **vision-svc**: an image goes to the replica that rendezvous hashing gives its bytes (so
//!   that replica's embedding cache hits when the image comes again), unless that replica has
//!   more than `vision_slack` calls in flight beyond the least loaded one, which then takes it.
//!
//! **What each replica holds** is the gateway's own record of what it sent where: per replica,
//! the block hashes of the prompts it was sent, least recently sent evicted past a bound. It
//! needs nothing from llm-svc and costs no hop; it is approximate (it does not see llm-svc
//! evict blocks under memory pressure, nor what other gateways sent), and forgets a replica's
//! blocks when it comes back from an ejection longer than a restart takes (a restart empties
//! its cache; a replica restarted faster is routed to as if it still held them, which costs
//! hits, not answers). **Load** is the gateway's own count of what each replica is serving for
//! it: requests in flight, and their prompts' blocks.

use std::collections::{HashMap, VecDeque};

use vlm_proto::prefix::BlockHash;

/// How a stage's replicas are chosen.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Policy {
    /// llm-svc: the prompt's KV blocks a replica holds against its load; vision-svc: the
    /// image's replica unless it is too busy.
    CacheAware,
    /// In turn, skipping ejected replicas.
    RoundRobin,
}

/// The cache-aware cost's weight of a block to prefill against a block being served. Dynamo's
/// default is 1. Measured on 2 H100s (8B shapes, 32 clients in 6-turn chats with images,
/// docs/deployment.md): weights 1 / 4 / 16 found 60.5% / 68.1% / 65.9% of prompt tokens in
/// the cache (round robin 48.6%, ideal about 71%), TTFT p50 463 / 279 / 317 ms (round robin
/// 978). A block being served costs every decode step a little; one to prefill costs a
/// whole forward pass once, so a cached block is worth several served ones.
pub const DEFAULT_OVERLAP_WEIGHT: f64 = 4.0;

/// Routing settings (`--routing`, `--route-*`).
#[derive(Clone, Debug)]
pub struct RoutingConfig {
    pub policy: Policy,
    /// Weight of a block to prefill against a block already being served (Dynamo's
    /// `overlap_score_weight`): higher favours cache hits, lower spreads load.
    pub overlap_weight: f64,
    /// Block hashes remembered per llm-svc replica (least recently sent evicted first).
    pub record_blocks: usize,
    /// Calls in flight a vision-svc replica may have beyond the least loaded one and still get
    /// the images it is affine to.
    pub vision_slack: usize,
    /// How often an upstream address that is a DNS name is resolved again (each address it
    /// gives is a replica): a Kubernetes headless Service's pods, compose's `deploy.replicas`.
    pub resolve_interval: std::time::Duration,
}

impl Default for RoutingConfig {
    fn default() -> Self {
        Self {
            policy: Policy::CacheAware,
            overlap_weight: DEFAULT_OVERLAP_WEIGHT,
            record_blocks: 1 << 16,
            vision_slack: 4,
            resolve_interval: std::time::Duration::from_secs(5),
        }
    }
}

/// The routing flags, for the gateway's command line.
#[derive(Clone, Debug, clap::Args)]
pub struct RoutingArgs {
    /// How replicas of vision-svc and llm-svc are picked: cache-aware (llm-svc: the replica
    /// that holds most of the prompt's KV blocks, against its load, as Dynamo's KV router;
    /// vision-svc: by image, against load) or round-robin.
    #[arg(long, env = "VLM_ROUTING", value_enum, default_value = "cache-aware")]
    pub routing: Policy,
    /// Cache-aware llm-svc cost: overlap_weight x prompt blocks the replica would prefill +
    /// blocks of the requests it is serving. Higher favours cache hits, lower spreads load.
    #[arg(long, env = "VLM_ROUTE_OVERLAP_WEIGHT", default_value_t = DEFAULT_OVERLAP_WEIGHT)]
    pub route_overlap_weight: f64,
    /// KV block hashes the gateway remembers per llm-svc replica (what it sent there, least
    /// recently sent forgotten first); about the blocks a replica's KV cache holds.
    #[arg(long, env = "VLM_ROUTE_RECORD_BLOCKS", default_value_t = 1 << 16)]
    pub route_record_blocks: usize,
    /// Calls in flight a vision-svc replica may have beyond the least loaded one and still get
    /// the images whose embeddings it caches.
    #[arg(long, env = "VLM_ROUTE_VISION_SLACK", default_value_t = 4)]
    pub route_vision_slack: usize,
    /// Seconds between DNS lookups of an upstream address that is a name: each address the
    /// name resolves to is a replica, so a Kubernetes headless Service's pods (or compose's
    /// deploy.replicas) are found as they come and go.
    #[arg(long, env = "VLM_RESOLVE_INTERVAL_SECS", default_value_t = 5.0)]
    pub resolve_interval_secs: f64,
}

impl RoutingArgs {
    pub fn config(&self) -> anyhow::Result<RoutingConfig> {
        anyhow::ensure!(
            self.route_overlap_weight.is_finite() && self.route_overlap_weight >= 0.0,
            "--route-overlap-weight must be a non-negative number, got {}",
            self.route_overlap_weight
        );
        let resolve_interval = std::time::Duration::try_from_secs_f64(self.resolve_interval_secs)
            .ok()
            .filter(|t| !t.is_zero())
            .ok_or_else(|| {
                anyhow::anyhow!(
                    "--resolve-interval-secs must be a positive number of seconds, got {}",
                    self.resolve_interval_secs
                )
            })?;
        Ok(RoutingConfig {
            resolve_interval,
            policy: self.routing,
            overlap_weight: self.route_overlap_weight,
            record_blocks: self.route_record_blocks,
            vision_slack: self.route_vision_slack,
        })
    }
}

/// What a call is routed by.
#[derive(Clone, Copy, Debug)]
pub enum RouteKey<'a> {
    /// Nothing: in turn.
    None,
    /// A prompt's full blocks, in order.
    Prompt(&'a [BlockHash]),
    /// An image's identity.
    Image(BlockHash),
}

/// The block hashes sent to one replica, least recently sent evicted past `capacity`.
#[derive(Debug, Default)]
pub struct BlockRecord {
    capacity: usize,
    /// Each hash and the tick it was last sent at.
    last_sent: HashMap<BlockHash, u64>,
    /// (tick, hash) in sending order; an entry whose tick is no longer the hash's is stale.
    order: VecDeque<(u64, BlockHash)>,
    tick: u64,
}

impl BlockRecord {
    pub fn new(capacity: usize) -> Self {
        Self {
            capacity,
            ..Default::default()
        }
    }

    /// How many leading `hashes` (a prompt's chain) the replica was sent.
    pub fn overlap(&self, hashes: &[BlockHash]) -> usize {
        hashes
            .iter()
            .take_while(|h| self.last_sent.contains_key(h))
            .count()
    }

    /// Notes that the replica was sent `hashes`.
    pub fn insert(&mut self, hashes: &[BlockHash]) {
        for &h in hashes {
            self.tick += 1;
            self.last_sent.insert(h, self.tick);
            self.order.push_back((self.tick, h));
        }
        while self.last_sent.len() > self.capacity {
            let Some((tick, h)) = self.order.pop_front() else {
                break;
            };
            if self.last_sent.get(&h) == Some(&tick) {
                self.last_sent.remove(&h);
            }
        }
        // Stale entries are dropped as they reach the front; bound them too.
        if self.order.len() > 2 * self.capacity.max(16) {
            let last_sent = &self.last_sent;
            self.order.retain(|(t, h)| last_sent.get(h) == Some(t));
        }
    }

    pub fn clear(&mut self) {
        self.last_sent.clear();
        self.order.clear();
    }

    pub fn len(&self) -> usize {
        self.last_sent.len()
    }

    pub fn is_empty(&self) -> bool {
        self.last_sent.is_empty()
    }
}

/// Dynamo's cost of sending a prompt of `blocks` full blocks to a replica that holds the
/// first `overlap` of them and serves `active_blocks` already: lower is better.
pub fn llm_cost(overlap_weight: f64, blocks: usize, overlap: usize, active_blocks: usize) -> f64 {
    overlap_weight * (blocks - overlap.min(blocks)) as f64 + active_blocks as f64
}

/// Rendezvous (highest random weight) score of `image` on the replica at `addr`: each image
/// has one best replica, and removing a replica moves only its own images.
pub fn affinity(image: BlockHash, addr: &str) -> u128 {
    vlm_proto::prefix::block_hash(
        Some(image),
        &[],
        &[vlm_proto::prefix::image_identity(addr.as_bytes())],
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_record_finds_a_prompts_leading_blocks_and_forgets_the_least_recently_sent() {
        let mut r = BlockRecord::new(4);
        r.insert(&[1, 2, 3]);
        assert_eq!(r.overlap(&[1, 2, 3, 4]), 3);
        assert_eq!(r.overlap(&[2, 3]), 2);
        assert_eq!(
            r.overlap(&[9, 1]),
            0,
            "a chain that starts elsewhere holds nothing"
        );
        r.insert(&[1]); // 1 is now the most recent: 2 goes first.
        r.insert(&[5, 6]);
        assert_eq!(r.len(), 4);
        assert_eq!(r.overlap(&[1]), 1);
        assert_eq!(r.overlap(&[2]), 0, "least recently sent: evicted");
        assert_eq!(r.overlap(&[3, 5, 6]), 3);
        r.clear();
        assert!(r.is_empty());
    }

    #[test]
    fn the_cost_weighs_blocks_to_prefill_against_blocks_in_flight() {
        // 10 blocks, 8 of them held, the replica busy with 5: 2 + 5.
        assert_eq!(llm_cost(1.0, 10, 8, 5), 7.0);
        // Idle and holding nothing costs the whole prompt.
        assert_eq!(llm_cost(1.0, 10, 0, 0), 10.0);
        // Weight 0: load alone.
        assert_eq!(llm_cost(0.0, 10, 0, 3), 3.0);
    }

    #[test]
    fn an_image_has_one_best_replica() {
        let addrs = ["a:1", "b:1", "c:1"];
        let best = |img| {
            addrs
                .iter()
                .max_by_key(|a| affinity(img, a))
                .copied()
                .unwrap()
        };
        assert_eq!(best(7), best(7));
        let spread: std::collections::HashSet<_> = (0..64u128).map(best).collect();
        assert_eq!(spread.len(), 3, "images spread over every replica");
    }
}
