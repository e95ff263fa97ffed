//! The VisionService gRPC server: `Encode(image bytes) -> embeddings + DeepStack + grid`.
//!
//! The model loads in the background while health reports NOT_SERVING. Each request decodes
//! and preprocesses its image on a blocking thread, then queues it for the encoder loop
//! (batcher.rs), which runs the ViT over every queued image together, up to
//! `max_batch_patches` patches per pass. At most `max_concurrent` images are in the service
//! at once (preprocessing, queued or encoding); more fail fast with RESOURCE_EXHAUSTED rather
//! than queue without bound. An image whose header is bad or over the limits gets
//! INVALID_ARGUMENT before it takes a place. An image sent before comes back from the
//! embedding cache (cache.rs) without taking a place or a ViT pass. A request whose client has
//! gone leaves the queue before its pass. Every failure is an [`Error`], which becomes a status
//! in one place.

use std::future::Future;
use std::ops::ControlFlow;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::{Arc, OnceLock};

use tokio::sync::Semaphore;
use tonic::{Request, Response, Status};
use tracing::{field::Empty, info_span, Instrument};
use vlm_compute::{handoff, Backend, Embeddings, OnDevice, Weights};
use vlm_proto::pb::vision_service_server::{VisionService, VisionServiceServer};
use vlm_proto::pb::{Dtype, EncodeRequest, EncodeResponse};
use vlm_proto::{shm, telemetry, tensor};

use crate::batcher::Batcher;
use crate::cache::{self, EmbeddingCache};
use crate::metrics::VisionMetrics;
use crate::{preprocess, Delivery, Error, VisionEncoder, VisionOutput};

/// Default of [`ServeConfig::max_batch_patches`]: a 1344×1344 image (84×84 = 7056 patches)
/// fits alone, and so do ten 448×448 ones (784 each). A pass of this many rows already
/// gives the ViT's GEMMs thousands of rows, enough to keep a GPU's tensor cores busy; a larger
/// pass would add latency to every image in it (and activation memory, ~64 KB per row at 8B
/// sizes) for little more throughput.
pub const DEFAULT_MAX_BATCH_PATCHES: usize = 8192;

pub struct ServeConfig {
    pub model: PathBuf,
    /// Random weights of the model's config from this seed instead of its checkpoint (for
    /// benchmarks and smoke tests of sizes whose weights are not at hand).
    pub random_weights: Option<u64>,
    /// Images in the service at once (preprocessing, queued or encoding); further requests
    /// get RESOURCE_EXHAUSTED.
    pub max_concurrent: usize,
    /// Most patches in one ViT pass over several images; an image with more runs alone.
    pub max_batch_patches: usize,
    /// Where the service's metrics are registered (its own, or one `vlm serve` shares).
    pub registry: prometheus::Registry,
    /// TLS (or mutual TLS) on the gRPC port; `None`: plaintext.
    pub tls: Option<tonic::transport::ServerTlsConfig>,
    /// Bytes of packed embeddings kept for images sent again (0: no cache); see
    /// [`cache::DEFAULT_BUDGET_BYTES`].
    pub embedding_cache_bytes: usize,
    /// Give the device memory the allocator cached back once the encoder has been idle for
    /// [`IDLE_TRIM_AFTER`]: true for a vision-svc process of its own; false where an llm-svc
    /// engine shares the process (`vlm serve`), since the device's memory pool is the whole
    /// process's and the engine trims it when it idles (a trim while it runs would make its
    /// next steps map memory afresh).
    pub trim_idle_memory: bool,
}

/// How long the encoder waits for an image before it gives cached device memory back (with
/// [`ServeConfig::trim_idle_memory`]): long enough that a steady stream of images never trims
/// between passes; what a trim gives back then costs the next pass's first allocations.
pub const IDLE_TRIM_AFTER: std::time::Duration = std::time::Duration::from_secs(1);

pub struct VisionServer<B: Backend> {
    loaded: Arc<OnceLock<LoadedEncoder<B>>>,
    permits: Arc<Semaphore>,
    max_concurrent: usize,
    metrics: VisionMetrics,
    cache: Arc<EmbeddingCache>,
    /// The shared memory this process sees ([`shm::domain`]); `None`: none to use.
    shm_domain: Option<String>,
}

/// What the handlers use once the model is loaded: its preprocessing settings, and the
/// encoder loop that runs its ViT.
struct LoadedEncoder<B: Backend> {
    encoder: Arc<VisionEncoder<B>>,
    batcher: Batcher,
    /// This process and device ([`handoff::domain`]): an llm-svc that names it takes the
    /// embeddings on the device.
    device_domain: String,
}

impl<B: Backend> LoadedEncoder<B> {
    fn new(encoder: Arc<VisionEncoder<B>>, batcher: Batcher) -> Self {
        let device_domain = handoff::domain(std::any::type_name::<B>());
        Self {
            encoder,
            batcher,
            device_domain,
        }
    }
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
            cache = Empty,
            path = Empty,
            tokens = Empty
        );
        telemetry::adopt_remote_parent(&span, request.metadata());
        let mut guard = ImageGuard::new(&self.metrics);
        let req = request.into_inner();
        // The reader (llm-svc) sees the shared memory this process does.
        let shared =
            !req.shm_domain.is_empty() && self.shm_domain.as_ref() == Some(&req.shm_domain);
        let result = async {
            let (response, source) = self.encode_image(req).await?;
            if response.device_handle != 0 {
                tracing::Span::current().record("path", "device");
                self.metrics
                    .embedding_bytes
                    .with_label_values(&["device"])
                    .inc_by(response.payload_bytes() as u64);
                return Ok((response, source));
            }
            Ok((self.deliver(response, shared).await?, source))
        }
        .instrument(span)
        .await;
        guard.outcome = match &result {
            Ok((_, Source::Cache)) => "cached",
            Ok((_, Source::Encoder)) => "ok",
            Err(e) if e.is_invalid_input() => "invalid",
            Err(Error::Overloaded { .. }) => "overloaded",
            Err(_) => "error",
        };
        result.map(|(r, _)| Response::new(r)).map_err(Status::from)
    }
}

impl<B: Backend> VisionServer<B> {
    /// The response as sent: its tensors' bytes inside it, or, when the reader `shared` this
    /// host's shared memory, written once into a segment it names (the bytes inside it if the
    /// segment cannot be written).
    async fn deliver(
        &self,
        response: EncodeResponse,
        shared: bool,
    ) -> Result<EncodeResponse, Error> {
        let bytes = response.payload_bytes();
        let parent = tracing::Span::current();
        let (path, response) = if shared {
            tokio::task::spawn_blocking(move || {
                let _span = info_span!(parent: &parent, "shm_write", bytes).entered();
                match to_shared(&response) {
                    Ok(shared) => ("shm", shared),
                    Err(e) => {
                        tracing::warn!(error = %e, "cannot write the embeddings to shared memory; sending them in the response");
                        ("grpc", response)
                    }
                }
            })
            .await
            .map_err(|e| Error::Encoder(format!("writing the embeddings failed: {e}")))?
        } else {
            ("grpc", response)
        };
        tracing::Span::current().record("path", path);
        self.metrics
            .embedding_bytes
            .with_label_values(&[path])
            .inc_by(bytes as u64);
        Ok(response)
    }

    /// An image's embeddings: from the cache, or decoded, preprocessed and run through the ViT
    /// (batched with others), then packed for the wire and cached; or, for an llm-svc in this
    /// process on this device, kept on the device and deposited for it ([`handoff`]), a copy
    /// downloaded for the cache after the answer.
    async fn encode_image(&self, req: EncodeRequest) -> Result<(EncodeResponse, Source), Error> {
        let Some(loaded) = self.loaded.get() else {
            return Err(Error::Loading);
        };
        let span = tracing::Span::current();
        // A bad or oversized image is refused before it takes a place: the header alone
        // says so, and reading it costs next to nothing.
        preprocess::check_header(&req.image, &loaded.encoder.limits)?;
        let dtype = Dtype::try_from(req.dtype).unwrap_or(Dtype::F32);
        let on_device = req.device_domain == loaded.device_domain;
        // Looked up before a place is taken: a hit costs no device work, so it is never
        // refused as overloaded.
        let key = match self.look_up(loaded, &req, dtype, on_device, &span).await? {
            ControlFlow::Break(hit) => return Ok((hit, Source::Cache)),
            ControlFlow::Continue(key) => key,
        };
        let overloaded = Error::Overloaded {
            limit: self.max_concurrent,
        };
        let permit = self.permits.clone().try_acquire_owned();
        let permit = permit.map_err(|_| overloaded)?;
        let encoder = loaded.encoder.clone();
        let parent = span.clone();
        // The permit goes along: an image still being decoded for a client that has
        // gone keeps its place until the decoding ends.
        let (patches, permit) = tokio::task::spawn_blocking(move || {
            info_span!(parent: &parent, "preprocess")
                .in_scope(|| {
                    preprocess::preprocess(&req.image, &encoder.preprocess, &encoder.limits)
                })
                .map(|patches| (patches, permit))
        })
        .await
        .map_err(|e| Error::Encoder(format!("image preprocessing failed: {e}")))??;
        let delivery = match &key {
            Some(key) if on_device => Delivery::Device {
                identity: key.to_vec(),
            },
            _ => Delivery::Host,
        };
        let out = loaded
            .batcher
            .encode(patches, delivery, permit, span.clone())
            .await?;
        span.record("tokens", out.embeds.shape()[0]);
        tracing::info!(tokens = out.embeds.shape()[0], grid = ?out.grid_thw, "image encoded");
        if !out.embeds.on_host() {
            let response = deposit(&out);
            if let Some(key) = key.filter(|_| self.cache.enabled()) {
                self.cache_later(loaded, out, key, dtype);
            }
            return Ok((response, Source::Encoder));
        }
        let response = pack(out, dtype, &span).await?;
        if let Some(key) = key.filter(|_| self.cache.enabled()) {
            self.cache.insert(key, &response);
        }
        Ok((response, Source::Encoder))
    }

    /// Looks the request's image up in the embedding cache, where the cache is on or the
    /// answer stays on the device: the key is also the identity of embeddings kept on the
    /// device (llm-svc's prefix cache cannot hash bytes it never sees). A hit is the answer
    /// (`Break`): for an llm-svc in this process on this device, uploaded once and handed
    /// over. Otherwise `Continue` carries the key, where one was made.
    async fn look_up(
        &self,
        loaded: &LoadedEncoder<B>,
        req: &EncodeRequest,
        dtype: Dtype,
        on_device: bool,
        span: &tracing::Span,
    ) -> Result<ControlFlow<EncodeResponse, Option<cache::CacheKey>>, Error> {
        if self.cache.enabled() || on_device {
            let (image, settings) = (req.image.clone(), loaded.encoder.preprocess.clone());
            let key = tokio::task::spawn_blocking(move || cache::key(&image, dtype, &settings))
                .await
                .map_err(|e| Error::Encoder(format!("hashing the image failed: {e}")))?;
            if let Some(hit) = self.cache.enabled().then(|| self.cache.get(&key)).flatten() {
                span.record("cache", "hit");
                if !on_device {
                    return Ok(ControlFlow::Break(hit));
                }
                // Uploaded once here and handed over (a host-to-device copy of f16 rows)
                // rather than written to shared memory and mapped and uploaded there.
                let encoder = loaded.encoder.clone();
                let parent = span.clone();
                let handed = tokio::task::spawn_blocking(move || {
                    let _span = info_span!(parent: &parent, "upload_cached").entered();
                    hand_off_cached(encoder.model.backend(), &hit, &key)
                })
                .await
                .map_err(|e| Error::Encoder(format!("handing over cached embeddings: {e}")))??;
                return Ok(ControlFlow::Break(deposit(&handed)));
            }
            span.record("cache", if self.cache.enabled() { "miss" } else { "off" });
            Ok(ControlFlow::Continue(Some(key)))
        } else {
            span.record("cache", "off");
            Ok(ControlFlow::Continue(None))
        }
    }

    /// Downloads embeddings kept on the device and caches them as `dtype` on the wire, off the
    /// request's path (its answer has gone already). A failure only costs the cache entry.
    fn cache_later(
        &self,
        loaded: &LoadedEncoder<B>,
        out: VisionOutput,
        key: cache::CacheKey,
        dtype: Dtype,
    ) {
        let (encoder, cache) = (loaded.encoder.clone(), self.cache.clone());
        tokio::task::spawn_blocking(move || {
            let be = encoder.model.backend();
            let download = |e: &Embeddings| be.embeddings_to_host(e);
            let host = (|| -> Result<EncodeResponse, Error> {
                let host = VisionOutput {
                    embeds: download(&out.embeds)?,
                    deepstack: out
                        .deepstack
                        .iter()
                        .map(download)
                        .collect::<vlm_compute::Result<_>>()?,
                    grid_thw: out.grid_thw,
                };
                to_wire(&host, dtype)
            })();
            match host {
                Ok(response) => cache.insert(key, &response),
                Err(e) => tracing::warn!(error = %e, "embeddings kept on the device not cached"),
            }
        });
    }
}

/// A cached encoding (host bytes) uploaded to `be`'s device and handed over there, as a
/// fresh encoding for an llm-svc in this process would be.
fn hand_off_cached<B: Backend>(
    be: &B,
    cached: &EncodeResponse,
    key: &cache::CacheKey,
) -> Result<VisionOutput, Error> {
    let hand_off = |t: Option<&vlm_proto::pb::Tensor>| -> Result<Embeddings, Error> {
        let t = t.ok_or_else(|| Error::Encoder("a cached encoding without embeddings".into()))?;
        let host = match tensor::f16_bytes(t).map_err(Error::Encoder)? {
            Some((shape, bytes)) => {
                Embeddings::F16(vlm_compute::HalfTensor::from_bytes(shape, bytes)?)
            }
            None => {
                let (shape, data) = tensor::decode(t).map_err(Error::Encoder)?;
                Embeddings::F32(vlm_compute::HostTensor::new(shape, data)?)
            }
        };
        Ok(be.hand_off(be.upload_embeddings(&host)?, key.to_vec())?)
    };
    let mut grid = [0usize; 3];
    for (g, &v) in grid.iter_mut().zip(&cached.grid_thw) {
        *g = v as usize;
    }
    Ok(VisionOutput {
        embeds: hand_off(cached.embeddings.as_ref())?,
        deepstack: cached
            .deepstack
            .iter()
            .map(|t| hand_off(Some(t)))
            .collect::<Result<_, _>>()?,
        grid_thw: grid,
    })
}

/// Embeddings on the host packed for the wire as `dtype`: f16 from a GPU to an f16 wire is
/// the bytes as downloaded; anything else is one conversion pass per tensor, off the
/// runtime's threads (a large image's embeddings are tens of megabytes).
async fn pack(
    out: VisionOutput,
    dtype: Dtype,
    span: &tracing::Span,
) -> Result<EncodeResponse, Error> {
    let parent = span.clone();
    tokio::task::spawn_blocking(move || {
        let _pack = info_span!(parent: &parent, "pack", dtype = ?dtype).entered();
        to_wire(&out, dtype)
    })
    .await
    .map_err(|e| Error::Encoder(format!("packing the embeddings failed: {e}")))?
}

/// Deposits an image's embeddings kept on the device ([`handoff`]) and returns the response
/// that names them: shapes and the handle, no bytes.
fn deposit(out: &VisionOutput) -> EncodeResponse {
    let shape_only = |e: &Embeddings| vlm_proto::pb::Tensor {
        dtype: Dtype::F32 as i32,
        shape: e.shape().iter().map(|&d| d as u64).collect(),
        ..Default::default()
    };
    let tensors: Vec<Embeddings> = std::iter::once(&out.embeds)
        .chain(&out.deepstack)
        .cloned()
        .collect();
    EncodeResponse {
        embeddings: Some(shape_only(&out.embeds)),
        deepstack: out.deepstack.iter().map(shape_only).collect(),
        grid_thw: out.grid_thw.iter().map(|&v| v as u32).collect(),
        shm_segment: String::new(),
        device_handle: handoff::deposit(tensors),
    }
}

/// An image's embeddings as the wire carries them, in `dtype` (unspecified: f32). f16
/// embeddings sent as f16 are passed on as they are; every other pair is converted. The
/// embeddings must be on the host.
pub fn to_wire(out: &VisionOutput, dtype: Dtype) -> Result<EncodeResponse, Error> {
    let pack = |e: &Embeddings| -> Result<vlm_proto::pb::Tensor, Error> {
        Ok(match (e, dtype) {
            (Embeddings::F16(h), Dtype::F16) => {
                tensor::from_f16_bytes(h.shape(), h.bytes().clone())
            }
            (e, dtype) => {
                let t = e.to_f32()?;
                tensor::encode(t.shape(), t.data(), dtype)
            }
        })
    };
    Ok(EncodeResponse {
        embeddings: Some(pack(&out.embeds)?),
        deepstack: out.deepstack.iter().map(pack).collect::<Result<_, _>>()?,
        grid_thw: out.grid_thw.iter().map(|&v| v as u32).collect(),
        ..Default::default()
    })
}

/// `response` with its tensors' bytes moved into a new shared-memory segment.
fn to_shared(response: &EncodeResponse) -> std::io::Result<EncodeResponse> {
    let parts: Vec<&[u8]> = response.tensors().map(|t| &t.data[..]).collect();
    let (name, offsets) = shm::write(&parts)?;
    let mut out = response.clone();
    for (t, offset) in out.tensors_mut().zip(offsets) {
        t.data = Default::default();
        t.shm_offset = Some(offset);
    }
    out.shm_segment = name;
    Ok(out)
}

/// Where an image's embeddings came from.
enum Source {
    Cache,
    Encoder,
}

/// [`serve`] as work for a [`vlm_compute::Device`], which picks the backend:
/// `device.run(Serve { cfg, listener, shutdown }).await`.
pub struct Serve<S> {
    pub cfg: ServeConfig,
    pub listener: tokio::net::TcpListener,
    pub shutdown: S,
}

impl<S: Future<Output = ()> + 'static> OnDevice for Serve<S> {
    type Output = Pin<Box<dyn Future<Output = anyhow::Result<()>>>>;
    fn run<B: Backend + Clone>(self, open: fn() -> vlm_compute::Result<B>) -> Self::Output {
        Box::pin(serve(self.cfg, open, self.listener, self.shutdown))
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
    let loaded = Arc::new(OnceLock::new());
    let metrics = VisionMetrics::new(&cfg.registry);
    let server = VisionServer {
        loaded: loaded.clone(),
        permits: Arc::new(Semaphore::new(cfg.max_concurrent.max(1))),
        max_concurrent: cfg.max_concurrent.max(1),
        metrics: metrics.clone(),
        cache: Arc::new(EmbeddingCache::new(
            cfg.embedding_cache_bytes,
            &cfg.registry,
        )),
        shm_domain: shm::domain(),
    };
    // Segments and device handoffs a gateway never passed on (it died between the calls),
    // and the segments of this service's earlier runs, are removed.
    let shared_memory = server.shm_domain.is_some();
    let sweeper = tokio::spawn(async move {
        loop {
            if shared_memory {
                let _ = tokio::task::spawn_blocking(|| shm::sweep(shm::SEGMENT_TTL)).await;
            }
            handoff::sweep(handoff::TTL);
            tokio::time::sleep(shm::SEGMENT_TTL / 4).await;
        }
    });
    let (health, router) =
        vlm_proto::grpc_server(cfg.tls.clone(), vlm_proto::Audience::Internal).await?;
    let svc = VisionServiceServer::new(server)
        .max_decoding_message_size(vlm_proto::MAX_MESSAGE_BYTES)
        .max_encoding_message_size(vlm_proto::MAX_MESSAGE_BYTES);
    let router = router.add_service(svc);
    tracing::info!(addr = %listener.local_addr()?, model = %cfg.model.display(), "vision-svc listening");
    let (model, random_weights) = (cfg.model.clone(), cfg.random_weights);
    let max_batch_patches = cfg.max_batch_patches;
    let idle_trim = cfg.trim_idle_memory.then_some(IDLE_TRIM_AFTER);
    let what = format!("the vision model from {}", cfg.model.display());
    let load = vlm_proto::load_model(loaded, what, move || -> anyhow::Result<_> {
        let weights = Weights::open_or_random(&model, random_weights)?;
        let encoder = Arc::new(VisionEncoder::load(&model, &weights, backend()?)?);
        weights.finish();
        let batcher = Batcher::start(encoder.clone(), max_batch_patches, idle_trim, metrics)
            .map_err(|e| anyhow::anyhow!("cannot start the vision encoder thread: {e}"))?;
        Ok(LoadedEncoder::new(encoder, batcher))
    });
    let name = <VisionServiceServer<VisionServer<B>> as tonic::server::NamedService>::NAME;
    let result = vlm_proto::run_service(router, listener, health, name, load, shutdown).await;
    sweeper.abort();
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A loaded server on the tiny fixture with one place and a cache of `cache_bytes`.
    fn server(cache_bytes: usize) -> VisionServer<vlm_compute::CpuBackend> {
        server_trimming(cache_bytes, None)
    }

    /// [`server`] whose encoder trims the device's memory after `idle_trim` without images.
    fn server_trimming(
        cache_bytes: usize,
        idle_trim: Option<std::time::Duration>,
    ) -> VisionServer<vlm_compute::CpuBackend> {
        let dir = vlm_compute::golden::tiny_fixture(env!("CARGO_MANIFEST_DIR"));
        let weights = Weights::open(&dir).unwrap();
        let encoder =
            Arc::new(VisionEncoder::load(&dir, &weights, vlm_compute::CpuBackend::new()).unwrap());
        let registry = prometheus::Registry::new();
        let metrics = VisionMetrics::new(&registry);
        let batcher = Batcher::start(
            encoder.clone(),
            DEFAULT_MAX_BATCH_PATCHES,
            idle_trim,
            metrics.clone(),
        )
        .unwrap();
        let loaded = Arc::new(OnceLock::new());
        let _ = loaded.set(LoadedEncoder::new(encoder, batcher));
        VisionServer {
            loaded,
            permits: Arc::new(Semaphore::new(1)),
            max_concurrent: 1,
            metrics,
            cache: Arc::new(EmbeddingCache::new(cache_bytes, &registry)),
            shm_domain: shm::domain(),
        }
    }

    #[tokio::test]
    async fn a_bad_image_gets_invalid_argument_even_when_every_place_is_taken() {
        let server = server(0);
        let encode = |image: Vec<u8>| server.encode(request(&image, Dtype::F32));
        let png = png(40, 3);
        // A JPEG frame header declaring 60000x60000: the header alone refuses it.
        let mut bomb = Vec::new();
        image::RgbImage::from_pixel(16, 16, image::Rgb([1, 2, 3]))
            .write_to(
                &mut std::io::Cursor::new(&mut bomb),
                image::ImageFormat::Jpeg,
            )
            .unwrap();
        let sof = bomb.windows(2).position(|w| w == [0xFF, 0xC0]).unwrap();
        bomb[sof + 5..sof + 9].copy_from_slice(&[0xEA, 0x60, 0xEA, 0x60]);

        let full = server.permits.clone().try_acquire_owned().unwrap();
        for (what, image) in [("garbage", b"not an image".to_vec()), ("bomb", bomb)] {
            let s = encode(image).await.unwrap_err();
            assert_eq!(s.code(), tonic::Code::InvalidArgument, "{what}: {s:?}");
        }
        let s = encode(png.clone()).await.unwrap_err();
        assert_eq!(s.code(), tonic::Code::ResourceExhausted, "{s:?}");
        assert!(s.message().contains("limit of 1 images"), "{s:?}");
        drop(full);
        let out = encode(png).await.unwrap().into_inner();
        assert!(out.embeddings.is_some());
    }

    /// An encoder that has idled past its trim (the CPU's pool has nothing to give back, so
    /// this checks the loop: it trims once, waits on, and serves the next image as before).
    #[tokio::test]
    async fn the_encoder_serves_on_after_trimming_while_idle() {
        let server = server_trimming(0, Some(std::time::Duration::from_millis(5)));
        let image = png(40, 4);
        let first = server.encode(request(&image, Dtype::F32)).await.unwrap();
        for _ in 0..2 {
            tokio::time::sleep(std::time::Duration::from_millis(30)).await;
            let again = server.encode(request(&image, Dtype::F32)).await.unwrap();
            assert_eq!(again.into_inner(), first.get_ref().clone());
        }
    }

    /// An Encode request for `image`, embeddings as `dtype`, in the message.
    fn request(image: &[u8], dtype: Dtype) -> Request<EncodeRequest> {
        Request::new(EncodeRequest {
            image: image.to_vec().into(),
            dtype: dtype as i32,
            ..Default::default()
        })
    }

    /// A `side` x `side` PNG, a gradient tinted by `shade`.
    fn png(side: u32, shade: u8) -> Vec<u8> {
        let mut png = Vec::new();
        image::RgbImage::from_fn(side, side, |x, y| image::Rgb([x as u8, y as u8, shade]))
            .write_to(&mut std::io::Cursor::new(&mut png), image::ImageFormat::Png)
            .unwrap();
        png
    }

    /// A repeated image comes from the cache: the same bytes as a fresh encode, no place
    /// taken (a hit is served even when every place is), and counted.
    #[tokio::test]
    async fn a_repeated_image_comes_from_the_cache_as_a_fresh_encode_gives_it() {
        let (cached, fresh) = (server(1 << 30), server(0));
        let (a, b) = (png(40, 1), png(40, 2));
        for dtype in [Dtype::F16, Dtype::F32] {
            let first = cached
                .encode(request(&a, dtype))
                .await
                .unwrap()
                .into_inner();
            let full = cached.permits.clone().try_acquire_owned().unwrap();
            let again = cached
                .encode(request(&a, dtype))
                .await
                .unwrap()
                .into_inner();
            drop(full);
            let want = fresh.encode(request(&a, dtype)).await.unwrap().into_inner();
            assert_eq!(
                again, want,
                "{dtype:?}: the cached answer is a fresh encode's"
            );
            assert_eq!(first, want, "{dtype:?}");
            assert_eq!(want.embeddings.as_ref().unwrap().dtype, dtype as i32);
            // Another image is not the cached one.
            let other = cached
                .encode(request(&b, dtype))
                .await
                .unwrap()
                .into_inner();
            assert_ne!(other.embeddings, want.embeddings);
        }
        let outcome = |o: &str| cached.metrics.images.with_label_values(&[o]).get();
        assert_eq!((outcome("ok"), outcome("cached")), (4, 2));
        assert_eq!(cached.cache.hits(), 2);
        assert_eq!(fresh.cache.hits(), 0);
    }
}
