//! A grammar whose masks are slow holds back its own sequence, never the batch: each step
//! waits for the masks only about as long as the device works anyway, and a sequence whose
//! mask is later takes no pick that step. It picks the same token a step later (its draw is
//! keyed by its position), so its answer is still the one it gives alone, sampled too.
//!
//! A process of its own: the masks are slowed for every engine in it.

use std::time::{Duration, Instant};

use llm_svc::{
    Engine, EngineConfig, Event, FinishReason, GenerateRequest, KvCacheSize, SamplingParams,
};
use vlm_compute::{CpuBackend, Weights};
use vlm_proto::pb::{constraint::Grammar, Constraint};

fn engine() -> Engine {
    let dir = vlm_compute::golden::tiny_fixture(env!("CARGO_MANIFEST_DIR"));
    let weights = Weights::open(&dir).unwrap();
    let cfg = EngineConfig {
        kv_cache: KvCacheSize::Tokens(8192),
        ..EngineConfig::default()
    };
    let registry = prometheus::Registry::new();
    Engine::load(&dir, &weights, CpuBackend::new(), cfg, &registry).unwrap()
}

fn request(prompt: std::ops::Range<u32>, max_new_tokens: usize) -> GenerateRequest {
    GenerateRequest {
        prompt: prompt.collect(),
        images: Vec::new(),
        sampling: SamplingParams::greedy(),
        max_new_tokens,
        ignore_eos: true,
        return_logits: false,
        constraint: None,
    }
}

fn answer(e: &Engine, r: &GenerateRequest) -> (Vec<u32>, FinishReason) {
    let mut s = e.submit(r.clone(), None, tracing::Span::none()).unwrap();
    loop {
        match s.blocking_recv().expect("the stream ends with Finished") {
            Event::Token { .. } => {}
            Event::Finished(g) => break (g.tokens, g.finish),
            Event::Failed(e) => panic!("failed: {e}"),
        }
    }
}

#[test]
fn a_slow_grammar_holds_back_its_own_sequence_only() {
    let e = engine();
    let free = request(40..72, 24);
    let mut constrained = request(50..80, 8);
    constrained.ignore_eos = false;
    constrained.sampling = SamplingParams {
        temperature: 1.0,
        seed: Some(7),
        ..SamplingParams::greedy()
    };
    let schema = r#"{"type":"object","properties":{"note":{"type":"string"}},"required":["note"]}"#;
    constrained.constraint = Some(Constraint {
        grammar: Some(Grammar::JsonSchema(schema.into())),
        after_token: None,
    });
    let alone = (answer(&e, &free), answer(&e, &constrained));

    // Each of the constrained request's (at least 8) masks now takes 100 ms, over 800 ms in
    // all; the free request's 24 steps take a few ms each on the tiny model.
    llm_svc::grammar::slow_every_mask_for_tests(Duration::from_millis(100));
    let mut slow = e
        .submit(constrained.clone(), None, tracing::Span::none())
        .unwrap();
    // The slowed request's stream, read as it comes: its tokens, and when it finished.
    let reader = std::thread::spawn(move || {
        let mut tokens_at = Vec::new();
        loop {
            match slow.blocking_recv().expect("the stream ends with Finished") {
                Event::Token { .. } => tokens_at.push(Instant::now()),
                Event::Finished(g) => break ((g.tokens, g.finish), tokens_at),
                Event::Failed(e) => panic!("failed: {e}"),
            }
        }
    });
    let fast = answer(&e, &free);
    let free_done = Instant::now();
    let (held, tokens_at) = reader.join().unwrap();
    let before = tokens_at.iter().filter(|&&t| t < free_done).count();
    assert!(
        before < held.0.len(),
        "the slowed request had all its {before} tokens before the free one ended"
    );
    assert_eq!((fast, held), alone);
}
