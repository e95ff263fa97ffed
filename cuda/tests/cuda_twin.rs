//! Every CUDA op against its CPU twin, on random inputs at the real Qwen3-VL-8B and ViT sizes
//! and at odd ones. Skipped (with a message) where no GPU is present; on the GPU machine:
//!
//!     cargo test --release -p vlm-compute --test cuda_twin -- --nocapture
//!
//! Tolerance: both sides are f32; only summation order differs (cuBLAS blocking, warp
//! reductions, online softmax), so results agree to ~1e-6 relative per op; we allow 1e-4 of the
//! largest magnitude (2e-4 for GEMMs with k >= 4096, whose sums are long).

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use vlm_compute::{AttnMask, Backend, CpuBackend, CudaBackend, GeluKind, HostTensor};

fn gpu() -> Option<CudaBackend> {
    match CudaBackend::new(0) {
        Ok(b) => Some(b),
        Err(e) => {
            // Straight to stderr, past the test harness's capture, so CI logs show the skip.
            use std::io::Write;
            let _ = writeln!(std::io::stderr(), "SKIPPED (no GPU): {e}");
            None
        }
    }
}

fn rand(shape: &[usize], seed: u64) -> HostTensor {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let n = shape.iter().product();
    HostTensor::new(
        shape.to_vec(),
        (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect(),
    )
    .unwrap()
}

/// |cuda - cpu| <= rel * max|cpu| (with a floor for all-small outputs).
fn assert_close(op: &str, cpu: &HostTensor, cuda: &HostTensor, rel: f32) {
    assert_eq!(cpu.shape(), cuda.shape(), "{op}: shape");
    let scale = cpu.data().iter().fold(1e-3f32, |m, v| m.max(v.abs()));
    let diff = cpu.max_abs_diff(cuda).unwrap();
    assert!(
        diff <= rel * scale,
        "{op}: max diff {diff} vs scale {scale}"
    );
    eprintln!("{op}: max diff {diff:.2e} (scale {scale:.2})");
}

/// Runs one body on the CPU backend and on the GPU with the same host inputs, and compares.
macro_rules! both {
    ($gpu:expr, $op:expr, $rel:expr, |$be:ident, $t:ident| $body:expr, $inputs:expr) => {{
        let inputs: Vec<HostTensor> = $inputs;
        let cpu_out = {
            let $be = &CpuBackend::new();
            let $t: Vec<_> = inputs.iter().map(|h| $be.upload(h).unwrap()).collect();
            $be.download(&$body).unwrap()
        };
        let cuda_out = {
            let $be = $gpu;
            let $t: Vec<_> = inputs.iter().map(|h| $be.upload(h).unwrap()).collect();
            $be.download(&$body).unwrap()
        };
        assert_close($op, &cpu_out, &cuda_out, $rel);
    }};
}

#[test]
fn elementwise_and_norms() {
    let Some(g) = gpu() else { return };
    for (rows, cols) in [
        (1, 4096),
        (17, 1152),
        (3, 4608),
        (5, 4304),
        (96, 128),
        (1, 7),
    ] {
        let tag = format!("[{rows},{cols}]");
        both!(
            &g,
            &format!("add {tag}"),
            1e-6,
            |be, t| be.add(&t[0], &t[1]).unwrap(),
            vec![rand(&[rows, cols], 1), rand(&[rows, cols], 2)]
        );
        both!(
            &g,
            &format!("silu_mul {tag}"),
            1e-5,
            |be, t| be.silu_mul(&t[0], &t[1]).unwrap(),
            vec![rand(&[rows, cols], 3), rand(&[rows, cols], 4)]
        );
        both!(
            &g,
            &format!("gelu tanh {tag}"),
            1e-5,
            |be, t| be.gelu(&t[0], GeluKind::Tanh).unwrap(),
            vec![rand(&[rows, cols], 5)]
        );
        both!(
            &g,
            &format!("gelu erf {tag}"),
            1e-5,
            |be, t| be.gelu(&t[0], GeluKind::Erf).unwrap(),
            vec![rand(&[rows, cols], 6)]
        );
        both!(
            &g,
            &format!("layer_norm {tag}"),
            1e-4,
            |be, t| be.layer_norm(&t[0], &t[1], &t[2], 1e-6).unwrap(),
            vec![rand(&[rows, cols], 7), rand(&[cols], 8), rand(&[cols], 9)]
        );
        both!(
            &g,
            &format!("rms_norm {tag}"),
            1e-4,
            |be, t| be.rms_norm(&t[0], &t[1], 1e-6).unwrap(),
            vec![rand(&[rows, cols], 10), rand(&[cols], 11)]
        );
    }
}

#[test]
fn linear_at_real_sizes() {
    let Some(g) = gpu() else { return };
    // (rows, in, out): decode and prefill at 8B text sizes, ViT sizes, odd ones.
    for (n, k, m) in [
        (1, 4096, 12288),
        (1, 12288, 4096),
        (33, 4096, 1024),
        (17, 1152, 4304),
        (196, 4608, 4096),
        (3, 7, 5),
    ] {
        let rel = if k >= 4096 { 2e-4 } else { 1e-4 };
        both!(
            &g,
            &format!("linear {n}x{k}->{m}"),
            rel,
            |be, t| be.linear(&t[0], &t[1], None).unwrap(),
            vec![rand(&[n, k], 12), rand(&[m, k], 13)]
        );
        both!(
            &g,
            &format!("linear+bias {n}x{k}->{m}"),
            rel,
            |be, t| be.linear(&t[0], &t[1], Some(&t[2])).unwrap(),
            vec![rand(&[n, k], 14), rand(&[m, k], 15), rand(&[m], 16)]
        );
    }
}

#[test]
fn rope_and_attention_at_real_sizes() {
    let Some(g) = gpu() else { return };
    for (n, h, d) in [(1, 32, 128), (37, 8, 128), (784, 16, 72), (5, 4, 32)] {
        both!(
            &g,
            &format!("rope [{n},{h},{d}]"),
            1e-5,
            |be, t| be.rope(&t[0], &t[1], &t[2]).unwrap(),
            vec![rand(&[n, h, d], 17), rand(&[n, d], 18), rand(&[n, d], 19)]
        );
    }
    // (queries, q heads, kv heads, head dim, kv slots, valid, mask)
    let cases = [
        (
            1,
            32,
            8,
            128,
            4096,
            4096,
            AttnMask::Causal {
                first_query_slot: 4095,
            },
        ),
        (
            1,
            32,
            8,
            128,
            600,
            513,
            AttnMask::Causal {
                first_query_slot: 512,
            },
        ),
        (
            37,
            32,
            8,
            128,
            64,
            37,
            AttnMask::Causal {
                first_query_slot: 0,
            },
        ),
        (784, 16, 16, 72, 784, 784, AttnMask::Full),
        (
            7,
            4,
            2,
            32,
            9,
            9,
            AttnMask::Causal {
                first_query_slot: 2,
            },
        ),
    ];
    for (nq, hq, hkv, d, slots, len, mask) in cases {
        both!(
            &g,
            &format!("attention q{nq} h{hq}/{hkv} d{d} kv{len} {mask:?}"),
            1e-4,
            |be, t| be.attention(&t[0], &t[1], &t[2], len, mask).unwrap(),
            vec![
                rand(&[nq, hq, d], 20),
                rand(&[slots, hkv, d], 21),
                rand(&[slots, hkv, d], 22)
            ]
        );
    }
}

#[test]
fn gathers_and_row_updates() {
    let Some(g) = gpu() else { return };
    let ids = [3u32, 0, 999, 3, 17];
    both!(
        &g,
        "embedding",
        0.0,
        |be, t| be.embedding(&t[0], &ids).unwrap(),
        vec![rand(&[1000, 4096], 23)]
    );
    let idx: Vec<u32> = (0..4 * 50).map(|i| (i * 37 % 2304) as u32).collect();
    let w: Vec<f32> = (0..4 * 50).map(|i| (i % 7) as f32 / 7.0).collect();
    both!(
        &g,
        "weighted_gather",
        1e-6,
        |be, t| be.weighted_gather(&t[0], &idx, &w, 4).unwrap(),
        vec![rand(&[2304, 1152], 24)]
    );
    both!(
        &g,
        "slice_rows",
        0.0,
        |be, t| be.slice_rows(&t[0], 3, 9).unwrap(),
        vec![rand(&[10, 64], 25)]
    );
    both!(
        &g,
        "write/scatter/add rows",
        1e-6,
        |be, t| {
            let mut cache = be.zeros(&[12, 8, 128]).unwrap();
            be.write_rows(
                &mut cache,
                4,
                &be.reshape(t[0].clone(), &[3, 8, 128]).unwrap(),
            )
            .unwrap();
            let mut x = t[1].clone();
            be.scatter_rows(&mut x, &[5, 0], &t[2]).unwrap();
            be.add_rows(&mut x, &[1, 5], &t[2]).unwrap();
            // The tensor `x` was cloned from is untouched by the in-place updates.
            let untouched = be.add(&t[1], &t[1]).unwrap();
            let flat = be.reshape(cache, &[12, 1024]).unwrap();
            let parts = [
                be.download(&flat).unwrap(),
                be.download(&x).unwrap(),
                be.download(&untouched).unwrap(),
            ];
            be.upload(&HostTensor::concat_rows(&parts).unwrap())
                .unwrap()
        },
        vec![
            rand(&[3, 1024], 26),
            rand(&[6, 1024], 27),
            rand(&[2, 1024], 28)
        ]
    );
}

#[test]
fn random_weights_are_generated_on_the_gpu_bit_for_bit_as_on_the_cpu() {
    let Some(g) = gpu() else { return };
    let key =
        vlm_compute::random::tensor_key(0, "model.language_model.layers.0.mlp.up_proj.weight");
    // The 8B up_proj, and an odd size that leaves a partial block.
    for shape in [[12288usize, 4096], [3, 7]] {
        let cpu = CpuBackend::new()
            .random_uniform(&shape, key, 0.027)
            .unwrap();
        let cuda = g
            .download(&g.random_uniform(&shape, key, 0.027).unwrap())
            .unwrap();
        assert_eq!(cpu.max_abs_diff(&cuda).unwrap(), 0.0, "{shape:?}");
    }
}

#[test]
fn kernels_compile_for_h100_and_orin_wherever_nvrtc_is() {
    // NVRTC needs no GPU, so this runs on any machine that has libnvrtc (pip install
    // nvidia-cuda-nvrtc-cu12 and LD_LIBRARY_PATH is enough): it catches kernel source errors
    // before a GPU session.
    if !vlm_compute::cuda::nvrtc_available() {
        use std::io::Write;
        let _ = writeln!(std::io::stderr(), "SKIPPED: libnvrtc not found");
        return;
    }
    for cc in [(9, 0), (8, 7)] {
        let ptx =
            vlm_compute::cuda::compile_ops_ptx(cc).unwrap_or_else(|e| panic!("sm {cc:?}: {e}"));
        for k in [
            "attention_f32",
            "layer_norm_f32",
            "rope_f32",
            "scatter_rows_f32",
        ] {
            assert!(
                ptx.contains(&format!(".entry {k}")),
                "sm {cc:?}: {k} missing from the PTX"
            );
        }
    }
}

#[test]
fn no_gpu_is_an_error_not_a_crash() {
    // Without the driver this is Err with a useful message; with a GPU, Ok.
    match CudaBackend::new(0) {
        Ok(b) => eprintln!(
            "GPU present: {} (sm {:?})",
            b.device_name(),
            b.compute_capability()
        ),
        Err(e) => {
            let m = e.to_string();
            assert!(
                m.contains("CUDA") && m.contains("could not be loaded"),
                "{m}"
            );
        }
    }
}
