//! `vlm serve`: vision-svc, llm-svc and the gateway on loopback in this process, with the
//! addresses printed, until ctrl-c or SIGTERM.

use std::path::PathBuf;

use anyhow::Context;
use vlm_compute::{CpuBackend, CudaBackend};

use crate::Device;

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

pub async fn serve(args: ServeArgs) -> anyhow::Result<()> {
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
