//! `vision-svc`: the VisionService gRPC server (image bytes in, image embeddings out).

use std::net::SocketAddr;
use std::path::PathBuf;

use clap::Parser;
use vision_svc::server::{Serve, ServeConfig};

#[derive(Parser)]
#[command(
    name = "vision-svc",
    version,
    about = "Qwen3-VL vision service: encodes images into embeddings for the LLM service, over gRPC (vlm.v1.VisionService)",
    long_about = "Qwen3-VL vision service: encodes images into embeddings for the LLM service, over gRPC \
        (vlm.v1.VisionService, plus grpc.health.v1 and reflection).\n\n\
        Images are batched: each request's image is decoded and preprocessed on its own thread, then queued; \
        one encoder loop runs the ViT over every queued image in one pass (up to --max-batch-patches patches, \
        attention within each image), so concurrent requests share the device's work.\n\n\
        Health is NOT_SERVING until the model is loaded. SIGTERM or ctrl-c drain in-flight requests, then exit 0.\n\
        Listens on loopback unless --listen says otherwise; --tls-cert/--tls-key serve TLS, and \
        --tls-client-ca admits only clients (the gateway) whose certificate that CA signed (mutual TLS).\n\
        Traces go to OTEL_EXPORTER_OTLP_ENDPOINT when set; logs to stderr (RUST_LOG, default info; \
        --log-format json for collectors); Prometheus metrics at --metrics-listen."
)]
struct Args {
    /// Address to listen on.
    #[arg(long, env = "VLM_VISION_LISTEN", default_value = "127.0.0.1:50051")]
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
    /// Images in the service at once (being preprocessed, queued or encoded); more get
    /// RESOURCE_EXHAUSTED at once. Images queued while a pass runs are encoded together in the
    /// next, so a higher limit gives fuller passes.
    #[arg(long, env = "VLM_VISION_MAX_CONCURRENT", default_value_t = 64)]
    max_concurrent: usize,
    /// Most patches in one ViT pass over several images (Qwen3-VL: one patch per 16x16 pixels);
    /// an image with more runs alone. The default holds one 1344x1344 image (7056 patches) or
    /// ten 448x448 ones.
    #[arg(long, env = "VLM_VISION_MAX_BATCH_PATCHES", default_value_t = vision_svc::server::DEFAULT_MAX_BATCH_PATCHES)]
    max_batch_patches: usize,
    /// Bytes of image embeddings kept for images sent again (a chat's history resends its
    /// images): a repeated image skips decoding and the ViT. Least recently used go first;
    /// 0 turns the cache off. Hits, misses and bytes held are in the metrics.
    #[arg(long, env = "VLM_EMBEDDING_CACHE_BYTES", default_value_t = vision_svc::cache::DEFAULT_BUDGET_BYTES)]
    embedding_cache_bytes: usize,
    /// Serve Prometheus metrics (images by outcome, in flight, encode time, images per pass,
    /// embedding cache) at http://ADDR/metrics.
    #[arg(long, env = "VLM_VISION_METRICS_LISTEN")]
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
        "vision-svc",
        args.log,
        &args.tls,
        args.listen,
        args.metrics_listen,
        |start| {
            let cfg = ServeConfig {
                model: args.model,
                random_weights: args.random_weights.then_some(0),
                max_concurrent: args.max_concurrent,
                max_batch_patches: args.max_batch_patches,
                registry: start.registry,
                tls: start.tls,
                embedding_cache_bytes: args.embedding_cache_bytes,
                // Alone in its process: its idle loop gives cached memory back.
                trim_idle_memory: true,
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
