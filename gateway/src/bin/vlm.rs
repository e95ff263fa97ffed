//! `vlm`: the command line of the Qwen3-VL serving system.
//!
//! `vlm run` answers one chat request offline, in one process, with no network: the quickest
//! way to see the model work and the reference the services are tested against.

use std::io::Write;
use std::ops::ControlFlow;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{bail, Context};
use clap::{Parser, Subcommand, ValueEnum};
use gateway::chat::{Message, Part};
use gateway::pipeline::{ChatRequest, Pipeline};
use llm_svc::SamplingParams;
use vlm_compute::{npy, Backend, CpuBackend, CudaBackend, HostTensor};

#[derive(Parser)]
#[command(
    name = "vlm",
    version,
    about = "Serve and run Qwen3-VL vision-language models",
    long_about = "Serve and run Qwen3-VL vision-language models.\n\n\
        A model is a Hugging Face checkpoint directory: config.json, model*.safetensors, \
        tokenizer.json, a chat template and the image-processor settings.\n\
        Log detail is set with RUST_LOG (e.g. RUST_LOG=debug)."
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Answer one chat request offline: images and a prompt in, generated text out.
    Run(RunArgs),
    /// Start vision-svc, llm-svc and the gateway on loopback, in this process, until ctrl-c.
    Serve(ServeArgs),
    /// Measure vision, prefill and decode on this machine against its copy bandwidth and GEMM rate.
    Bench(BenchArgs),
    /// Ask a service's grpc.health.v1 whether it is SERVING (exit 0) or not (exit 1); for
    /// container health checks.
    Health(HealthArgs),
    /// Check what --device cuda needs here (driver, NVRTC, cuBLAS, headers, kernel cache), compile
    /// the kernels for target GPUs, and run the GPU self-check op by op; exit 0 if all is in order.
    Doctor(DoctorArgs),
}

#[derive(clap::Args)]
struct DoctorArgs {
    /// GPU architectures to compile every kernel for (no GPU needed), comma-separated: sm_87
    /// is Jetson Orin, sm_90 H100, sm_89 L4/L40, sm_80 A100.
    #[arg(long, value_delimiter = ',', default_value = "sm_87,sm_90")]
    arch: Vec<String>,
}

fn doctor(args: DoctorArgs) -> anyhow::Result<()> {
    let archs = args
        .arch
        .iter()
        .map(|a| {
            let digits = a.trim_start_matches("sm_");
            match (digits.len(), digits.parse::<i32>()) {
                (2..=3, Ok(n)) => Ok((n / 10, n % 10)),
                _ => bail!("--arch {a}: expected sm_XY, e.g. sm_87 (Orin) or sm_90 (H100)"),
            }
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    let ok = vlm_compute::cuda::doctor::run(&archs, |f| {
        println!(
            "{:<8} {:<38} {}",
            if f.ok { "ok" } else { "PROBLEM" },
            f.what,
            f.detail
        );
    });
    if !ok {
        bail!("--device cuda cannot run here until the problems above are fixed");
    }
    println!("--device cuda can run here.");
    Ok(())
}

#[derive(clap::Args)]
struct BenchArgs {
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
    /// Where to run.
    #[arg(long, value_enum, default_value = "cpu")]
    device: Device,
    /// Unmeasured runs before each measurement.
    #[arg(long, default_value_t = 1)]
    warmup: usize,
    /// Measured runs of each measurement (median and spread reported).
    #[arg(long, default_value_t = 5)]
    repeats: usize,
    /// Sides of the square images for the ViT, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "448,896,1344")]
    image_sides: Vec<usize>,
    /// Prompt lengths for prefill throughput, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "512,4096")]
    prefill_tokens: Vec<usize>,
    /// Contexts at which decode tokens/s is measured, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "512,4096")]
    decode_contexts: Vec<usize>,
    /// Tokens decoded per decode run.
    #[arg(long, default_value_t = 32)]
    decode_tokens: usize,
    /// Batch sizes for batched decode (that many sequences decoding together at the first
    /// --decode-contexts), comma-separated; empty for none.
    #[arg(long, value_delimiter = ',', default_value = "1,8,32,64,128")]
    decode_batches: Vec<usize>,
    /// Also print, op by op, where device time goes in a prefill and a batched decode.
    #[arg(long)]
    profile: bool,
    /// Image side of the time-to-first-token request (with --ttft-text-tokens of text).
    #[arg(long, default_value_t = 448)]
    ttft_image_side: usize,
    /// Text tokens of the time-to-first-token request.
    #[arg(long, default_value_t = 32)]
    ttft_text_tokens: usize,
    /// Skip sending that request through vision-svc, llm-svc and the gateway on loopback.
    #[arg(long)]
    no_gateway: bool,
    /// Also write the measurements as JSON (one object each, with device, config and commit).
    #[arg(long, value_name = "FILE")]
    json: Option<PathBuf>,
}

fn bench(args: BenchArgs) -> anyhow::Result<()> {
    gateway::pipeline::check_model_dir(&args.model)?;
    match args.device {
        Device::Cpu => {
            let device = format!(
                "cpu ({} threads)",
                std::thread::available_parallelism().map_or(1, |n| n.get())
            );
            let copy = |_: &CpuBackend, bytes: usize| -> anyhow::Result<std::time::Duration> {
                // Both buffers written first, so page faults are not timed as copying.
                let src = vec![1u8; bytes];
                let mut dst = vec![2u8; bytes];
                let t = std::time::Instant::now();
                dst.copy_from_slice(&src);
                let d = t.elapsed();
                std::hint::black_box(&dst);
                Ok(d)
            };
            bench_on(&args, || Ok(CpuBackend::new()), copy, device)
        }
        Device::Cuda => {
            let gpu = open_cuda()?;
            let (major, minor) = gpu.compute_capability();
            let device = format!(
                "{} (sm_{major}{minor}, driver CUDA {})",
                gpu.device_name(),
                gpu.driver_version()
            );
            drop(gpu);
            let copy = |g: &CudaBackend, bytes: usize| Ok(g.time_copy(bytes)?);
            bench_on(&args, || CudaBackend::open_verified(0), copy, device)
        }
    }
}

fn bench_on<B: Backend + Clone>(
    args: &BenchArgs,
    open: fn() -> vlm_compute::Result<B>,
    copy: impl Fn(&B, usize) -> anyhow::Result<std::time::Duration>,
    device: String,
) -> anyhow::Result<()> {
    let opts = gateway::bench::BenchOptions {
        warmup: args.warmup,
        repeats: args.repeats,
        image_sides: args.image_sides.clone(),
        prefill_tokens: args.prefill_tokens.clone(),
        decode_contexts: args.decode_contexts.clone(),
        decode_tokens: args.decode_tokens,
        decode_batches: args.decode_batches.clone(),
        profile: args.profile,
        ttft_image_side: args.ttft_image_side,
        ttft_text_tokens: args.ttft_text_tokens,
        through_gateway: !args.no_gateway,
        random_weights: args.random_weights.then_some(0),
    };
    let rows = gateway::bench::run(&args.model, open, &opts, copy)?;
    let config = format!(
        "{}{}",
        args.model.display(),
        if args.random_weights {
            " (random weights)"
        } else {
            ""
        }
    );
    println!("device: {device}\n{}", gateway::bench::table(&rows));
    if let Some(path) = &args.json {
        let commit = std::process::Command::new("git")
            .args(["rev-parse", "--short", "HEAD"])
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map_or("unknown".into(), |o| {
                String::from_utf8_lossy(&o.stdout).trim().to_string()
            });
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

/// GPU 0, once every kernel has matched the CPU reference on it (the self-check).
fn open_cuda() -> anyhow::Result<CudaBackend> {
    Ok(CudaBackend::open_verified(0)?)
}

#[derive(clap::Args)]
struct HealthArgs {
    /// host:port of the service's gRPC port.
    #[arg(long, default_value = "127.0.0.1:50050")]
    addr: String,
    /// Service to ask about ("" is the server as a whole).
    #[arg(long, default_value = "")]
    service: String,
    /// Give up after this many seconds.
    #[arg(long, default_value_t = 3)]
    timeout_secs: u64,
}

async fn health(args: HealthArgs) -> anyhow::Result<()> {
    use tonic_health::pb::health_check_response::ServingStatus;
    use tonic_health::pb::{health_client::HealthClient, HealthCheckRequest};
    let check = async {
        let ch = tonic::transport::Endpoint::from_shared(format!("http://{}", args.addr))?
            .connect()
            .await
            .with_context(|| format!("cannot connect to {}", args.addr))?;
        let r = HealthClient::new(ch)
            .check(HealthCheckRequest {
                service: args.service.clone(),
            })
            .await?;
        anyhow::Ok(r.into_inner().status)
    };
    let status = tokio::time::timeout(std::time::Duration::from_secs(args.timeout_secs), check)
        .await
        .with_context(|| format!("no answer from {} within {}s", args.addr, args.timeout_secs))??;
    let status = ServingStatus::try_from(status).unwrap_or(ServingStatus::Unknown);
    println!("{}", status.as_str_name());
    if status != ServingStatus::Serving {
        bail!("{} is {}", args.addr, status.as_str_name());
    }
    Ok(())
}

#[derive(clap::Args)]
struct ServeArgs {
    /// Checkpoint directory (Hugging Face layout).
    #[arg(
        long,
        value_name = "DIR",
        default_value = "tests/fixtures/tiny-qwen3-vl"
    )]
    model: PathBuf,
    /// Where to run the models.
    #[arg(long, value_enum, default_value = "cpu")]
    device: Device,
    /// Random weights (seed 0) of the model's config instead of its checkpoint, e.g. with
    /// --model deploy/models/qwen3-vl-8b: the real 8B shapes behind the real API, answering noise.
    #[arg(long)]
    random_weights: bool,
    /// Interface the public ports listen on.
    #[arg(long, default_value = "127.0.0.1")]
    host: std::net::IpAddr,
    /// Port of the OpenAI-compatible HTTP API.
    #[arg(long, default_value_t = 8080)]
    http_port: u16,
    /// Port of the public gRPC API (vlm.v1.Gateway).
    #[arg(long, default_value_t = 50050)]
    grpc_port: u16,
    /// Requests served at once by the gateway and held by the LLM service (running or
    /// queued); more get RESOURCE_EXHAUSTED / 429 at once.
    #[arg(long, default_value_t = 256)]
    max_concurrent: usize,
    /// Images encoded at once by the vision service.
    #[arg(long, default_value_t = 8)]
    vision_max_concurrent: usize,
    /// Cap on prompt + generated tokens per request (default: the model's own, and at most
    /// what the KV cache holds).
    #[arg(long)]
    max_context: Option<usize>,
    #[command(flatten)]
    engine: llm_svc::EngineArgs,
}

async fn serve_all(args: ServeArgs) -> anyhow::Result<()> {
    use gateway::pipeline::RequestLimits;
    use tokio::net::TcpListener;
    use tokio_util::sync::CancellationToken;

    gateway::pipeline::check_model_dir(&args.model).with_context(|| {
        "vlm serve needs a model; run it from the repository root or pass --model DIR"
    })?;
    let telemetry = vlm_proto::telemetry::init("vlm");
    let loopback = std::net::Ipv4Addr::LOCALHOST;
    let vision_l = TcpListener::bind((loopback, 0)).await?;
    let llm_l = TcpListener::bind((loopback, 0)).await?;
    let grpc_l = TcpListener::bind((args.host, args.grpc_port))
        .await
        .with_context(|| {
            format!(
                "cannot listen on {}:{} (--grpc-port)",
                args.host, args.grpc_port
            )
        })?;
    let http_l = TcpListener::bind((args.host, args.http_port))
        .await
        .with_context(|| {
            format!(
                "cannot listen on {}:{} (--http-port)",
                args.host, args.http_port
            )
        })?;
    let (vision_addr, llm_addr) = (vision_l.local_addr()?, llm_l.local_addr()?);
    let (grpc_addr, http_addr) = (grpc_l.local_addr()?, http_l.local_addr()?);

    let token = CancellationToken::new();
    let mut services = tokio::task::JoinSet::new();
    let registry = prometheus::Registry::new();
    let models = gateway::serve::ModelServices {
        model: args.model.clone(),
        random_weights: args.random_weights.then_some(0),
        vision_max_concurrent: args.vision_max_concurrent,
        llm_max_concurrent: args.max_concurrent,
        engine: args
            .engine
            .config(args.max_context, matches!(args.device, Device::Cuda)),
        registry: registry.clone(),
    };
    let listeners = (vision_l, llm_l);
    match args.device {
        Device::Cpu => models.spawn(&mut services, || Ok(CpuBackend::new()), listeners, &token),
        Device::Cuda => models.spawn(
            &mut services,
            || CudaBackend::open_verified(0),
            listeners,
            &token,
        ),
    }
    let model_name = args
        .model
        .file_name()
        .map_or("model".into(), |n| n.to_string_lossy().into_owned());
    services.spawn(gateway::serve::serve(
        gateway::serve::GatewayConfig {
            model: args.model.clone(),
            model_name: model_name.clone(),
            vision_addrs: vec![vision_addr.to_string()],
            llm_addrs: vec![llm_addr.to_string()],
            max_concurrent: args.max_concurrent,
            limits: RequestLimits::default(),
            default_max_tokens: 256,
            request_timeout: std::time::Duration::from_secs(600),
            embedding_dtype: vlm_proto::pb::Dtype::F32,
            also_metrics: vec![registry],
        },
        grpc_l,
        http_l,
        token.clone(),
    ));
    println!(
        "vlm serving {} ({model_name}) on {}",
        args.model.display(),
        args.device.name()
    );
    println!("  HTTP  http://{http_addr}/v1/chat/completions   (OpenAI-compatible; also /v1/models, /health, /metrics)");
    println!("  gRPC  {grpc_addr}   (vlm.v1.Gateway: Chat, ChatStream; health and reflection)");
    println!("  internal: vision-svc {vision_addr}, llm-svc {llm_addr}");
    println!("ctrl-c to stop");
    let stop = token.clone();
    tokio::spawn(async move {
        vlm_proto::shutdown_signal().await;
        stop.cancel();
    });
    // Any service ending (an error, or the shutdown) stops the others.
    let mut first_error = None;
    while let Some(joined) = services.join_next().await {
        token.cancel();
        if let Err(e) = joined.map_err(anyhow::Error::from).and_then(|r| r) {
            first_error.get_or_insert(e);
        }
    }
    telemetry.shutdown();
    match first_error {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

#[derive(Clone, Copy, ValueEnum)]
enum Device {
    /// The CPU reference path (any machine).
    Cpu,
    /// An NVIDIA GPU through CUDA (kernels compiled at run time by NVRTC, each checked against
    /// the CPU reference on this GPU first).
    Cuda,
}

impl Device {
    fn name(self) -> &'static str {
        match self {
            Device::Cpu => "cpu",
            Device::Cuda => "cuda",
        }
    }
}

#[derive(clap::Args)]
struct RunArgs {
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

fn run(args: RunArgs) -> anyhow::Result<()> {
    match args.device {
        Device::Cpu => run_on(args, CpuBackend::new()),
        Device::Cuda => run_on(args, open_cuda()?),
    }
}

fn run_on<B: Backend + Clone>(args: RunArgs, backend: B) -> anyhow::Result<()> {
    let mut parts = Vec::new();
    for path in &args.images {
        let bytes =
            std::fs::read(path).with_context(|| format!("cannot read image {}", path.display()))?;
        parts.push(Part::Image(bytes));
    }
    parts.push(Part::Text(args.prompt.clone()));
    let mut messages = Vec::new();
    if let Some(system) = &args.system {
        messages.push(Message {
            role: "system".into(),
            parts: vec![Part::Text(system.clone())],
        });
    }
    messages.push(Message::user(parts));
    let request = ChatRequest {
        messages,
        sampling: SamplingParams {
            temperature: args.temperature,
            top_k: args.top_k,
            top_p: args.top_p,
            seed: args.seed,
        },
        max_new_tokens: args.max_new_tokens,
        stop: args.stop.clone(),
        ignore_eos: false,
        return_logits: args.logits_out.is_some(),
    };

    // One request: a cache for one sequence of the longest context asked for.
    let engine = llm_svc::EngineConfig {
        max_context: args.max_context,
        kv_cache: llm_svc::KvCacheSize::Tokens(args.max_context.unwrap_or(32768)),
        ..llm_svc::EngineConfig::default()
    };
    let pipeline = if args.random_weights {
        let weights = vlm_compute::Weights::random(&args.model, args.weights_seed);
        Pipeline::with_weights(&args.model, &weights, backend, engine)
    } else {
        Pipeline::load(&args.model, backend, engine)
    }
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
    let t = &out.timings;
    if args.json {
        let json = serde_json::json!({
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
        });
        writeln!(stdout, "{json}")?;
    } else {
        // Text held back at the end (a partial stop string that never completed).
        writeln!(
            stdout,
            "{}",
            out.text.get(printed.len()..).unwrap_or_default()
        )?;
    }
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
    Ok(())
}

/// Plain logs on stderr for the one-shot commands (`serve` sets up tracing with OpenTelemetry).
fn init_logs(default_level: &str) {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default_level)),
        )
        .with_writer(std::io::stderr)
        .init();
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Run(args) => {
            init_logs("info");
            run(args)
        }
        Command::Serve(args) => tokio::runtime::Runtime::new()
            .map_err(anyhow::Error::from)
            .and_then(|rt| rt.block_on(serve_all(args))),
        Command::Bench(args) => {
            init_logs("warn");
            bench(args)
        }
        Command::Health(args) => tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(anyhow::Error::from)
            .and_then(|rt| rt.block_on(health(args))),
        Command::Doctor(args) => {
            init_logs("warn");
            doctor(args)
        }
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
