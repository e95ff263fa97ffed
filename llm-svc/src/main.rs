//! `llm-svc`: the LlmService gRPC server (prompt ids + image embeddings in, tokens streamed out).

use std::net::SocketAddr;
use std::path::PathBuf;

use clap::Parser;
use llm_svc::server::{Serve, ServeConfig};
use llm_svc::{EngineArgs, WeightArgs};

#[derive(Parser)]
#[command(
    name = "llm-svc",
    version,
    about = "Qwen3-VL language service: continuous batching over a paged KV cache, tokens streamed over gRPC (vlm.v1.LlmService)",
    long_about = "Qwen3-VL language service: continuous batching over a paged KV cache, tokens streamed over gRPC \
        (vlm.v1.LlmService, plus grpc.health.v1 and reflection).\n\n\
        --model takes a Qwen3-VL checkpoint, or a text-only Qwen3 (Qwen3ForCausalLM) or Qwen2 / Qwen2.5 \
        (Qwen2ForCausalLM) one, which refuses requests with images (INVALID_ARGUMENT).\n\n\
        One engine loop owns the device: every step it runs the decoding requests together with chunks of \
        waiting prompts (--max-batch-seqs, --max-batch-tokens). The KV cache is a pool of blocks allocated once \
        at start-up (--gpu-memory-utilization or --kv-cache-tokens; the size is logged); prompts that begin like \
        an earlier one reuse its blocks (prefix caching). When blocks run out the youngest request waits and is \
        recomputed later; none is lost.\n\n\
        Health is NOT_SERVING until the model is loaded. A client that drops its stream cancels its generation; \
        grpc-timeout deadlines are enforced per step. SIGTERM or ctrl-c drain in-flight requests, then exit 0.\n\
        Listens on loopback unless --listen says otherwise; --tls-cert/--tls-key serve TLS, and \
        --tls-client-ca admits only clients (the gateway) whose certificate that CA signed (mutual TLS).\n\
        Traces go to OTEL_EXPORTER_OTLP_ENDPOINT when set; logs to stderr (RUST_LOG, default info; \
        --log-format json for collectors); Prometheus metrics at --metrics-listen."
)]
struct Args {
    /// Address to listen on.
    #[arg(long, env = "VLM_LLM_LISTEN", default_value = "127.0.0.1:50052")]
    listen: SocketAddr,
    /// Checkpoint directory (Hugging Face layout).
    #[arg(long, env = "VLM_MODEL")]
    model: PathBuf,
    /// Random weights (seed 0) of the model directory's config instead of its checkpoint: for
    /// benchmarks and smoke tests of sizes whose weights are not at hand. Answers are noise.
    #[arg(long)]
    random_weights: bool,
    /// Where to run the model: cpu, or cuda (GPU 0) / cuda:N (GPU N: one service per GPU on a
    /// host of several); kernels are compiled by NVRTC and checked against the CPU reference on
    /// that GPU before the service reports SERVING.
    #[arg(long, env = "VLM_DEVICE", value_enum, default_value = "cpu")]
    device: vlm_compute::Device,
    /// Requests held at once (running or queued); more get RESOURCE_EXHAUSTED at once.
    #[arg(long, env = "VLM_LLM_MAX_CONCURRENT", default_value_t = 256)]
    max_concurrent: usize,
    /// Cap on prompt + generated tokens per request (default: the model's
    /// max_position_embeddings, and at most what the KV cache holds).
    #[arg(long, env = "VLM_MAX_CONTEXT")]
    max_context: Option<usize>,
    #[command(flatten)]
    engine: EngineArgs,
    #[command(flatten)]
    weights: WeightArgs,
    /// Serve Prometheus metrics (KV blocks in use, sequences running/waiting, prefix-cache
    /// hits, step times) at http://ADDR/metrics.
    #[arg(long, env = "VLM_LLM_METRICS_LISTEN")]
    metrics_listen: Option<SocketAddr>,
    #[command(flatten)]
    tls: vlm_proto::tls::ServiceTlsArgs,
    #[command(flatten)]
    log: vlm_proto::telemetry::LogArgs,
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    vlm_proto::exit_code(run(Args::parse()).await)
}

async fn run(args: Args) -> anyhow::Result<()> {
    vlm_proto::service_main(
        "llm-svc",
        args.log,
        &args.tls,
        args.listen,
        args.metrics_listen,
        |start| {
            let cfg = ServeConfig {
                model: args.model,
                random_weights: args.random_weights.then_some(0),
                weights: args.weights,
                max_concurrent: args.max_concurrent,
                engine: args.engine.config(args.max_context, args.device.is_gpu()),
                registry: start.registry,
                tls: start.tls,
                // Alone in its process: no vision-svc here to hand embeddings over on the device.
                device_handoff: false,
            };
            args.device.run(Serve {
                cfg,
                listener: start.listener,
                shutdown: start.shutdown,
            })
        },
    )
    .await
}
