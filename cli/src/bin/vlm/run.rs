//! `vlm run`: one chat request answered offline, in one process, with no network: the
//! quickest way to see the model work and the reference the services are tested against.

use std::io::Write;
use std::ops::ControlFlow;
use std::path::PathBuf;

use anyhow::Context;
use gateway::chat::{Message, Part};
use gateway::request::ChatRequest;
use llm_svc::SamplingParams;
use vlm_cli::pipeline::{ChatOutput, Pipeline};
use vlm_compute::{npy, Backend, Device, HostTensor, OnDevice};

#[derive(clap::Args)]
pub struct RunArgs {
    /// Checkpoint directory (Hugging Face layout), e.g. tests/fixtures/tiny-qwen3-vl.
    #[arg(long, value_name = "DIR")]
    model: PathBuf,
    /// An image to show the model (PNG, JPEG, WebP, GIF); repeat for several, in order.
    #[arg(long = "image", value_name = "PATH")]
    images: Vec<PathBuf>,
    /// The user's text, placed after the images.
    #[arg(long)]
    prompt: String,
    /// An optional system message.
    #[arg(long)]
    system: Option<String>,
    /// Most tokens to generate.
    #[arg(long, default_value_t = 128)]
    max_new_tokens: usize,
    /// Sampling temperature; 0 picks the most likely token (greedy).
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    temperature: f32,
    /// Sample only among the k most likely tokens (0: no limit).
    #[arg(long, default_value_t = 0)]
    top_k: usize,
    /// Sample only among the most likely tokens holding this much probability.
    #[arg(long, default_value_t = 1.0, allow_negative_numbers = true)]
    top_p: f32,
    /// Seed for sampling, for reproducible output at temperature > 0.
    #[arg(long)]
    seed: Option<u64>,
    /// Stop before this text (repeatable); it is not included in the output.
    #[arg(long = "stop", value_name = "TEXT")]
    stop: Vec<String>,
    /// Where to run the model.
    #[arg(long, value_enum, default_value = "cpu")]
    device: Device,
    /// Random weights of the config's shapes instead of the checkpoint's: runs a model size
    /// without its weights (e.g. --model deploy/models/qwen3-vl-8b, the real 8B config with a
    /// stand-in tokenizer). The text is meaningless; the shapes and timings are real.
    #[arg(long)]
    random_weights: bool,
    /// Seed of the random weights (the same seed gives the same model).
    #[arg(long, default_value_t = 0, requires = "random_weights")]
    weights_seed: u64,
    #[command(flatten)]
    weights: llm_svc::WeightArgs,
    /// How the KV cache stores keys and values: auto (f16 on a GPU, f32 on the CPU) or fp8
    /// (e4m3 with the checkpoint's scales or 1.0; see docs/serving.md).
    #[arg(
        long,
        env = "VLM_KV_CACHE_DTYPE",
        default_value = "auto",
        value_name = "auto|fp8"
    )]
    kv_cache_dtype: llm_svc::KvCacheDtype,
    /// Cap on prompt + generated tokens (defaults to the model's max_position_embeddings, at
    /// most 32768: the KV cache `vlm run` allocates).
    #[arg(long)]
    max_context: Option<usize>,
    /// Print one JSON object (prompt_token_ids, generated_token_ids, text, ...) instead of text.
    #[arg(long)]
    json: bool,
    /// Write the logits each generated token was chosen from, as float32 .npy [steps, vocab].
    #[arg(long, value_name = "FILE.npy")]
    logits_out: Option<PathBuf>,
}

pub fn run(args: RunArgs) -> anyhow::Result<()> {
    args.device.run(args)
}

impl OnDevice for RunArgs {
    type Output = anyhow::Result<()>;
    fn run<B: Backend + Clone>(self, open: fn() -> vlm_compute::Result<B>) -> Self::Output {
        run_on(self, open()?)
    }
}

fn run_on<B: Backend + Clone>(args: RunArgs, backend: B) -> anyhow::Result<()> {
    let request = chat_request(&args)?;
    let engine = engine_config(&args);
    // A missing or incomplete directory is named before any weights are opened.
    gateway::checkpoint::check_model_dir(&args.model)
        .with_context(|| format!("cannot load the model in {}", args.model.display()))?;
    let seed = args.random_weights.then_some(args.weights_seed);
    let pipeline = args
        .weights
        .open(&args.model, seed)
        .map_err(vlm_cli::Error::from)
        .and_then(|weights| Pipeline::with_weights(&args.model, &weights, backend, engine))
        .with_context(|| format!("cannot load the model in {}", args.model.display()))?;
    let vocab = pipeline.engine.config().text.vocab_size;
    let mut logits: Vec<f32> = Vec::new();
    let mut printed = String::new();
    let mut stdout = std::io::stdout().lock();
    let out = pipeline.run(&request, |ev, text| {
        if let Some(l) = ev.logits {
            logits.extend_from_slice(l);
        }
        if !args.json && !text.is_empty() {
            // Stream as we go; a closed stdout is not worth failing the generation for.
            let _ = stdout
                .write_all(text.as_bytes())
                .and_then(|_| stdout.flush());
            printed.push_str(text);
        }
        ControlFlow::Continue(())
    })?;

    if let Some(path) = &args.logits_out {
        let steps = logits.len() / vocab;
        npy::write_f32(path, &HostTensor::new(vec![steps, vocab], logits)?)
            .with_context(|| format!("cannot write {}", path.display()))?;
    }
    if args.json {
        writeln!(stdout, "{}", answer_json(&out))?;
    } else {
        // Text held back at the end (a partial stop string that never completed).
        writeln!(
            stdout,
            "{}",
            out.text.get(printed.len()..).unwrap_or_default()
        )?;
    }
    log_done(&out);
    Ok(())
}

/// The request the arguments describe: the images in order, then the prompt, after the system
/// message if there is one.
fn chat_request(args: &RunArgs) -> anyhow::Result<ChatRequest> {
    let mut parts = Vec::new();
    for path in &args.images {
        let bytes =
            std::fs::read(path).with_context(|| format!("cannot read image {}", path.display()))?;
        parts.push(Part::Image(bytes));
    }
    parts.push(Part::Text(args.prompt.clone()));
    let mut messages = Vec::new();
    if let Some(system) = &args.system {
        messages.push(Message::new("system", vec![Part::Text(system.clone())]));
    }
    messages.push(Message::user(parts));
    Ok(ChatRequest {
        messages,
        sampling: SamplingParams {
            temperature: args.temperature,
            top_k: args.top_k,
            top_p: args.top_p,
            seed: args.seed,
            ..Default::default()
        },
        max_new_tokens: args.max_new_tokens,
        stop: args.stop.clone(),
        ignore_eos: false,
        return_logits: args.logits_out.is_some(),
        ..Default::default()
    })
}

/// One request: a cache for one sequence of the longest context asked for, in whole blocks
/// (the engine refuses a cache smaller than one block, e.g. for --max-context 8).
fn engine_config(args: &RunArgs) -> llm_svc::EngineConfig {
    let defaults = llm_svc::EngineConfig::default();
    llm_svc::EngineConfig {
        max_context: args.max_context,
        kv_cache: llm_svc::KvCacheSize::Tokens(
            args.max_context
                .unwrap_or(32768)
                .next_multiple_of(defaults.block_size),
        ),
        kv_cache_dtype: args.kv_cache_dtype,
        ..defaults
    }
}

/// `--json`'s answer: the tokens, the text, why it stopped, the usage and the timings.
fn answer_json(out: &ChatOutput) -> serde_json::Value {
    let t = &out.timings;
    serde_json::json!({
        "prompt_token_ids": out.prompt_token_ids,
        "generated_token_ids": out.generated_token_ids,
        "text": out.text,
        "finish_reason": out.finish_reason.as_str(),
        "usage": {
            "prompt_tokens": out.prompt_token_ids.len(),
            "completion_tokens": out.generated_token_ids.len(),
        },
        "timings_ms": {
            "vision": t.vision.as_secs_f64() * 1e3,
            "prefill": t.prefill.as_secs_f64() * 1e3,
            "decode": t.decode.as_secs_f64() * 1e3,
        },
    })
}

/// The log line of a finished run: the token counts, why it stopped, the stages' times.
fn log_done(out: &ChatOutput) {
    let t = &out.timings;
    let decoded = out.generated_token_ids.len().saturating_sub(1);
    tracing::info!(
        prompt_tokens = out.prompt_token_ids.len(),
        generated_tokens = out.generated_token_ids.len(),
        finish_reason = out.finish_reason.as_str(),
        vision_ms = format!("{:.1}", t.vision.as_secs_f64() * 1e3),
        prefill_ms = format!("{:.1}", t.prefill.as_secs_f64() * 1e3),
        decode_tok_per_s = format!(
            "{:.1}",
            if t.decode.is_zero() {
                0.0
            } else {
                decoded as f64 / t.decode.as_secs_f64()
            }
        ),
        "done"
    );
}
