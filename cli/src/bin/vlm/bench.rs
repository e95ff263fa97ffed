//! `vlm bench`: the stages measured on this machine against its copy bandwidth and GEMM rate
//! (the measurements are in [`vlm_cli::bench`]); prints a table and, with `--json`, one object
//! per measurement with the device, config and commit.

use std::path::PathBuf;

use anyhow::Context;
use vlm_compute::{Backend, Device, OnDevice};

use crate::git_commit;

/// A comma-separated list of sizes; an empty value (`--decode-batches ""`) is an empty list,
/// which skips that measurement.
#[derive(Clone, Debug)]
struct Sizes(Vec<usize>);

impl std::str::FromStr for Sizes {
    type Err = std::num::ParseIntError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        s.split(',')
            .map(str::trim)
            .filter(|v| !v.is_empty())
            .map(str::parse)
            .collect::<Result<_, _>>()
            .map(Sizes)
    }
}

#[derive(clap::Args)]
pub struct BenchArgs {
    /// Checkpoint directory; with --random-weights only its config.json is read.
    #[arg(
        long,
        value_name = "DIR",
        default_value = "tests/fixtures/tiny-qwen3-vl"
    )]
    model: PathBuf,
    /// Random weights of the config's shapes instead of the checkpoint's (e.g. --model
    /// deploy/models/qwen3-vl-8b for the real 8B sizes; f32 on the CPU needs ~36 GB).
    #[arg(long)]
    random_weights: bool,
    #[command(flatten)]
    weights: llm_svc::WeightArgs,
    /// How the KV cache stores keys and values: auto (f16 on a GPU) or fp8 (e4m3).
    #[arg(long, default_value = "auto", value_name = "auto|fp8")]
    kv_cache_dtype: llm_svc::KvCacheDtype,
    /// Where to run.
    #[arg(long, value_enum, default_value = "cpu")]
    device: Device,
    /// Unmeasured runs before each measurement.
    #[arg(long, default_value_t = 1)]
    warmup: usize,
    /// Measured runs of each measurement (median and spread reported).
    #[arg(long, default_value_t = 5)]
    repeats: usize,
    /// Sides of the square images for the ViT, comma-separated; empty for none. Each is timed
    /// from the image's bytes (the patches are cut on the device) twice: outputs kept on the
    /// device, and downloaded to the host.
    #[arg(long, default_value = "448,896,1344")]
    image_sides: Sizes,
    /// Prompt lengths for prefill throughput, comma-separated; empty for none.
    #[arg(long, default_value = "512,4096")]
    prefill_tokens: Sizes,
    /// Contexts at which decode tokens/s is measured, comma-separated; empty for none.
    #[arg(long, default_value = "512,4096")]
    decode_contexts: Sizes,
    /// Tokens decoded per decode run.
    #[arg(long, default_value_t = 32)]
    decode_tokens: usize,
    /// Batch sizes for batched decode (that many sequences decoding together at the first
    /// --decode-contexts), comma-separated; empty for none.
    #[arg(long, default_value = "1,8,32,64,128")]
    decode_batches: Sizes,
    /// Also print, op by op, where device time goes in the ViT (each --image-sides), prefills
    /// of 256, 512 and 2048 tokens, a batched decode step and a mixed step (sequences decoding
    /// while a prompt is prefilled beside them); steps then run op by op, not from recordings.
    #[arg(long)]
    profile: bool,
    /// Measure decoding greedy only; by default every decode row is also measured sampled as
    /// Qwen3-VL's model card asks (temperature 0.7, top-p 0.8, top-k 20, presence penalty
    /// 1.5), what real clients send.
    #[arg(long)]
    greedy_only: bool,
    /// Skip the structured-output rows: by default every decode row is also measured sampled
    /// with a JSON schema on every request (Qwen3-VL's detections: bbox_2d and label), and at
    /// each --decode-batches size the host's time for one step's grammar token masks (median
    /// and p99), computed as the engine does while the device runs the forward pass.
    #[arg(long)]
    no_json_schema: bool,
    /// Image sides of the time-to-first-token requests (each with --ttft-text-tokens of
    /// text), comma-separated; empty for none.
    #[arg(long, alias = "ttft-image-side", default_value = "448")]
    ttft_image_sides: Sizes,
    /// Text tokens of the time-to-first-token request.
    #[arg(long, default_value_t = 32)]
    ttft_text_tokens: usize,
    /// Skip sending those requests through vision-svc, llm-svc and the gateway on loopback
    /// (with an image new to vision-svc, and with one its embedding cache holds), and timing
    /// how long packing and unpacking their embeddings takes.
    #[arg(long)]
    no_gateway: bool,
    /// Also write the measurements as JSON (one object each, with device, config and commit).
    #[arg(long, value_name = "FILE")]
    json: Option<PathBuf>,
}

pub fn bench(args: BenchArgs) -> anyhow::Result<()> {
    gateway::checkpoint::check_model_dir(&args.model)?;
    let device = args.device.describe()?;
    args.device.run(Bench {
        args: &args,
        device,
    })
}

/// The bench, written once for any backend.
struct Bench<'a> {
    args: &'a BenchArgs,
    /// What it runs on, for the report.
    device: String,
}

impl OnDevice for Bench<'_> {
    type Output = anyhow::Result<()>;
    fn run<B: Backend + Clone>(self, open: fn() -> vlm_compute::Result<B>) -> Self::Output {
        let copy = |b: &B, bytes: usize| Ok(b.time_copy(bytes)?);
        bench_on(self.args, open, copy, self.device)
    }
}

fn bench_on<B: Backend + Clone>(
    args: &BenchArgs,
    open: fn() -> vlm_compute::Result<B>,
    copy: impl Fn(&B, usize) -> anyhow::Result<std::time::Duration>,
    device: String,
) -> anyhow::Result<()> {
    let opts = vlm_cli::bench::BenchOptions {
        warmup: args.warmup,
        repeats: args.repeats,
        image_sides: args.image_sides.0.clone(),
        prefill_tokens: args.prefill_tokens.0.clone(),
        decode_contexts: args.decode_contexts.0.clone(),
        decode_tokens: args.decode_tokens,
        decode_batches: args.decode_batches.0.clone(),
        profile: args.profile,
        sampled_decode: !args.greedy_only,
        json_schema_decode: !args.no_json_schema,
        ttft_image_sides: args.ttft_image_sides.0.clone(),
        ttft_text_tokens: args.ttft_text_tokens,
        through_gateway: !args.no_gateway,
        random_weights: args.random_weights.then_some(0),
        weights: args.weights,
        kv_cache_dtype: args.kv_cache_dtype,
    };
    let rows = vlm_cli::bench::run(&args.model, open, &opts, copy)?;
    let config = format!(
        "{}{}{}{}{}",
        args.model.display(),
        if args.random_weights {
            " (random weights)"
        } else {
            ""
        },
        match args.weights.quantize {
            Some(to) => format!(" --quantize {to}"),
            None => String::new(),
        },
        if args.weights.quantize_lm_head {
            " --quantize-lm-head"
        } else {
            ""
        },
        match args.kv_cache_dtype {
            llm_svc::KvCacheDtype::Auto => String::new(),
            dtype => format!(" --kv-cache-dtype {dtype}"),
        }
    );
    println!("device: {device}\n{}", vlm_cli::bench::table(&rows));
    if let Some(path) = &args.json {
        let commit = git_commit();
        let items: Vec<serde_json::Value> = rows
            .iter()
            .map(|m| {
                let mut v = m.to_json(&device, &config);
                v["commit"] = commit.clone().into();
                v
            })
            .collect();
        std::fs::write(path, serde_json::to_string_pretty(&items)?)
            .with_context(|| format!("cannot write {}", path.display()))?;
    }
    Ok(())
}
