//! Batched decode's projections at 8B shapes (q/k/v, o, gate/up, down, and the text MLP as
//! one op) for 8 to 64 rows: f16 weights on cuBLAS, W8, W4 and FP8 on the tensor-core integer
//! GEMM (weights_f16.cu's int_mma_gemm; on an H100/H200 from 17 rows int_wgmma_gemm, each op
//! timed on int_mma_gemm too, the kernel other GPUs run), and the same dequantized into the
//! f16 scratch for cuBLAS (the path before it, `VLM_INT_GEMM=dequant`, timed in a child
//! process of this example, as the switch is read once a process). Per op: microseconds a
//! call, the weights' GB/s against the device's copy bandwidth, and the integer GEMM's grid
//! (block shape, blocks, k splits).
//!
//!     cargo run --release -p vlm-compute --example int_gemm [ROWS...] [FORMAT...]
//!
//! ROWS defaults to 8 16 32 64; FORMATs (`f16`, `w8`, `w4`, `fp8`) time only those, in this
//! process. The target: W4 at 64 rows at least as fast as f16.
//! Past 64 rows (prefill chunks: e.g. `int_gemm 64 512 4096`) the integer weights take the
//! dequantization and cuBLAS. FP8 runs weight-only here (`VLM_FP8_GEMM=w8a16`, as on GPUs
//! without FP8 tensor cores); a third child process times FP8 as served on an H100, on the
//! W8A8 GEMM (w8a8.rs) at every row count.
//! `VLM_INT_GEMM_ROWS=256` (or 192, 128) times every integer GEMM on that block shape instead
//! of each shape's own choice, and `VLM_INT_GEMM_SPLITS=n` caps the k splits.

use std::time::Instant;

use vlm_compute::cuda::Fp8Gemm;
use vlm_compute::quant::fp8::{e4m3_is_nan, Fp8Matrix};
use vlm_compute::quant::QuantizeTo;
use vlm_compute::{Backend, CudaBackend, CudaTensor, CudaWeight, HostTensor};

/// Distinct copies of each matrix, called in turn: more bytes than an H100's 50 MB L2 at
/// every format, so each call reads its weights from DRAM as decode does.
const COPIES: usize = 8;

fn main() -> vlm_compute::Result<()> {
    // Numbers are row counts; words pick formats (f16, w8, w4, fp8: only those, no children).
    let (words, numbers): (Vec<String>, Vec<String>) = std::env::args()
        .skip(1)
        .partition(|a| a.parse::<usize>().is_err());
    let mut rows: Vec<usize> = numbers.iter().map(|a| a.parse().expect("rows")).collect();
    let picked = |name: &str| words.is_empty() || words.iter().any(|w| w == name);
    if rows.is_empty() {
        rows = vec![8, 16, 32, 64];
    }
    let dequant = std::env::var("VLM_INT_GEMM").is_ok_and(|v| v == "dequant");
    let w8a8 = std::env::var("VLM_FP8_GEMM").is_ok_and(|v| v == "w8a8");
    let g = CudaBackend::new(0)?;
    if !w8a8 {
        g.set_fp8_gemm(Fp8Gemm::W8a16);
    }
    let copy_bytes = 1usize << 30;
    let copy = g.time_copy(copy_bytes)?;
    let copy = g.time_copy(copy_bytes)?.min(copy);
    let copy_bw = 2.0 * copy_bytes as f64 / copy.as_secs_f64();
    let (h, inter, qkv) = (4096usize, 12288usize, 6144usize);
    let formats: &[Option<QuantizeTo>] = if w8a8 {
        &[Some(QuantizeTo::Fp8)]
    } else if dequant {
        &[
            Some(QuantizeTo::Int8),
            Some(QuantizeTo::Int4),
            Some(QuantizeTo::Fp8),
        ]
    } else {
        println!("{} copy: {:.0} GB/s", g.device_name(), copy_bw / 1e9);
        &[
            None,
            Some(QuantizeTo::Int8),
            Some(QuantizeTo::Int4),
            Some(QuantizeTo::Fp8),
        ]
    };
    let path = if w8a8 {
        "W8A8 cuBLASLt"
    } else if dequant {
        "dequant+cuBLAS"
    } else {
        "int GEMM"
    };
    let tag = |fmt: Option<QuantizeTo>| match fmt {
        None => "f16",
        Some(QuantizeTo::Int8) => "w8",
        Some(QuantizeTo::Int4) => "w4",
        Some(QuantizeTo::Fp8) => "fp8",
    };
    for &fmt in formats.iter().filter(|&&f| picked(tag(f))) {
        let make = |m: usize, k: usize, key: u64| -> vlm_compute::Result<CudaWeight> {
            match fmt {
                None => g.random_weight(&[m, k], key, 0.02),
                Some(QuantizeTo::Fp8) => g.upload_fp8_weight(&random_fp8(m, k, key)),
                Some(to) => g.random_int_weight(&[m, k], key, 0.02, to),
            }
        };
        let bits = fmt.map_or(16, |t| t.bits() as usize);
        let name = match fmt {
            None => "f16 cuBLAS".to_string(),
            Some(QuantizeTo::Int8) => format!("w8 {path}"),
            Some(QuantizeTo::Int4) => format!("w4 {path}"),
            Some(QuantizeTo::Fp8) => format!("fp8 {path}"),
        };
        // (name, m, k) and COPIES weights of each.
        let shapes = [
            ("qkv", qkv, h),
            ("o", h, h),
            ("gate_up", 2 * inter, h),
            ("down", h, inter),
        ];
        let mut ws: Vec<Vec<CudaWeight>> = Vec::new();
        for (s, &(_, m, k)) in shapes.iter().enumerate() {
            let copies = (0..COPIES)
                .map(|c| make(m, k, (s * COPIES + c) as u64))
                .collect::<vlm_compute::Result<Vec<_>>>()?;
            ws.push(copies);
        }
        let bytes_of = |m: usize, k: usize| {
            let groups = if bits == 16 { 0 } else { m * k / 128 };
            (m * k * bits / 8 + groups * 4) as f64
        };
        for &n in &rows {
            let x = g.upload(&HostTensor::new(vec![n, h], vec![0.01; n * h])?)?;
            let xi = g.upload(&HostTensor::new(vec![n, inter], vec![0.01; n * inter])?)?;
            let norm = g.upload(&HostTensor::new(vec![h], vec![1.0; h])?)?;
            // Past the integer GEMM's 64 rows the weight-only path is another.
            let past = if fmt.is_some() && n > 64 && !w8a8 {
                " (dequant+cuBLAS)"
            } else {
                ""
            };
            println!("{name} rows {n}{past}:");
            for (s, &(op, m, k)) in shapes.iter().enumerate() {
                let input: &CudaTensor = if k == h { &x } else { &xi };
                let t = time(&g, |c| g.linear(input, &ws[s][c], None).map(drop))?;
                let bytes = bytes_of(m, k);
                let grid = g
                    .int_gemm_grid_of(&ws[s][0], n)
                    .map_or(String::new(), |grid| format!(", {grid}"));
                let mma = on_mma(&g, grid.is_empty(), n, || {
                    time(&g, |c| g.linear(input, &ws[s][c], None).map(drop))
                })?;
                println!(
                    "  {op:>8} {m}x{k}: {:8.2} us, {:5.0} GB/s = {:3.0}% of copy, {:4.0} TFLOP/s{grid}{mma}",
                    t * 1e6,
                    bytes / t / 1e9,
                    100.0 * bytes / t / copy_bw,
                    2.0 * (n * m * k) as f64 / t / 1e12
                );
            }
            // The text MLP as decode runs it: norm, gate/up (f16 out), SwiGLU, down into x.
            let mut resid = x.clone();
            let t = time(&g, |c| {
                g.rms_norm_mlp(&mut resid, &norm, 1e-6, &ws[2][c], &ws[3][c])
            })?;
            let bytes = bytes_of(2 * inter, h) + bytes_of(h, inter);
            let gemm = g.int_gemm_grid_of(&ws[2][0], n).is_some();
            let mma = on_mma(&g, !gemm, n, || {
                time(&g, |c| {
                    g.rms_norm_mlp(&mut resid, &norm, 1e-6, &ws[2][c], &ws[3][c])
                })
            })?;
            println!(
                "  {:>8} {h}->{inter}->{h}: {:8.2} us, {:5.0} GB/s = {:3.0}% of copy{mma}",
                "mlp",
                t * 1e6,
                bytes / t / 1e9,
                100.0 * bytes / t / copy_bw
            );
        }
    }
    if !dequant && !w8a8 && words.is_empty() {
        // The dequantized path and FP8's W8A8 GEMM, each in a process of its own.
        let mut children = vec![("VLM_INT_GEMM", "dequant")];
        if g.has_w8a8() {
            children.push(("VLM_FP8_GEMM", "w8a8"));
        }
        for (var, value) in children {
            let status = std::process::Command::new(std::env::current_exe().expect("own path"))
                .args(rows.iter().map(|r| r.to_string()))
                .env(var, value)
                .status()
                .expect("running a child");
            assert!(status.success(), "{var}={value} failed: {status}");
        }
    }
    Ok(())
}

/// Where the integer GEMM ran on wgmma (an H100/H200, 17 rows or more) for the op just timed
/// at `rows` rows (not `skip`: it took the GEMM), the same op's time on mma.sync (the kernel
/// every other GPU runs), as ", mma.sync N us"; else nothing.
fn on_mma(
    g: &CudaBackend,
    skip: bool,
    rows: usize,
    timed: impl FnOnce() -> vlm_compute::Result<f64>,
) -> vlm_compute::Result<String> {
    if skip || !g.int_gemm_on_wgmma(rows) {
        return Ok(String::new());
    }
    let t = vlm_compute::cuda::with_int_gemm_on_mma(true, timed)?;
    Ok(format!(", mma.sync {:.2} us", t * 1e6))
}

/// An FP8 matrix of pseudo-random e4m3 bytes (no NaN) and 128x128 block scales of about a
/// trained layer's (amax 0.02): random_int_weight makes no FP8, and quantizing f32 matrices of
/// these sizes on the CPU would take longer than the timing.
fn random_fp8(out: usize, inp: usize, key: u64) -> Fp8Matrix {
    let mut state = key.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let q = (0..out * inp)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            let b = (state >> 56) as u8;
            if e4m3_is_nan(b) {
                0
            } else {
                b
            }
        })
        .collect();
    Fp8Matrix {
        out,
        inp,
        block: [128, 128],
        q,
        scales: vec![0.02 / 448.0; out.div_ceil(128) * inp.div_ceil(128)],
    }
}

/// Seconds a call of `f` (given the weight copy to use), over rounds of COPIES calls after
/// one warm-up round.
fn time(
    g: &CudaBackend,
    mut f: impl FnMut(usize) -> vlm_compute::Result<()>,
) -> vlm_compute::Result<f64> {
    for c in 0..COPIES {
        f(c)?;
    }
    g.synchronize()?;
    let rounds = 10;
    let t = Instant::now();
    for _ in 0..rounds {
        for c in 0..COPIES {
            f(c)?;
        }
    }
    g.synchronize()?;
    Ok(t.elapsed().as_secs_f64() / (rounds * COPIES) as f64)
}
