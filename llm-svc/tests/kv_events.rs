//! KV events as a router reads them: a ZeroMQ SUB socket on loopback (bound, as llm-d's
//! endpoint picker binds one for every replica to connect to) receives the engine's msgpack
//! batches; the blocks of a prompt arrive stored, under the prefix-cache hashes and with the
//! prompt's token ids, and go out as removed once a small cache reuses them for other prompts.

use std::collections::HashSet;
use std::ops::ControlFlow;
use std::time::{Duration, Instant};

use llm_svc::kv_events::{external_hash, KvEvent, KvEventBatch, KvEventsConfig};
use llm_svc::{Engine, EngineConfig, GenerateRequest, KvCacheSize, SamplingParams};
use vlm_compute::{CpuBackend, Weights};
use vlm_proto::prefix::{prompt_block_hashes, KV_BLOCK_SIZE};
use zeromq::{Socket, SocketRecv};

fn request(prompt: Vec<u32>) -> GenerateRequest {
    GenerateRequest {
        prompt,
        images: vec![],
        sampling: SamplingParams::greedy(),
        max_new_tokens: 1,
        ignore_eos: true,
        return_logits: false,
        constraint: None,
    }
}

/// A prompt of `len` tokens of the tiny vocabulary, different for each `seed`.
fn prompt(seed: u32, len: usize) -> Vec<u32> {
    (0..len as u32)
        .map(|i| (seed * 31 + i * 7 + 5) % 400)
        .collect()
}

/// Batches as received: the topic, the sequence number and the decoded payload.
async fn next_batch(sub: &mut zeromq::SubSocket) -> (String, u64, KvEventBatch) {
    let msg = tokio::time::timeout(Duration::from_secs(20), sub.recv())
        .await
        .expect("a KV event batch within 20 s")
        .unwrap();
    assert_eq!(msg.len(), 3, "topic, sequence number, payload");
    let topic = String::from_utf8(msg.get(0).unwrap().to_vec()).unwrap();
    let seq = u64::from_be_bytes(msg.get(1).unwrap()[..].try_into().unwrap());
    let batch = KvEventBatch::decode(msg.get(2).unwrap()).expect("vLLM's msgpack batch");
    (topic, seq, batch)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_subscriber_sees_a_prompts_blocks_stored_then_removed_when_the_cache_reuses_them() {
    let mut sub = zeromq::SubSocket::new();
    let bound = sub.bind("tcp://127.0.0.1:0").await.unwrap();
    sub.subscribe("").await.unwrap();

    let dir = vlm_compute::golden::tiny_fixture(env!("CARGO_MANIFEST_DIR"));
    let cfg = EngineConfig {
        // 10 blocks: a few prompts of 4 blocks each reuse the first one's.
        kv_cache: KvCacheSize::Tokens(10 * KV_BLOCK_SIZE),
        kv_events: Some(KvEventsConfig {
            endpoint: bound.to_string(),
            topic: "kv@test@tiny".into(),
        }),
        ..EngineConfig::default()
    };
    let engine = tokio::task::spawn_blocking(move || {
        let weights = Weights::open(&dir).unwrap();
        let registry = prometheus::Registry::new();
        Engine::load(&dir, &weights, CpuBackend::new(), cfg, &registry).unwrap()
    })
    .await
    .unwrap();
    let generate = |p: Vec<u32>| {
        let engine = engine.clone();
        tokio::task::spawn_blocking(move || {
            engine
                .generate(&request(p), |_| ControlFlow::Continue(()))
                .unwrap()
        })
    };

    // The publisher connects, then our subscription travels to it: until then batches are
    // dropped (PUB semantics). Send throwaway prompts until one is heard.
    let started = Instant::now();
    let mut last_seq = loop {
        generate(prompt(1000 + started.elapsed().as_millis() as u32, 20))
            .await
            .unwrap();
        match tokio::time::timeout(Duration::from_millis(300), sub.recv()).await {
            Ok(Ok(msg)) => {
                break u64::from_be_bytes(msg.get(1).unwrap()[..].try_into().unwrap());
            }
            _ => assert!(
                started.elapsed() < Duration::from_secs(20),
                "no KV event reached the subscriber"
            ),
        }
    };

    // 50 tokens: three full blocks, stored as one chain with their tokens.
    let a = prompt(1, 50);
    let want: Vec<u64> = prompt_block_hashes(&a, &[], KV_BLOCK_SIZE)
        .into_iter()
        .map(external_hash)
        .collect();
    assert_eq!(want.len(), 3);
    generate(a.clone()).await.unwrap();
    let mut stored = Vec::new();
    let mut tokens = Vec::new();
    let mut parent = None;
    while stored.len() < want.len() {
        let (topic, seq, batch) = next_batch(&mut sub).await;
        assert_eq!(topic, "kv@test@tiny");
        assert_eq!(seq, last_seq + 1, "sequence numbers without a gap");
        last_seq = seq;
        assert_eq!(batch.data_parallel_rank, Some(0));
        for e in batch.events {
            if let KvEvent::BlockStored {
                block_hashes,
                parent_block_hash,
                token_ids,
                block_size,
                medium,
            } = e
            {
                assert_eq!(block_size, KV_BLOCK_SIZE);
                assert_eq!(medium.as_deref(), Some("GPU"));
                assert_eq!(token_ids.len(), block_hashes.len() * block_size);
                if block_hashes.first() == want.get(stored.len()) {
                    if stored.is_empty() {
                        parent = Some(parent_block_hash);
                    }
                    stored.extend(block_hashes);
                    tokens.extend(token_ids);
                }
            }
        }
    }
    assert_eq!(stored, want, "the prompt's block hashes, in order");
    assert_eq!(parent, Some(None), "the first block has no parent");
    assert_eq!(tokens, a[..48], "the token ids of the three blocks");

    // Other prompts take the free blocks, least recently freed first: a's go.
    let mut removed = HashSet::new();
    for seed in 2..8 {
        generate(prompt(seed, 50)).await.unwrap();
    }
    let deadline = Instant::now() + Duration::from_secs(20);
    while !want.iter().all(|h| removed.contains(h)) {
        assert!(
            Instant::now() < deadline,
            "removals of {want:?}: saw {removed:?}"
        );
        let (_, seq, batch) = next_batch(&mut sub).await;
        assert_eq!(seq, last_seq + 1, "sequence numbers without a gap");
        last_seq = seq;
        for e in batch.events {
            if let KvEvent::BlockRemoved { block_hashes, .. } = e {
                removed.extend(block_hashes);
            }
        }
    }

    // Going away, the engine says it holds nothing.
    drop(engine);
    let cleared = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            let (_, _, batch) = next_batch(&mut sub).await;
            if batch.events.contains(&KvEvent::AllBlocksCleared) {
                break;
            }
        }
    })
    .await;
    assert!(cleared.is_ok(), "AllBlocksCleared at exit");
}
