//! Whether cuBLASLt's heuristic picks the fastest of its own algorithms for the W8A8 GEMMs of an
//! FP8 8B's prefill (q/k/v, o, gate/up, down at 4096 x 4096 hidden, 12288 intermediate): each
//! algorithm it offers (up to 16), timed on zeroed operands, against its first choice, which is
//! what w8a8.rs runs. GEMMs are ~60% of an FP8 prefill step at 4096 tokens.
//!
//!     cargo run --release -p vlm-compute --example lt_fp8_algos [ROWS...]
//!
//! ROWS (multiples of 16) defaults to 4096 2048 512.
//!
//! On an H200 with CUDA 13 (2026-11-29) the heuristic offered one algorithm for every shape and
//! row count here: an autotuner over its candidates has nothing to choose from. At 4096 rows
//! the four GEMMs ran at 1.19-1.49 PFLOPS on zeroed operands
//! (docs/results/h200-2026-11-29-*-lt-fp8-algos.txt).

use vlm_compute::CudaBackend;

/// name, (k, m), f16 output (else f32), added to the output.
const SHAPES: [(&str, (usize, usize), bool, bool); 4] = [
    ("qkv", (4096, 6144), false, false),
    ("o", (4096, 4096), false, true),
    ("gate_up", (4096, 24576), true, false),
    ("down", (12288, 4096), false, true),
];

fn main() -> vlm_compute::Result<()> {
    let mut rows: Vec<usize> = std::env::args()
        .skip(1)
        .map(|a| a.parse().expect("ROWS are numbers"))
        .collect();
    if rows.is_empty() {
        rows = vec![4096, 2048, 512];
    }
    let gpu = CudaBackend::new(0)?;
    println!(
        "rows  gemm     algos  heuristic_us  best_us  best_index  heuristic/best  TFLOPS(best)"
    );
    for n in rows {
        for (name, (k, m), f16, accumulate) in SHAPES {
            let times = gpu.w8a8_algo_times((n, k, m), f16, accumulate, 16, 20)?;
            let Some((best_i, best)) = times
                .iter()
                .copied()
                .enumerate()
                .min_by(|a, b| a.1.total_cmp(&b.1))
            else {
                println!("{n:5} {name:8} none");
                continue;
            };
            let tflops = 2.0 * (n * k * m) as f64 / best / 1e6;
            println!(
                "{n:5} {name:8} {:5} {:13.1} {best:8.1} {best_i:11} {:15.3} {tflops:13.0}",
                times.len(),
                times[0],
                times[0] / best
            );
            println!(
                "      all: {}",
                times
                    .iter()
                    .map(|t| format!("{t:.1}"))
                    .collect::<Vec<_>>()
                    .join(" ")
            );
        }
    }
    Ok(())
}
