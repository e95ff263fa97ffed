//! The whole system in one process: vision-svc, llm-svc and the gateway started on loopback
//! with one shutdown token; or several vision-svc and llm-svc replicas, one pair per device
//! (`vlm serve --gpus 0,1`, `--replicas N` on the CPU), with the gateway routing over them by
//! cache ([`LocalStack::start_replicas`]). `vlm serve` runs it until ctrl-c; the benchmarks (`vlm bench`'s
//! through-the-gateway row, `vlm load`) start it, wait until it serves, send their requests
//! through the public ports and stop it.
//!
//! The model services listen on loopback ports the kernel picks; the public gRPC and HTTP
//! ports are the configured ones (port 0: any). Every listener is bound before anything is
//! spawned, so the addresses are known, and connectable, as soon as [`LocalStack::start`]
//! returns; requests get UNAVAILABLE / 503 until the models are loaded ([`LocalStack::ready`]).

use std::net::{Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::Context;
use tokio::net::TcpListener;
use tokio::task::{Id, JoinSet};
use tokio_util::sync::CancellationToken;

use gateway::request::RequestLimits;
use gateway::serve::{GatewayConfig, UpstreamHealth};
use gateway::upstream::{Release, ReleaseOnHost};
use vlm_proto::pb;

/// What a failed request's images left upstream, let go of in a process that holds both
/// stages: the shared-memory segment as any gateway does, and the device handoff
/// (`vlm_compute::handoff`), whose device memory is freed now instead of at the deposit's expiry.
pub struct ReleaseInProcess;

impl Release for ReleaseInProcess {
    fn release(&self, image: &pb::ImageEmbeddings) {
        ReleaseOnHost.release(image);
        if image.device_handle != 0 {
            drop(vlm_compute::handoff::take::<Vec<vlm_compute::Embeddings>>(
                image.device_handle,
            ));
        }
    }
}

/// Replica `i`'s metrics registry: of `replicas` > 1, every series labelled `replica="i"`, so the
/// gateway's /metrics shows each llm-svc apart (and sums over them read as one).
fn replica_registry(i: usize, replicas: usize) -> anyhow::Result<prometheus::Registry> {
    if replicas == 1 {
        return Ok(prometheus::Registry::new());
    }
    let labels = std::collections::HashMap::from([("replica".to_string(), i.to_string())]);
    Ok(prometheus::Registry::new_custom(None, Some(labels))?)
}

/// What to start, and how.
#[derive(Clone, Debug)]
pub struct StackConfig {
    /// Checkpoint directory (with `random_weights`, only its config, tokenizer and template
    /// are read).
    pub model: PathBuf,
    /// Random weights from this seed instead of the checkpoint's.
    pub random_weights: Option<u64>,
    /// `--quantize` and `--quantize-lm-head`: matrices quantized at load.
    pub weights: llm_svc::WeightArgs,
    /// Name served in `/v1/models` and responses.
    pub model_name: String,
    /// Where the public gRPC API (vlm.v1.Gateway) listens; port 0 for any free port.
    pub grpc_addr: SocketAddr,
    /// Where the OpenAI-compatible HTTP API listens; port 0 for any free port.
    pub http_addr: SocketAddr,
    /// Requests served at once by the gateway and held by llm-svc (running or queued); more
    /// get RESOURCE_EXHAUSTED / 429.
    pub max_concurrent: usize,
    /// Images encoded at once by vision-svc.
    pub vision_max_concurrent: usize,
    /// Bytes of embeddings vision-svc keeps for images sent again (0: no cache).
    pub embedding_cache_bytes: usize,
    pub engine: llm_svc::EngineConfig,
    /// How image embeddings travel from vision-svc to llm-svc.
    pub embedding_dtype: vlm_proto::pb::Dtype,
    /// Embeddings through shared memory between the services (they share this process's).
    pub shared_memory: bool,
    /// Embeddings kept on the device from vision-svc to llm-svc (both in this process:
    /// `vlm_compute::handoff`), where no bytes move at all; ahead of shared memory.
    pub device_handoff: bool,
    /// `max_tokens` of a request that does not say.
    pub default_max_tokens: usize,
    /// Longest a request may take.
    pub request_timeout: Duration,
    /// The gateway's request limits and image-URL rules (`--max-image-bytes`,
    /// `--allowed-media-domains`, ...).
    pub limits: RequestLimits,
    /// The key the public APIs require; `None`: open.
    pub api_key: Option<gateway::auth::ApiKey>,
    /// HTTPS and gRPC over TLS on the public ports.
    pub tls: Option<vlm_proto::tls::ServerIdentity>,
    /// Whether the checkpoint's generation_config.json gives the sampling fields a request
    /// leaves out.
    pub generation_config: gateway::sampling::GenerationConfig,
    /// Instead of llm-svc, a stand-in that hands each request a token every this long, with
    /// no model ([`crate::stand_in`]), and no vision-svc (text requests only): what the
    /// gateway and the hops cost, measured without the models.
    pub stand_in_llm: Option<Duration>,
    /// How the gateway picks among several replicas (`--routing`, `--route-*`).
    pub routing: gateway::routing::RoutingConfig,
}

impl StackConfig {
    /// `vlm serve`'s settings for `model`, with every port picked by the kernel on loopback.
    pub fn loopback(model: PathBuf) -> Self {
        let any_port = SocketAddr::from((Ipv4Addr::LOCALHOST, 0));
        let model_name = model
            .file_name()
            .map_or("model".into(), |n| n.to_string_lossy().into_owned());
        Self {
            model,
            random_weights: None,
            weights: Default::default(),
            model_name,
            grpc_addr: any_port,
            http_addr: any_port,
            max_concurrent: 256,
            vision_max_concurrent: 8,
            embedding_cache_bytes: vision_svc::cache::DEFAULT_BUDGET_BYTES,
            engine: llm_svc::EngineConfig::default(),
            embedding_dtype: vlm_proto::pb::Dtype::F32,
            shared_memory: true,
            device_handoff: true,
            default_max_tokens: 256,
            request_timeout: Duration::from_secs(600),
            limits: RequestLimits::default(),
            api_key: None,
            tls: None,
            generation_config: Default::default(),
            stand_in_llm: None,
            routing: Default::default(),
        }
    }
}

/// vision-svc, llm-svc and the gateway running in this process.
pub struct LocalStack {
    /// The first replica's vision-svc and llm-svc.
    pub vision_addr: SocketAddr,
    pub llm_addr: SocketAddr,
    /// Every replica's, in device order.
    pub vision_addrs: Vec<SocketAddr>,
    pub llm_addrs: Vec<SocketAddr>,
    pub grpc_addr: SocketAddr,
    pub http_addr: SocketAddr,
    stop: CancellationToken,
    services: JoinSet<anyhow::Result<()>>,
    /// Which service each task is, for the message when one ends.
    names: Vec<(Id, String)>,
    /// A service's failure that [`LocalStack::ready`] already reported: the other services may
    /// be stopped before they fail themselves, so [`LocalStack::wait`] returns this one too.
    failed_while_starting: Option<String>,
    /// Whether a vision-svc runs: not beside a stand-in llm-svc ([`StackConfig::stand_in_llm`])
    /// or for a text-only checkpoint.
    runs_vision: bool,
}

impl LocalStack {
    /// Binds every listener and spawns the three services on the current tokio runtime, each
    /// model service on a backend that `open` opens while it loads. Returns at once; the
    /// models load in the background (see [`LocalStack::ready`]).
    pub async fn start<B: vlm_compute::Backend + Clone>(
        cfg: StackConfig,
        open: fn() -> vlm_compute::Result<B>,
    ) -> anyhow::Result<Self> {
        Self::start_replicas(cfg, vec![open]).await
    }

    /// [`LocalStack::start`] with one vision-svc and one llm-svc per entry of `opens` (each
    /// opening its own device: GPU N, or the CPU again), the gateway routing over them all.
    /// Each llm-svc's metrics carry a `replica` label (0, 1, ...) when there are several, and
    /// its KV events, if on, go to the endpoint's port plus its index (vLLM's rule for
    /// data-parallel ranks).
    pub async fn start_replicas<B: vlm_compute::Backend + Clone>(
        cfg: StackConfig,
        opens: Vec<fn() -> vlm_compute::Result<B>>,
    ) -> anyhow::Result<Self> {
        anyhow::ensure!(
            !opens.is_empty(),
            "a local stack needs at least one replica"
        );
        let internal = || TcpListener::bind((Ipv4Addr::LOCALHOST, 0));
        let (mut visions, mut llms) = (Vec::new(), Vec::new());
        for _ in &opens {
            visions.push(
                internal()
                    .await
                    .context("cannot listen on a loopback port for vision-svc")?,
            );
            llms.push(
                internal()
                    .await
                    .context("cannot listen on a loopback port for llm-svc")?,
            );
        }
        let grpc = TcpListener::bind(cfg.grpc_addr)
            .await
            .with_context(|| format!("cannot listen on {} for the gRPC API", cfg.grpc_addr))?;
        let http = TcpListener::bind(cfg.http_addr)
            .await
            .with_context(|| format!("cannot listen on {} for the HTTP API", cfg.http_addr))?;
        let vision_addrs = visions
            .iter()
            .map(TcpListener::local_addr)
            .collect::<std::io::Result<Vec<_>>>()?;
        let llm_addrs = llms
            .iter()
            .map(TcpListener::local_addr)
            .collect::<std::io::Result<Vec<_>>>()?;
        let mut stack = Self {
            vision_addr: vision_addrs[0],
            llm_addr: llm_addrs[0],
            vision_addrs,
            llm_addrs,
            grpc_addr: grpc.local_addr()?,
            http_addr: http.local_addr()?,
            stop: CancellationToken::new(),
            services: JoinSet::new(),
            names: Vec::new(),
            failed_while_starting: None,
            runs_vision: false,
        };
        // The model services and the gateway show their metrics on the gateway's /metrics.
        let replicas = opens.len();
        let mut registries = Vec::new();
        // A text-only checkpoint gets no vision-svc (the gateway refuses its images); nor does a
        // stand-in llm-svc.
        let takes_images = cfg.stand_in_llm.is_none()
            && gateway::checkpoint::ModelIds::read(&cfg.model)?
                .image_token_id
                .is_some();
        stack.runs_vision = takes_images;
        for (i, ((open, vision), llm)) in opens.into_iter().zip(visions).zip(llms).enumerate() {
            let registry = replica_registry(i, replicas)?;
            registries.push(registry.clone());
            let name = |service: &str| {
                if replicas == 1 {
                    service.to_string()
                } else {
                    format!("{service} {i}")
                }
            };
            if let Some(step) = cfg.stand_in_llm {
                let model = cfg.model.clone();
                let stop = stack.stop.clone();
                stack.spawn(name("llm-svc (stand-in)"), async move {
                    crate::stand_in::serve(&model, step, llm, stop.cancelled_owned()).await
                });
                // Nothing answers there: image requests fail, text ones never ask.
                continue;
            }
            if takes_images {
                let vision_task = vision_svc::server::serve(
                    vision_svc::server::ServeConfig {
                        model: cfg.model.clone(),
                        random_weights: cfg.random_weights,
                        max_concurrent: cfg.vision_max_concurrent,
                        max_batch_patches: vision_svc::server::DEFAULT_MAX_BATCH_PATCHES,
                        registry: registry.clone(),
                        tls: None,
                        embedding_cache_bytes: cfg.embedding_cache_bytes,
                        // The engine beside it trims the process's device pool when it idles.
                        trim_idle_memory: false,
                    },
                    open,
                    vision,
                    stack.stop.clone().cancelled_owned(),
                );
                stack.spawn(name("vision-svc"), vision_task);
            }
            let mut engine = cfg.engine.clone();
            engine.kv_events = engine.kv_events.map(|k| k.for_replica(i));
            let llm_task = llm_svc::server::serve(
                llm_svc::server::ServeConfig {
                    model: cfg.model.clone(),
                    random_weights: cfg.random_weights,
                    weights: cfg.weights,
                    max_concurrent: cfg.max_concurrent,
                    engine,
                    registry,
                    tls: None,
                    device_handoff: cfg.device_handoff,
                },
                open,
                llm,
                stack.stop.clone().cancelled_owned(),
            );
            stack.spawn(name("llm-svc"), llm_task);
        }
        let gateway_task = gateway::serve::serve(
            GatewayConfig {
                model: cfg.model.clone(),
                model_name: cfg.model_name.clone(),
                vision_addrs: stack.vision_addrs.iter().map(|a| a.to_string()).collect(),
                llm_addrs: stack.llm_addrs.iter().map(|a| a.to_string()).collect(),
                max_concurrent: cfg.max_concurrent,
                limits: cfg.limits.clone(),
                default_max_tokens: cfg.default_max_tokens,
                request_timeout: cfg.request_timeout,
                client_send_timeout: gateway::orchestrator::DEFAULT_CLIENT_SEND_TIMEOUT,
                embedding_dtype: cfg.embedding_dtype,
                shared_memory: cfg.shared_memory,
                release: std::sync::Arc::new(ReleaseInProcess),
                also_metrics: registries,
                api_key: cfg.api_key.clone(),
                tls: cfg.tls.clone(),
                // The model services are this process's own, on loopback.
                upstream_tls: None,
                generation_config: cfg.generation_config,
                routing: cfg.routing.clone(),
            },
            grpc,
            http,
            stack.stop.clone(),
        );
        stack.spawn("gateway".into(), gateway_task);
        Ok(stack)
    }

    fn spawn(
        &mut self,
        name: String,
        task: impl std::future::Future<Output = anyhow::Result<()>> + Send + 'static,
    ) {
        let id = self.services.spawn(task).id();
        self.names.push((id, name));
    }

    fn name_of(&self, id: Id) -> String {
        self.names
            .iter()
            .find(|(i, _)| *i == id)
            .map_or("a service".into(), |(_, n)| n.clone())
    }

    /// Waits until every model service (the stand-ins alone, with them) says SERVING (their models are loaded), at most
    /// `timeout`. A service that ends meanwhile (a missing checkpoint, a failed GPU self-check,
    /// a cache that does not fit) fails this with its name and its error.
    pub async fn ready(&mut self, timeout: Duration) -> anyhow::Result<()> {
        let addrs = |a: &[SocketAddr]| a.iter().map(|a| a.to_string()).collect::<Vec<_>>();
        let vision = if self.runs_vision {
            addrs(&self.vision_addrs)
        } else {
            Vec::new()
        };
        let health = UpstreamHealth::new(&vision, &addrs(&self.llm_addrs));
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(ended) = self.services.try_join_next_with_id() {
                let (name, why) = match ended {
                    Ok((id, Ok(()))) => (self.name_of(id), "it stopped".to_string()),
                    Ok((id, Err(e))) => (self.name_of(id), format!("{e:#}")),
                    Err(e) => (self.name_of(e.id()), format!("its task failed: {e}")),
                };
                self.stop.cancel();
                let failure = format!("{name} ended while the local stack was starting: {why}");
                self.failed_while_starting = Some(failure.clone());
                anyhow::bail!(failure);
            }
            if health.check().await.0 {
                if self.llm_addrs.len() > 1 {
                    // The gateway ejected the replicas that were loading; its own checks (every
                    // 250 ms) admit them again, and until then it would route to the first
                    // one seen SERVING alone.
                    tokio::time::sleep(Duration::from_millis(750)).await;
                }
                return Ok(());
            }
            anyhow::ensure!(
                Instant::now() < deadline,
                "the local stack was not serving within {}s (vision-svc {:?}, llm-svc {:?})",
                timeout.as_secs(),
                self.vision_addrs,
                self.llm_addrs
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Cancelling this token stops the whole stack (e.g. on ctrl-c).
    pub fn shutdown_token(&self) -> CancellationToken {
        self.stop.clone()
    }

    /// Runs until a service ends (an error, or the shutdown token cancelled); then stops the
    /// others, waits for them to drain, and returns the first error.
    pub async fn wait(mut self) -> anyhow::Result<()> {
        let mut first_error = self.failed_while_starting.take().map(anyhow::Error::msg);
        while let Some(joined) = self.services.join_next_with_id().await {
            self.stop.cancel();
            let failed = match joined {
                Ok((_, Ok(()))) => None,
                Ok((id, Err(e))) => Some(e.context(self.name_of(id))),
                Err(e) => Some(anyhow::anyhow!(
                    "{}: its task failed: {e}",
                    self.name_of(e.id())
                )),
            };
            if let Some(e) = failed {
                first_error.get_or_insert(e);
            }
        }
        first_error.map_or(Ok(()), Err)
    }

    /// Stops every service and waits until they have drained.
    pub async fn stop(self) -> anyhow::Result<()> {
        self.stop.cancel();
        self.wait().await
    }
}

impl Drop for LocalStack {
    /// A stack dropped without [`LocalStack::stop`] (an early return) still shuts down: the
    /// token is cancelled and the services' tasks are aborted with the set that holds them.
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_handoff_not_passed_on_is_let_go() {
        use vlm_compute::{handoff, Embeddings};
        let dropped = handoff::deposit(Vec::<Embeddings>::new());
        ReleaseInProcess.release(&pb::ImageEmbeddings {
            device_handle: dropped,
            ..Default::default()
        });
        assert!(
            handoff::take::<Vec<Embeddings>>(dropped).is_none(),
            "let go"
        );
        let kept = handoff::deposit(Vec::<Embeddings>::new());
        assert!(
            handoff::take::<Vec<Embeddings>>(kept).is_some(),
            "still there"
        );
    }
}
