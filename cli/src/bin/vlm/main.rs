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
use vlm_compute::{Backend, Device, OnDevices};

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

/// How many vision-svc + llm-svc replicas the local stack runs, and where (`vlm serve`,
/// `vlm load`).
#[derive(clap::Args, Clone, Debug)]
pub struct ReplicaArgs {
    /// One vision-svc and one llm-svc per GPU named (CUDA ordinals, e.g. 0,1), the gateway
    /// routing over them by cache; instead of --device.
    #[arg(long, value_delimiter = ',', value_name = "N,N,...", conflicts_with_all = ["device", "replicas"])]
    gpus: Vec<u8>,
    /// Replicas of vision-svc and llm-svc on the CPU (each its own KV cache and embedding
    /// cache, sharing the cores), the gateway routing over them: routing tried without GPUs.
    #[arg(long, default_value_t = 1)]
    replicas: usize,
    /// With several replicas: how the gateway picks one for each call.
    #[command(flatten)]
    routing: gateway::routing::RoutingArgs,
}

impl ReplicaArgs {
    /// The device of each replica, given `--device`.
    fn devices(&self, device: Device) -> anyhow::Result<Vec<Device>> {
        if !self.gpus.is_empty() {
            let mut seen = std::collections::HashSet::new();
            return self
                .gpus
                .iter()
                .map(|&n| {
                    anyhow::ensure!(
                        (n as usize) < vlm_compute::MAX_GPUS,
                        "--gpus: GPU {n} is past the last one a flag can name ({})",
                        vlm_compute::MAX_GPUS - 1
                    );
                    anyhow::ensure!(seen.insert(n), "--gpus names GPU {n} twice");
                    Ok(Device::Cuda(n))
                })
                .collect();
        }
        anyhow::ensure!(self.replicas >= 1, "--replicas must be at least 1, got 0");
        anyhow::ensure!(
            self.replicas == 1 || device == Device::Cpu,
            "--replicas runs replicas on the CPU; name GPUs with --gpus (one replica each)"
        );
        Ok(vec![device; self.replicas])
    }

    /// What the replicas run on, for the banner and reports.
    fn name(&self, device: Device) -> String {
        match (self.gpus.as_slice(), self.replicas) {
            ([], 1) => device.name().to_string(),
            ([], n) => format!("{n} replicas on {}", device.name()),
            (gpus, _) => {
                let list: Vec<String> = gpus.iter().map(|n| format!("cuda:{n}")).collect();
                format!("{} GPUs ({})", gpus.len(), list.join(", "))
            }
        }
    }
}

/// vision-svc, llm-svc and the gateway on loopback in this process, one pair of model
/// services per device of `devices` (`vlm serve`, `vlm load`).
async fn start_stack(cfg: StackConfig, devices: &[Device]) -> anyhow::Result<LocalStack> {
    struct Start(StackConfig);
    impl OnDevices for Start {
        type Output = Pin<Box<dyn Future<Output = anyhow::Result<LocalStack>>>>;
        fn run<B: Backend + Clone>(
            self,
            opens: Vec<fn() -> vlm_compute::Result<B>>,
        ) -> Self::Output {
            Box::pin(LocalStack::start_replicas(self.0, opens))
        }
    }
    let start = Device::run_all(devices, Start(cfg))
        .ok_or_else(|| anyhow::anyhow!("the replicas' devices must be all CPU or all GPUs"))?;
    start.await
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
