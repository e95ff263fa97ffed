//! Running the gateway: the public gRPC API and the OpenAI-style HTTP API over one
//! [`Orchestrator`], with health, graceful shutdown and upstream health checks.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use serde_json::{json, Value};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::HealthCheckRequest;
use vlm_proto::pb::gateway_server::GatewayServer;

use tonic::transport::ClientTlsConfig;
use vlm_proto::image::PreprocessConfig;
use vlm_proto::tls::ServerIdentity;

use crate::auth::{ApiKey, GrpcAuth};
use crate::chat::ChatTokenizer;
use crate::checkpoint::{check_model_dir, ModelIds};
use crate::grpc::GatewayService;
use crate::http::{router, HttpState};
use crate::metrics::Metrics;
use crate::orchestrator::Orchestrator;
use crate::request::RequestLimits;
use crate::routing::RoutingConfig;
use crate::sampling::{GenerationConfig, SamplingDefaults};
use crate::upstream::{upstream_endpoint, Release, Upstreams};

pub struct GatewayConfig {
    /// Checkpoint directory: the gateway reads its tokenizer, chat template and config.json.
    pub model: PathBuf,
    /// Name served in `/v1/models` and responses.
    pub model_name: String,
    pub vision_addrs: Vec<String>,
    pub llm_addrs: Vec<String>,
    /// Requests served at once; more get RESOURCE_EXHAUSTED / 429.
    pub max_concurrent: usize,
    pub limits: RequestLimits,
    pub default_max_tokens: usize,
    /// Longest a request may take (a client's shorter deadline wins).
    pub request_timeout: Duration,
    /// Longest a stream waits for its client to read; then the generation is cancelled.
    pub client_send_timeout: Duration,
    /// How image embeddings travel from vision-svc to llm-svc.
    pub embedding_dtype: vlm_proto::pb::Dtype,
    /// Let embeddings travel through shared memory when vision-svc and llm-svc share this
    /// host's (see `vlm_proto::shm`); off: always inside the gRPC messages.
    pub shared_memory: bool,
    /// Lets go of what a failed request's images left upstream
    /// ([`crate::upstream::ReleaseOnHost`] unless the stages share this process and can free
    /// device handoffs too).
    pub release: Arc<dyn Release>,
    /// Metrics of other services to show on the gateway's `/metrics` (`vlm serve` runs the
    /// model services in its process).
    pub also_metrics: Vec<prometheus::Registry>,
    /// The key `/v1/*` and `vlm.v1.Gateway` require; `None`: open.
    pub api_key: Option<ApiKey>,
    /// HTTPS and gRPC over TLS on the public ports; `None`: plaintext.
    pub tls: Option<ServerIdentity>,
    /// TLS (with a client certificate: mutual TLS) to vision-svc and llm-svc.
    pub upstream_tls: Option<ClientTlsConfig>,
    /// How calls are spread over the replicas ([`crate::routing`]).
    pub routing: RoutingConfig,
    /// Whether the checkpoint's generation_config.json gives the sampling fields a request
    /// leaves out (`--generation-config`).
    pub generation_config: GenerationConfig,
}

/// Longest one upstream replica's health probe (connect and check) may take.
const HEALTH_PROBE_TIMEOUT: Duration = Duration::from_secs(1);

/// Asks each upstream replica's `grpc.health.v1` for its status.
pub struct UpstreamHealth {
    targets: Vec<(String, String)>,
    tls: Option<ClientTlsConfig>,
}

impl UpstreamHealth {
    /// The replicas of both stages.
    pub fn new(vision_addrs: &[String], llm_addrs: &[String]) -> Self {
        let named = |service: &str, addrs: &[String]| {
            addrs
                .iter()
                .map(|a| (service.to_string(), a.clone()))
                .collect::<Vec<_>>()
        };
        let mut targets = named("vision-svc", vision_addrs);
        targets.extend(named("llm-svc", llm_addrs));
        Self { targets, tls: None }
    }

    /// Asks over TLS (the upstreams' own configuration).
    pub fn with_tls(mut self, tls: Option<ClientTlsConfig>) -> Self {
        self.tls = tls;
        self
    }

    /// Whether every upstream service has at least one SERVING replica (requests can be
    /// served), and a per-replica report.
    pub async fn check(&self) -> (bool, Value) {
        let mut serving: std::collections::BTreeMap<&str, bool> = std::collections::BTreeMap::new();
        let mut report = Vec::new();
        for (service, addr) in &self.targets {
            let probe = async {
                let ep = upstream_endpoint(addr, self.tls.as_ref())
                    .map_err(|e| format!("bad address: {e:#}"))?;
                let ch = ep.connect().await.map_err(|_| "unreachable".to_string())?;
                let r = HealthClient::new(ch)
                    .check(HealthCheckRequest {
                        service: String::new(),
                    })
                    .await
                    .map_err(|s| format!("error: {}", s.message()))?;
                Ok::<_, String>(
                    ServingStatus::try_from(r.into_inner().status)
                        .map(|s| s.as_str_name().to_string())
                        .unwrap_or_default(),
                )
            };
            // The whole probe is bounded: an upstream that accepts connections and never
            // answers must not hang `/health` or the readiness loop.
            let status = match tokio::time::timeout(HEALTH_PROBE_TIMEOUT, probe).await {
                Ok(Ok(s) | Err(s)) => s,
                Err(_) => format!("no answer within {HEALTH_PROBE_TIMEOUT:?}"),
            };
            *serving.entry(service.as_str()).or_default() |= status == "SERVING";
            report.push(json!({"service": service, "addr": addr, "status": status}));
        }
        (serving.values().all(|&s| s), Value::Array(report))
    }
}

/// How often the gateway's gRPC readiness re-asks the upstreams.
const UPSTREAM_POLL: Duration = Duration::from_secs(2);

/// Keeps grpc.health.v1's status for `service` (the gateway's own name) equal to what `/health`
/// says: SERVING while each stage has a SERVING replica. That is readiness for gRPC load
/// balancers and probes; the server-wide status ("") stays liveness, SERVING while the process
/// is up (what the compose health check and the Kubernetes liveness probe ask).
fn follow_upstreams(
    service: &'static str,
    reporter: tonic_health::server::HealthReporter,
    upstreams: Arc<UpstreamHealth>,
    stop: CancellationToken,
) {
    tokio::spawn(async move {
        loop {
            let (ready, _) = upstreams.check().await;
            // The shutdown marks everything NOT_SERVING; never mark it back.
            if stop.is_cancelled() {
                break;
            }
            let status = if ready {
                tonic_health::ServingStatus::Serving
            } else {
                tonic_health::ServingStatus::NotServing
            };
            reporter.set_service_status(service, status).await;
            tokio::select! {
                _ = stop.cancelled() => break,
                _ = tokio::time::sleep(UPSTREAM_POLL) => {}
            }
        }
    });
}

/// Serves the gateway until `shutdown` is cancelled, then drains both APIs.
pub async fn serve(
    cfg: GatewayConfig,
    grpc: TcpListener,
    http: TcpListener,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    let orchestrator = Arc::new(orchestrator(&cfg)?);
    // Each replica's health, asked every quarter second: the failing ones are ejected.
    orchestrator.llm.watch_health(shutdown.clone());
    if let Some(vision) = &orchestrator.vision {
        vision.watch_health(shutdown.clone());
    }
    // A text-only model's gateway asks no vision-svc, and its health waits on none.
    let vision_addrs: &[String] = match &orchestrator.vision {
        Some(_) => &cfg.vision_addrs,
        None => &[],
    };
    let health = Arc::new(
        UpstreamHealth::new(vision_addrs, &cfg.llm_addrs).with_tls(cfg.upstream_tls.clone()),
    );
    let http_state = HttpState {
        orchestrator: orchestrator.clone(),
        model_name: cfg.model_name.clone(),
        default_max_tokens: cfg.default_max_tokens,
        request_timeout: cfg.request_timeout,
        health: health.clone(),
    };
    let scheme = if cfg.tls.is_some() {
        "TLS"
    } else {
        "plaintext"
    };
    tracing::info!(grpc = %grpc.local_addr()?, http = %http.local_addr()?, vision = ?cfg.vision_addrs, llm = ?cfg.llm_addrs, scheme, api_key = cfg.api_key.is_some(), "gateway listening");

    let app = router(http_state, cfg.api_key.clone());
    let http_task = spawn_http(http, app, cfg.tls.as_ref(), shutdown.clone())?;
    let (reporter, grpc_router) = vlm_proto::grpc_server(
        cfg.tls.as_ref().map(|id| id.grpc_config(None)),
        vlm_proto::Audience::Public,
    )
    .await?;
    let svc = GatewayServer::new(GatewayService {
        orchestrator,
        default_max_tokens: cfg.default_max_tokens,
        request_timeout: cfg.request_timeout,
    })
    .max_decoding_message_size(cfg.limits.max_body_bytes)
    .max_encoding_message_size(vlm_proto::MAX_MESSAGE_BYTES);
    // The key guards the Gateway service only: health and reflection stay open.
    let svc = tonic::service::interceptor::InterceptedService::new(svc, GrpcAuth(cfg.api_key));
    let name = <GatewayServer<GatewayService> as tonic::server::NamedService>::NAME;
    follow_upstreams(name, reporter.clone(), health, shutdown.clone());
    let grpc_stop = shutdown.clone();
    let grpc_result = vlm_proto::run_service(
        grpc_router.add_service(svc),
        grpc,
        reporter,
        name,
        async { Ok(()) },
        async move { grpc_stop.cancelled().await },
    )
    .await;
    shutdown.cancel();
    http_task.await??;
    grpc_result
}

/// The orchestrator `cfg` describes: the checkpoint's tokenizer, chat template and sampling
/// defaults, the upstreams, the limits and how embeddings travel.
/// The vision-svc replicas, for a checkpoint that takes images; a text-only one needs none (and
/// any given are not asked).
fn vision_upstreams(cfg: &GatewayConfig, takes_images: bool) -> anyhow::Result<Option<Upstreams>> {
    if !takes_images {
        if !cfg.vision_addrs.is_empty() {
            tracing::info!(vision = ?cfg.vision_addrs, "the model is text-only: no vision-svc is used, and requests with images get 400");
        }
        return Ok(None);
    }
    Ok(Some(Upstreams::with_routing(
        "vision-svc",
        &cfg.vision_addrs,
        cfg.upstream_tls.as_ref(),
        cfg.routing.clone(),
    )?))
}

fn orchestrator(cfg: &GatewayConfig) -> anyhow::Result<Orchestrator> {
    check_model_dir(&cfg.model)?;
    let ids = ModelIds::read(&cfg.model)?;
    let chat = ChatTokenizer::from_dir(&cfg.model, ids.image_token_id)?;
    let sampling_defaults = SamplingDefaults::load(&cfg.model, cfg.generation_config)?;
    if !sampling_defaults.is_empty() {
        // As vLLM says it: a request that names no temperature is not greedy here.
        tracing::info!(defaults = ?sampling_defaults, "sampling fields a request leaves out take the checkpoint's generation_config.json values (--generation-config none: greedy)");
    }
    let mut metrics = Metrics::new();
    for r in &cfg.also_metrics {
        metrics.also_show(r.clone());
    }
    let mut orchestrator = Orchestrator::new(
        chat,
        vision_upstreams(cfg, ids.image_token_id.is_some())?,
        Upstreams::with_routing(
            "llm-svc",
            &cfg.llm_addrs,
            cfg.upstream_tls.as_ref(),
            cfg.routing.clone(),
        )?,
        cfg.limits.clone(),
        cfg.max_concurrent,
        metrics,
    );
    orchestrator.embedding_dtype = cfg.embedding_dtype;
    orchestrator.shared_memory = cfg.shared_memory;
    orchestrator.release = cfg.release.clone();
    orchestrator.image_settings = match PreprocessConfig::from_dir(&cfg.model) {
        Ok(settings) => Some(settings),
        Err(e) => {
            tracing::warn!(error = %e, "prompts wait for the image embeddings to count image tokens");
            None
        }
    };
    orchestrator.client_send_timeout = cfg.client_send_timeout;
    orchestrator.sampling_defaults = sampling_defaults;
    orchestrator.vocab_size = Some(ids.vocab_size);
    Ok(orchestrator)
}

/// Serves the HTTP API on `http` (HTTPS with `tls`) on a task of its own until `stop` is
/// cancelled; then, as axum::serve does, it stops accepting and lets in-flight requests finish.
fn spawn_http(
    http: TcpListener,
    app: axum::Router,
    tls: Option<&ServerIdentity>,
    stop: CancellationToken,
) -> anyhow::Result<tokio::task::JoinHandle<std::io::Result<()>>> {
    Ok(match tls {
        None => tokio::spawn(async move {
            use axum::serve::ListenerExt;
            // No Nagle delay on small SSE chunks (see vlm_proto::run_service).
            let http = http.tap_io(|tcp| {
                let _ = tcp.set_nodelay(true);
            });
            axum::serve(http, app)
                .with_graceful_shutdown(async move { stop.cancelled().await })
                .await
        }),
        Some(identity) => {
            let tls = axum_server::tls_rustls::RustlsAcceptor::new(
                axum_server::tls_rustls::RustlsConfig::from_config(identity.rustls_config()),
            )
            .handshake_timeout(vlm_proto::tls::HANDSHAKE_TIMEOUT)
            .acceptor(axum_server::accept::NoDelayAcceptor::new());
            let handle = axum_server::Handle::new();
            let server = axum_server::from_tcp(http.into_std()?)?
                .acceptor(tls)
                .handle(handle.clone());
            tokio::spawn(async move {
                tokio::spawn(async move {
                    stop.cancelled().await;
                    // Like axum::serve's: stop accepting, let in-flight requests finish.
                    handle.graceful_shutdown(None);
                });
                server.serve(app.into_make_service()).await
            })
        }
    })
}
