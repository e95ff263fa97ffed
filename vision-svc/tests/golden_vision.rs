//! The vision stage against HF transformers, through the golden fixtures
//! (`tests/fixtures/make_fixtures.py`): preprocessing from the image files, and the tower
//! (embeddings + DeepStack features) from HF's own pixel values, so each stage is checked alone.

use std::path::{Path, PathBuf};

use vision_svc::{preprocess, PatchValues, Patches, VisionEncoder};
use vlm_compute::{golden::Golden, CpuBackend, HostTensor, Weights};

fn fixture() -> PathBuf {
    vlm_compute::golden::tiny_fixture(env!("CARGO_MANIFEST_DIR"))
}

fn image_names(g: &Golden) -> Vec<String> {
    g.manifest()["images"]
        .as_object()
        .unwrap()
        .keys()
        .cloned()
        .collect()
}

/// Largest |a - b| and the mean |a - b|.
fn diff(a: &HostTensor, b: &HostTensor) -> (f32, f32) {
    assert_eq!(a.shape(), b.shape());
    let d: Vec<f32> = a
        .data()
        .iter()
        .zip(b.data())
        .map(|(x, y)| (x - y).abs())
        .collect();
    (
        d.iter().cloned().fold(0.0, f32::max),
        d.iter().sum::<f32>() / d.len() as f32,
    )
}

#[test]
fn preprocessing_matches_hf_pixel_values() {
    let dir = fixture();
    let g = Golden::open(&dir).unwrap();
    let enc = vision_svc::PreprocessConfig::from_dir(&dir).unwrap();
    for name in image_names(&g) {
        let bytes = std::fs::read(dir.join("images").join(&name)).unwrap();
        let ours = preprocess::preprocess(&bytes, &enc, &Default::default()).unwrap();
        let (_, grid) = g.ints(&format!("image.{name}.grid_thw")).unwrap();
        assert_eq!(
            ours.grid_thw.map(|v| v as i64).to_vec(),
            grid,
            "{name}: grid"
        );
        let hf = g.tensor(&format!("image.{name}.pixel_values")).unwrap();
        let (max, mean) = diff(&ours.to_values().unwrap(), &hf);
        if name.ends_with(".jpg") {
            // Lossy: libjpeg-turbo (PIL) and the Rust decoder round the IDCT differently, by a
            // few levels of 255 on some pixels; normalized values step by 2/255 = 0.0078.
            assert!(
                max <= 12.0 / 255.0 && mean <= 1.5 / 255.0,
                "{name}: max {max}, mean {mean}"
            );
        } else {
            // Lossless input and Pillow-exact resampling: equal up to f32 rounding.
            assert!(max <= 1e-6, "{name}: max {max}, mean {mean}");
        }
    }
}

#[test]
fn vision_tower_matches_hf_embeddings_and_deepstack() {
    // f32 on both sides; only summation order differs (GEMM blocking, softmax, LayerNorm),
    // which moves O(1) activations by ~1e-6 per op over 4 blocks and 2 GEMMs after them.
    check_tower(&fixture(), CpuBackend::new(), 1e-4);
}

/// Qwen's FP8 layout (`tests/fixtures/tiny-qwen3-vl-fp8`, made by transformers' FineGrainedFP8
/// quantizer): the text decoder's matrices are e4m3 with block scales, the vision tower is left
/// unquantized (`modules_to_not_convert`), and the tower reads its bf16 tensors from the same
/// files as it does from a bf16 checkpoint.
#[test]
fn an_fp8_checkpoints_vision_tower_matches_hf() {
    let dir = vlm_compute::golden::fixture(env!("CARGO_MANIFEST_DIR"), "tiny-qwen3-vl-fp8");
    check_tower(&dir, CpuBackend::new(), 1e-4);
}

/// The same check with the CUDA backend; skipped without a GPU. On the GPU machine:
/// `cargo test --release -p vision-svc --test golden_vision -- --nocapture`.
#[test]
fn vision_tower_on_cuda_matches_hf() {
    // The fixture's bf16 weights convert to f16 exactly (bar a few below 6e-5), but every
    // GEMM takes its input rounded to f16 (2^-11 relative), ~25 of them in a row: O(1)
    // outputs move by a few 1e-3. The outputs come back as f16 too (another 2^-11 relative).
    // 1e-2 stays far below the O(0.1-1) of a wrong op.
    if let Some(gpu) = vlm_compute::cuda::test_gpu() {
        check_tower(&fixture(), gpu, 1e-2);
    }
}

fn check_tower<B: vlm_compute::Backend>(dir: &Path, backend: B, tol: f32) {
    let g = Golden::open(dir).unwrap();
    let weights = Weights::open(dir).unwrap();
    let enc = VisionEncoder::load(dir, &weights, backend).unwrap();
    for name in image_names(&g) {
        let (_, grid) = g.ints(&format!("image.{name}.grid_thw")).unwrap();
        let patches = Patches {
            values: PatchValues::Values(g.tensor(&format!("image.{name}.pixel_values")).unwrap()),
            grid_thw: [grid[0] as usize, grid[1] as usize, grid[2] as usize],
        };
        let out = enc.model.forward(&patches).unwrap();
        let hf = g.tensor(&format!("image.{name}.embeds")).unwrap();
        let (max, _) = diff(&out.embeds.to_f32().unwrap(), &hf);
        assert!(max <= tol, "{name}: embeddings differ by {max}");
        assert_eq!(out.deepstack.len(), 3);
        for (j, ds) in out.deepstack.iter().enumerate() {
            let hf = g.tensor(&format!("image.{name}.deepstack.{j}")).unwrap();
            let (max, _) = diff(&ds.to_f32().unwrap(), &hf);
            assert!(max <= tol, "{name}: DeepStack {j} differs by {max}");
        }
        // A GPU recorded the first pass for this grid and replays it now; timing ops runs
        // them one by one (where a backend times them). The same kernels, the same values.
        let again = enc.model.forward(&patches).unwrap();
        assert_eq!(again, out, "{name}: a second pass differs from the first");
        let be = enc.model.backend();
        if be.time_ops(true).unwrap() {
            let op_by_op = enc.model.forward(&patches);
            be.time_ops(false).unwrap();
            assert_eq!(
                op_by_op.unwrap(),
                out,
                "{name}: op by op differs from the recording"
            );
        }
        // Our own preprocessing hands the tower the image's bytes, which the backend cuts
        // into patches (a GPU on the device): the same values, so the same outputs, as when
        // the host cuts them and hands over the values.
        let bytes = std::fs::read(dir.join("images").join(&name)).unwrap();
        let ours = preprocess::preprocess(&bytes, &enc.preprocess, &enc.limits).unwrap();
        let as_values = Patches {
            values: PatchValues::Values(ours.to_values().unwrap()),
            grid_thw: ours.grid_thw,
        };
        assert_eq!(
            enc.model.forward(&ours).unwrap(),
            enc.model.forward(&as_values).unwrap(),
            "{name}: patches cut by the backend differ from the host's"
        );
    }
}
