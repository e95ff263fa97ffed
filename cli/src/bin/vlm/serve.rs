//! `vlm serve`: vision-svc, llm-svc and the gateway on loopback in this process (a pair of
//! model services per GPU with `--gpus`, or `--replicas N` on the CPU), with the addresses
//! printed, until ctrl-c or SIGTERM.

use std::path::PathBuf;

use anyhow::Context;
use vlm_cli::stack::StackConfig;

use vlm_compute::Device;

use crate::start_stack;

#[derive(clap::Args)]
pub struct ServeArgs {
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
    /// Images held at once by the vision service (preprocessing, queued or encoding; queued
    /// ones are encoded together in one ViT pass); more get RESOURCE_EXHAUSTED / 429.
    #[arg(long, default_value_t = 64)]
    vision_max_concurrent: usize,
    /// Bytes of image embeddings the vision service keeps for images sent again (a chat's
    /// history resends its images): a repeated image skips the ViT. 0 turns it off.
    #[arg(long, default_value_t = vision_svc::cache::DEFAULT_BUDGET_BYTES)]
    embedding_cache_bytes: usize,
    /// Cap on prompt + generated tokens per request (default: the model's own, and at most
    /// what the KV cache holds).
    #[arg(long)]
    max_context: Option<usize>,
    /// Where the sampling fields a request leaves out come from: auto, the checkpoint's
    /// generation_config.json for each key it has, as vLLM; none, greedy.
    #[arg(long, value_enum, default_value = "auto")]
    generation_config: gateway::sampling::GenerationConfig,
    /// Measure the gateway alone: instead of llm-svc, a stand-in without a model that hands
    /// every request a token each MS milliseconds (as a GPU's batched step does, about 10 at
    /// batch 64 on the 8B shapes), and no vision-svc (text chats only).
    #[arg(long, value_name = "MS")]
    stand_in_llm: Option<f64>,
    #[command(flatten)]
    replicas: crate::ReplicaArgs,
    #[command(flatten)]
    engine: llm_svc::EngineArgs,
    #[command(flatten)]
    weights: llm_svc::WeightArgs,
    /// Longest a request may take, in seconds (a client's shorter grpc-timeout wins).
    #[arg(long, env = "VLM_REQUEST_TIMEOUT_SECS", default_value_t = 600)]
    request_timeout_secs: u64,
    #[command(flatten)]
    limits: gateway::request::RequestLimitArgs,
    #[command(flatten)]
    access: gateway::auth::AccessArgs,
}

pub async fn serve(
    args: ServeArgs,
    log_format: vlm_proto::telemetry::LogFormat,
) -> anyhow::Result<()> {
    gateway::checkpoint::check_model_dir(&args.model).with_context(|| {
        "vlm serve needs a model; run it from the repository root or pass --model DIR"
    })?;
    let telemetry = vlm_proto::telemetry::init("vlm", log_format);
    let mut cfg = StackConfig::loopback(args.model.clone());
    cfg.api_key = args.access.api_key()?;
    cfg.tls = args.access.tls()?;
    let (http, tls_note) = if cfg.tls.is_some() {
        ("https", "TLS")
    } else {
        ("http", "plaintext")
    };
    let key_note = if cfg.api_key.is_some() {
        "; /v1/* and vlm.v1.Gateway need the API key"
    } else {
        ""
    };
    cfg.random_weights = args.random_weights.then_some(0);
    cfg.weights = args.weights;
    cfg.grpc_addr = (args.host, args.grpc_port).into();
    cfg.http_addr = (args.host, args.http_port).into();
    cfg.max_concurrent = args.max_concurrent;
    cfg.vision_max_concurrent = args.vision_max_concurrent;
    cfg.embedding_cache_bytes = args.embedding_cache_bytes;
    cfg.generation_config = args.generation_config;
    cfg.limits = args.limits.limits()?;
    cfg.request_timeout = std::time::Duration::from_secs(args.request_timeout_secs);
    let devices = args.replicas.devices(args.device)?;
    cfg.routing = args.replicas.routing.config()?;
    cfg.engine = args.engine.config(args.max_context, devices[0].is_gpu());
    cfg.stand_in_llm = crate::load::stand_in_step(args.stand_in_llm)?;
    let model_name = cfg.model_name.clone();
    let stack = start_stack(cfg, &devices)
        .await
        .context("vlm serve cannot start (its ports: --host, --http-port, --grpc-port)")?;
    println!(
        "vlm serving {} ({model_name}) on {}",
        args.model.display(),
        match args.stand_in_llm {
            Some(ms) => format!("a stand-in llm-svc (a token every {ms} ms, no model, no images)"),
            None => args.replicas.name(args.device),
        }
    );
    println!(
        "  HTTP  {http}://{}/v1/chat/completions   (OpenAI-compatible; also /v1/models, /health, /metrics)",
        stack.http_addr
    );
    println!(
        "  gRPC  {}   ({tls_note}; vlm.v1.Gateway: Chat, ChatStream; health and reflection{key_note})",
        stack.grpc_addr
    );
    let list = |a: &[std::net::SocketAddr]| {
        a.iter()
            .map(|a| a.to_string())
            .collect::<Vec<_>>()
            .join(", ")
    };
    println!(
        "  internal: vision-svc {}, llm-svc {}",
        list(&stack.vision_addrs),
        list(&stack.llm_addrs)
    );
    println!("ctrl-c to stop");
    let stop = stack.shutdown_token();
    tokio::spawn(async move {
        vlm_proto::shutdown_signal().await;
        stop.cancel();
    });
    // Any service ending (an error, or the shutdown) stops the others.
    let result = stack.wait().await;
    telemetry.shutdown();
    result
}
