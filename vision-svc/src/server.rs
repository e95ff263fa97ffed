//! The VisionService gRPC server: `Encode(image bytes) -> embeddings + DeepStack + grid`.
//!
//! The model loads in the background while health reports NOT_SERVING; image decoding and the
//! ViT run on blocking threads, at most `max_concurrent` at a time (more fail fast with
//! RESOURCE_EXHAUSTED rather than queue without bound).

use std::future::Future;
use std::path::PathBuf;
use std::sync::{Arc, OnceLock};

use tokio::sync::Semaphore;
use tonic::{Request, Response, Status};
use tracing::{field::Empty, info_span, Instrument};
use vlm_compute::{Backend, Weights};
use vlm_proto::pb::vision_service_server::{VisionService, VisionServiceServer};
use vlm_proto::pb::{Dtype, EncodeRequest, EncodeResponse};
use vlm_proto::{telemetry, tensor};

use crate::metrics::VisionMetrics;
use crate::{preprocess, Error, VisionEncoder};

/// The one place vision errors become gRPC statuses.
pub fn to_status(e: &Error) -> Status {
    vlm_proto::error_status(e.is_invalid_input(), e.to_string())
}

pub struct ServeConfig {
    pub model: PathBuf,
    /// Random weights of the model's config from this seed instead of its checkpoint (for
    /// benchmarks and smoke tests of sizes whose weights are not at hand).
    pub random_weights: Option<u64>,
    /// Images encoded at the same time; further requests get RESOURCE_EXHAUSTED.
    pub max_concurrent: usize,
    /// Where the service's metrics are registered (its own, or one `vlm serve` shares).
    pub registry: prometheus::Registry,
}

pub struct VisionServer<B: Backend> {
    encoder: Arc<OnceLock<VisionEncoder<B>>>,
    permits: Arc<Semaphore>,
    max_concurrent: usize,
    metrics: VisionMetrics,
}

/// Counts an image in flight and, however its request ends, its outcome and time.
struct ImageGuard {
    metrics: VisionMetrics,
    started: std::time::Instant,
    outcome: &'static str,
}

impl ImageGuard {
    fn new(metrics: &VisionMetrics) -> Self {
        metrics.in_flight.inc();
        Self {
            metrics: metrics.clone(),
            started: std::time::Instant::now(),
            outcome: "cancelled",
        }
    }
}

impl Drop for ImageGuard {
    fn drop(&mut self) {
        self.metrics.in_flight.dec();
        self.metrics.images.with_label_values(&[self.outcome]).inc();
        if self.outcome == "ok" {
            self.metrics
                .encode_seconds
                .observe(self.started.elapsed().as_secs_f64());
        }
    }
}

#[tonic::async_trait]
impl<B: Backend> VisionService for VisionServer<B> {
    async fn encode(
        &self,
        request: Request<EncodeRequest>,
    ) -> Result<Response<EncodeResponse>, Status> {
        let span = info_span!(
            "vision.encode",
            otel.kind = "server",
            trace_id = Empty,
            image_bytes = request.get_ref().image.len(),
            tokens = Empty
        );
        telemetry::adopt_remote_parent(&span, request.metadata());
        let mut guard = ImageGuard::new(&self.metrics);
        let result = async move {
            let Some(_) = self.encoder.get() else {
                return Err(Status::unavailable("the vision model is still loading"));
            };
            let _permit = self.permits.clone().try_acquire_owned().map_err(|_| {
                Status::resource_exhausted(format!(
                    "the vision service is encoding {} images already; retry later",
                    self.max_concurrent
                ))
            })?;
            let req = request.into_inner();
            let dtype = Dtype::try_from(req.dtype).unwrap_or(Dtype::F32);
            let encoder = self.encoder.clone();
            let parent = tracing::Span::current();
            let out = tokio::task::spawn_blocking(move || {
                let enc = encoder.get().expect("checked above");
                let patches = info_span!(parent: &parent, "preprocess").in_scope(|| {
                    preprocess::preprocess(&req.image, &enc.preprocess, &enc.limits)
                })?;
                info_span!(parent: &parent, "vision_encode", patches = patches.pixels.shape()[0])
                    .in_scope(|| enc.model.forward(&patches))
            })
            .await
            .map_err(|e| Status::internal(format!("vision worker failed: {e}")))?
            .map_err(|e| to_status(&e))?;
            tracing::Span::current().record("tokens", out.embeds.shape()[0]);
            tracing::info!(tokens = out.embeds.shape()[0], grid = ?out.grid_thw, "image encoded");
            let pack = |t: &vlm_compute::HostTensor| tensor::encode(t.shape(), t.data(), dtype);
            Ok(Response::new(EncodeResponse {
                embeddings: Some(pack(&out.embeds)),
                deepstack: out.deepstack.iter().map(pack).collect(),
                grid_thw: out.grid_thw.iter().map(|&v| v as u32).collect(),
            }))
        }
        .instrument(span)
        .await;
        guard.outcome = match &result {
            Ok(_) => "ok",
            Err(s) if s.code() == tonic::Code::InvalidArgument => "invalid",
            Err(s) if s.code() == tonic::Code::ResourceExhausted => "overloaded",
            Err(_) => "error",
        };
        result
    }
}

/// Serves VisionService on `listener` until `shutdown`; `backend` opens the device and the
/// model loads on it in the background (health NOT_SERVING meanwhile).
pub async fn serve<B: Backend>(
    cfg: ServeConfig,
    backend: impl FnOnce() -> vlm_compute::Result<B> + Send + 'static,
    listener: tokio::net::TcpListener,
    shutdown: impl Future<Output = ()>,
) -> anyhow::Result<()> {
    let encoder = Arc::new(OnceLock::new());
    let server = VisionServer {
        encoder: encoder.clone(),
        permits: Arc::new(Semaphore::new(cfg.max_concurrent.max(1))),
        max_concurrent: cfg.max_concurrent.max(1),
        metrics: VisionMetrics::new(&cfg.registry),
    };
    let (health, router) = vlm_proto::grpc_server().await;
    let svc = VisionServiceServer::new(server)
        .max_decoding_message_size(vlm_proto::MAX_MESSAGE_BYTES)
        .max_encoding_message_size(vlm_proto::MAX_MESSAGE_BYTES);
    let router = router.add_service(svc);
    tracing::info!(addr = %listener.local_addr()?, model = %cfg.model.display(), "vision-svc listening");
    let (model, random_weights) = (cfg.model.clone(), cfg.random_weights);
    let what = format!("the vision model from {}", cfg.model.display());
    let load = vlm_proto::load_model(encoder, what, move || -> Result<_, Error> {
        let weights = Weights::open_or_random(&model, random_weights)?;
        let enc = VisionEncoder::load(&model, &weights, backend()?)?;
        weights.finish();
        Ok(enc)
    });
    let name = <VisionServiceServer<VisionServer<B>> as tonic::server::NamedService>::NAME;
    vlm_proto::run_service(router, listener, health, name, load, shutdown).await
}
