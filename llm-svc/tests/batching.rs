//! The engine under concurrency, on the tiny fixture: requests sent together give exactly the
//! tokens each gives alone, whatever the batch, the token budget (prefill in chunks), the cache
//! size (requests preempted and recomputed) or the prefix cache; nothing is lost; a cancelled
//! or timed-out request gives its cache blocks back at once.
//!
//! Exact equality holds on the CPU: every op computes each row, and each sequence's attention,
//! the same way whatever else is in the batch. On a GPU (`--device cuda` runs these with the
//! CUDA backend; skipped without one) batched GEMMs round differently from the one-row GEMVs,
//! so there the same tokens are expected up to the first step where the two best logits are
//! within the GPU's tolerance (see golden_text.rs).

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use llm_svc::{
    Engine, EngineConfig, Event, GenerateRequest, KvCacheSize, SamplerRow, SamplingParams,
};
use vlm_compute::{Backend, CpuBackend, Weights};

mod common;
use common::{fixture, together};

/// The engine of the checkpoint in `dir`.
fn engine_of<B: Backend>(dir: &Path, backend: B, cfg: EngineConfig) -> Engine {
    let weights = Weights::open(dir).unwrap();
    Engine::load(dir, &weights, backend, cfg, &prometheus::Registry::new()).unwrap()
}

fn engine_on<B: Backend>(backend: B, cfg: EngineConfig) -> Engine {
    engine_of(&fixture(), backend, cfg)
}

/// An engine config for a GPU test: a KV cache of a fixed size, not 90% of the device (the
/// default there), so that engines of tests running at once, or one after another in a
/// process whose freed memory the pool keeps, all fit.
fn on_gpu() -> EngineConfig {
    EngineConfig {
        kv_cache: KvCacheSize::Tokens(8192),
        ..EngineConfig::default()
    }
}

fn engine(cfg: EngineConfig) -> Engine {
    engine_on(CpuBackend::new(), cfg)
}

/// Every golden case twice: greedy, and sampled with its own seed and filters; generating
/// through eos for a while so decodes overlap.
fn requests() -> Vec<GenerateRequest> {
    requests_of(&fixture())
}

/// The same for the fixture in `dir`.
fn requests_of(dir: &Path) -> Vec<GenerateRequest> {
    let mut out = Vec::new();
    for (i, (prompt, images)) in common::golden_inputs_of(dir).into_iter().enumerate() {
        let base = GenerateRequest {
            prompt,
            images,
            sampling: SamplingParams::greedy(),
            max_new_tokens: 12 + 3 * i,
            ignore_eos: true,
            return_logits: false,
            constraint: None,
        };
        out.push(base.clone());
        out.push(GenerateRequest {
            sampling: SamplingParams {
                temperature: 0.8,
                top_k: 20 + i,
                top_p: 0.9,
                min_p: 0.02 * i as f32,
                // Penalties (their token counts live on the device), a bias and logprobs on
                // some: none of it may depend on the batch.
                presence_penalty: if i % 2 == 1 { 1.5 } else { 0.0 },
                frequency_penalty: if i % 3 == 2 { 0.4 } else { 0.0 },
                repetition_penalty: if i % 2 == 0 { 1.2 } else { 1.0 },
                logit_bias: vec![(17, 3.0), (40 + i as u32, -100.0)],
                logprobs: (i % 2 == 0).then_some(3),
                seed: Some(i as u64),
                choice: 0,
            },
            max_new_tokens: 20 - i,
            ..base
        });
    }
    out
}

/// Each request run alone, one after the other.
fn alone(engine: &Engine, reqs: &[GenerateRequest]) -> Vec<Vec<u32>> {
    reqs.iter()
        .map(|r| {
            engine
                .generate(r, |_| std::ops::ControlFlow::Continue(()))
                .unwrap()
                .tokens
        })
        .collect()
}

/// Waits (up to 5 s) until the engine holds no request and no cache block.
fn wait_idle(engine: &Engine) {
    let m = engine.metrics();
    let end = Instant::now() + Duration::from_secs(5);
    while Instant::now() < end {
        let running = m.sequences.with_label_values(&["running"]).get();
        let waiting = m.sequences.with_label_values(&["waiting"]).get();
        if m.kv_blocks_in_use.get() == 0 && running == 0 && waiting == 0 {
            return;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    panic!(
        "engine not idle: {} blocks in use",
        m.kv_blocks_in_use.get()
    );
}

#[test]
fn requests_sent_together_give_exactly_the_tokens_each_gives_alone() {
    let reqs = requests();
    let reference = alone(&engine(EngineConfig::default()), &reqs);
    assert!(reference.iter().all(|t| !t.is_empty()));
    // Several batch shapes: everything at once; small steps (long prompts prefilled in
    // chunks of 7 tokens beside running decodes); few sequences per step.
    for cfg in [
        EngineConfig::default(),
        EngineConfig {
            max_batch_tokens: 7,
            ..EngineConfig::default()
        },
        EngineConfig {
            max_batch_seqs: 3,
            max_batch_tokens: 40,
            prefix_caching: false,
            ..EngineConfig::default()
        },
    ] {
        let e = engine(cfg.clone());
        assert_eq!(together(&e, &reqs), reference, "{cfg:?}");
        wait_idle(&e);
    }
}

#[test]
fn more_requests_than_the_cache_holds_all_finish_preempted_or_queued() {
    let reqs = requests();
    let reference = alone(&engine(EngineConfig::default()), &reqs);
    // 10 blocks of 16: the longest request (90 prompt + 20 generated) fits alone, a handful
    // together do not. Requests wait, and running ones give their blocks back and are
    // recomputed later.
    let e = engine(EngineConfig {
        kv_cache: KvCacheSize::Tokens(160),
        ..EngineConfig::default()
    });
    assert_eq!(e.kv_cache_tokens(), 160);
    assert_eq!(together(&e, &reqs), reference);
    assert!(
        e.metrics().preemptions.get() > 0,
        "the cache was small enough to force preemption"
    );
    wait_idle(&e);
}

#[test]
fn prefix_cache_hits_give_the_same_tokens_as_misses() {
    let reqs = requests();
    let without = engine(EngineConfig {
        prefix_caching: false,
        ..EngineConfig::default()
    });
    let with = engine(EngineConfig::default());
    for r in &reqs {
        let miss = without
            .generate(r, |_| std::ops::ControlFlow::Continue(()))
            .unwrap();
        assert_eq!(miss.cached_tokens, 0);
        let first = with
            .generate(r, |_| std::ops::ControlFlow::Continue(()))
            .unwrap();
        let again = with
            .generate(r, |_| std::ops::ControlFlow::Continue(()))
            .unwrap();
        // The whole prompt but its last (partial) block comes from the cache the second time.
        let full_blocks = (r.prompt.len() - 1) / 16 * 16;
        assert_eq!(
            again.cached_tokens, full_blocks,
            "second run of the same prompt"
        );
        assert_eq!(first.tokens, miss.tokens);
        assert_eq!(again.tokens, miss.tokens);
    }
    let m = with.metrics();
    assert!(m.prefix_hit_tokens.get() > 0);
    assert!(m.prefix_hit_tokens.get() < m.prefix_queried_tokens.get());
    wait_idle(&with);
}

/// A request's `n` choices as the gateway sends them: the same prompt and seed, submitted
/// together with `choice` 0, 1, ... Each draws its own tokens, choice 0 those of the request
/// alone, and every choice after the first finds the prompt's full blocks computed by the
/// first instead of computing them again beside it.
#[test]
fn choices_of_one_prompt_draw_their_own_tokens_and_share_its_blocks() {
    let reference_engine = engine(EngineConfig::default());
    // The sampled request of every case (with images and without).
    for r in requests().into_iter().skip(1).step_by(2) {
        let choices: Vec<GenerateRequest> = (0..4)
            .map(|c| GenerateRequest {
                sampling: SamplingParams {
                    choice: c,
                    ..r.sampling.clone()
                },
                ..r.clone()
            })
            .collect();
        let alone_tokens = alone(&reference_engine, &choices);
        // A fresh engine each time: nothing of the prompt is cached before.
        let e = engine(EngineConfig::default());
        let streams: Vec<_> = choices
            .iter()
            .map(|c| e.submit(c.clone(), None, tracing::Span::none()).unwrap())
            .collect();
        let gens: Vec<_> = streams
            .into_iter()
            .map(|mut s| loop {
                match s.blocking_recv().expect("the stream ends with Finished") {
                    Event::Token { .. } => {}
                    Event::Finished(g) => break g,
                    Event::Failed(e) => panic!("a choice failed: {e}"),
                }
            })
            .collect();
        let tokens: Vec<Vec<u32>> = gens.iter().map(|g| g.tokens.clone()).collect();
        assert_eq!(tokens, alone_tokens, "each choice as it draws alone");
        assert_eq!(
            tokens[0],
            alone(&reference_engine, std::slice::from_ref(&r))[0],
            "choice 0 is the request of one choice"
        );
        for i in 0..tokens.len() {
            for j in 0..i {
                assert_ne!(tokens[i], tokens[j], "choices {j} and {i} drew alike");
            }
        }
        let full_blocks = (r.prompt.len() - 1) / 16 * 16;
        let cached: Vec<usize> = gens.iter().map(|g| g.cached_tokens).collect();
        assert_eq!(
            cached,
            [0, full_blocks, full_blocks, full_blocks],
            "{} prompt tokens",
            r.prompt.len()
        );
        assert_eq!(e.metrics().prefix_hit_tokens.get(), 3 * full_blocks as u64);
        wait_idle(&e);
    }
}

#[test]
fn a_dropped_stream_or_a_passed_deadline_frees_its_blocks_at_once() {
    let e = engine(EngineConfig::default());
    let mut long = requests().remove(0);
    long.max_new_tokens = 1800;
    let mut s = e.submit(long.clone(), None, tracing::Span::none()).unwrap();
    for _ in 0..3 {
        assert!(matches!(s.blocking_recv(), Some(Event::Token { .. })));
    }
    assert!(e.metrics().kv_blocks_in_use.get() > 0);
    drop(s);
    wait_idle(&e);
    assert_eq!(
        e.metrics().requests.with_label_values(&["cancelled"]).get(),
        1
    );

    let deadline = Instant::now() + Duration::from_millis(50);
    let mut s = e
        .submit(long, Some(deadline), tracing::Span::none())
        .unwrap();
    let last = loop {
        match s.blocking_recv().expect("a last event") {
            Event::Token { .. } => {}
            other => break other,
        }
    };
    assert!(
        matches!(last, Event::Failed(llm_svc::Error::DeadlineExceeded { .. })),
        "{last:?}"
    );
    wait_idle(&e);
}

/// A copy of the fixture whose only eos is tokenizer_config.json's `eos_token` (a string;
/// none when `None`): generation_config.json dropped, `eos_token_id` taken out of config.json.
fn fixture_with_tokenizer_eos(name: &str, eos_token: Option<&str>) -> PathBuf {
    let src = fixture();
    let dir = std::env::temp_dir().join(format!("vlm-eos-engine-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    for entry in std::fs::read_dir(&src).unwrap() {
        let path = entry.unwrap().path();
        if path.is_file() {
            std::fs::copy(&path, dir.join(path.file_name().unwrap())).unwrap();
        }
    }
    std::fs::remove_file(dir.join("generation_config.json")).unwrap();
    let edit = |file: &str, f: &dyn Fn(&mut serde_json::Value)| {
        let mut v: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join(file)).unwrap()).unwrap();
        f(&mut v);
        std::fs::write(dir.join(file), v.to_string()).unwrap();
    };
    edit("config.json", &|v| {
        v.as_object_mut().unwrap().remove("eos_token_id");
        v["text_config"]
            .as_object_mut()
            .unwrap()
            .remove("eos_token_id");
    });
    edit("tokenizer_config.json", &|v| match eos_token {
        Some(t) => v["eos_token"] = t.into(),
        None => {
            v.as_object_mut().unwrap().remove("eos_token");
        }
    });
    dir
}

/// HF transformers' behaviour for checkpoints that name eos only in tokenizer_config.json, or
/// nowhere: the first stops at that token, the second runs to the budget.
#[test]
fn eos_from_tokenizer_config_stops_generation_and_no_eos_runs_to_the_budget() {
    let cfg = EngineConfig::default;
    let mut req = requests().remove(0);
    req.max_new_tokens = 6;
    let through = engine(cfg()).generate(&req, |_| std::ops::ControlFlow::Continue(()));
    let through = through.unwrap().tokens;
    assert_eq!(through.len(), 6);
    req.ignore_eos = false;

    // Make the first token the model picks the tokenizer's eos: generation stops right there.
    let tokenizer: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixture().join("tokenizer.json")).unwrap())
            .unwrap();
    let first = u64::from(through[0]);
    let name = tokenizer["added_tokens"]
        .as_array()
        .unwrap()
        .iter()
        .find(|a| a["id"] == first)
        .map(|a| a["content"].as_str().unwrap().to_string())
        .or_else(|| {
            let vocab = tokenizer["model"]["vocab"].as_object().unwrap();
            vocab
                .iter()
                .find(|(_, id)| **id == first)
                .map(|(t, _)| t.clone())
        })
        .unwrap();
    let dir = fixture_with_tokenizer_eos("named", Some(&name));
    let e = engine_of(&dir, CpuBackend::new(), cfg());
    assert_eq!(e.config().eos_token_ids, vec![through[0]]);
    let gen = e
        .generate(&req, |_| std::ops::ControlFlow::Continue(()))
        .unwrap();
    assert_eq!(
        gen.tokens,
        vec![through[0]],
        "stops at the eos token `{name}`"
    );
    assert_eq!(gen.finish, llm_svc::FinishReason::Eos);
    drop(e);
    let _ = std::fs::remove_dir_all(dir);

    // No eos anywhere: the same tokens as ignoring eos, to the budget.
    let dir = fixture_with_tokenizer_eos("none", None);
    let e = engine_of(&dir, CpuBackend::new(), cfg());
    assert!(e.config().eos_token_ids.is_empty());
    let gen = e
        .generate(&req, |_| std::ops::ControlFlow::Continue(()))
        .unwrap();
    assert_eq!(gen.tokens, through);
    assert_eq!(gen.finish, llm_svc::FinishReason::Length);
    drop(e);
    let _ = std::fs::remove_dir_all(dir);
}

/// The same checks with the CUDA backend, where greedy tokens must agree up to near ties.
#[test]
fn on_cuda_batched_greedy_tokens_match_alone() {
    let Some(gpu) = vlm_compute::cuda::test_gpu() else {
        return;
    };
    batched_greedy_matches_alone(&engine_on(gpu, on_gpu()), &requests());
}

/// The same with Qwen's FP8 layout (tests/fixtures/tiny-qwen3-vl-fp8) on the W8A8 GEMM (an
/// H100's): steps of more than 4 rows quantize their activations to e4m3, and decode's GEMVs
/// round theirs the same way, so a request alone (GEMVs) and in a batch (the GEMM) differ by
/// summation order only, as f16 weights do. Without that rounding the two differed by up to
/// 0.66 on this fixture's logits (golden_text's W8A8 test) and the tie bound below would not
/// hold.
#[test]
fn on_cuda_fp8_w8a8_batched_greedy_tokens_match_alone() {
    let Some(gpu) = vlm_compute::cuda::test_gpu() else {
        return;
    };
    gpu.set_fp8_gemm(vlm_compute::cuda::Fp8Gemm::W8a8);
    eprintln!("W8A8 {}", if gpu.has_w8a8() { "on" } else { "off" });
    let dir = vlm_compute::golden::fixture(env!("CARGO_MANIFEST_DIR"), "tiny-qwen3-vl-fp8");
    batched_greedy_matches_alone(&engine_of(&dir, gpu, on_gpu()), &requests_of(&dir));
}

/// Each greedy request of `reqs` run alone and all of them together: the same tokens up to the
/// first step where the best two logits are within the GPU paths' difference.
fn batched_greedy_matches_alone(e: &Engine, reqs: &[GenerateRequest]) {
    let reqs: Vec<GenerateRequest> = reqs
        .iter()
        .filter(|r| r.sampling.temperature == 0.0)
        .map(|r| GenerateRequest {
            return_logits: true,
            ..r.clone()
        })
        .collect();
    let logits_of = |r: &GenerateRequest| {
        let mut logits = Vec::new();
        let g = e
            .generate(r, |ev| {
                logits.push(ev.logits.unwrap().to_vec());
                std::ops::ControlFlow::Continue(())
            })
            .unwrap();
        (g.tokens, logits)
    };
    let solo: Vec<_> = reqs.iter().map(logits_of).collect();
    let batched = together(e, &reqs);
    // Logits are O(10); the GPU's GEMV and GEMM paths differ by ~1e-2 at most here.
    const TIE: f32 = 0.1;
    let mut compared = 0;
    for ((tokens, logits), got) in solo.iter().zip(&batched) {
        for (step, l) in logits.iter().enumerate() {
            if common::top_two_gap(l) <= TIE {
                break;
            }
            assert_eq!(got[step], tokens[step], "greedy token {step}");
            compared += 1;
        }
    }
    eprintln!("{compared} greedy tokens compared, batched against alone");
    wait_idle(e);
}

/// On the GPU, every sampled token is the sampling rule's pick (`vlm_compute::sampling`, the
/// CPU twin) from the logits it was picked from, with the sequence's own seed, position and
/// token counts, whatever the batch: the device's sampler in the recorded decode steps and
/// the eager ones, its count table and its slots.
#[test]
fn on_cuda_sampled_tokens_are_the_rules_picks_in_any_batch() {
    use vlm_compute::sampling::{sample_row, IN_PROMPT};
    let Some(gpu) = vlm_compute::cuda::test_gpu() else {
        return;
    };
    let reqs: Vec<GenerateRequest> = requests()
        .into_iter()
        .filter(|r| r.sampling.temperature > 0.0)
        .map(|r| GenerateRequest {
            return_logits: true,
            ..r
        })
        .collect();
    let e = engine_on(gpu, on_gpu());
    let streams: Vec<_> = reqs
        .iter()
        .map(|r| e.submit(r.clone(), None, tracing::Span::none()).unwrap())
        .collect();
    for (r, mut s) in reqs.iter().zip(streams) {
        let sampling = &r.sampling;
        let vocab = 414;
        let mut counts = vec![0u32; vocab];
        for &t in &r.prompt {
            counts[t as usize] |= IN_PROMPT;
        }
        let mut tokens = r.prompt.clone();
        loop {
            match s.blocking_recv().expect("the stream ends with Finished") {
                Event::Token {
                    id,
                    logits,
                    logprob,
                } => {
                    let logits = logits.expect("asked for");
                    let slot = sampling.needs_counts().then_some(0);
                    let row = sampling.row(sampling.seed.unwrap(), tokens.len(), slot, 0);
                    let want = sample_row(
                        &logits,
                        &row,
                        &sampling.logit_bias,
                        slot.map(|_| &mut counts[..]),
                    );
                    assert_eq!(id, want.token, "token {}", tokens.len());
                    assert_eq!(logprob.is_some(), sampling.logprobs.is_some());
                    if let Some(lp) = logprob {
                        assert!((lp.logprob - want.logprob).abs() < 1e-4);
                        let ids: Vec<u32> = lp.top.iter().map(|t| t.0).collect();
                        let want_ids: Vec<u32> = want.top.iter().map(|t| t.0).collect();
                        assert_eq!(ids, want_ids);
                    }
                    tokens.push(id);
                }
                Event::Finished(_) => break,
                Event::Failed(e) => panic!("a request failed: {e}"),
            }
        }
    }
    wait_idle(&e);
}
