//! `vlm load`: many streamed chats at once, through the gateway's HTTP and gRPC APIs, at one
//! concurrency after another; a table of throughput and latency per level (the measuring is
//! in [`vlm_cli::load`]).
//!
//! It targets a running gateway (`--http`, `--grpc`) or starts the local stack itself, as
//! `vlm serve` would, with the same model and engine flags. The clients run on their own
//! tokio runtime, so the gateway's and the services' tasks do not delay the clients'
//! timestamps (and the other way round) beyond sharing the machine's cores.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, ensure, Context};
use indicatif::{ProgressBar, ProgressStyle};
use vlm_cli::load::{self, ApiMix, LevelLimits, LevelStats, RequestMaker, Target, Workload};
use vlm_cli::stack::{LocalStack, StackConfig};

use vlm_compute::Device;

use crate::{git_commit, start_stack};

/// The model `vlm load` serves when given none (as `vlm serve`).
const DEFAULT_MODEL: &str = "tests/fixtures/tiny-qwen3-vl";

#[derive(clap::Args)]
pub struct LoadArgs {
    /// HTTP API of a running gateway, e.g. http://127.0.0.1:8080. With neither --http nor
    /// --grpc, vlm load starts vision-svc, llm-svc and the gateway itself (as vlm serve).
    #[arg(long, value_name = "URL")]
    http: Option<String>,
    /// gRPC API of a running gateway, e.g. http://127.0.0.1:50050.
    #[arg(long, value_name = "URL")]
    grpc: Option<String>,
    /// Checkpoint directory the local stack serves (default: tests/fixtures/tiny-qwen3-vl);
    /// with --http/--grpc only its tokenizer is read, to size the prompts.
    #[arg(long, value_name = "DIR")]
    model: Option<PathBuf>,
    /// Random weights (seed 0) of the model's config for the local stack, e.g. with --model
    /// deploy/models/qwen3-vl-8b: the real 8B shapes, no download.
    #[arg(long, conflicts_with_all = ["http", "grpc"])]
    random_weights: bool,
    /// Where the local stack runs the models.
    #[arg(long, value_enum, default_value = "cpu", conflicts_with_all = ["http", "grpc"])]
    device: Device,
    /// Concurrency levels, run one after another: this many clients, each sending its next
    /// request as soon as its last one has ended (a closed loop).
    #[arg(long, value_delimiter = ',', default_value = "1,8,32,64,128")]
    concurrency: Vec<usize>,
    /// Requests per level, all clients together (default: 4 per client and at least 16,
    /// unless --duration is given).
    #[arg(long)]
    requests: Option<usize>,
    /// Seconds per level: no request is started after this; those under way finish and are
    /// counted. With --requests, whichever comes first ends the level.
    #[arg(long, value_name = "SECS")]
    duration: Option<f64>,
    /// Mean text tokens per prompt; each prompt's length is drawn uniformly from [0.5x,
    /// 1.5x] (counted with the model's tokenizer when --model or the local stack gives one,
    /// else one word per token).
    #[arg(long, default_value_t = 512)]
    prompt_tokens: usize,
    /// Tokens each request generates, sent with ignore_eos so every request generates
    /// exactly this many.
    #[arg(long, default_value_t = 128)]
    max_tokens: usize,
    /// Every K-th request carries one PNG image generated here, each different (0: none).
    #[arg(long, value_name = "K", default_value_t = 4)]
    image_every: usize,
    /// Side in pixels of those square images.
    #[arg(long, value_name = "PIXELS", default_value_t = 448)]
    image_side: u32,
    /// APIs the requests go through: mixed alternates the OpenAI HTTP API (SSE streaming)
    /// and gRPC ChatStream.
    #[arg(long, value_enum, default_value = "mixed")]
    api: ApiMix,
    /// Seed of the prompts and images: the same seed sends the same requests.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Sampling temperature of every request (0: greedy). Qwen3-VL's model card asks for 0.7
    /// with --top-p 0.8 --top-k 20 --presence-penalty 1.5, what real clients send. Each
    /// request also sends its index as its seed, so runs repeat.
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    /// Nucleus sampling's probability mass (sent only when given).
    #[arg(long)]
    top_p: Option<f32>,
    /// Keep the k most likely tokens (sent only when given).
    #[arg(long)]
    top_k: Option<u32>,
    /// OpenAI's presence penalty, in [-2, 2] (sent only when given).
    #[arg(long)]
    presence_penalty: Option<f32>,
    /// Send every request with a JSON schema to answer to (`response_format` over HTTP,
    /// `output_format` over gRPC): Qwen3-VL's detections, bbox_2d and label, at least 64 of
    /// them, so that no answer completes before --max-tokens (vlm bench's schema). Measures
    /// structured outputs against the same run without it.
    #[arg(long)]
    json_schema: bool,
    /// Turns per conversation: with T > 1 each client holds a conversation and every turn
    /// resends its history (user messages, their images, an answer for each) plus a new user
    /// message, so the prefix cache and cache-aware routing over replicas show in the cache
    /// hit rate and the time to first token. --requests counts turns.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=64))]
    turns: u64,
    /// Requests sent one at a time before the first level, not measured (connections,
    /// kernels and caches warm up).
    #[arg(long, default_value_t = 2)]
    warmup: usize,
    /// Also write one JSON object per level, with device, model, config and commit.
    #[arg(long, value_name = "FILE")]
    json: Option<PathBuf>,
    /// Local stack: requests served at once by the gateway and held by llm-svc (default:
    /// 256, or the largest --concurrency if more; never less than that).
    #[arg(long)]
    max_concurrent: Option<usize>,
    /// Local stack: images held at once by vision-svc (preprocessing, queued or encoding;
    /// queued ones are encoded together).
    #[arg(long, default_value_t = 64)]
    vision_max_concurrent: usize,
    /// Local stack: cap on prompt + generated tokens per request.
    #[arg(long)]
    max_context: Option<usize>,
    /// Local stack: measure the gateway alone. Instead of llm-svc, a stand-in without a model
    /// that hands every request a token each MS milliseconds (as a GPU's batched step does,
    /// about 10 at batch 64 on the 8B shapes), and no vision-svc (needs --image-every 0).
    #[arg(long, value_name = "MS", conflicts_with_all = ["http", "grpc", "random_weights"])]
    stand_in_llm: Option<f64>,
    /// Local stack: how many replicas, on which GPUs (--gpus) or on the CPU (--replicas).
    #[command(flatten)]
    replicas: crate::ReplicaArgs,
    #[command(flatten)]
    engine: llm_svc::EngineArgs,
    #[command(flatten)]
    weights: llm_svc::WeightArgs,
}

/// `--stand-in-llm MS` as the stack takes it.
pub fn stand_in_step(ms: Option<f64>) -> anyhow::Result<Option<Duration>> {
    let Some(ms) = ms else { return Ok(None) };
    ensure!(
        ms.is_finite() && ms > 0.0,
        "--stand-in-llm must be a positive number of milliseconds, got {ms}"
    );
    Ok(Some(Duration::from_secs_f64(ms / 1e3)))
}

/// `http://host:port` from what a user may type: a bare host:port, a trailing `/` or `/v1`.
fn base_url(url: &str) -> String {
    let url = if url.contains("://") {
        url.to_string()
    } else {
        format!("http://{url}")
    };
    let url = url.trim_end_matches('/');
    url.strip_suffix("/v1").unwrap_or(url).to_string()
}

fn check(args: &LoadArgs) -> anyhow::Result<()> {
    ensure!(
        !args.concurrency.is_empty() && !args.concurrency.contains(&0),
        "--concurrency must list levels of at least 1 client, got {:?}",
        args.concurrency
    );
    ensure!(
        args.max_tokens > 0,
        "--max-tokens must be at least 1, got 0"
    );
    ensure!(
        args.prompt_tokens > 0,
        "--prompt-tokens must be at least 1, got 0"
    );
    ensure!(
        args.requests != Some(0),
        "--requests must be at least 1, got 0"
    );
    if let Some(d) = args.duration {
        ensure!(
            d.is_finite() && d > 0.0,
            "--duration must be a positive number of seconds, got {d}"
        );
    }
    ensure!(
        args.stand_in_llm.is_none() || args.image_every == 0,
        "--stand-in-llm serves text only: pass --image-every 0"
    );
    if args.http.is_some() || args.grpc.is_some() {
        match (args.api, &args.http, &args.grpc) {
            (ApiMix::Mixed, Some(_), Some(_)) | (ApiMix::Http, Some(_), _) => {}
            (ApiMix::Grpc, _, Some(_)) => {}
            (ApiMix::Mixed, ..) => {
                bail!("--api mixed needs both --http and --grpc (or pass --api http or --api grpc)")
            }
            (ApiMix::Http, ..) => bail!("--api http needs --http URL"),
            (ApiMix::Grpc, ..) => bail!("--api grpc needs --grpc URL"),
        }
    }
    Ok(())
}

/// The model directory's tokenizer, to size the prompts.
fn tokenizer(dir: &Path) -> anyhow::Result<tokenizers::Tokenizer> {
    let path = dir.join("tokenizer.json");
    tokenizers::Tokenizer::from_file(&path)
        .map_err(|e| anyhow::anyhow!("cannot load the tokenizer {}: {e}", path.display()))
}

pub fn load(args: LoadArgs) -> anyhow::Result<()> {
    check(&args)?;
    let remote = args.http.is_some() || args.grpc.is_some();
    let model = match (&args.model, remote) {
        (Some(dir), _) => Some(dir.clone()),
        (None, false) => Some(PathBuf::from(DEFAULT_MODEL)),
        (None, true) => None,
    };
    if let Some(dir) = &model {
        gateway::checkpoint::check_model_dir(dir).with_context(|| {
            "vlm load needs a model; run it from the repository root or pass --model DIR"
        })?;
    }
    let stack_rt = tokio::runtime::Runtime::new()?;
    let client_threads = std::thread::available_parallelism().map_or(2, |n| n.get().min(4));
    let client_rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(client_threads)
        .thread_name("vlm-load-client")
        .enable_all()
        .build()?;

    let (served, stack) = if remote {
        (remote_gateway(&args, &client_rt), None)
    } else {
        let dir = model.clone().expect("the local stack has a model");
        let (served, stack) = start_local_stack(&args, dir, &stack_rt)?;
        (served, Some(stack))
    };

    let workload = Workload {
        prompt_tokens: args.prompt_tokens,
        max_tokens: args.max_tokens,
        image_every: args.image_every,
        image_side: args.image_side,
        api: args.api,
        seed: args.seed,
        sampling: vlm_cli::load::LoadSampling {
            temperature: args.temperature,
            top_p: args.top_p,
            top_k: args.top_k,
            presence_penalty: args.presence_penalty,
        },
        json_schema: args.json_schema,
        turns: args.turns as usize,
    };
    let tokenizer = model.as_deref().map(tokenizer).transpose()?;
    let counted_by = if tokenizer.is_some() {
        "the model's tokenizer"
    } else {
        "words, about one token each"
    };
    let maker = Arc::new(RequestMaker::new(workload, tokenizer));
    let run = client_rt.block_on(run_levels(&args, &served.target, &maker));
    if let Some(stack) = stack {
        let stopped = stack_rt.block_on(stack.stop());
        if run.is_ok() {
            stopped.context("the local stack did not stop cleanly")?;
        }
    }
    let levels = run?;

    let config = config_line(&args, counted_by, &served.served_by);
    let Served {
        device, model_desc, ..
    } = served;
    println!("device: {device}\nmodel: {model_desc}\nconfig: {config}");
    print!("{}", load::table(&levels));
    if let Some(path) = &args.json {
        write_json(path, &args, &levels, &device, &model_desc, &config)?;
    }
    Ok(())
}

/// What the levels run against, and how the report describes it.
struct Served {
    target: Target,
    device: String,
    model_desc: String,
    /// What serves the requests, for the config line.
    served_by: String,
}

/// A running gateway at `--http` / `--grpc`, its model named by its `/v1/models` if it answers.
fn remote_gateway(args: &LoadArgs, client_rt: &tokio::runtime::Runtime) -> Served {
    let http = args.http.as_deref().map(base_url);
    let grpc = args.grpc.as_deref().map(base_url);
    let served_name = match &http {
        Some(url) => client_rt.block_on(served_model(url)),
        None => None,
    };
    let addresses = [http.as_deref(), grpc.as_deref()]
        .into_iter()
        .flatten()
        .collect::<Vec<_>>()
        .join(", ");
    let target = Target {
        http,
        grpc,
        model_name: served_name.clone().unwrap_or_else(|| "vlm".into()),
    };
    Served {
        target,
        device: "unknown (a running gateway)".to_string(),
        model_desc: served_name.unwrap_or_else(|| "unknown".into()),
        served_by: format!("a running gateway at {addresses}"),
    }
}

/// Starts the local stack (or the gateway with a stand-in llm-svc) on `dir`, as `vlm serve`
/// would with the same flags, and waits until it is ready.
fn start_local_stack(
    args: &LoadArgs,
    dir: PathBuf,
    stack_rt: &tokio::runtime::Runtime,
) -> anyhow::Result<(Served, LocalStack)> {
    let largest = args.concurrency.iter().copied().max().unwrap_or(1);
    let max_concurrent = args.max_concurrent.unwrap_or(256.max(largest));
    ensure!(
        max_concurrent >= largest,
        "--max-concurrent {max_concurrent} is below the largest --concurrency {largest}: \
         the clients past it would get RESOURCE_EXHAUSTED / 429"
    );
    let devices = args.replicas.devices(args.device)?;
    let device = match devices.as_slice() {
        [one] => one.describe()?,
        many => format!("{} x {}", many.len(), many[0].describe()?),
    };
    let mut cfg = StackConfig::loopback(dir.clone());
    cfg.random_weights = args.random_weights.then_some(0);
    cfg.weights = args.weights;
    cfg.max_concurrent = max_concurrent;
    cfg.vision_max_concurrent = args.vision_max_concurrent;
    cfg.engine = args.engine.config(args.max_context, devices[0].is_gpu());
    cfg.stand_in_llm = stand_in_step(args.stand_in_llm)?;
    cfg.routing = args.replicas.routing.config()?;
    let e = &cfg.engine;
    let served_by = match args.stand_in_llm {
        Some(ms) => format!(
            "the gateway alone (max_concurrent {max_concurrent}), with a stand-in llm-svc \
             that hands each request a token every {ms} ms (no model)"
        ),
        None => format!(
            "the local stack on {} (max_concurrent {max_concurrent}, max_batch_seqs {}, \
         max_batch_tokens {}, prefix caching {}, KV cache {})",
            args.replicas.name(args.device),
            e.max_batch_seqs,
            e.max_batch_tokens,
            if e.prefix_caching { "on" } else { "off" },
            match e.kv_cache {
                llm_svc::KvCacheSize::Tokens(n) => format!("{n} tokens"),
                llm_svc::KvCacheSize::DeviceFraction(f) => format!("{f} of the GPU's memory"),
                llm_svc::KvCacheSize::Auto => "sized by the engine".into(),
            },
        ),
    };
    let target_name = cfg.model_name.clone();
    eprintln!("starting {served_by} with {}", dir.display());
    let mut started = stack_rt.block_on(start_stack(cfg, &devices))?;
    // Weights and the GPU's self-check take their time at the 8B sizes.
    stack_rt.block_on(started.ready(Duration::from_secs(1800)))?;
    let target = Target {
        http: Some(format!("http://{}", started.http_addr)),
        grpc: Some(format!("http://{}", started.grpc_addr)),
        model_name: target_name,
    };
    let model_desc = format!(
        "{}{}",
        dir.display(),
        if args.random_weights {
            " (random weights)"
        } else {
            ""
        }
    );
    let served = Served {
        target,
        device,
        model_desc,
        served_by,
    };
    Ok((served, started))
}

/// The report's `config:` line: the workload, the sampling, the API and what served it.
fn config_line(args: &LoadArgs, counted_by: &str, served_by: &str) -> String {
    let mut sampling = if args.temperature == 0.0 {
        "greedy".to_string()
    } else {
        format!(
            "sampled at temperature {} top-p {} top-k {} presence penalty {}",
            args.temperature,
            args.top_p.unwrap_or(1.0),
            args.top_k.unwrap_or(0),
            args.presence_penalty.unwrap_or(0.0)
        )
    };
    if args.json_schema {
        sampling.push_str(", a JSON schema on every request");
    }
    let turns = match args.turns {
        1 => String::new(),
        t => format!(
            "conversations of {t} turns, each resending its history and images with a new \
             message of "
        ),
    };
    format!(
        "{turns}prompts of {}-{} text tokens (mean {}, counted by {counted_by}), {} generated with \
         ignore_eos, {}, {sampling}, api {}, seed {}; {served_by}",
        args.prompt_tokens.div_ceil(2).max(1),
        (args.prompt_tokens * 3 / 2).max(1),
        args.prompt_tokens,
        args.max_tokens,
        match args.image_every {
            0 => "no images".to_string(),
            1 => format!("a {0}x{0} PNG in every request", args.image_side),
            k => format!("a {0}x{0} PNG in 1 of every {k} requests", args.image_side),
        },
        args.api.name(),
        args.seed,
    )
}

/// `--json`: one object per level, with what was run and where.
fn write_json(
    path: &Path,
    args: &LoadArgs,
    levels: &[LevelStats],
    device: &str,
    model_desc: &str,
    config: &str,
) -> anyhow::Result<()> {
    let commit = git_commit();
    let items: Vec<serde_json::Value> = levels
        .iter()
        .map(|level| {
            let mut v = level.to_json();
            v["system"] = "vlm".into();
            v["device"] = device.into();
            v["model"] = model_desc.into();
            v["config"] = config.into();
            v["commit"] = commit.clone().into();
            v["api"] = args.api.name().into();
            v["prompt_tokens_mean"] = args.prompt_tokens.into();
            v["max_tokens"] = args.max_tokens.into();
            v["image_every"] = args.image_every.into();
            v["image_side"] = args.image_side.into();
            v["seed"] = args.seed.into();
            v
        })
        .collect();
    std::fs::write(path, serde_json::to_string_pretty(&items)?)
        .with_context(|| format!("cannot write {}", path.display()))
}

/// The id the gateway's `/v1/models` lists, if it answers.
async fn served_model(http: &str) -> Option<String> {
    let models: serde_json::Value = reqwest::get(format!("{http}/v1/models"))
        .await
        .ok()?
        .json()
        .await
        .ok()?;
    models["data"][0]["id"].as_str().map(str::to_string)
}

/// The warm-up, then every level in turn, with a progress bar on stderr (hidden when stderr
/// is not a terminal).
async fn run_levels(
    args: &LoadArgs,
    target: &Target,
    maker: &Arc<RequestMaker>,
) -> anyhow::Result<Vec<LevelStats>> {
    let duration = args.duration.map(Duration::from_secs_f64);
    let requests_for = |c: usize| match (args.requests, duration) {
        (Some(n), _) => Some(n),
        (None, None) => Some((4 * c).max(16)),
        (None, Some(_)) => None,
    };
    let total: Option<usize> = args.concurrency.iter().map(|&c| requests_for(c)).sum();
    let bar = match total {
        Some(n) => ProgressBar::new(n as u64).with_style(
            ProgressStyle::with_template("load {bar:30} {pos}/{len} requests {msg}")
                .expect("valid template"),
        ),
        None => ProgressBar::new_spinner().with_style(
            ProgressStyle::with_template("load {spinner} {pos} requests {msg}")
                .expect("valid template"),
        ),
    };
    bar.set_message("warming up");
    load::warm_up(target, maker, 0, args.warmup).await?;
    // Request numbers run on across levels: no level resends an earlier level's prompts.
    let mut next = args.warmup as u64;
    let mut levels = Vec::new();
    for &concurrency in &args.concurrency {
        bar.set_message(format!("at concurrency {concurrency}"));
        let limits = LevelLimits {
            requests: requests_for(concurrency),
            duration,
        };
        let (level, used) = load::run_level(target, maker, concurrency, limits, next, &bar).await?;
        next += used;
        levels.push(level);
    }
    bar.finish_and_clear();
    Ok(levels)
}
