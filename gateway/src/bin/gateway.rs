//! `gateway`: the public face of the system. Speaks gRPC (vlm.v1.Gateway) and OpenAI-style
//! HTTP to clients, and chains the vision and LLM services behind it.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;
use gateway::serve::{serve, GatewayConfig};
use tokio_util::sync::CancellationToken;

#[derive(Parser)]
#[command(
    name = "gateway",
    version,
    about = "Qwen3-VL gateway: gRPC (vlm.v1.Gateway) and OpenAI-compatible HTTP in front of vision-svc and llm-svc",
    long_about = "Qwen3-VL gateway: gRPC (vlm.v1.Gateway) and OpenAI-compatible HTTP \
        (POST /v1/chat/completions, GET /v1/models, /health, /metrics) in front of vision-svc and llm-svc.\n\n\
        It tokenizes with the model's own chat template, sends images to the vision service (concurrently), \
        streams tokens from the LLM service, and carries one trace per request across all three \
        (W3C traceparent in gRPC metadata). Upstreams may be lists (comma-separated): calls rotate over \
        the replicas and skip one that is unavailable.\n\
        Access: with --api-key (or VLM_API_KEY, or --api-key-file) /v1/* and vlm.v1.Gateway need \
        `Authorization: Bearer <key>` (401 / UNAUTHENTICATED otherwise); /health, /metrics, grpc.health.v1 \
        and reflection stay open. --tls-cert/--tls-key serve HTTPS and gRPC over TLS on the public ports; \
        --upstream-tls-* speak TLS, or mutual TLS, to the services.\n\
        Image URLs: data: always; http(s):// fetched by the gateway unless --no-media-fetch, only from \
        hosts whose addresses are public (--allow-private-media-addresses lifts that; \
        --allowed-media-domains narrows it), at most --max-image-bytes, 3 redirects each checked again, \
        cached by URL; file:// only under --allowed-local-media-path.\n\
        Traces go to OTEL_EXPORTER_OTLP_ENDPOINT when set; logs to stderr (RUST_LOG, default info; \
        --log-format json for collectors)."
)]
struct Args {
    /// Address of the public gRPC API.
    #[arg(long, env = "VLM_GRPC_LISTEN", default_value = "127.0.0.1:50050")]
    grpc_listen: SocketAddr,
    /// Address of the OpenAI-compatible HTTP API.
    #[arg(long, env = "VLM_HTTP_LISTEN", default_value = "127.0.0.1:8080")]
    http_listen: SocketAddr,
    /// Checkpoint directory: the gateway reads tokenizer.json, the chat template and config.json.
    #[arg(long, env = "VLM_MODEL")]
    model: PathBuf,
    /// Model name in /v1/models and responses (default: the directory's name).
    #[arg(long, env = "VLM_MODEL_NAME")]
    model_name: Option<String>,
    /// vision-svc address(es), host:port, comma-separated. Each replica's health is asked
    /// every 250 ms (one that fails is ejected until it answers); a DNS name is a replica per
    /// address it resolves to (--resolve-interval-secs).
    #[arg(
        long,
        env = "VLM_VISION_ADDRS",
        value_delimiter = ',',
        default_value = "127.0.0.1:50051"
    )]
    vision_addr: Vec<String>,
    /// llm-svc address(es), host:port, comma-separated; health and DNS names as for
    /// --vision-addr. A request whose replica fails before its first token is retried once on
    /// another.
    #[arg(
        long,
        env = "VLM_LLM_ADDRS",
        value_delimiter = ',',
        default_value = "127.0.0.1:50052"
    )]
    llm_addr: Vec<String>,
    /// Requests served at once; more get RESOURCE_EXHAUSTED (HTTP 429).
    #[arg(long, env = "VLM_MAX_CONCURRENT", default_value_t = 256)]
    max_concurrent: usize,
    #[command(flatten)]
    limits: gateway::request::RequestLimitArgs,
    /// Tokens generated when a request does not say.
    #[arg(long, env = "VLM_DEFAULT_MAX_TOKENS", default_value_t = 256)]
    default_max_tokens: usize,
    /// Longest a request may take, in seconds (a client's shorter grpc-timeout wins).
    #[arg(long, env = "VLM_REQUEST_TIMEOUT_SECS", default_value_t = 600)]
    request_timeout_secs: u64,
    /// Longest a streamed response waits for its client to read the next chunk, in seconds;
    /// a client that reads nothing for this long has its generation cancelled.
    #[arg(long, env = "VLM_CLIENT_SEND_TIMEOUT_SECS", default_value_t = gateway::orchestrator::DEFAULT_CLIENT_SEND_TIMEOUT.as_secs_f64())]
    client_send_timeout_secs: f64,
    /// How image embeddings travel between the services: f32 (exact), or f16/bf16 (half the bytes).
    #[arg(long, env = "VLM_EMBEDDING_DTYPE", default_value = "f32", value_parser = ["f32", "f16", "bf16"])]
    embedding_dtype: String,
    /// Always send embeddings inside the gRPC messages. By default they go through shared
    /// memory (/dev/shm) once vision-svc and llm-svc turn out to share it (one host, or
    /// containers sharing their IPC namespace), which saves copying them through the gateway.
    #[arg(long, env = "VLM_NO_SHARED_MEMORY")]
    no_shared_memory: bool,
    /// Where the sampling fields a request leaves out (temperature, top_k, top_p, min_p, the
    /// penalties) come from: auto, the checkpoint's generation_config.json for each key it
    /// has ("do_sample": false: greedy), as vLLM; none, greedy with every control off.
    #[arg(
        long,
        env = "VLM_GENERATION_CONFIG",
        value_enum,
        default_value = "auto"
    )]
    generation_config: gateway::sampling::GenerationConfig,
    #[command(flatten)]
    routing: gateway::routing::RoutingArgs,
    #[command(flatten)]
    access: gateway::auth::AccessArgs,
    #[command(flatten)]
    upstream_tls: gateway::auth::UpstreamTlsArgs,
    #[command(flatten)]
    log: vlm_proto::telemetry::LogArgs,
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    vlm_proto::exit_code(run(Args::parse()).await)
}

async fn run(args: Args) -> anyhow::Result<()> {
    let telemetry = vlm_proto::telemetry::init("gateway", args.log.log_format);
    // Every key and certificate file is read now, so a bad one stops the start with its name.
    let api_key = args.access.api_key()?;
    let tls = args.access.tls()?;
    let upstream_tls = args.upstream_tls.client_config()?;
    let grpc = tokio::net::TcpListener::bind(args.grpc_listen).await?;
    let http = tokio::net::TcpListener::bind(args.http_listen).await?;
    let model_name = args.model_name.unwrap_or_else(|| {
        args.model
            .file_name()
            .map_or("model".into(), |n| n.to_string_lossy().into_owned())
    });
    let cfg = GatewayConfig {
        also_metrics: Vec::new(),
        release: std::sync::Arc::new(gateway::upstream::ReleaseOnHost),
        model: args.model,
        model_name,
        vision_addrs: args.vision_addr,
        llm_addrs: args.llm_addr,
        routing: args.routing.config()?,
        max_concurrent: args.max_concurrent,
        limits: args.limits.limits()?,
        default_max_tokens: args.default_max_tokens,
        request_timeout: Duration::from_secs(args.request_timeout_secs),
        client_send_timeout: Duration::try_from_secs_f64(args.client_send_timeout_secs)
            .ok()
            .filter(|t| !t.is_zero())
            .ok_or_else(|| {
                anyhow::anyhow!(
                    "--client-send-timeout-secs must be a positive number of seconds, got {}",
                    args.client_send_timeout_secs
                )
            })?,
        embedding_dtype: match args.embedding_dtype.as_str() {
            "f16" => vlm_proto::pb::Dtype::F16,
            "bf16" => vlm_proto::pb::Dtype::Bf16,
            _ => vlm_proto::pb::Dtype::F32,
        },
        shared_memory: !args.no_shared_memory,
        api_key,
        tls,
        upstream_tls,
        generation_config: args.generation_config,
    };
    let token = CancellationToken::new();
    let stop = token.clone();
    tokio::spawn(async move {
        vlm_proto::shutdown_signal().await;
        stop.cancel();
    });
    let result = serve(cfg, grpc, http, token).await;
    telemetry.shutdown();
    result
}
