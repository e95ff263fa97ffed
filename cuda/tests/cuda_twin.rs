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

/// `t` with every value rounded to the nearest f16: the weights the GPU stores, and (for the
/// cuBLAS path) the activations it multiplies them with, so the CPU twin sees the same inputs.
fn f16_exact(t: HostTensor) -> HostTensor {
    let data = t
        .data()
        .iter()
        .map(|&v| half::f16::from_f32(v).to_f32())
        .collect();
    HostTensor::new(t.shape().to_vec(), data).unwrap()
}

/// `linear` / `swiglu` on both backends with the same f16-exact inputs.
fn compare_matmul(g: &CudaBackend, op: &str, rel: f32, n: usize, k: usize, m: usize, seed: u64) {
    let x = f16_exact(rand(&[n, k], seed));
    let (w, w2, b) = (
        f16_exact(rand(&[m, k], seed + 1)),
        f16_exact(rand(&[m, k], seed + 2)),
        rand(&[m], seed + 3),
    );
    fn run<B: Backend>(
        be: &B,
        op: &str,
        x: &HostTensor,
        w: &HostTensor,
        w2: &HostTensor,
        b: &HostTensor,
    ) -> HostTensor {
        let (x, wt, w2t, bt) = (
            be.upload(x).unwrap(),
            be.upload_weight(w).unwrap(),
            be.upload_weight(w2).unwrap(),
            be.upload(b).unwrap(),
        );
        let y = match op {
            "linear" => be.linear(&x, &wt, None),
            "linear+bias" => be.linear(&x, &wt, Some(&bt)),
            _ => be.swiglu(&x, &wt, &w2t),
        };
        be.download(&y.unwrap()).unwrap()
    }
    let cpu = run(&CpuBackend::new(), op, &x, &w, &w2, &b);
    let cuda = run(g, op, &x, &w, &w2, &b);
    assert_close(&format!("{op} {n}x{k}->{m}"), &cpu, &cuda, rel);
}

#[test]
fn linear_and_swiglu_at_real_sizes() {
    let Some(g) = gpu() else { return };
    // Weights are f16 on the GPU and x is f16-exact here, so both sides multiply the same
    // values; they differ only in summation order (f32 accumulation both). n <= 4 runs our
    // GEMV (decode), larger n cuBLAS. (rows, in, out): 8B decode and prefill, ViT, odd sizes
    // (k % 8 != 0 takes the GEMV's scalar path).
    for (n, k, m) in [
        (1, 4096, 12288),
        (1, 12288, 4096),
        (4, 4096, 151936),
        (2, 4096, 4096),
        (33, 4096, 1024),
        (17, 1152, 4304),
        (196, 4608, 4096),
        (3, 7, 5),
        (1, 4100, 9),
    ] {
        let rel = if k >= 4096 { 2e-4 } else { 1e-4 };
        for op in ["linear", "linear+bias", "swiglu"] {
            compare_matmul(&g, op, rel, n, k, m, 12);
        }
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
        // Prefill after a cached prefix (queries start at slot 512), and 8B prefill at 1024.
        (
            100,
            32,
            8,
            128,
            700,
            612,
            AttnMask::Causal {
                first_query_slot: 512,
            },
        ),
        (
            1024,
            32,
            8,
            128,
            1024,
            1024,
            AttnMask::Causal {
                first_query_slot: 0,
            },
        ),
        // The tiny fixture's head dim, padded to 64, and a partial query tile.
        (65, 4, 2, 16, 65, 65, AttnMask::Full),
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
        // 16 queries and up run the flash kernel: Q (scaled), K, V and the probabilities are
        // rounded to f16 for the tensor cores (2^-11 relative each), f32 accumulation; fewer
        // run the f32 kernel, which differs from the CPU in summation order only.
        let rel = if nq >= 16 { 2e-3 } else { 1e-4 };
        both!(
            &g,
            &format!("attention q{nq} h{hq}/{hkv} d{d} kv{len} {mask:?}"),
            rel,
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
fn decode_step_ops_read_the_slot_from_device_memory() {
    let Some(g) = gpu() else { return };
    // (q heads, kv heads, head dim, cache slots, slot): 8B at short and long context (one and
    // 16 key splits), a slot in the last split, the tiny fixture's sizes, odd ones.
    for (hq, hkv, d, slots, slot) in [
        (32, 8, 128, 4096, 4095),
        (32, 8, 128, 4096, 100),
        (32, 8, 128, 600, 512),
        (32, 8, 128, 512, 0),
        (4, 2, 16, 64, 33),
        (6, 3, 40, 700, 257),
    ] {
        let slot_t = HostTensor::new(vec![1], vec![slot as f32]).unwrap();
        let tag = format!("h{hq}/{hkv} d{d} slots{slots} at {slot}");
        both!(
            &g,
            &format!("decode_attention {tag}"),
            1e-4,
            |be, t| be.decode_attention(&t[0], &t[1], &t[2], &t[3]).unwrap(),
            vec![
                rand(&[1, hq, d], 30),
                rand(&[slots, hkv, d], 31),
                rand(&[slots, hkv, d], 32),
                slot_t.clone()
            ]
        );
        both!(
            &g,
            &format!("write_row_at {tag}"),
            0.0,
            |be, t| {
                let mut cache = t[0].clone();
                be.write_row_at(&mut cache, &t[2], &t[1]).unwrap();
                cache
            },
            vec![
                rand(&[slots, hkv, d], 33),
                rand(&[1, hkv, d], 34),
                slot_t.clone()
            ]
        );
    }
    // Greedy picks on the device: the 8B vocabulary, a tie (the first wins), a short row.
    for (n, tie) in [
        (151_936usize, None),
        (151_936, Some((70_000usize, 90_000usize))),
        (7, None),
    ] {
        let mut logits = rand(&[1, n], 36);
        if let Some((a, b)) = tie {
            logits.data_mut()[a] = 5.0;
            logits.data_mut()[b] = 5.0;
        }
        let cpu = CpuBackend::new().argmax(&logits).unwrap();
        let cuda = g.argmax(&g.upload(&logits).unwrap()).unwrap();
        assert_eq!(cpu, cuda, "argmax over {n} (tie {tie:?})");
    }
    // `write` refreshes a buffer in place: a clone taken before keeps the old values.
    let mut t = g.upload(&rand(&[1, 128], 35)).unwrap();
    let before = t.clone();
    g.write(&mut t, &[0.5; 128]).unwrap();
    assert_eq!(g.download(&t).unwrap().data(), &[0.5; 128]);
    assert_eq!(g.download(&before).unwrap(), rand(&[1, 128], 35));
}

#[test]
fn gathers_and_row_updates() {
    let Some(g) = gpu() else { return };
    let ids = HostTensor::new(vec![5], vec![3., 0., 999., 3., 17.]).unwrap();
    let table = f16_exact(rand(&[1000, 4096], 23));
    let cpu = CpuBackend::new();
    let rows = cpu.embedding(&table, &ids).unwrap();
    let on_gpu = g
        .embedding(&g.upload_weight(&table).unwrap(), &g.upload(&ids).unwrap())
        .unwrap();
    // f16 table values are exact in f32: the gathered rows are equal.
    assert_close("embedding", &rows, &g.download(&on_gpu).unwrap(), 0.0);
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
        // As a weight: rounded to f16 on the GPU exactly as an upload would round the CPU's.
        let as_weight = g.random_weight(&shape, key, 0.027).unwrap();
        let uploaded = g.upload_weight(&cpu).unwrap();
        let x = g
            .upload(&HostTensor::new(vec![1, shape[1]], vec![1.0; shape[1]]).unwrap())
            .unwrap();
        // Row sums through the GEMV: equal weights give bit-equal sums (same kernel, same order).
        let (a, b) = (
            g.download(&g.linear(&x, &as_weight, None).unwrap())
                .unwrap(),
            g.download(&g.linear(&x, &uploaded, None).unwrap()).unwrap(),
        );
        assert_eq!(a.max_abs_diff(&b).unwrap(), 0.0, "{shape:?} as f16 weight");
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
    // weights_f16.cu includes cuda_fp16.h: NVRTC needs the CUDA headers (CUDA_HOME; CI
    // pip-installs them with NVRTC).
    if let Err(e) = vlm_compute::cuda::compile::cuda_include_dir() {
        use std::io::Write;
        let _ = writeln!(std::io::stderr(), "SKIPPED: {e}");
        return;
    }
    let ptxas = std::env::var_os("VLM_PTXAS");
    if ptxas.is_none() {
        eprintln!("ptxas not checked: set VLM_PTXAS (.ci/run does) to assemble the PTX too");
    }
    for cc in [(9, 0), (8, 7)] {
        let files =
            vlm_compute::cuda::compile_all_ptx(cc).unwrap_or_else(|e| panic!("sm {cc:?}: {e}"));
        if let Some(ptxas) = &ptxas {
            for (file, ptx) in &files {
                assemble(ptxas, file, ptx, cc);
            }
        }
        let ptx: String = files.into_iter().map(|(_, ptx)| ptx).collect();
        for k in [
            "attention_f32",
            "layer_norm_f32",
            "rope_f32",
            "scatter_rows_f32",
            "gemv_f16w",
            "swiglu_gemv_f16w",
            "embedding_f16w",
            "fill_uniform_f16",
            "write_row_at_f32",
            "decode_attention_partial_f32",
            "decode_attention_combine_f32",
            "argmax_partial_f32",
            "argmax_final_f32",
            "flash_attention_d80",
            "flash_attention_d128",
        ] {
            assert!(
                ptx.contains(&format!(".entry {k}")),
                "sm {cc:?}: {k} missing from the PTX"
            );
        }
    }
}

/// Assembles `ptx` for `sm_{cc}` with ptxas, as the driver would at load: it must assemble
/// (registers, shared memory within the limits) without spilling registers to local memory.
fn assemble(ptxas: &std::ffi::OsStr, file: &str, ptx: &str, cc: (i32, i32)) {
    let dir = std::env::temp_dir().join(format!("vlm-ptxas-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let src = dir.join(format!("{file}.sm{}{}.ptx", cc.0, cc.1));
    std::fs::write(&src, ptx).unwrap();
    let out = std::process::Command::new(ptxas)
        .arg(format!("-arch=sm_{}{}", cc.0, cc.1))
        .arg("-v")
        .arg(&src)
        .arg("-o")
        .arg(src.with_extension("cubin"))
        .output()
        .expect("ptxas runs");
    let log = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "ptxas {file} sm_{}{}: {log}",
        cc.0,
        cc.1
    );
    let spills: Vec<&str> = log
        .lines()
        .filter(|l| {
            l.contains("spill") && !l.contains(" 0 bytes spill stores, 0 bytes spill loads")
        })
        .collect();
    assert!(
        spills.is_empty(),
        "{file} sm_{}{} spills registers: {spills:?}",
        cc.0,
        cc.1
    );
    let most = log
        .lines()
        .filter_map(|l| {
            l.split("Used ")
                .nth(1)?
                .split(' ')
                .next()?
                .parse::<u32>()
                .ok()
        })
        .max()
        .unwrap_or(0);
    eprintln!(
        "{file} sm_{}{}: assembles, no spills, at most {most} registers",
        cc.0, cc.1
    );
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
