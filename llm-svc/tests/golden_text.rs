//! The language stage against HF transformers, through the golden fixtures: M-RoPE positions,
//! the logits of every generated step and the greedy tokens, fed with HF's own vision outputs
//! so that this checks the decoder alone.

use std::ops::ControlFlow;
use std::path::PathBuf;

use llm_svc::{mrope, Engine, EngineConfig, GenerateRequest, ImageInput, SamplingParams};
use vlm_compute::{golden::Golden, CpuBackend, Embeddings, Weights};

fn fixture() -> PathBuf {
    vlm_compute::golden::tiny_fixture(env!("CARGO_MANIFEST_DIR"))
}

fn hf_image(g: &Golden, name: &str) -> ImageInput {
    let (_, grid) = g.ints(&format!("image.{name}.grid_thw")).unwrap();
    ImageInput {
        embeds: Embeddings::F32(g.tensor(&format!("image.{name}.embeds")).unwrap()),
        deepstack: (0..3)
            .map(|j| Embeddings::F32(g.tensor(&format!("image.{name}.deepstack.{j}")).unwrap()))
            .collect(),
        grid_thw: [grid[0] as usize, grid[1] as usize, grid[2] as usize],
    }
}

/// Logits are O(10). CPU: f32 on both sides with different summation orders over 4 layers, so
/// 1e-3 absolute (1e-4 relative) is what f32 allows, and a wrong op (a missed norm, a shifted
/// position) moves them by O(1).
const CPU_LOGITS_TOL: f32 = 1e-3;
/// CUDA: the fixture's bf16 weights convert to f16 exactly (bar a few below 6e-5), but
/// prefill's GEMMs take their inputs rounded to f16 (2^-11 relative each) and the KV cache
/// holds f16 keys and values (2^-11 relative each), which over 4 layers moves O(10) logits by
/// up to ~1e-2; 5e-2 keeps a 20x margin below the O(1) of a wrong op. (Decode GEMVs keep f32
/// inputs.)
const CUDA_LOGITS_TOL: f32 = 5e-2;

#[test]
fn logits_and_greedy_tokens_match_hf_for_every_case() {
    check_engine(CpuBackend::new(), CPU_LOGITS_TOL);
}

/// The same check with the CUDA backend; skipped without a GPU. On the GPU machine:
/// `cargo test --release -p llm-svc --test golden_text -- --nocapture`.
#[test]
fn logits_on_cuda_match_hf() {
    if let Some(gpu) = vlm_compute::cuda::test_gpu() {
        check_engine(gpu, CUDA_LOGITS_TOL);
    }
}

fn check_engine<B: vlm_compute::Backend>(backend: B, tol: f32) {
    let dir = fixture();
    let g = Golden::open(&dir).unwrap();
    let weights = Weights::open(&dir).unwrap();
    let engine = Engine::load(
        &dir,
        &weights,
        backend,
        EngineConfig::default(),
        &prometheus::Registry::new(),
    )
    .unwrap();
    let cases = g.manifest()["cases"].as_array().unwrap().clone();
    assert!(cases.len() >= 3);
    for case in cases {
        let name = case["name"].as_str().unwrap();
        let key = format!("case.{name}");
        let (_, prompt) = g.ints(&format!("{key}.prompt_ids")).unwrap();
        let images: Vec<ImageInput> = case["images"]
            .as_array()
            .unwrap()
            .iter()
            .map(|n| hf_image(&g, n.as_str().unwrap()))
            .collect();
        let (_, hf_tokens) = g.ints(&format!("{key}.tokens")).unwrap();
        let hf_logits = g.tensor(&format!("{key}.logits")).unwrap();
        let req = GenerateRequest {
            prompt: prompt.iter().map(|&t| t as u32).collect(),
            images,
            sampling: SamplingParams::greedy(),
            max_new_tokens: hf_tokens.len(),
            ignore_eos: false,
            return_logits: true,
        };

        // Positions first: a wrong M-RoPE layout would show here before it shows in logits.
        let m = engine.config().spatial_merge_size;
        let grids: Vec<_> = req
            .images
            .iter()
            .map(|i| (i.grid_thw[1] / m, i.grid_thw[2] / m))
            .collect();
        let spans =
            mrope::image_spans(&req.prompt, engine.config().image_token_id, &grids).unwrap();
        let ours = mrope::prompt_positions(req.prompt.len(), &spans);
        let (shape, hf_pos) = g.ints(&format!("{key}.position_ids")).unwrap();
        let l = shape[1];
        for (i, p) in ours.positions.iter().enumerate() {
            let hf = [hf_pos[i], hf_pos[l + i], hf_pos[2 * l + i]];
            assert_eq!(p.map(i64::from), hf, "{name}: position of token {i}");
        }

        let mut logits = Vec::new();
        let out = engine
            .generate(&req, |ev| {
                logits.push(ev.logits.expect("asked for").to_vec());
                ControlFlow::Continue(())
            })
            .unwrap();
        let vocab = hf_logits.shape()[1];
        for (step, ours) in logits.iter().enumerate() {
            let hf = &hf_logits.data()[step * vocab..(step + 1) * vocab];
            let max = ours
                .iter()
                .zip(hf)
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            assert!(max <= tol, "{name}: step {step} logits differ by {max}");
            // Greedy tokens must be HF's, except where HF's top two are closer than the
            // tolerance allows us to tell apart; after such a step the sequences may diverge.
            let mut sorted = hf.to_vec();
            sorted.sort_by(|a, b| b.total_cmp(a));
            if sorted[0] - sorted[1] <= 2.0 * tol {
                eprintln!(
                    "{name}: step {step} is a near tie in HF's logits; tokens compared up to here"
                );
                break;
            }
            assert_eq!(
                out.tokens.get(step).map(|&t| t as i64),
                hf_tokens.get(step).copied(),
                "{name}: greedy token {step}"
            );
        }
        // Without logits, greedy tokens are picked on the device (Backend::sample_rows): the same.
        let on_device = engine
            .generate(
                &GenerateRequest {
                    return_logits: false,
                    ..req.clone()
                },
                |ev| {
                    assert!(ev.logits.is_none());
                    ControlFlow::Continue(())
                },
            )
            .unwrap();
        assert_eq!(on_device.tokens, out.tokens, "{name}: argmax on the device");
        if tol == CPU_LOGITS_TOL {
            let tokens: Vec<i64> = out.tokens.iter().map(|&t| t as i64).collect();
            assert_eq!(tokens, hf_tokens, "{name}: greedy tokens");
        }
    }
}
