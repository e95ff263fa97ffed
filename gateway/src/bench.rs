//! `vlm bench`: the stages measured in-process on the device at hand, against the hardware
//! limits measured in the same run.
//!
//! - ViT + mergers for square images of the given sides;
//! - prefill throughput for a text prompt of N tokens;
//! - decode tokens/s at a given context (steady state, eos ignored);
//! - limits: copy bandwidth (decode reads every weight and the KV cache once per token, so
//!   bytes per token / bandwidth bounds it) and a large GEMM's FLOP rate (prefill and the ViT
//!   are GEMM-bound).
//!
//! Works from a checkpoint or, with `--random-weights`, from a config alone, so the real 8B
//! shapes can be measured without downloading weights. Each measurement runs `warmup` times
//! unmeasured, then `repeats` times; the report gives the median and the spread.

use std::path::Path;
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressStyle};
use llm_svc::{Engine, GenerateRequest, SamplingParams};
use serde_json::{json, Value};
use vision_svc::{Patches, VisionConfig, VisionModel};
use vlm_compute::{Backend, HostTensor, Weights};

pub struct BenchOptions {
    pub warmup: usize,
    pub repeats: usize,
    /// Sides (pixels) of the square images for the ViT measurement.
    pub image_sides: Vec<usize>,
    /// Prompt length for the prefill measurement.
    pub prefill_tokens: usize,
    /// Context at which decoding is measured, and how many tokens are decoded.
    pub decode_context: usize,
    pub decode_tokens: usize,
}

/// One row of the report.
#[derive(Clone, Debug)]
pub struct Measurement {
    pub name: String,
    /// Seconds per run, sorted.
    pub seconds: Vec<f64>,
    /// Work per run in `unit`s (tokens, bytes, FLOPs), for the throughput column.
    pub work: f64,
    pub unit: &'static str,
    /// Fraction of the measured hardware limit reached, when one applies.
    pub roofline: Option<f64>,
}

impl Measurement {
    pub fn median(&self) -> f64 {
        self.seconds[self.seconds.len() / 2]
    }
    pub fn throughput(&self) -> f64 {
        self.work / self.median()
    }
    pub fn to_json(&self, device: &str, config: &str) -> Value {
        json!({
            "name": self.name,
            "device": device,
            "config": config,
            "median_ms": self.median() * 1e3,
            "min_ms": self.seconds[0] * 1e3,
            "max_ms": self.seconds[self.seconds.len() - 1] * 1e3,
            "runs": self.seconds.len(),
            "throughput": self.throughput(),
            "unit": format!("{}/s", self.unit),
            "roofline_fraction": self.roofline,
        })
    }
}

/// Times `f` `warmup + repeats` times; returns the measured durations, sorted.
fn time(
    opts: &BenchOptions,
    bar: &ProgressBar,
    mut f: impl FnMut() -> anyhow::Result<Duration>,
) -> anyhow::Result<Vec<f64>> {
    for _ in 0..opts.warmup {
        f()?;
        bar.inc(1);
    }
    let mut s = Vec::with_capacity(opts.repeats);
    for _ in 0..opts.repeats.max(1) {
        s.push(f()?.as_secs_f64());
        bar.inc(1);
    }
    s.sort_by(f64::total_cmp);
    Ok(s)
}

/// Runs every measurement on `backend` for the checkpoint (or config) in `dir`.
/// `copy` copies `bytes` bytes once on the device and returns how long that took; the limit it
/// gives counts the read and the write (2 x bytes), the traffic decoding's reads compare with.
pub fn run<B: Backend + Clone>(
    dir: &Path,
    weights: &Weights,
    backend: B,
    opts: &BenchOptions,
    copy: impl Fn(&B, usize) -> anyhow::Result<Duration>,
) -> anyhow::Result<Vec<Measurement>> {
    let vcfg = VisionConfig::from_dir(dir)?;
    let vision = VisionModel::new(vcfg.clone(), weights, backend.clone())?;
    let engine = Engine::load(dir, weights, backend.clone(), None)?;
    weights.finish();
    let tcfg = engine.config().text.clone();

    let per_measure = opts.warmup + opts.repeats.max(1);
    let total = per_measure * (2 + opts.image_sides.len() + 2);
    let bar = ProgressBar::new(total as u64).with_style(
        ProgressStyle::with_template("bench {bar:30} {pos}/{len} runs {msg}")
            .expect("valid template"),
    );
    let mut out = Vec::new();

    // Limits first: copy bandwidth and a large GEMM.
    bar.set_message("copy bandwidth");
    const COPY_BYTES: usize = 256 << 20;
    let bw = time(opts, &bar, || copy(&backend, COPY_BYTES))?;
    out.push(Measurement {
        name: "limit: copy bandwidth (read + write)".into(),
        seconds: bw,
        work: 2.0 * COPY_BYTES as f64,
        unit: "B",
        roofline: None,
    });
    let bandwidth = out[0].throughput();

    bar.set_message("GEMM rate");
    let (m, k, n) = (2048, 2048, 2048);
    let a = backend.upload(&HostTensor::new(vec![n, k], vec![0.5; n * k])?)?;
    let w = backend.upload_weight(&HostTensor::new(vec![m, k], vec![0.25; m * k])?)?;
    let gemm = time(opts, &bar, || {
        let t = Instant::now();
        let y = backend.linear(&a, &w, None)?;
        backend.download(&backend.slice_rows(&y, 0, 1)?)?;
        Ok(t.elapsed())
    })?;
    out.push(Measurement {
        name: format!("limit: GEMM {n}x{k}x{m}"),
        seconds: gemm,
        work: 2.0 * (m * n * k) as f64,
        unit: "FLOP",
        roofline: None,
    });
    let flop_rate = out[1].throughput();

    // Vision: random pixels of the right shape (decoding and resizing are not the ViT's cost).
    let factor = vcfg.patch_size * vcfg.spatial_merge_size;
    for &side in &opts.image_sides {
        let g = (side / factor).max(1) * vcfg.spatial_merge_size;
        let patches = Patches {
            pixels: HostTensor::new(
                vec![g * g, vcfg.patch_dim()],
                vec![0.1; g * g * vcfg.patch_dim()],
            )?,
            grid_thw: [1, g, g],
        };
        bar.set_message(format!("ViT {side}x{side}"));
        let s = time(opts, &bar, || {
            let t = Instant::now();
            vision.forward(&patches)?;
            Ok(t.elapsed())
        })?;
        let flops = vit_flops(&vcfg, g * g);
        let mut meas = Measurement {
            name: format!("vision: ViT + mergers {side}x{side} ({} patches)", g * g),
            seconds: s,
            work: flops,
            unit: "FLOP",
            roofline: None,
        };
        meas.roofline = Some(meas.throughput() / flop_rate);
        out.push(meas);
    }

    // Prefill and decode on a synthetic text prompt (ids away from the special tokens).
    let prompt = |len: usize| -> Vec<u32> { (0..len).map(|i| (i % 100 + 10) as u32).collect() };
    let params = text_params(&tcfg) as f64;
    bar.set_message(format!("prefill {}", opts.prefill_tokens));
    let req = GenerateRequest {
        prompt: prompt(opts.prefill_tokens),
        images: Vec::new(),
        sampling: SamplingParams::greedy(),
        max_new_tokens: 1,
        ignore_eos: true,
    };
    let s = time(opts, &bar, || {
        Ok(engine
            .generate(&req, |_| std::ops::ControlFlow::Continue(()))?
            .prefill)
    })?;
    let mut meas = Measurement {
        name: format!("prefill: {} text tokens", opts.prefill_tokens),
        seconds: s,
        work: opts.prefill_tokens as f64,
        unit: "token",
        roofline: None,
    };
    meas.roofline = Some(meas.throughput() * 2.0 * params / flop_rate);
    out.push(meas);

    bar.set_message(format!("decode at {}", opts.decode_context));
    let req = GenerateRequest {
        prompt: prompt(opts.decode_context),
        max_new_tokens: opts.decode_tokens + 1,
        ..req
    };
    let s = time(opts, &bar, || {
        let g = engine.generate(&req, |_| std::ops::ControlFlow::Continue(()))?;
        // Seconds per decoded token (the first token comes from the prefill).
        Ok(g.decode / (g.tokens.len().saturating_sub(1).max(1)) as u32)
    })?;
    let kv_bytes = (opts.decode_context + opts.decode_tokens / 2) as f64
        * (tcfg.num_hidden_layers * 2 * tcfg.num_key_value_heads * tcfg.head_dim * 4) as f64;
    // Weights as the backend stores them (f32 on the CPU, f16 on a GPU), the KV cache in f32.
    let bytes_per_token = params * B::WEIGHT_BYTES as f64 + kv_bytes;
    let mut meas = Measurement {
        name: format!("decode: batch 1 at context {}", opts.decode_context),
        seconds: s,
        work: 1.0,
        unit: "token",
        roofline: None,
    };
    meas.roofline = Some(meas.throughput() * bytes_per_token / bandwidth);
    out.push(meas);
    bar.finish_and_clear();
    Ok(out)
}

/// Parameters of the text decoder (what decoding reads per token), lm_head included.
pub fn text_params(c: &llm_svc::TextConfig) -> usize {
    let (h, i, d) = (c.hidden_size, c.intermediate_size, c.head_dim);
    let attn = h * d * (2 * c.num_attention_heads + 2 * c.num_key_value_heads) + 2 * d;
    let mlp = 3 * h * i;
    c.num_hidden_layers * (attn + mlp + 2 * h) + 2 * c.vocab_size * h + h
}

/// Multiply-adds x 2 of the ViT and its mergers for `n` patches.
pub fn vit_flops(c: &VisionConfig, n: usize) -> f64 {
    let (h, i) = (c.hidden_size as f64, c.intermediate_size as f64);
    let n = n as f64;
    let block = 2.0 * n * (4.0 * h * h + 2.0 * h * i) + 4.0 * n * n * h;
    let g = h * (c.spatial_merge_size * c.spatial_merge_size) as f64;
    let merger = 2.0 * (n / 4.0) * (g * g + g * c.out_hidden_size as f64);
    2.0 * n * c.patch_dim() as f64 * h
        + c.depth as f64 * block
        + (1 + c.deepstack_visual_indexes.len()) as f64 * merger
}

/// A table for the terminal.
pub fn table(rows: &[Measurement]) -> String {
    let mut s = format!(
        "{:<52} {:>11} {:>11} {:>16} {:>9}\n",
        "measurement", "median ms", "spread ms", "throughput", "of limit"
    );
    for m in rows {
        let (value, unit) = match m.unit {
            "FLOP" => (m.throughput() / 1e9, "GFLOP/s"),
            "B" => (m.throughput() / 1e9, "GB/s"),
            _ => (m.throughput(), "tok/s"),
        };
        s.push_str(&format!(
            "{:<52} {:>11.3} {:>11.3} {:>9.1} {:<6} {:>9}\n",
            m.name,
            m.median() * 1e3,
            (m.seconds[m.seconds.len() - 1] - m.seconds[0]) * 1e3,
            value,
            unit,
            m.roofline
                .map_or("-".to_string(), |r| format!("{:.1}%", r * 100.0))
        ));
    }
    s
}
