//! A decode step's projections at 8B shapes (36 layers of q/k/v, o, gate/up + SwiGLU and down,
//! each with its fused norm or residual add) for f16, W8 and W4 weights, timed against the
//! device's copy bandwidth: what `--quantize` buys batch-1 decode, kernel by kernel.
//!
//!     cargo run --release -p vlm-compute --example int_gemv [ROWS]
//!
//! `VLM_INT_GEMV=cuda` times the CUDA-core integer GEMVs instead of the tensor-core ones.

use std::time::Instant;

use vlm_compute::quant::QuantizeTo;
use vlm_compute::{Backend, CudaBackend, HostTensor};

fn main() -> vlm_compute::Result<()> {
    let rows: usize = std::env::args()
        .nth(1)
        .map_or(1, |a| a.parse().expect("rows"));
    let g = CudaBackend::new(0)?;
    let (h, inter, qkv, layers) = (4096usize, 12288usize, 6144usize, 36usize);
    let copy_bytes = 1usize << 30;
    let copy = g.time_copy(copy_bytes)?;
    let copy = g.time_copy(copy_bytes)?.min(copy);
    let copy_bw = 2.0 * copy_bytes as f64 / copy.as_secs_f64();
    println!("{} copy: {:.0} GB/s", g.device_name(), copy_bw / 1e9);
    let x = g.upload(&HostTensor::new(vec![rows, h], vec![0.01; rows * h])?)?;
    let norm = g.upload(&HostTensor::new(vec![h], vec![1.0; h])?)?;
    for fmt in [None, Some(QuantizeTo::Int8), Some(QuantizeTo::Int4)] {
        let make = |m: usize, k: usize, key: u64| match fmt {
            None => g.random_weight(&[m, k], key, 0.02),
            Some(to) => g.random_int_weight(&[m, k], key, 0.02, to),
        };
        let bits = fmt.map_or(16, |t| t.bits() as usize);
        let mut ws = Vec::new();
        for l in 0..layers as u64 {
            ws.push((
                make(qkv, h, 4 * l)?,
                make(h, h, 4 * l + 1)?,
                make(2 * inter, h, 4 * l + 2)?,
                make(h, inter, 4 * l + 3)?,
            ));
        }
        let params = layers * (qkv * h + h * h + 2 * inter * h + h * inter);
        let groups = if bits == 16 { 0 } else { params / 128 };
        let bytes = params * bits / 8 + groups * 4;
        let step = |resid: &mut vlm_compute::CudaTensor| -> vlm_compute::Result<()> {
            for (wqkv, wo, wgu, wd) in &ws {
                // (attention's output stands in as x: the projections are what is timed)
                g.rms_norm_linear(resid, &norm, 1e-6, wqkv, None)?;
                g.add_linear(resid, &x, wo, None)?;
                let f = g.rms_norm_swiglu(resid, &norm, 1e-6, wgu)?;
                g.add_linear(resid, &f, wd, None)?;
            }
            Ok(())
        };
        let mut resid = x.clone();
        step(&mut resid)?;
        g.synchronize()?;
        let reps = 20;
        let t = Instant::now();
        for _ in 0..reps {
            let mut resid = x.clone();
            step(&mut resid)?;
        }
        g.synchronize()?;
        let s = t.elapsed().as_secs_f64() / reps as f64;
        println!(
            "{:>4} rows {rows}: {:.3} ms a step, {:.2} GB, {:.0} GB/s = {:.0}% of copy",
            match fmt {
                None => "f16",
                Some(QuantizeTo::Int8) => "w8",
                Some(QuantizeTo::Int4) => "w4",
                Some(QuantizeTo::Fp8) => "fp8",
            },
            s * 1e3,
            bytes as f64 / 1e9,
            bytes as f64 / s / 1e9,
            100.0 * bytes as f64 / s / copy_bw
        );
        // Each projection alone, its 36 layers back to back: which shape is short of copy.
        let f = g.rms_norm_swiglu(&resid, &norm, 1e-6, &ws[0].2)?;
        for (kind, (name, m, k)) in [
            ("qkv", qkv, h),
            ("o", h, h),
            ("gate_up", 2 * inter, h),
            ("down", h, inter),
        ]
        .into_iter()
        .enumerate()
        {
            let run = |resid: &mut vlm_compute::CudaTensor| -> vlm_compute::Result<()> {
                for (wqkv, wo, wgu, wd) in &ws {
                    match kind {
                        0 => drop(g.rms_norm_linear(resid, &norm, 1e-6, wqkv, None)?),
                        1 => g.add_linear(resid, &x, wo, None)?,
                        2 => drop(g.rms_norm_swiglu(resid, &norm, 1e-6, wgu)?),
                        _ => g.add_linear(resid, &f, wd, None)?,
                    }
                }
                Ok(())
            };
            let mut resid = x.clone();
            run(&mut resid)?;
            g.synchronize()?;
            let t = Instant::now();
            for _ in 0..reps {
                run(&mut resid)?;
            }
            g.synchronize()?;
            let s = t.elapsed().as_secs_f64() / (reps * layers) as f64;
            let params = m * k;
            let groups = if bits == 16 { 0 } else { params / 128 };
            let bytes = (params * bits / 8 + groups * 4) as f64;
            println!(
                "     {name:>8} {m}x{k}: {:.2} us, {:.0} GB/s = {:.0}% of copy",
                s * 1e6,
                bytes / s / 1e9,
                100.0 * bytes / s / copy_bw
            );
        }
    }
    Ok(())
}
