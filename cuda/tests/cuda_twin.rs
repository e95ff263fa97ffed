//! Every CUDA op against its CPU twin, on random inputs at the real Qwen3-VL-8B and ViT sizes
//! and at odd ones (the startup self-check, `vlm_compute::twin::self_check`, runs the same
//! comparison at small sizes). Skipped (with a message) where no GPU is present; on the GPU
//! machine:
//!
//!     cargo test --release -p vlm-compute --test cuda_twin -- --nocapture
//!
//! Tolerances are `Case::tolerance`'s, stated there with their reasons.

use vlm_compute::cuda::{
    test_gpu, with_decode_attention, with_prefill_attention, DecodeAttention, PrefillAttention,
};
use vlm_compute::quant::QuantizeTo;
use vlm_compute::twin::{compare, Case, IntOp, FP8_KV};
use vlm_compute::KvFormat;
use vlm_compute::{AttnMask, Backend, CpuBackend, CudaBackend, GeluKind, HostTensor};

/// Runs every case, prints each outcome, and fails naming all that are outside tolerance.
fn check_all(g: &CudaBackend, cases: impl IntoIterator<Item = Case>) {
    let mut failed = Vec::new();
    for case in cases {
        let outcome = compare(g, &case).unwrap_or_else(|e| panic!("{}: {e}", case.name()));
        eprintln!("{outcome}");
        if !outcome.passed() {
            failed.push(outcome.to_string());
        }
    }
    assert!(
        failed.is_empty(),
        "outside tolerance:\n{}",
        failed.join("\n")
    );
}

#[test]
fn the_startup_self_check_passes() {
    let Some(g) = test_gpu() else { return };
    vlm_compute::twin::self_check(&g, |o| eprintln!("{o}")).unwrap();
}

#[test]
fn elementwise_and_norms() {
    let Some(g) = test_gpu() else { return };
    check_all(
        &g,
        [
            (1, 4096),
            (17, 1152),
            (3, 4608),
            (5, 4304),
            (96, 128),
            (1, 7),
        ]
        .into_iter()
        .flat_map(|(rows, cols)| {
            [
                Case::Add { rows, cols },
                Case::SiluMul { rows, cols },
                Case::Gelu {
                    rows,
                    cols,
                    kind: GeluKind::Tanh,
                },
                Case::Gelu {
                    rows,
                    cols,
                    kind: GeluKind::Erf,
                },
                Case::LayerNorm { rows, cols },
                Case::RmsNorm { rows, cols },
            ]
        }),
    );
}

#[test]
fn image_embeddings_leave_and_enter_at_real_sizes() {
    let Some(g) = test_gpu() else { return };
    // An 8B image's embeddings at 448x448 (196 tokens) and 1344x1344 (1764), and odd sizes.
    check_all(
        &g,
        [(196, 4096), (1764, 4096), (1, 4096), (3, 5)]
            .into_iter()
            .map(|(rows, cols)| Case::Embeddings { rows, cols }),
    );
}

#[test]
fn linear_and_swiglu_at_real_sizes() {
    let Some(g) = test_gpu() else { return };
    // Weights are f16 on the GPU and x is f16-exact, so both sides multiply the same values;
    // they differ only in summation order (f32 accumulation both). n <= 4 runs our GEMV
    // (decode), larger n cuBLAS. (rows, in, out): 8B decode and prefill, ViT, odd sizes
    // (k % 8 != 0 takes the GEMV's scalar path).
    check_all(
        &g,
        [
            (1, 4096, 12288),
            (1, 12288, 4096),
            (4, 4096, 151936),
            (2, 4096, 4096),
            (33, 4096, 1024),
            (17, 1152, 4304),
            (196, 4608, 4096),
            (3, 7, 5),
            (1, 4100, 9),
        ]
        .into_iter()
        .flat_map(|(n, k, m)| Case::linears(n, k, m)),
    );
}

#[test]
fn int_weights_at_real_sizes() {
    let Some(g) = test_gpu() else { return };
    // W4 and W8 (group 128) and FP8 (128x128 blocks): the CPU multiplies the dequantized f32
    // values, the GPU's GEMVs the packed ones (exact q - zero or e4m3 value, the scale once a
    // load), so they differ in summation order only; past 4 rows the integer GEMM forms f16
    // weights (FP8's scale rounded to f16 first) in passes of 64 rows up to 128 (the second
    // pass here of 33 rows), past that the GEMM reads the matrix dequantized to f16 (gate/up's
    // halves and down in two chunks of rows each: 64 MiB of scratch at most). (rows, in, out):
    // 8B q/k/v, o, gate/up (as two halves), down, batches and a prefill chunk.
    for to in [QuantizeTo::Int4, QuantizeTo::Int8, QuantizeTo::Fp8] {
        check_all(
            &g,
            [
                (1, 4096, 6144),
                (1, 4096, 4096),
                (2, 4096, 12288),
                (4, 12288, 4096),
                (3, 12288, 4096),
                (64, 4096, 6144),
                (97, 4096, 6144),
                (512, 12288, 4096),
            ]
            .into_iter()
            .flat_map(|(n, k, m)| Case::int_linears(n, k, m, to)),
        );
    }
    // The dispatch a GPU without programmatic dependent launch takes (sm_87, Orin): the same
    // kernels launched plainly.
    g.set_programmatic_launch(false);
    check_all(
        &g,
        [(1, 4096, 6144), (4, 12288, 4096)]
            .into_iter()
            .flat_map(|(n, k, m)| Case::int_linears(n, k, m, QuantizeTo::Int4))
            .chain(Case::int_linears(1, 4096, 6144, QuantizeTo::Fp8)),
    );
    g.set_programmatic_launch(true);
}

/// Every e4m3 byte read exactly by each kernel an FP8 weight meets: row j of the matrix holds
/// byte j in column 0 (NaN's two bytes as 0), x is one-hot at column 0, so each output is one
/// value times the scale, exact in f32 and in f16 (0.5 times an e4m3 value is an f16 value,
/// and the scale, 128 to the kernels, is one in f16 too). 64 columns take the tensor-core GEMV,
/// 16 the CUDA-core one; past 4 rows 128 columns (a whole stage) take the integer GEMM (at 5
/// and 64 rows: n-tiles 1 and 8), 64 (no whole stage) the dequantized GEMM.
#[test]
fn every_e4m3_value_is_read_exactly() {
    use vlm_compute::quant::fp8::{e4m3_is_nan, Fp8Matrix};
    let Some(g) = test_gpu() else { return };
    // The weight-only kernels (the W8A8 GEMM rounds x's scale: w8a8_at_real_sizes checks it).
    g.set_fp8_gemm(vlm_compute::cuda::Fp8Gemm::W8a16);
    let cpu = CpuBackend::new();
    let cases = [
        (1, 64),
        (4, 64),
        (1, 16),
        (3, 16),
        (5, 64),
        (5, 128),
        (64, 128),
    ];
    for (rows, cols) in cases {
        let mut q = vec![0u8; 256 * cols];
        for j in 0..256 {
            q[j * cols] = if e4m3_is_nan(j as u8) { 0 } else { j as u8 };
        }
        let m = Fp8Matrix {
            out: 256,
            inp: cols,
            block: [128, 128],
            q,
            scales: vec![0.5; 2],
        };
        let mut x = vec![0.0f32; rows * cols];
        for r in 0..rows {
            x[r * cols] = 1.0;
        }
        let x = HostTensor::new(vec![rows, cols], x).unwrap();
        let cpu_w = cpu.upload_fp8_weight(&m).unwrap();
        let want = cpu
            .download(&cpu.linear(&cpu.upload(&x).unwrap(), &cpu_w, None).unwrap())
            .unwrap();
        let gpu_w = g.upload_fp8_weight(&m).unwrap();
        let got = g
            .download(&g.linear(&g.upload(&x).unwrap(), &gpu_w, None).unwrap())
            .unwrap();
        assert_eq!(
            got.max_abs_diff(&want).unwrap(),
            0.0,
            "{rows} rows of {cols} columns: {:?} vs {:?}",
            &got.data()[..16],
            &want.data()[..16]
        );
    }
}

/// FP8 weights' W8A8 GEMM at 8B shapes (prefill chunks and batches past 64 rows on an H100):
/// e4m3-exact activations (quantizing them changes nothing, so it must equal the CPU's W8A16
/// up to the sums' order: Case::W8a8), then random ones against the CPU fed the activations
/// as the GPU quantizes them (`quant::fp8::quantize_rows`), with the drift from unquantized
/// activations printed. On an H100 with cuBLAS 12.9+ (`VLM_REQUIRE_GPU=1`) W8A8 must be on.
#[test]
fn w8a8_at_real_sizes() {
    use vlm_compute::quant::fp8::{quantize_fp8, quantize_rows, ACT_GROUP, E4M3};
    use vlm_compute::twin::{f16_exact, Outcome};
    let Some(g) = test_gpu() else { return };
    eprintln!(
        "{} (sm_{}{}): W8A8 {}",
        g.device_name(),
        g.compute_capability().0,
        g.compute_capability().1,
        if g.has_w8a8() {
            "on"
        } else {
            "off: weight-only"
        }
    );
    if std::env::var("VLM_REQUIRE_GPU").is_ok_and(|v| v == "1") && g.compute_capability() == (9, 0)
    {
        assert!(
            g.has_w8a8(),
            "an sm_90 GPU without W8A8: cuBLASLt older than 12.9?"
        );
    }
    check_all(
        &g,
        [
            (512, 4096, 6144, IntOp::Linear),
            (300, 12288, 4096, IntOp::AddLinear),
            (65, 4096, 24576, IntOp::Linear),
            // Row counts the GEMM pads (w8a8.rs's W8A8_ROWS), into a new output and added to
            // one.
            (61, 4096, 6144, IntOp::Linear),
            (303, 12288, 4096, IntOp::AddLinear),
        ]
        .map(|(n, k, m, op)| Case::W8a8 { n, k, m, op }),
    );
    let cpu = CpuBackend::new();
    // 639 and 61 rows: a mixed step's and a batch's counts that cuBLASLt has no algorithm for
    // unpadded (they took the weight-only path before W8A8_ROWS).
    for (n, k, m) in [
        (256, 4096, 4096),
        (100, 12288, 1024),
        (639, 4096, 1024),
        (61, 4096, 4096),
    ] {
        let key = (n * k + m) as u64;
        let x = f16_exact(vlm_compute::random::uniform_tensor(&[n, k], key, 2.0));
        let w = quantize_fp8(&vlm_compute::random::uniform_tensor(
            &[m, k],
            key + 1,
            1.0 / (k as f32).sqrt(),
        ));
        let (q, scales) = quantize_rows(x.data(), n, k);
        let as_quantized: Vec<f32> = q
            .iter()
            .enumerate()
            .map(|(i, &b)| E4M3[b as usize] * scales[(i % k / ACT_GROUP) * n + i / k])
            .collect();
        let as_quantized = HostTensor::new(vec![n, k], as_quantized).unwrap();
        let cpu_w = cpu.upload_fp8_weight(&w).unwrap();
        let run_cpu = |x: &HostTensor| {
            cpu.download(&cpu.linear(&cpu.upload(x).unwrap(), &cpu_w, None).unwrap())
                .unwrap()
        };
        let (want, unquantized) = (run_cpu(&as_quantized), run_cpu(&x));
        let gpu_w = g.upload_fp8_weight(&w).unwrap();
        assert_eq!(
            g.w8a8_takes(&gpu_w, n).unwrap(),
            g.has_w8a8(),
            "{n}x{k}->{m}: W8A8 refused where the GPU has it (cuBLASLt's warning says why)"
        );
        let got = g
            .download(&g.linear(&g.upload(&x).unwrap(), &gpu_w, None).unwrap())
            .unwrap();
        let name = format!("w8a8 random {n}x{k}->{m}");
        let drift = Outcome::of(name.clone(), &unquantized, &got, 1.0);
        eprintln!(
            "{name}: against unquantized activations max diff {:.2e} ({:.2}% of the largest output)",
            drift.max_diff,
            100.0 * drift.max_diff / drift.limit
        );
        // Where W8A8 is off the GPU computed W8A16: the quantized model is then not its twin.
        let reference = if g.has_w8a8() { &want } else { &unquantized };
        let outcome = Outcome::of(name, reference, &got, 3e-3);
        eprintln!("{outcome}");
        assert!(outcome.passed(), "{outcome}");
    }
}

/// The W8A8 GEMM's activation quantization (`quant_rows_f8`) against the CPU's, byte for byte
/// and scale for scale: random rows, a group of zeros, values at f16's edges.
#[test]
fn w8a8_quantizes_activations_as_the_cpu_does() {
    use vlm_compute::quant::fp8::quantize_rows;
    use vlm_compute::twin::f16_exact;
    let Some(g) = test_gpu() else { return };
    let (n, k) = (37, 384);
    let mut x = vlm_compute::random::uniform_tensor(&[n, k], 77, 3.0);
    let data = x.data_mut();
    data[5 * k + 128..5 * k + 256].fill(0.0);
    data[7 * k + 3] = 60000.0;
    data[8 * k + 200] = -1e-6;
    for v in &mut data[9 * k..10 * k] {
        *v *= 1e-4;
    }
    let x = f16_exact(x);
    let (q, scales) = g.quantize_rows_fp8(&g.upload(&x).unwrap()).unwrap();
    let (want_q, want_scales) = quantize_rows(x.data(), n, k);
    assert_eq!(scales, want_scales);
    let differ: Vec<usize> = (0..q.len()).filter(|&i| q[i] != want_q[i]).collect();
    assert!(
        differ.is_empty(),
        "{} bytes differ, first at {:?}",
        differ.len(),
        differ.first()
    );
}

/// The W8A8 GEMM's operands written by the norm and the SwiGLU that compute them
/// (`rms_norm_f8`, `silu_mul_halves_f8`), and o_proj's quantized from f32 in one pass
/// (`quant_rows_f32_f8`), are the bytes and scales of the two-kernel path
/// (the f16 norm or SwiGLU, then `quant_rows_f8`, which the test above holds to the CPU),
/// exactly: at 8B's widths (hidden 4096, intermediate 12288) and the tiny fixtures' (128,
/// 384), with a row of zeros (scale 1), one past e4m3's range and one of tiny values.
#[test]
fn w8a8_fused_operands_equal_the_two_kernel_path() {
    let Some(g) = test_gpu() else { return };
    let plant = |x: &mut HostTensor, k: usize| {
        let data = x.data_mut();
        data[k..2 * k].fill(0.0);
        data[2 * k + 3] = 3.0e4;
        for v in &mut data[3 * k..4 * k] {
            *v *= 1e-5;
        }
    };
    for (n, k) in [(5, 128), (37, 384), (300, 4096)] {
        let mut x = vlm_compute::random::uniform_tensor(&[n, k], 5, 4.0);
        plant(&mut x, k);
        let w = vlm_compute::random::uniform_tensor(&[k], 6, 1.5);
        let [fused, two] = g
            .rms_norm_fp8_fused_and_not(&g.upload(&x).unwrap(), &g.upload(&w).unwrap(), 1e-6)
            .unwrap();
        assert!(
            fused == two,
            "rms_norm_f8, {n} x {k}: differs from rms_norm_f16 + quant_rows_f8"
        );
    }
    for (n, m) in [(5, 128), (37, 384), (300, 12288)] {
        let mut y = vlm_compute::random::uniform_tensor(&[n, 2 * m], 7, 8.0);
        plant(&mut y, 2 * m);
        let [fused, two] = g.swiglu_fp8_fused_and_not(&g.upload(&y).unwrap()).unwrap();
        assert!(
            fused == two,
            "silu_mul_halves_f8, {n} x {m}: differs from the two kernels"
        );
    }
    // o_proj's f32 input quantized in one pass (`quant_rows_f32_f8`) against cast_f32_to_f16
    // then quant_rows_f8: values not f16-exact, so the rounding to f16 is compared too.
    for (n, k) in [(5, 128), (37, 384), (300, 4096)] {
        let mut x = vlm_compute::random::uniform_tensor(&[n, k], 8, 4.0);
        plant(&mut x, k);
        let [fused, two] = g
            .quantize_rows_f32_fused_and_not(&g.upload(&x).unwrap())
            .unwrap();
        assert!(
            fused == two,
            "quant_rows_f32_f8, {n} x {k}: differs from cast_f32_to_f16 + quant_rows_f8"
        );
    }
}

/// Decode's GEMVs of an FP8 weight whose larger GEMMs run W8A8 read their rows as the GEMM
/// reads its own: each value rounded to f16, then to e4m3 with its row's and group's scale,
/// times that scale. Plain rows against the CPU (`quantize_rows`, then each byte's value times
/// its scale), and normed rows against the W8A8 GEMM's own operand (`rms_norm_f8`), exactly.
#[test]
fn w8a8_rounds_decode_gemv_rows_as_its_gemm_does() {
    use vlm_compute::quant::fp8::{quantize_rows, ACT_GROUP, E4M3};
    use vlm_compute::twin::f16_exact;
    let Some(g) = test_gpu() else { return };
    let dequant = |q: &[u8], scales: &[f32], n: usize, k: usize| -> Vec<f32> {
        (0..n * k)
            .map(|i| E4M3[q[i] as usize] * scales[(i % k / ACT_GROUP) * n + i / k])
            .collect()
    };
    let (n, k) = (4, 384);
    let mut x = vlm_compute::random::uniform_tensor(&[n, k], 41, 3.0);
    let data = x.data_mut();
    data[k..k + 128].fill(0.0);
    data[2 * k + 5] = 3.0e4;
    let x = f16_exact(x);
    let got = g
        .download(&g.w8a8_rounded_rows(&g.upload(&x).unwrap(), None).unwrap())
        .unwrap();
    let (q, scales) = quantize_rows(x.data(), n, k);
    assert!(
        got.data() == dequant(&q, &scales, n, k).as_slice(),
        "qdq_rows_f8 differs from the CPU"
    );
    let (n, k) = (3, 4096);
    let x = vlm_compute::random::uniform_tensor(&[n, k], 42, 4.0);
    let w = vlm_compute::random::uniform_tensor(&[k], 43, 1.5);
    let (x, w) = (g.upload(&x).unwrap(), g.upload(&w).unwrap());
    let got = g
        .download(&g.w8a8_rounded_rows(&x, Some((&w, 1e-6))).unwrap())
        .unwrap();
    let [(q, scales), _] = g.rms_norm_fp8_fused_and_not(&x, &w, 1e-6).unwrap();
    assert!(
        got.data() == dequant(&q, &scales, n, k).as_slice(),
        "rms_norm_qdq_f8 differs from rms_norm_f8's operand"
    );
}

#[test]
fn int_gemm_at_real_sizes() {
    let Some(g) = test_gpu() else { return };
    // The tensor-core integer GEMM (5..=64 rows; `VLM_INT_GEMM=dequant` runs the same cases on
    // the dequantization and cuBLAS): batched decode at 8B shapes, k split into several ranges
    // (4096 columns: up to 8 splits of 4 stages on an H100), groups of 32 and 128 (FP8: blocks
    // of 128 rows by as many columns); the 8B model's MLP at 64 rows (on an H100 gate/up on
    // 128 blocks of 192 rows, down on 16 of 256 split 8 ways); then q/k/v's shape on each
    // block shape, forced (on an H100 k is split on each: 24 blocks of 256 rows x 5, 32 of 192
    // x 4, 48 of 128 x 2). On an H100/H200 every case runs as served (17 rows and more on the
    // wgmma kernel) and again all on mma.sync's, the one Jetson Orin runs.
    let kernels: &[bool] = if g.int_gemm_on_wgmma(64) {
        &[false, true]
    } else {
        &[false]
    };
    for (&mma, to) in kernels
        .iter()
        .flat_map(|m| [QuantizeTo::Int4, QuantizeTo::Int8, QuantizeTo::Fp8].map(|to| (m, to)))
    {
        vlm_compute::cuda::with_int_gemm_on_mma(mma, || int_gemm_cases(&g, to));
    }
}

/// int_gemm_at_real_sizes' cases for one format.
fn int_gemm_cases(g: &CudaBackend, to: QuantizeTo) {
    check_all(
        g,
        [(8, 4096, 6144), (64, 4096, 512), (32, 12288, 4096)]
            .into_iter()
            .flat_map(|(n, k, m)| Case::int_linears(n, k, m, to)),
    );
    let int_gemm = |(n, k, m, group, op, block_rows)| Case::IntGemm {
        n,
        k,
        m,
        to,
        group,
        op,
        block_rows,
    };
    let cases = [
        (64, 4096, 4096, 128, IntOp::AddLinear, None),
        (40, 4096, 777, 32, IntOp::Linear, None),
        (64, 12288, 4096, 32, IntOp::Linear, None),
        (17, 4096, 6144, 128, IntOp::AddLinear, None),
        (64, 4096, 1536, 128, IntOp::Mlp, None),
        (64, 4096, 12288, 128, IntOp::Mlp, None),
    ];
    check_all(g, cases.map(int_gemm));
    check_all(
        g,
        [256, 192, 128].map(|rows| int_gemm((64, 4096, 6144, 128, IntOp::AddLinear, Some(rows)))),
    );
}

/// A vocabulary-sized integer weight (`lm_head` under `--quantize-lm-head`: 65,536 rows or more)
/// has no dequantization scratch; past the integer GEMM's 64 rows its GEMMs take the integer
/// GEMM 64 rows of x at a time, each chunk into its own rows of the output (here 129 rows: two
/// whole chunks and one row), a bias included: a biased GEMM used to go to cuBLASLt, which
/// reads a dequantized weight (the first run, on an H200, failed there).
#[test]
fn a_vocabulary_sized_int_weight_takes_the_integer_gemm_in_chunks_of_rows() {
    let Some(g) = test_gpu() else { return };
    for to in [QuantizeTo::Int8, QuantizeTo::Int4] {
        check_all(
            &g,
            [
                (64, IntOp::Linear),
                (129, IntOp::Linear),
                (129, IntOp::AddLinear),
            ]
            .map(|(n, op)| Case::IntGemm {
                n,
                k: 256,
                m: 65_600,
                to,
                group: 128,
                op,
                block_rows: None,
            }),
        );
    }
}

#[test]
fn random_int_weights_are_generated_on_the_gpu_as_on_the_cpu() {
    let Some(g) = test_gpu() else { return };
    let key =
        vlm_compute::random::tensor_key(0, "model.language_model.layers.0.mlp.up_proj.weight");
    for to in [QuantizeTo::Int4, QuantizeTo::Int8] {
        let shape = [12288usize, 4096];
        let cpu = vlm_compute::quant::random_int(shape[0], shape[1], key, 0.027, to);
        let uploaded = g.upload_int_weight(&cpu).unwrap();
        let generated = g.random_int_weight(&shape, key, 0.027, to).unwrap();
        let x = g
            .upload(&HostTensor::new(vec![1, shape[1]], vec![1.0; shape[1]]).unwrap())
            .unwrap();
        let (a, b) = (
            g.download(&g.linear(&x, &generated, None).unwrap())
                .unwrap(),
            g.download(&g.linear(&x, &uploaded, None).unwrap()).unwrap(),
        );
        assert_eq!(a.max_abs_diff(&b).unwrap(), 0.0, "{to:?}");
    }
}

#[test]
fn decode_gemvs_without_programmatic_launch() {
    let Some(g) = test_gpu() else { return };
    // On sm_90 the GEMVs above are the streamed kernels under programmatic dependent launch;
    // the classic ones (every other GPU, and VLM_PDL=0) are checked here too. Elsewhere this
    // runs the classic ones twice.
    g.set_programmatic_launch(false);
    check_all(
        &g,
        [
            (1, 4096, 12288),
            (1, 12288, 4096),
            (4, 4096, 6144),
            (3, 7, 5),
            (1, 4100, 9),
        ]
        .into_iter()
        .flat_map(|(n, k, m)| Case::linears(n, k, m))
        .chain([Case::RmsNormMlp {
            n: 1,
            k: 4096,
            hidden: 12288,
        }])
        .chain([Case::RecordReplay]),
    );
}

#[test]
fn text_mlp_at_real_sizes() {
    let Some(g) = test_gpu() else { return };
    // The 8B text MLP (4096 -> 12288 -> 4096): one decode row (GEMVs), a batch of 64 rows
    // and a 512-token prefill step (f16 operands), and a hidden size that is not a multiple of
    // 8 (one column a thread in the SwiGLU).
    check_all(
        &g,
        [
            (1, 4096, 12288),
            (64, 4096, 12288),
            (512, 4096, 12288),
            (9, 128, 36),
        ]
        .map(|(n, k, hidden)| Case::RmsNormMlp { n, k, hidden }),
    );
}

#[test]
fn vit_block_halves_at_real_sizes() {
    let Some(g) = test_gpu() else { return };
    // (rows, width, projection outputs / MLP hidden): the ViT at 448x448 (784 patches), a
    // batch of 4 rows (the GEMV path), and odd sizes cuBLASLt may have no algorithm for
    // (then the op-by-op path runs).
    check_all(
        &g,
        [(784, 1152, 1152), (4, 1152, 1152), (9, 36, 20)]
            .into_iter()
            .flat_map(|(n, k, m)| {
                let hidden = if m == 1152 { 4304 } else { m };
                [
                    Case::LayerNormLinears { n, k, m },
                    Case::LayerNormMlp { n, k, hidden },
                ]
            }),
    );
    // The attention half, `layer_norm_rope_attention` (16 heads of 72 over 1152 columns): a
    // 448x448 image beside a 224x224 one in one pass (fused: f16 q/k/v from cuBLASLt, RoPE and
    // the pack in one kernel reading them, flash attention per image, the projection added in
    // its GEMM), and 3 rows (op by op: the GEMVs).
    check_all(
        &g,
        [vec![784, 196], vec![3]].map(|lens| Case::LayerNormRopeAttention {
            lens,
            hidden: 1152,
            heads: 16,
            dim: 72,
        }),
    );
}

#[test]
fn rope_and_attention_at_real_sizes() {
    let Some(g) = test_gpu() else { return };
    let rope = [(1, 32, 128), (37, 8, 128), (784, 16, 72), (5, 4, 32)]
        .map(|(tokens, heads, dim)| Case::Rope { tokens, heads, dim });
    let causal = |first_query_slot| AttnMask::Causal { first_query_slot };
    // (queries, q heads, kv heads, head dim, kv slots, valid, mask): prefill, the ViT at 448²,
    // prefill after a cached prefix (queries start at slot 512), 8B prefill at 1024, the tiny
    // fixture's head dim (padded to 64) with a partial query tile, causal GQA at head dim 64,
    // calls with enough query tiles x heads for the wide kernels on an H100 (two m-tiles a
    // warp: 1,024 and 1,024 blocks, bidirectional and causal; head dims 72 and 68 padded to 80,
    // GQA, bidirectional and causal after a cached prefix; 3,136 queries, the ViT at 896x896;
    // 76), and the f32 kernel below 16 queries.
    let attention = [
        (37, 32, 8, 128, 64, 37, causal(0)),
        (784, 16, 16, 72, 784, 784, AttnMask::Full),
        (100, 32, 8, 128, 700, 612, causal(512)),
        (1024, 32, 8, 128, 1024, 1024, causal(0)),
        (65, 4, 2, 16, 65, 65, AttnMask::Full),
        (150, 8, 2, 64, 300, 250, causal(100)),
        (1024, 128, 16, 72, 1024, 1024, AttnMask::Full),
        (1000, 128, 16, 64, 1200, 1100, causal(100)),
        (1000, 64, 16, 72, 1200, 1100, causal(100)),
        (600, 256, 32, 68, 600, 600, AttnMask::Full),
        (3136, 16, 16, 72, 3136, 3136, AttnMask::Full),
        (1024, 128, 16, 76, 1024, 1024, AttnMask::Full),
        (7, 4, 2, 32, 9, 9, causal(2)),
    ]
    .map(
        |(queries, q_heads, kv_heads, dim, slots, kv_len, mask)| Case::Attention {
            queries,
            q_heads,
            kv_heads,
            dim,
            slots,
            kv_len,
            mask,
        },
    );
    // The ViT's q/k/v from its fused projection, rotated, packed and attended in one op (on an
    // H100 by the wgmma kernel over its tiles of 112 keys, each image on its own): a 448x448
    // image's pass, three images of one pass (196 and 64 patches: partial tiles), and an
    // 896x896 image's beside a 448x448 one's.
    let fused =
        [vec![784], vec![196, 784, 64], vec![784, 3136]].map(|lens| Case::RopeAttentionSegments {
            lens,
            heads: 16,
            dim: 72,
        });
    check_all(&g, rope.into_iter().chain(attention).chain(fused));
}

/// Prefill chunks' attention on both kernels: Hopper's wgmma (an H100's default; any other GPU
/// runs mma.sync in its place) and mma.sync (`VLM_PREFILL_ATTENTION=mma`, what a Jetson Orin
/// runs, forced here on an H100 too): 8B heads (32 of 8 KV heads, dim 128) and
/// Qwen2.5-7B's (28 of 4) over the f16 cache. A chunk after 1536 cached keys beside decodes and a
/// fresh prompt whose last block is partial; 1000 queries (each kernel's last block part
/// empty: 64 and 192 queries a block) and 2048 (a whole prefill); 17 queries, a block of mostly empty rows; blocks of 32
/// slots (the staging's run-time division).
#[test]
fn paged_prefill_attention_on_both_kernels() {
    let Some(g) = test_gpu() else { return };
    let cases = [
        (
            [vec![(1, 700); 4], vec![(512, 2048), (100, 100)]].concat(),
            4,
            32,
            8,
            16,
        ),
        (vec![(1000, 1000)], 0, 32, 8, 16),
        (vec![(2048, 2048)], 0, 32, 8, 16),
        (vec![(17, 17), (130, 400)], 0, 32, 8, 16),
        (vec![(300, 300)], 0, 28, 4, 16),
        (vec![(200, 333)], 0, 32, 8, 32),
    ]
    .map(
        |(seqs, decode, q_heads, kv_heads, block_size)| Case::PagedAttention {
            seqs,
            decode,
            q_heads,
            kv_heads,
            dim: 128,
            block_size,
            kv: KvFormat::Native,
        },
    );
    for kernel in [PrefillAttention::Wgmma, PrefillAttention::MmaSync] {
        eprintln!("prefill attention: {kernel:?}");
        with_prefill_attention(kernel, || check_all(&g, cases.clone()));
    }
}

#[test]
fn paged_kv_cache_at_real_sizes() {
    let Some(g) = test_gpu() else { return };
    // (sequences as (queries, keys), decoding, q heads, kv heads, head dim, block size): 8B
    // decode at batch 1 (4096, 2047 and 513 keys), at batch 64 (600 keys each, one split), a mixed step of 32 decodes and two prefill
    // chunks (a 512-token chunk after 1536 cached keys), the tiny fixture's sizes, the ViT-like
    // 72 (padded to 80) through the per-row kernel; Qwen2.5-7B's heads (28 of 4 KV heads: the
    // kernel for 8 heads a KV head, one skipped) and head dim 256; blocks of 32 slots, which
    // the flash kernel's staging divides by at run time (16, the engine's, is compiled in).
    let paged = [
        (vec![(1, 4096)], 1, 32, 8, 128, 16),
        (vec![(1, 2047)], 1, 32, 8, 128, 16),
        (vec![(1, 513)], 1, 32, 8, 128, 16),
        (vec![(1, 600); 64], 64, 32, 8, 128, 16),
        (
            [vec![(1, 700); 32], vec![(512, 2048), (100, 100)]].concat(),
            32,
            32,
            8,
            128,
            16,
        ),
        (vec![(1, 40), (1, 2), (33, 33)], 2, 4, 2, 32, 16),
        (vec![(1, 90), (9, 30)], 1, 16, 16, 72, 16),
        (vec![(1, 1001), (1, 77), (1, 4)], 3, 28, 4, 128, 16),
        (vec![(1, 530), (1, 9)], 2, 8, 4, 256, 16),
        (vec![(1, 300), (200, 333)], 1, 32, 8, 128, 32),
    ]
    .map(
        |(seqs, decode, q_heads, kv_heads, dim, block_size)| Case::PagedAttention {
            seqs,
            decode,
            q_heads,
            kv_heads,
            dim,
            block_size,
            kv: KvFormat::Native,
        },
    );
    let writes =
        [(4096, 8, 128, 256), (64, 2, 32, 17)].map(|(slots, heads, dim, rows)| Case::WriteKv {
            slots,
            heads,
            dim,
            rows,
            kv: KvFormat::Native,
        });
    // The fused q/k/v step of the 8B model at a prefill chunk, the tiny fixture's sizes, and
    // Qwen2.5-7B's heads (no q/k norm) at a prefill chunk.
    let qkv = [
        (512, 32, 8, 128, true),
        (7, 4, 2, 32, true),
        (512, 28, 4, 128, false),
    ]
    .map(
        |(tokens, q_heads, kv_heads, dim, normed)| Case::QkvToCache {
            tokens,
            q_heads,
            kv_heads,
            dim,
            normed,
            kv: KvFormat::Native,
        },
    );
    // Each again over FP8 caches (`--kv-cache-dtype fp8`): every kernel's `_f8` twin.
    let fp8 = paged
        .iter()
        .chain(&writes)
        .chain(&qkv)
        .cloned()
        .map(|mut case| {
            if let Case::PagedAttention { kv, .. }
            | Case::WriteKv { kv, .. }
            | Case::QkvToCache { kv, .. } = &mut case
            {
                *kv = FP8_KV;
            }
            case
        })
        .collect::<Vec<_>>();
    // Decode takes the tensor-core kernel where one is compiled for the shape (head dims 64
    // and 128, 2 to 8 heads a KV head); the per-lane kernel, which `VLM_DECODE_ATTENTION=lanes`
    // picks for every shape, again over the same cases.
    let lanes: Vec<Case> = paged
        .iter()
        .chain(&fp8)
        .filter(|c| matches!(c, Case::PagedAttention { .. }))
        .cloned()
        .collect();
    check_all(&g, paged.into_iter().chain(writes).chain(qkv).chain(fp8));
    with_decode_attention(DecodeAttention::PerLane, || check_all(&g, lanes));
    // Greedy picks on the device: the 8B vocabulary at batch 1 and 128, a tie (the first
    // wins), short rows; the rows a step's logits come from.
    check_all(
        &g,
        [
            Case::ArgmaxRows {
                rows: 1,
                n: 151_936,
                tie: None,
            },
            Case::ArgmaxRows {
                rows: 128,
                n: 151_936,
                tie: Some((70_000, 90_000)),
            },
            Case::ArgmaxRows {
                rows: 3,
                n: 7,
                tie: None,
            },
            Case::GatherRows {
                rows: 200,
                cols: 4096,
            },
        ],
    );
    // Draws on the device: the 8B vocabulary at batch 1 and over every setting (greedy,
    // temperature, top-k, top-p, min-p, penalties, bias, logprobs) at 33 and 128 rows, and the
    // tiny model's vocabulary (not a multiple of 4). The same tokens as the CPU's.
    check_all(
        &g,
        [(1, 151_936), (33, 151_936), (128, 151_936), (11, 414)]
            .into_iter()
            .flat_map(|(rows, vocab)| {
                [
                    Case::SampleRows { rows, vocab },
                    Case::SampleLogprobs { rows, vocab },
                ]
            }),
    );
    // `write` refreshes a buffer in place: a clone taken before keeps the old values.
    let values = HostTensor::new(vec![1, 128], (0..128).map(|i| i as f32).collect()).unwrap();
    let mut t = g.upload(&values).unwrap();
    let before = t.clone();
    g.write(&mut t, &[0.5; 128]).unwrap();
    assert_eq!(g.download(&t).unwrap().data(), &[0.5; 128]);
    assert_eq!(g.download(&before).unwrap(), values);
}

#[test]
fn gathers_and_row_updates() {
    let Some(g) = test_gpu() else { return };
    check_all(
        &g,
        [
            Case::Embedding {
                vocab: 1000,
                width: 4096,
            },
            Case::WeightedGather {
                rows: 2304,
                width: 1152,
                out: 50,
                taps: 4,
            },
            Case::RowUpdates,
            Case::AttentionSegments {
                lens: vec![196, 784, 64],
                heads: 16,
                dim: 72,
            },
        ],
    );
}

#[test]
fn patches_from_image_bytes_at_real_sizes() {
    let Some(g) = test_gpu() else { return };
    check_all(
        &g,
        [(448, 448), (1344, 1344), (32, 928)]
            .into_iter()
            .map(|(height, width)| Case::Patchify { height, width }),
    );
}

#[test]
fn random_weights_are_generated_on_the_gpu_bit_for_bit_as_on_the_cpu() {
    let Some(g) = test_gpu() else { return };
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
        vlm_compute::cuda::skip_test(&"libnvrtc not found");
        return;
    }
    // weights_f16.cu includes cuda_fp16.h: NVRTC needs the CUDA headers (CUDA_HOME; CI
    // pip-installs them with NVRTC).
    if let Err(e) = vlm_compute::cuda::compile::cuda_include_dir() {
        vlm_compute::cuda::skip_test(&e);
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
            "layer_norm_f16",
            "rope_f32",
            "rope_qkv_pack_f16",
            "rope_qkv16_pack_f16",
            "scatter_rows_f32",
            "gemv_f16w_r1",
            "gemv_f16w_r4",
            "rms_norm_gemv_f16w_r1",
            "swiglu_gemv_f16w_r1",
            "rms_norm_swiglu_gemv_f16w_r1",
            "embedding_f16w",
            "fill_uniform_f16",
            "write_kv_f16",
            "qkv_to_cache_f32",
            "paged_decode_d128_g4",
            "paged_attention_rows_f16",
            "sample_rows_f32",
            "gather_rows_f32",
            "flash_attention_d80",
            "flash_attention_d128",
            "paged_flash_attention_d64",
            "paged_flash_attention_d128",
            // The integer GEMM's block shapes (IG_BLOCKS, defined by the host).
            "int_gemm_w4_r256_n8_f32",
            "int_gemm_w8_r192_n8_f16",
            "int_gemm_f8_r128_n1_f32",
        ] {
            assert!(
                ptx.contains(&format!(".entry {k}")),
                "sm {cc:?}: {k} missing from the PTX"
            );
        }
        // Hopper's wgmma kernels and the pack are built for sm_90 only (as compute_90a).
        for k in [
            "flash_attention_wgmma_d80",
            "flash_attention_wgmma_d80_f16out",
            "int_gemm_wg_w4_r256_n8_f32",
            "int_gemm_wg_w8_r192_n4_f16",
            "int_gemm_wg_f8_r128_n4_f32",
            "rope_qkv_pack_tiled_f16",
            "rope_qkv16_pack_tiled_f16",
            "rope_qkv16_pack_tiled_rows_f16",
        ] {
            assert_eq!(
                ptx.contains(&format!(".entry {k}")),
                cc == (9, 0),
                "sm {cc:?}: {k}"
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
    // A file compiled for the exact chip (compute_90a) assembles for it (sm_90a).
    let exact = if ptx.contains(&format!(".target sm_{}{}a", cc.0, cc.1)) {
        "a"
    } else {
        ""
    };
    let out = std::process::Command::new(ptxas)
        .arg(format!("-arch=sm_{}{}{exact}", cc.0, cc.1))
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
    // ptxas -v prints a kernel's name, then its stack and spill line.
    let mut kernel = "";
    let spills: Vec<String> = log
        .lines()
        .filter_map(|l| {
            if let Some(name) = l.split("Compiling entry function '").nth(1) {
                kernel = name.split('\'').next().unwrap_or("");
            }
            let spill =
                l.contains("spill") && !l.contains(" 0 bytes spill stores, 0 bytes spill loads");
            spill.then(|| format!("{kernel}: {l}"))
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

/// `--kv-cache-dtype fp8` where no kernel takes the model's head dim, or with a scale that is no
/// number, is refused before anything is allocated, naming the flag.
#[test]
fn an_fp8_cache_no_kernel_takes_is_refused() {
    let Some(g) = test_gpu() else { return };
    for (format, dim) in [
        (FP8_KV, 512),
        (KvFormat::Fp8 { scale: f32::NAN }, 128),
        (KvFormat::Fp8 { scale: 0.0 }, 128),
    ] {
        let err = g.check_kv_format(format, 8, dim).unwrap_err().to_string();
        assert!(err.contains("--kv-cache-dtype fp8"), "{err}");
        assert!(g.zeros_cache(16, 8, dim, format).is_err());
    }
    assert!(g.check_kv_format(FP8_KV, 8, 128).is_ok());
    assert!(g.check_kv_format(KvFormat::Native, 8, 512).is_ok());
}

/// What an op's output freed stays cached in the device's pool (so the next step maps
/// nothing); `release_cached_memory` gives it back, all of it beyond `keep`, and never what a
/// live buffer holds.
#[test]
fn cached_device_memory_is_given_back() {
    let Some(g) = test_gpu() else { return };
    let mib = 1usize << 20;
    g.release_cached_memory(0).unwrap();
    let live = g.zeros(&[64 * mib / 4]).unwrap();
    drop(g.zeros(&[512 * mib / 4]).unwrap());
    // Keeping 128 MiB of the freed 512 gives back at least the other 384.
    let given = g.release_cached_memory(128 * mib).unwrap();
    assert!(given >= 384 * mib, "gave back {} MiB", given / mib);
    let given = g.release_cached_memory(0).unwrap();
    assert!(given >= 128 * mib, "gave back {} MiB", given / mib);
    // Nothing left to give: the live buffer's 64 MiB are not cached memory.
    assert_eq!(g.release_cached_memory(0).unwrap(), 0);
    let back = g.download(&live).unwrap();
    assert!(back.data().iter().all(|&v| v == 0.0));
}
