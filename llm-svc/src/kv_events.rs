//! KV cache events in vLLM's format, so the routers built for vLLM (llm-d's endpoint picker,
//! Dynamo's KV router) can follow what each llm-svc replica holds without polling it.
//!
//! ```text
//! BlockPool (register / evict) ─changes─▶ engine loop: token ids filled in from the sequences
//!   ─KvEventBatch─▶ channel (never blocks a step) ─▶ publisher thread: msgpack, ZMQ PUB
//!   multipart [topic, sequence number (8 bytes, big-endian), payload]
//! ```
//!
//! The payload is what vLLM's `vllm/distributed/kv_events.py` sends: msgspec structs encoded
//! `array_like`, each event an array whose first element is its tag.
//! - batch: `[ts, [event, ...], data_parallel_rank]`
//! - `["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
//!   lora_name]`: full blocks just computed, in prompt order, each chained to the one before
//!   (`parent_block_hash` names the block before the first, or is nil at a prompt's start)
//! - `["BlockRemoved", block_hashes, medium]`: blocks whose contents were reused for others
//! - `["AllBlocksCleared"]`: forget everything this replica held (sent at start and at exit)
//!
//! Hashes are llm-svc's prefix-cache block hashes ([`vlm_proto::prefix`]), cut to their low 64
//! bits as vLLM cuts its own (`int.from_bytes(hash[-8:], "big")`) so msgpack carries them as
//! integers. Routers that hash prompts themselves read `token_ids`; the hashes only have to be
//! consistent between a block's `BlockStored` and its `BlockRemoved`, which they are.
//!
//! The socket binds when the endpoint's host is `*` or `::` and connects otherwise (vLLM's rule:
//! llm-d's endpoint picker binds a SUB socket that every replica connects to; Dynamo connects to
//! each replica). There is no replay socket: a subscriber that sees a gap in the sequence
//! numbers (a batch dropped because the publisher fell behind) has lost events.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::de::{self, IgnoredAny, SeqAccess, Visitor};
use serde::{Deserialize, Serialize};

use crate::kv_cache::BlockHash;
use crate::{Error, Result};

/// vLLM's `medium` for blocks in device memory.
pub const MEDIUM_GPU: &str = "GPU";

/// Batches the engine may queue ahead of the socket before it drops them (vLLM's
/// `max_queue_size`).
const QUEUE_BATCHES: usize = 100_000;

/// A block hash as published: the low 64 bits of llm-svc's 128-bit hash.
pub fn external_hash(h: BlockHash) -> u64 {
    h as u64
}

/// One change to the prefix cache, as vLLM names it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KvEvent {
    /// Full blocks now computed and findable by prefix: `token_ids` holds every token of every
    /// block, `block_size` per block.
    BlockStored {
        block_hashes: Vec<u64>,
        parent_block_hash: Option<u64>,
        token_ids: Vec<u32>,
        block_size: usize,
        medium: Option<String>,
    },
    /// Blocks no longer held.
    BlockRemoved {
        block_hashes: Vec<u64>,
        medium: Option<String>,
    },
    /// Every block this replica held is gone.
    AllBlocksCleared,
}

/// Events of one engine step, with when they were sent.
#[derive(Clone, Debug, PartialEq)]
pub struct KvEventBatch {
    /// Seconds since the Unix epoch.
    pub ts: f64,
    pub events: Vec<KvEvent>,
    pub data_parallel_rank: Option<i64>,
}

impl KvEventBatch {
    /// A batch stamped now, of data-parallel rank 0 (one engine per llm-svc).
    pub fn now(events: Vec<KvEvent>) -> Self {
        let ts = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64());
        Self {
            ts,
            events,
            data_parallel_rank: Some(0),
        }
    }

    /// The msgpack payload vLLM's encoder would write for this batch.
    pub fn encode(&self) -> Vec<u8> {
        rmp_serde::to_vec(self).expect("a batch always encodes")
    }

    /// Reads a payload in vLLM's format (extra trailing fields, as newer vLLM versions add, are
    /// skipped).
    pub fn decode(payload: &[u8]) -> std::result::Result<Self, rmp_serde::decode::Error> {
        rmp_serde::from_slice(payload)
    }
}

impl Serialize for KvEventBatch {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        (self.ts, &self.events, self.data_parallel_rank).serialize(s)
    }
}

impl Serialize for KvEvent {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        let no_lora: Option<i64> = None;
        let no_lora_name: Option<&str> = None;
        match self {
            KvEvent::BlockStored {
                block_hashes,
                parent_block_hash,
                token_ids,
                block_size,
                medium,
            } => (
                "BlockStored",
                block_hashes,
                parent_block_hash,
                token_ids,
                block_size,
                no_lora,
                medium,
                no_lora_name,
            )
                .serialize(s),
            KvEvent::BlockRemoved {
                block_hashes,
                medium,
            } => ("BlockRemoved", block_hashes, medium).serialize(s),
            KvEvent::AllBlocksCleared => ("AllBlocksCleared",).serialize(s),
        }
    }
}

impl<'de> Deserialize<'de> for KvEventBatch {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        struct Batch;
        impl<'de> Visitor<'de> for Batch {
            type Value = KvEventBatch;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a KV event batch [ts, events, data_parallel_rank]")
            }
            fn visit_seq<A: SeqAccess<'de>>(
                self,
                mut seq: A,
            ) -> std::result::Result<Self::Value, A::Error> {
                let ts = seq
                    .next_element()?
                    .ok_or_else(|| de::Error::invalid_length(0, &self))?;
                let events = seq
                    .next_element()?
                    .ok_or_else(|| de::Error::invalid_length(1, &self))?;
                let data_parallel_rank = seq.next_element()?.flatten();
                while seq.next_element::<IgnoredAny>()?.is_some() {}
                Ok(KvEventBatch {
                    ts,
                    events,
                    data_parallel_rank,
                })
            }
        }
        d.deserialize_seq(Batch)
    }
}

impl<'de> Deserialize<'de> for KvEvent {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        struct Event;
        impl<'de> Visitor<'de> for Event {
            type Value = KvEvent;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a KV event [tag, fields...]")
            }
            fn visit_seq<A: SeqAccess<'de>>(
                self,
                mut seq: A,
            ) -> std::result::Result<Self::Value, A::Error> {
                let missing = |i| de::Error::invalid_length(i, &"the fields of a KV event");
                let tag: String = seq.next_element()?.ok_or_else(|| missing(0))?;
                let event = match tag.as_str() {
                    "BlockStored" => {
                        let block_hashes = seq.next_element()?.ok_or_else(|| missing(1))?;
                        let parent_block_hash = seq.next_element()?.ok_or_else(|| missing(2))?;
                        let token_ids = seq.next_element()?.ok_or_else(|| missing(3))?;
                        let block_size = seq.next_element()?.ok_or_else(|| missing(4))?;
                        let _lora_id: Option<Option<i64>> = seq.next_element()?;
                        let medium = seq.next_element()?.flatten();
                        KvEvent::BlockStored {
                            block_hashes,
                            parent_block_hash,
                            token_ids,
                            block_size,
                            medium,
                        }
                    }
                    "BlockRemoved" => {
                        let block_hashes = seq.next_element()?.ok_or_else(|| missing(1))?;
                        let medium = seq.next_element()?.flatten();
                        KvEvent::BlockRemoved {
                            block_hashes,
                            medium,
                        }
                    }
                    "AllBlocksCleared" => KvEvent::AllBlocksCleared,
                    other => {
                        return Err(de::Error::unknown_variant(
                            other,
                            &["BlockStored", "BlockRemoved", "AllBlocksCleared"],
                        ))
                    }
                };
                while seq.next_element::<IgnoredAny>()?.is_some() {}
                Ok(event)
            }
        }
        d.deserialize_seq(Event)
    }
}

/// Where to publish, and under which topic.
#[derive(Clone, Debug)]
pub struct KvEventsConfig {
    /// A ZeroMQ endpoint: `tcp://*:5557` binds, `tcp://host:port` connects.
    pub endpoint: String,
    /// The first frame of every message (llm-d reads the pod and model from it, e.g.
    /// `kv@10.0.0.7@Qwen3-VL-8B`); empty by default, as vLLM's.
    pub topic: String,
}

impl KvEventsConfig {
    /// Replica `i`'s endpoint when one process runs several engines: the port plus `i`, as vLLM
    /// offsets it by data-parallel rank (`tcp://*:5557` -> `tcp://*:5558` for replica 1).
    pub fn for_replica(self, i: usize) -> Self {
        let endpoint = match self.endpoint.rsplit_once(':') {
            Some((host, port)) if i > 0 => match port.parse::<usize>() {
                Ok(p) => format!("{host}:{}", p + i),
                Err(_) => self.endpoint,
            },
            _ => self.endpoint,
        };
        Self { endpoint, ..self }
    }
}

/// What the engine loop holds: a queue to the publisher thread. Sequence numbers are taken
/// here, so a batch dropped because the queue was full shows as a gap.
pub struct KvEventPublisher {
    tx: tokio::sync::mpsc::Sender<(u64, KvEventBatch)>,
    next_seq: u64,
    dropped: u64,
    endpoint: String,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl KvEventPublisher {
    /// Binds (or connects) the socket on a thread of its own and sends `AllBlocksCleared`, so a
    /// subscriber that knew an earlier process at this address forgets what it held. Fails if
    /// a bind fails (a port in use, an address not ours).
    pub fn start(cfg: &KvEventsConfig) -> Result<Self> {
        let (tx, rx) = tokio::sync::mpsc::channel(QUEUE_BATCHES);
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let cfg = cfg.clone();
        let thread = std::thread::Builder::new()
            .name("kv-events".into())
            .spawn(move || {
                let rt = match tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                {
                    Ok(rt) => rt,
                    Err(e) => {
                        let _ = ready_tx.send(Err(format!("cannot start its runtime: {e}")));
                        return;
                    }
                };
                rt.block_on(publish(cfg, rx, ready_tx));
            })
            .map_err(|e| Error::Engine(format!("cannot start the KV event thread: {e}")))?;
        let endpoint = ready_rx
            .recv()
            .map_err(|_| Error::Engine("the KV event thread stopped at start".into()))?
            .map_err(|e| Error::Config(format!("--kv-events-endpoint: {e}")))?;
        let mut publisher = Self {
            tx,
            next_seq: 0,
            dropped: 0,
            endpoint,
            thread: Some(thread),
        };
        publisher.publish(vec![KvEvent::AllBlocksCleared]);
        Ok(publisher)
    }

    /// The endpoint as bound (its port resolved when `:0` was asked for) or connected to.
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// Queues a batch; never waits. A full queue drops the batch (and logs it).
    pub fn publish(&mut self, events: Vec<KvEvent>) {
        if events.is_empty() {
            return;
        }
        let seq = self.next_seq;
        self.next_seq += 1;
        if self.tx.try_send((seq, KvEventBatch::now(events))).is_err() {
            self.dropped += 1;
            if self.dropped.is_power_of_two() {
                tracing::warn!(
                    dropped = self.dropped,
                    "KV event batches dropped: the publisher is behind"
                );
            }
        }
    }
}

impl Drop for KvEventPublisher {
    /// Says `AllBlocksCleared` (a router stops sending here what it thought was cached) and
    /// waits, up to a second, for the queue to go out.
    fn drop(&mut self) {
        self.publish(vec![KvEvent::AllBlocksCleared]);
        let (tx, _) = tokio::sync::mpsc::channel(1);
        drop(std::mem::replace(&mut self.tx, tx));
        if let Some(t) = self.thread.take() {
            let deadline = std::time::Instant::now() + Duration::from_secs(1);
            while !t.is_finished() && std::time::Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(5));
            }
        }
    }
}

/// vLLM's rule: bind where the address is a wildcard, connect otherwise.
fn binds(endpoint: &str) -> bool {
    endpoint.contains('*') || endpoint.contains("::")
}

async fn publish(
    cfg: KvEventsConfig,
    mut rx: tokio::sync::mpsc::Receiver<(u64, KvEventBatch)>,
    ready: std::sync::mpsc::Sender<std::result::Result<String, String>>,
) {
    use zeromq::{Socket, SocketSend};
    let mut socket = zeromq::PubSocket::new();
    let endpoint = if binds(&cfg.endpoint) {
        // zeromq resolves the host by name; a wildcard is every address.
        let addr = cfg.endpoint.replacen("//*:", "//0.0.0.0:", 1);
        match socket.bind(&addr).await {
            Ok(bound) => bound.to_string(),
            Err(e) => {
                let _ = ready.send(Err(format!("cannot bind {}: {e}", cfg.endpoint)));
                return;
            }
        }
    } else {
        cfg.endpoint.clone()
    };
    tracing::info!(endpoint = %endpoint, topic = %cfg.topic, "publishing KV cache events");
    let _ = ready.send(Ok(endpoint.clone()));
    if !binds(&cfg.endpoint) {
        // The subscriber may not be up yet: retry until it is, while batches wait in the queue.
        let mut attempts = 0u32;
        while let Err(e) = socket.connect(&cfg.endpoint).await {
            if attempts % 30 == 0 {
                tracing::warn!(endpoint = %cfg.endpoint, error = %e, "cannot connect the KV event socket yet; retrying");
            }
            attempts += 1;
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
    }
    let topic = bytes::Bytes::from(cfg.topic.into_bytes());
    while let Some((seq, batch)) = rx.recv().await {
        let mut msg = zeromq::ZmqMessage::from(topic.clone());
        msg.push_back(bytes::Bytes::copy_from_slice(&seq.to_be_bytes()));
        msg.push_back(batch.encode().into());
        if let Err(e) = socket.send(msg).await {
            tracing::warn!(error = %e, seq, "a KV event batch could not be sent");
        }
    }
}

/// The prefix-cache changes of the steps since the last batch, as the pool saw them, waiting for
/// their token ids ([`PendingEvents::fill`]) before they go out as vLLM events.
#[derive(Default)]
pub struct PendingEvents {
    changes: Vec<Pending>,
    /// Stored blocks still without their tokens: hash to index in `changes`.
    unfilled: std::collections::HashMap<BlockHash, usize>,
}

enum Pending {
    Stored {
        hash: BlockHash,
        /// The previous block's hash and this block's tokens, once a sequence has told them.
        contents: Option<(Option<BlockHash>, Vec<u32>)>,
    },
    Removed(BlockHash),
}

impl PendingEvents {
    /// Takes the pool's changes, in the order they happened.
    pub fn extend(&mut self, changes: Vec<crate::kv_cache::CacheChange>) {
        use crate::kv_cache::CacheChange;
        for c in changes {
            match c {
                CacheChange::Stored(hash) => {
                    self.unfilled.insert(hash, self.changes.len());
                    self.changes.push(Pending::Stored {
                        hash,
                        contents: None,
                    });
                }
                CacheChange::Removed(hash) => {
                    self.unfilled.remove(&hash);
                    self.changes.push(Pending::Removed(hash));
                }
            }
        }
    }

    /// Fills in the tokens of the blocks this sequence registered since the last batch: its
    /// newest registered blocks, walked back until one that is not waiting.
    pub fn fill(&mut self, hashes: &[BlockHash], registered: usize, tokens: &[u32], bs: usize) {
        if self.unfilled.is_empty() {
            return;
        }
        for b in (0..registered.min(hashes.len())).rev() {
            let Some(i) = self.unfilled.remove(&hashes[b]) else {
                break;
            };
            if let Pending::Stored { contents, .. } = &mut self.changes[i] {
                let parent = b.checked_sub(1).map(|p| hashes[p]);
                *contents = Some((parent, tokens[b * bs..(b + 1) * bs].to_vec()));
            }
        }
    }

    /// The changes as vLLM events, a chain of stored blocks as one `BlockStored` and removals
    /// in a row as one `BlockRemoved`; stored blocks no sequence told the tokens of are left
    /// out (a router then does not know of them, which costs it a hit, never a wrong route).
    pub fn take(&mut self, block_size: usize) -> Vec<KvEvent> {
        self.unfilled.clear();
        let mut out: Vec<KvEvent> = Vec::new();
        let mut last_stored: Option<u64> = None;
        for change in self.changes.drain(..) {
            match change {
                Pending::Stored {
                    hash,
                    contents: Some((parent, tokens)),
                } => {
                    let (hash, parent) = (external_hash(hash), parent.map(external_hash));
                    match out.last_mut() {
                        Some(KvEvent::BlockStored {
                            block_hashes,
                            token_ids,
                            ..
                        }) if parent.is_some() && parent == last_stored => {
                            block_hashes.push(hash);
                            token_ids.extend(tokens);
                        }
                        _ => out.push(KvEvent::BlockStored {
                            block_hashes: vec![hash],
                            parent_block_hash: parent,
                            token_ids: tokens,
                            block_size,
                            medium: Some(MEDIUM_GPU.into()),
                        }),
                    }
                    last_stored = Some(hash);
                }
                Pending::Stored { contents: None, .. } => last_stored = None,
                Pending::Removed(hash) => {
                    last_stored = None;
                    match out.last_mut() {
                        Some(KvEvent::BlockRemoved { block_hashes, .. }) => {
                            block_hashes.push(external_hash(hash))
                        }
                        _ => out.push(KvEvent::BlockRemoved {
                            block_hashes: vec![external_hash(hash)],
                            medium: Some(MEDIUM_GPU.into()),
                        }),
                    }
                }
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv_cache::{block_hash, CacheChange};

    #[test]
    fn a_batch_encodes_as_vllms_array_like_msgpack_and_decodes_back() {
        let batch = KvEventBatch {
            ts: 1.5,
            events: vec![
                KvEvent::BlockStored {
                    block_hashes: vec![1, u64::MAX],
                    parent_block_hash: None,
                    token_ids: vec![7, 8],
                    block_size: 1,
                    medium: Some("GPU".into()),
                },
                KvEvent::BlockRemoved {
                    block_hashes: vec![1],
                    medium: Some("GPU".into()),
                },
                KvEvent::AllBlocksCleared,
            ],
            data_parallel_rank: Some(0),
        };
        let bytes = batch.encode();
        // What msgspec writes for the same structs, byte for byte: fixarray(3), float64 1.5,
        // fixarray(3) of events, 0.
        let mut want = vec![0x93, 0xcb];
        want.extend(1.5f64.to_be_bytes());
        want.push(0x93);
        want.push(0x98); // BlockStored: tag + 7 fields
        want.push(0xab);
        want.extend(b"BlockStored");
        want.extend([0x92, 0x01, 0xcf]);
        want.extend(u64::MAX.to_be_bytes());
        want.extend([0xc0, 0x92, 0x07, 0x08, 0x01, 0xc0, 0xa3]);
        want.extend(b"GPU");
        want.push(0xc0);
        want.extend([0x93, 0xac]);
        want.extend(b"BlockRemoved");
        want.extend([0x91, 0x01, 0xa3]);
        want.extend(b"GPU");
        want.extend([0x91, 0xb0]);
        want.extend(b"AllBlocksCleared");
        want.push(0x00);
        assert_eq!(bytes, want);
        assert_eq!(KvEventBatch::decode(&bytes).unwrap(), batch);
    }

    #[test]
    fn a_wildcard_endpoint_binds_and_a_taken_port_is_refused() {
        let cfg = |endpoint: &str| KvEventsConfig {
            endpoint: endpoint.into(),
            topic: String::new(),
        };
        let p = KvEventPublisher::start(&cfg("tcp://*:0")).unwrap();
        let port = p.endpoint().rsplit(':').next().unwrap().to_string();
        assert_ne!(port, "0", "the port as bound: {}", p.endpoint());
        let again = KvEventPublisher::start(&cfg(&format!("tcp://*:{port}")));
        assert!(
            matches!(&again, Err(Error::Config(m)) if m.contains("cannot bind")),
            "{:?}",
            again.err()
        );
    }

    #[test]
    fn each_replica_publishes_on_the_next_port() {
        let cfg = KvEventsConfig {
            endpoint: "tcp://*:5557".into(),
            topic: "t".into(),
        };
        assert_eq!(cfg.clone().for_replica(0).endpoint, "tcp://*:5557");
        assert_eq!(cfg.for_replica(2).endpoint, "tcp://*:5559");
    }

    #[test]
    fn stored_chains_become_one_event_with_their_tokens_and_removals_follow_in_order() {
        let toks: Vec<u32> = (0..10).collect();
        let h0 = block_hash(None, &toks[0..2], &[]);
        let h1 = block_hash(Some(h0), &toks[2..4], &[]);
        let h2 = block_hash(Some(h1), &toks[4..6], &[]);
        let mut p = PendingEvents::default();
        // h0 was stored by an earlier batch; h1 and h2 now, then h0 evicted.
        p.extend(vec![
            CacheChange::Stored(h1),
            CacheChange::Stored(h2),
            CacheChange::Removed(h0),
        ]);
        p.fill(&[h0, h1, h2], 3, &toks, 2);
        assert_eq!(
            p.take(2),
            [
                KvEvent::BlockStored {
                    block_hashes: vec![external_hash(h1), external_hash(h2)],
                    parent_block_hash: Some(external_hash(h0)),
                    token_ids: vec![2, 3, 4, 5],
                    block_size: 2,
                    medium: Some("GPU".into()),
                },
                KvEvent::BlockRemoved {
                    block_hashes: vec![external_hash(h0)],
                    medium: Some("GPU".into()),
                },
            ]
        );
        assert!(p.take(2).is_empty());
    }
}
