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
use gateway::stack::{LocalStack, StackConfig};
use vlm_compute::{Backend, Device, OnDevice};

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

/// The checked-out commit, for reports ("unknown" outside a git checkout).
fn git_commit() -> String {
    std::process::Command::new("git")
        .args(["rev-parse", "--short", "HEAD"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map_or("unknown".into(), |o| {
            String::from_utf8_lossy(&o.stdout).trim().to_string()
        })
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
            run::run(args)
        }
        Command::Serve(args) => tokio::runtime::Runtime::new()
            .map_err(anyhow::Error::from)
            .and_then(|rt| rt.block_on(serve::serve(args))),
        Command::Bench(args) => {
            init_logs("warn");
            bench::bench(args)
        }
        Command::Load(args) => {
            init_logs("warn");
            load::load(args)
        }
        Command::Health(args) => tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(anyhow::Error::from)
            .and_then(|rt| rt.block_on(health::health(args))),
        Command::Doctor(args) => {
            init_logs("warn");
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
