//! `--kv-cache-dtype fp8` on the tiny Qwen3-VL fixture, on the CPU reference: the cache holds
//! e4m3 bytes (a quarter of the CPU's f32, half of a GPU's f16), greedy tokens and logits stay
//! near the native cache's, a batch gives each request exactly its tokens alone, a checkpoint's
//! `k_scale`/`v_scale` are used, and scales that are no scales are refused at start.

use std::ops::ControlFlow;
use std::path::{Path, PathBuf};

use llm_svc::{Engine, EngineConfig, GenerateRequest, KvCacheDtype, KvCacheSize, SamplingParams};
use safetensors::{tensor::TensorView, Dtype};
use vlm_compute::{Backend, CpuBackend, Weights};

mod common;
use common::{fixture, together};

fn fp8() -> EngineConfig {
    EngineConfig {
        kv_cache_dtype: KvCacheDtype::Fp8,
        ..EngineConfig::default()
    }
}

fn engine_of<B: Backend>(dir: &Path, backend: B, cfg: EngineConfig) -> llm_svc::Result<Engine> {
    let weights = Weights::open(dir).unwrap();
    Engine::load(dir, &weights, backend, cfg, &prometheus::Registry::new())
}

/// Every golden case, greedy with its logits, generating through eos so that the decodes run
/// long; and each again sampled with a seed (`sampled`).
fn requests(sampled: bool) -> Vec<GenerateRequest> {
    let mut out = Vec::new();
    for (i, (prompt, images)) in common::golden_inputs().into_iter().enumerate() {
        let base = GenerateRequest {
            prompt,
            images,
            sampling: SamplingParams::greedy(),
            max_new_tokens: 16 + 3 * i,
            ignore_eos: true,
            return_logits: !sampled,
            constraint: None,
        };
        if sampled {
            out.push(GenerateRequest {
                sampling: SamplingParams {
                    temperature: 0.8,
                    top_k: 20,
                    top_p: 0.9,
                    seed: Some(i as u64),
                    ..SamplingParams::greedy()
                },
                ..base.clone()
            });
        }
        out.push(base);
    }
    out
}

/// A request's tokens and each step's logits.
fn generate(e: &Engine, r: &GenerateRequest) -> (Vec<u32>, Vec<Vec<f32>>) {
    let mut logits = Vec::new();
    let g = e
        .generate(r, |ev| {
            if let Some(l) = ev.logits {
                logits.push(l.to_vec());
            }
            ControlFlow::Continue(())
        })
        .unwrap();
    (g.tokens, logits)
}

/// The largest |a - b| over the steps both have, up to the first step whose tokens differ
/// (after it the two sequences are different texts), and whether they differed before `a`'s
/// top-two margin fell within `tie`.
fn drift(
    (a_tokens, a): &(Vec<u32>, Vec<Vec<f32>>),
    (b_tokens, b): &(Vec<u32>, Vec<Vec<f32>>),
    tie: f32,
) -> (f32, Option<usize>) {
    let mut most = 0.0f32;
    for (step, (la, lb)) in a.iter().zip(b).enumerate() {
        let d = la
            .iter()
            .zip(lb)
            .map(|(x, y)| (x - y).abs())
            .fold(0.0, f32::max);
        most = most.max(d);
        if a_tokens[step] != b_tokens[step] {
            let mut sorted = la.clone();
            sorted.sort_by(|x, y| y.total_cmp(x));
            let bad = (sorted[0] - sorted[1] > tie).then_some(step);
            return (most, bad);
        }
    }
    (most, None)
}

/// The largest difference allowed between a step's logits over an FP8 cache and over the
/// native one, on this fixture's logits of |x| <= 13.1. e4m3 keeps 3 mantissa bits: each cached
/// key and value is off by up to 2^-4 of itself (6.25%; about 2.6% RMS), independently;
/// attention averages those errors over the keys it weighs and every later layer adds its own.
/// Measured on the six golden cases (text, one and two images, 16 to 31 tokens each): 0.22 to
/// 0.43 with the default scale 1.0 (values here are |x| <= 5.3, mean 0.8: normal e4m3
/// numbers), 0.30 with scales of 1/64 on the first case. The bound is 0.75 (5.7% of the
/// largest logit), 1.7 times the worst measured.
const DRIFT: f32 = 0.75;

/// The logits' drift of an FP8 cache (scale 1.0: this checkpoint has none) against the CPU's
/// f32 cache, over every golden case, within [`DRIFT`]; greedy tokens agree except where the
/// two best logits are within twice that (measured: two cases took the other token, at
/// margins of 0.016 and 0.038).
#[test]
fn an_fp8_cache_keeps_greedy_tokens_and_logits_near_the_native_cache() {
    let reqs = requests(false);
    let native = engine_of(&fixture(), CpuBackend::new(), EngineConfig::default()).unwrap();
    let fp8 = engine_of(&fixture(), CpuBackend::new(), fp8()).unwrap();
    let mut most = 0.0f32;
    for (i, r) in reqs.iter().enumerate() {
        let a = generate(&native, r);
        let b = generate(&fp8, r);
        assert_eq!(a.1.len(), a.0.len(), "a logit row a token");
        let (d, diverged) = drift(&a, &b, 2.0 * DRIFT);
        let big = a.1.iter().flatten().fold(0.0f32, |m, x| m.max(x.abs()));
        eprintln!(
            "case {i}: {} tokens, logits up to {big}, drift {d}, tokens equal: {}",
            a.0.len(),
            a.0 == b.0
        );
        if let Some(step) = a.0.iter().zip(&b.0).position(|(x, y)| x != y) {
            let mut sorted = a.1[step].clone();
            sorted.sort_by(|x, y| y.total_cmp(x));
            eprintln!(
                "  the tokens differ from step {step}, where the top two logits were {} apart",
                sorted[0] - sorted[1]
            );
        }
        assert_eq!(
            diverged, None,
            "case {i}: greedy tokens differ past a near tie"
        );
        most = most.max(d);
    }
    eprintln!("largest logit drift, FP8 against the f32 cache: {most}");
    assert!(most <= DRIFT, "logits drifted by {most}, more than {DRIFT}");
    assert!(
        most > 0.0,
        "an FP8 cache that changes nothing is not storing FP8"
    );
}

/// Sent together or alone, greedy or sampled, chunked prefill or not: each request's tokens
/// are the same over an FP8 cache, as over the native one (each row's keys are rounded the
/// same whatever the batch).
#[test]
fn an_fp8_cache_gives_each_request_its_tokens_alone_in_any_batch() {
    let reqs = requests(true);
    let e = engine_of(&fixture(), CpuBackend::new(), fp8()).unwrap();
    let alone: Vec<Vec<u32>> = reqs.iter().map(|r| generate(&e, r).0).collect();
    for cfg in [
        fp8(),
        EngineConfig {
            max_batch_tokens: 7,
            max_batch_seqs: 3,
            prefix_caching: false,
            ..fp8()
        },
    ] {
        let e = engine_of(&fixture(), CpuBackend::new(), cfg.clone()).unwrap();
        assert_eq!(together(&e, &reqs), alone, "{cfg:?}");
    }
}

/// One byte an element: a quarter of the CPU's f32 cache, half of a GPU's f16 one, so a cache
/// of the same bytes holds twice (or four times) the tokens.
#[test]
fn an_fp8_cache_takes_one_byte_an_element() {
    let cfg = llm_svc::ModelConfig::from_dir(&fixture()).unwrap().text;
    let per = |dtype| llm_svc::PagedKv::<CpuBackend>::bytes_per_token(&cfg, dtype);
    let gpu = |dtype| llm_svc::PagedKv::<vlm_compute::CudaBackend>::bytes_per_token(&cfg, dtype);
    assert_eq!(per(KvCacheDtype::Auto), 4 * per(KvCacheDtype::Fp8));
    assert_eq!(gpu(KvCacheDtype::Auto), 2 * gpu(KvCacheDtype::Fp8));
    let elements = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim;
    assert_eq!(per(KvCacheDtype::Fp8), elements);
    let e = engine_of(&fixture(), CpuBackend::new(), fp8()).unwrap();
    assert_eq!(e.kv_bytes_per_token(), elements);
    assert_eq!(e.kv_cache_bytes(), (e.kv_cache_tokens() + 16) * elements);
}

/// A scale tensor to write: its name, values and shape.
type Scale<N> = (N, Vec<f32>, Vec<usize>);

/// The tiny fixture with per-layer KV cache scales added beside its weights (an index naming
/// its own shards and one more file), as vLLM and llm-compressor write them: `tensors` are
/// (name, values as f32, shape).
fn with_scales(tag: &str, tensors: &[Scale<String>]) -> PathBuf {
    // Absolute, so the links below resolve from the temporary directory (the fixture's path is
    // relative where the tests run from a checkout other than the one they were built in).
    let src = std::fs::canonicalize(fixture()).unwrap();
    let dir = std::env::temp_dir().join(format!("vlm-fp8-kv-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    for entry in std::fs::read_dir(&src).unwrap() {
        let entry = entry.unwrap();
        let name = entry.file_name();
        if name != "model.safetensors.index.json" && entry.file_type().unwrap().is_file() {
            std::os::unix::fs::symlink(entry.path(), dir.join(&name)).unwrap();
        }
    }
    let index_path = src.join("model.safetensors.index.json");
    let mut index: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(index_path).unwrap()).unwrap();
    let bytes: Vec<Vec<u8>> = tensors
        .iter()
        .map(|(_, v, _)| v.iter().flat_map(|x| x.to_le_bytes()).collect())
        .collect();
    let views: Vec<(String, TensorView)> = tensors
        .iter()
        .zip(&bytes)
        .map(|((n, _, s), b)| {
            (
                n.clone(),
                TensorView::new(Dtype::F32, s.clone(), b).unwrap(),
            )
        })
        .collect();
    safetensors::serialize_to_file(views, None, &dir.join("kv-scales.safetensors")).unwrap();
    for (n, _, _) in tensors {
        index["weight_map"][n] = "kv-scales.safetensors".into();
    }
    std::fs::write(dir.join("model.safetensors.index.json"), index.to_string()).unwrap();
    dir
}

fn layer_scale(layer: usize, name: &str) -> String {
    format!("model.language_model.layers.{layer}.self_attn.{name}")
}

/// A checkpoint's scales are the cache's: scales of 1/64 (every key and value then far
/// inside e4m3's range, at finer steps than 1.0 gives) change the logits from the default's
/// and stay as close to the native cache's; compressed-tensors' and ModelOpt's spellings, a
/// scale per KV head (the largest taken) and the deprecated `kv_scale` read as vLLM reads them.
#[test]
fn a_checkpoint_s_kv_scales_are_the_cache_s() {
    let layers = llm_svc::ModelConfig::from_dir(&fixture())
        .unwrap()
        .text
        .num_hidden_layers;
    let heads = llm_svc::ModelConfig::from_dir(&fixture())
        .unwrap()
        .text
        .num_key_value_heads;
    let r = requests(false).remove(0);
    let native = generate(
        &engine_of(&fixture(), CpuBackend::new(), EngineConfig::default()).unwrap(),
        &r,
    );
    let default = generate(
        &engine_of(&fixture(), CpuBackend::new(), fp8()).unwrap(),
        &r,
    );
    let spellings: [&[Scale<&str>]; 4] = [
        &[
            ("k_scale", vec![1.0 / 64.0], vec![]),
            ("v_scale", vec![1.0 / 64.0], vec![]),
        ],
        &[
            ("k_proj.output_scale", vec![1.0 / 64.0], vec![1]),
            ("v_proj.output_scale", vec![1.0 / 64.0], vec![1]),
        ],
        &[
            (
                "k_proj.k_scale",
                [vec![1.0 / 128.0; heads - 1], vec![1.0 / 64.0]].concat(),
                vec![heads],
            ),
            ("v_proj.v_scale", vec![1.0 / 64.0], vec![]),
        ],
        &[("kv_scale", vec![1.0 / 64.0], vec![])],
    ];
    let mut first = None;
    for (tag, names) in spellings.iter().enumerate() {
        let tensors: Vec<_> = (0..layers)
            .flat_map(|l| {
                names
                    .iter()
                    .map(move |(n, v, s)| (layer_scale(l, n), v.clone(), s.clone()))
            })
            .collect();
        let dir = with_scales(&format!("ok{tag}"), &tensors);
        let scaled = generate(&engine_of(&dir, CpuBackend::new(), fp8()).unwrap(), &r);
        assert_ne!(
            scaled.1, default.1,
            "spelling {tag}: the checkpoint's scales unused"
        );
        let (d, diverged) = drift(&native, &scaled, 2.0 * DRIFT);
        assert!(
            d <= DRIFT && diverged.is_none(),
            "spelling {tag}: drift {d}"
        );
        // Every spelling of the same scales gives the same cache.
        assert_eq!(
            *first.get_or_insert_with(|| scaled.clone()),
            scaled,
            "spelling {tag}"
        );
        let _ = std::fs::remove_dir_all(dir);
    }
}

/// Scales that are no scales, or only some layers', are refused at start with an error that
/// names the flag and the tensor; without the flag the same checkpoint serves (the scales are
/// not read).
#[test]
fn bad_kv_scales_are_refused_at_start_naming_the_flag() {
    let layers = llm_svc::ModelConfig::from_dir(&fixture())
        .unwrap()
        .text
        .num_hidden_layers;
    let both = |l: usize, k: f32| {
        [
            (layer_scale(l, "k_scale"), vec![k], vec![]),
            (layer_scale(l, "v_scale"), vec![0.5], vec![]),
        ]
    };
    let zero: Vec<_> = (0..layers).flat_map(|l| both(l, 0.0)).collect();
    let nan: Vec<_> = (0..layers).flat_map(|l| both(l, f32::NAN)).collect();
    let partial: Vec<_> = both(0, 0.5).into_iter().collect();
    let shape: Vec<_> = (0..layers)
        .flat_map(|l| {
            [
                (layer_scale(l, "k_scale"), vec![0.5; 6], vec![2, 3]),
                (layer_scale(l, "v_scale"), vec![0.5], vec![]),
            ]
        })
        .collect();
    for (tag, tensors, names) in [
        ("zero", zero, "layers.0.self_attn.k_scale"),
        ("nan", nan, "layers.0.self_attn.k_scale"),
        ("partial", partial, "layers.1.self_attn.k_scale"),
        ("shape", shape, "layers.0.self_attn.k_scale"),
    ] {
        let dir = with_scales(tag, &tensors);
        let err = engine_of(&dir, CpuBackend::new(), fp8())
            .err()
            .unwrap_or_else(|| panic!("{tag}: served"))
            .to_string();
        assert!(
            err.contains("--kv-cache-dtype fp8") && err.contains(names),
            "{tag}: {err}"
        );
        let cfg = EngineConfig {
            kv_cache: KvCacheSize::Tokens(256),
            ..EngineConfig::default()
        };
        assert!(engine_of(&dir, CpuBackend::new(), cfg).is_ok(), "{tag}");
        let _ = std::fs::remove_dir_all(dir);
    }
}

/// On the GPU (skipped without one): an FP8 cache's logits stay within [`DRIFT`] of the f16
/// cache's and greedy tokens agree up to near ties; requests sent together give the tokens
/// each gives alone up to near ties (the GPU's batched GEMMs round differently from its GEMVs,
/// see batching.rs); and the CPU's FP8 engine agrees with it as the f16 ones do. Every FP8
/// kernel runs: qkv_to_cache_f8, the split-K decode's (recorded decode steps), the paged
/// flash prefill's and the per-row kernel's.
#[test]
fn on_cuda_an_fp8_cache_stays_near_the_f16_cache_in_any_batch() {
    let Some(gpu) = vlm_compute::cuda::test_gpu() else {
        return;
    };
    let on_gpu = |dtype| EngineConfig {
        kv_cache: KvCacheSize::Tokens(8192),
        kv_cache_dtype: dtype,
        ..EngineConfig::default()
    };
    let reqs = requests(false);
    let f16 = engine_of(&fixture(), gpu.clone(), on_gpu(KvCacheDtype::Auto)).unwrap();
    let fp8 = engine_of(&fixture(), gpu, on_gpu(KvCacheDtype::Fp8)).unwrap();
    let cpu = engine_of(&fixture(), CpuBackend::new(), self::fp8()).unwrap();
    let mut most = [0.0f32; 2];
    let mut solo = Vec::new();
    for (i, r) in reqs.iter().enumerate() {
        let a = generate(&f16, r);
        let b = generate(&fp8, r);
        let c = generate(&cpu, r);
        for (m, (x, y)) in most.iter_mut().zip([(&a, &b), (&c, &b)]) {
            let (d, diverged) = drift(x, y, 2.0 * DRIFT);
            assert_eq!(
                diverged, None,
                "case {i}: greedy tokens differ past a near tie"
            );
            *m = m.max(d);
        }
        solo.push(b);
    }
    eprintln!(
        "largest logit drift on the GPU: FP8 against f16 {}, against the CPU's FP8 {}",
        most[0], most[1]
    );
    assert!(most[0] <= DRIFT && most[1] <= DRIFT, "{most:?}");
    // Logits are O(10); the GPU's GEMV and GEMM paths differ by ~1e-2 at most here.
    const TIE: f32 = 0.1;
    for ((tokens, logits), got) in solo.iter().zip(together(&fp8, &reqs)) {
        for (step, l) in logits.iter().enumerate() {
            if common::top_two_gap(l) <= TIE {
                break;
            }
            assert_eq!(got[step], tokens[step], "greedy token {step}");
        }
    }
}
