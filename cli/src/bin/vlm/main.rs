//! `vlm`: the command line of the Qwen3-VL serving system.
//!
//! This file is the CLI (clap) and the dispatch; each subcommand lives in its own module:
//! [`run`] (one request offline), [`serve`] (the three services on loopback), [`bench`] (the
//! stages against the hardware limits), [`load`] (many clients at once through the gateway),
//! [`health`] (a grpc.health.v1 probe) and [`doctor`] (what `--device cuda` needs).

mod bench;
mod doctor;
mod health;
mod load;
mod run;
mod serve;

use std::process::ExitCode;

use std::future::Future;
use std::pin::Pin;

use clap::{Parser, Subcommand};
use vlm_cli::stack::{LocalStack, StackConfig};
use vlm_compute::{Backend, Device, OnDevice};

#[derive(Parser)]
#[command(
    name = "vlm",
    version,
    about = "Serve and run Qwen3-VL vision-language models",
    long_about = "Serve and run Qwen3-VL vision-language models.\n\n\
        A model is a Hugging Face checkpoint directory: config.json, model*.safetensors, \
        tokenizer.json, a chat template and the image-processor settings.\n\
        Log detail is set with RUST_LOG (e.g. RUST_LOG=debug); --log-format json writes one JSON \
        object per line."
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
    #[command(flatten)]
    log: vlm_proto::telemetry::LogArgs,
}

#[derive(Subcommand)]
enum Command {
    /// Answer one chat request offline: images and a prompt in, generated text out.
    Run(run::RunArgs),
    /// Start vision-svc, llm-svc and the gateway on loopback, in this process, until ctrl-c.
    Serve(serve::ServeArgs),
    /// Measure vision, prefill and decode on this machine against its copy bandwidth and GEMM rate.
    Bench(bench::BenchArgs),
    /// Many streamed chats at once over HTTP and gRPC, at one concurrency after another:
    /// output tokens/s, requests/s, time to first token and inter-token latency per level.
    Load(load::LoadArgs),
    /// Ask a service's grpc.health.v1 whether it is SERVING (exit 0) or not (exit 1); for
    /// container health checks.
    Health(health::HealthArgs),
    /// Check what --device cuda needs here (driver, NVRTC, cuBLAS, headers, kernel cache), compile
    /// the kernels for target GPUs, and run the GPU self-check op by op; exit 0 if all is in order.
    Doctor(doctor::DoctorArgs),
}

/// The commit this binary was built from, for reports ("unknown" when built outside a git
/// checkout; see build.rs).
fn git_commit() -> String {
    env!("VLM_BUILD_COMMIT").to_string()
}

/// vision-svc, llm-svc and the gateway on loopback in this process, on `device`
/// (`vlm serve`, `vlm load`).
async fn start_stack(cfg: StackConfig, device: Device) -> anyhow::Result<LocalStack> {
    struct Start(StackConfig);
    impl OnDevice for Start {
        type Output = Pin<Box<dyn Future<Output = anyhow::Result<LocalStack>>>>;
        fn run<B: Backend + Clone>(self, open: fn() -> vlm_compute::Result<B>) -> Self::Output {
            Box::pin(LocalStack::start(self.0, open))
        }
    }
    device.run(Start(cfg)).await
}

/// Logs on stderr for the one-shot commands (`serve` sets up tracing with OpenTelemetry).
fn init_logs(default_level: &str, format: vlm_proto::telemetry::LogFormat) {
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::util::SubscriberInitExt;
    tracing_subscriber::registry()
        .with(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default_level)),
        )
        .with(vlm_proto::telemetry::log_layer(format))
        .init();
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let format = cli.log.log_format;
    let result = match cli.command {
        Command::Run(args) => {
            init_logs("info", format);
            run::run(args)
        }
        Command::Serve(args) => tokio::runtime::Runtime::new()
            .map_err(anyhow::Error::from)
            .and_then(|rt| rt.block_on(serve::serve(args, format))),
        Command::Bench(args) => {
            init_logs("warn", format);
            bench::bench(args)
        }
        Command::Load(args) => {
            init_logs("warn", format);
            load::load(args)
        }
        Command::Health(args) => tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(anyhow::Error::from)
            .and_then(|rt| rt.block_on(health::health(args))),
        Command::Doctor(args) => {
            init_logs("warn", format);
            doctor::doctor(args)
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
