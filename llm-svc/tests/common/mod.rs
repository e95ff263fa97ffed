//! What several of llm-svc's test programs read alike from the tiny Qwen3-VL fixture, and how
//! they run requests together. Each program uses part of it.
#![allow(dead_code)]

use std::path::{Path, PathBuf};

use llm_svc::{Engine, Event, FinishReason, GenerateRequest, ImageInput};
use vlm_compute::golden::Golden;
use vlm_compute::Embeddings;

pub fn fixture() -> PathBuf {
    vlm_compute::golden::tiny_fixture(env!("CARGO_MANIFEST_DIR"))
}

/// Each golden case's prompt tokens and images (their embeddings and DeepStack features as HF
/// computed them), in the manifest's order.
pub fn golden_inputs() -> Vec<(Vec<u32>, Vec<ImageInput>)> {
    golden_inputs_of(&fixture())
}

/// The same for the fixture in `dir`.
pub fn golden_inputs_of(dir: &Path) -> Vec<(Vec<u32>, Vec<ImageInput>)> {
    let g = Golden::open(dir).unwrap();
    let cases = g.manifest()["cases"].as_array().unwrap().clone();
    cases
        .iter()
        .map(|case| {
            let key = format!("case.{}", case["name"].as_str().unwrap());
            let (_, prompt) = g.ints(&format!("{key}.prompt_ids")).unwrap();
            let images = case["images"]
                .as_array()
                .unwrap()
                .iter()
                .map(|n| {
                    let n = n.as_str().unwrap();
                    let (_, grid) = g.ints(&format!("image.{n}.grid_thw")).unwrap();
                    let features = |name: &str| Embeddings::F32(g.tensor(name).unwrap());
                    ImageInput {
                        embeds: features(&format!("image.{n}.embeds")),
                        deepstack: (0..3)
                            .map(|j| features(&format!("image.{n}.deepstack.{j}")))
                            .collect(),
                        grid_thw: [grid[0] as usize, grid[1] as usize, grid[2] as usize],
                    }
                })
                .collect();
            (prompt.iter().map(|&t| t as u32).collect(), images)
        })
        .collect()
}

/// All requests submitted at once, then collected: each one's tokens and why it finished.
pub fn together_finished(
    engine: &Engine,
    reqs: &[GenerateRequest],
) -> Vec<(Vec<u32>, FinishReason)> {
    let streams: Vec<_> = reqs
        .iter()
        .map(|r| {
            engine
                .submit(r.clone(), None, tracing::Span::none())
                .unwrap()
        })
        .collect();
    streams
        .into_iter()
        .map(|mut s| loop {
            match s.blocking_recv().expect("the stream ends with Finished") {
                Event::Token { .. } => {}
                Event::Finished(g) => break (g.tokens, g.finish),
                Event::Failed(e) => panic!("a request failed: {e}"),
            }
        })
        .collect()
}

/// All requests submitted at once, then collected: each one's tokens.
pub fn together(engine: &Engine, reqs: &[GenerateRequest]) -> Vec<Vec<u32>> {
    together_finished(engine, reqs)
        .into_iter()
        .map(|(tokens, _)| tokens)
        .collect()
}

/// The gap between the two largest logits (0 where the largest appears twice): how near a
/// greedy pick is to a tie, the point past which two computations that differ only in
/// rounding may pick differently.
pub fn top_two_gap(logits: &[f32]) -> f32 {
    let (mut first, mut second) = (f32::NEG_INFINITY, f32::NEG_INFINITY);
    for &v in logits {
        if v.total_cmp(&first).is_gt() {
            second = first;
            first = v;
        } else if v.total_cmp(&second).is_gt() {
            second = v;
        }
    }
    first - second
}
