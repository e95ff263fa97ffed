//! The LlmService gRPC server: `Generate(prompt ids + image embeddings) -> stream of tokens`.
//!
//! Each generation runs on a blocking thread and sends tokens through a small channel; when the
//! client goes away the channel closes, the next send fails, and decoding stops at once. The
//! caller's deadline (`grpc-timeout`) is checked at every token. At most `max_concurrent`
//! generations run; more get RESOURCE_EXHAUSTED at once.

use std::future::Future;
use std::ops::ControlFlow;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::{Arc, OnceLock};
use std::time::Instant;

use tokio::sync::{mpsc, Semaphore};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};
use tracing::{field::Empty, info_span, Instrument};
use vlm_compute::{Backend, HostTensor, Weights};
use vlm_proto::pb::llm_service_server::{LlmService, LlmServiceServer};
use vlm_proto::pb::{self, FinishReason as PbFinish, GenerateResponse, Usage};
use vlm_proto::{telemetry, tensor};

use crate::{Engine, Error, FinishReason, GenerateRequest, ImageInput, SamplingParams};

/// The one place language-stage errors become gRPC statuses.
pub fn to_status(e: &Error) -> Status {
    vlm_proto::error_status(e.is_invalid_input(), e.to_string())
}

pub struct ServeConfig {
    pub model: PathBuf,
    /// Random weights of the model's config from this seed instead of its checkpoint (for
    /// benchmarks and smoke tests of sizes whose weights are not at hand).
    pub random_weights: Option<u64>,
    /// Generations running at the same time; more get RESOURCE_EXHAUSTED.
    pub max_concurrent: usize,
    /// Cap on prompt + generated tokens per sequence (the model's own limit if unset).
    pub max_context: Option<usize>,
}

pub struct LlmServer<B: Backend> {
    engine: Arc<OnceLock<Engine<B>>>,
    permits: Arc<Semaphore>,
}

fn image_from_pb(i: usize, img: &pb::ImageEmbeddings) -> Result<ImageInput, Status> {
    let bad = |m: String| Status::invalid_argument(format!("images[{i}]: {m}"));
    let host = |t: &pb::Tensor| -> Result<HostTensor, Status> {
        let (shape, data) = tensor::decode(t).map_err(bad)?;
        HostTensor::new(shape, data).map_err(|e| bad(e.to_string()))
    };
    let embeds = host(
        img.embeddings
            .as_ref()
            .ok_or_else(|| bad("no embeddings".into()))?,
    )?;
    let [t, h, w] = img.grid_thw[..] else {
        return Err(bad(format!(
            "grid_thw must have 3 entries, got {}",
            img.grid_thw.len()
        )));
    };
    Ok(ImageInput {
        embeds,
        deepstack: img.deepstack.iter().map(host).collect::<Result<_, _>>()?,
        grid_thw: [t as usize, h as usize, w as usize],
    })
}

fn request_from_pb(req: pb::GenerateRequest) -> Result<GenerateRequest, Status> {
    let s = req.sampling.unwrap_or_default();
    Ok(GenerateRequest {
        images: req
            .images
            .iter()
            .enumerate()
            .map(|(i, img)| image_from_pb(i, img))
            .collect::<Result<_, _>>()?,
        prompt: req.prompt_token_ids,
        sampling: SamplingParams {
            temperature: s.temperature,
            top_k: s.top_k as usize,
            top_p: if s.top_p == 0.0 { 1.0 } else { s.top_p },
            seed: s.seed,
        },
        max_new_tokens: req.max_new_tokens as usize,
        ignore_eos: req.ignore_eos,
        return_logits: false,
    })
}

type TokenStream =
    Pin<Box<dyn tokio_stream::Stream<Item = Result<GenerateResponse, Status>> + Send>>;

#[tonic::async_trait]
impl<B: Backend> LlmService for LlmServer<B> {
    type GenerateStream = TokenStream;

    async fn generate(
        &self,
        request: Request<pb::GenerateRequest>,
    ) -> Result<Response<TokenStream>, Status> {
        let span = info_span!(
            "llm.generate",
            otel.kind = "server",
            trace_id = Empty,
            prompt_tokens = request.get_ref().prompt_token_ids.len(),
            images = request.get_ref().images.len(),
            generated_tokens = Empty,
            finish_reason = Empty
        );
        telemetry::adopt_remote_parent(&span, request.metadata());
        let deadline = vlm_proto::grpc_timeout(request.metadata()).map(|d| Instant::now() + d);
        let setup = async {
            if self.engine.get().is_none() {
                return Err(Status::unavailable("the language model is still loading"));
            }
            let permit = self.permits.clone().try_acquire_owned().map_err(|_| {
                Status::resource_exhausted(
                    "the LLM service is at its concurrent-generation limit; retry later",
                )
            })?;
            let req = request_from_pb(request.into_inner())?;
            self.engine
                .get()
                .expect("checked")
                .validate(&req)
                .map_err(|e| to_status(&e))?;
            Ok((permit, req))
        };
        let (permit, req) = setup.instrument(span.clone()).await?;

        let (tx, rx) = mpsc::channel::<Result<GenerateResponse, Status>>(32);
        let engine = self.engine.clone();
        tokio::task::spawn_blocking(move || {
            let _permit = permit;
            let _guard = span.enter();
            let engine = engine.get().expect("checked");
            let mut client_gone = false;
            let mut timed_out = false;
            let result = engine.generate(&req, |ev| {
                if deadline.is_some_and(|d| Instant::now() > d) {
                    timed_out = true;
                    return ControlFlow::Break(());
                }
                let msg = GenerateResponse {
                    token_ids: vec![ev.token],
                    ..Default::default()
                };
                if tx.blocking_send(Ok(msg)).is_err() {
                    client_gone = true;
                    return ControlFlow::Break(());
                }
                ControlFlow::Continue(())
            });
            let last = match result {
                Ok(gen) => {
                    span.record("generated_tokens", gen.tokens.len());
                    if client_gone {
                        tracing::info!(
                            generated = gen.tokens.len(),
                            "client went away; generation cancelled"
                        );
                        return;
                    }
                    if timed_out {
                        tracing::warn!(
                            generated = gen.tokens.len(),
                            "deadline exceeded; generation stopped"
                        );
                        Err(Status::deadline_exceeded(format!(
                            "deadline exceeded after {} generated tokens",
                            gen.tokens.len()
                        )))
                    } else {
                        span.record("finish_reason", gen.finish.as_str());
                        tracing::info!(
                            generated = gen.tokens.len(),
                            prefill_ms = gen.prefill.as_secs_f64() * 1e3,
                            decode_ms = gen.decode.as_secs_f64() * 1e3,
                            "generation finished"
                        );
                        let finish = match gen.finish {
                            FinishReason::Length => PbFinish::Length,
                            FinishReason::Eos | FinishReason::Stopped => PbFinish::Stop,
                        };
                        Ok(GenerateResponse {
                            token_ids: vec![],
                            finish_reason: finish as i32,
                            usage: Some(Usage {
                                prompt_tokens: gen.prompt_tokens as u32,
                                completion_tokens: gen.tokens.len() as u32,
                            }),
                        })
                    }
                }
                Err(e) => {
                    tracing::error!(error = %e, "generation failed");
                    Err(to_status(&e))
                }
            };
            let _ = tx.blocking_send(last);
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }
}

/// Serves LlmService on `listener` until `shutdown`; `backend` opens the device and the model
/// loads on it in the background (health NOT_SERVING meanwhile).
pub async fn serve<B: Backend>(
    cfg: ServeConfig,
    backend: impl FnOnce() -> vlm_compute::Result<B> + Send + 'static,
    listener: tokio::net::TcpListener,
    shutdown: impl Future<Output = ()>,
) -> anyhow::Result<()> {
    let engine = Arc::new(OnceLock::new());
    let server = LlmServer {
        engine: engine.clone(),
        permits: Arc::new(Semaphore::new(cfg.max_concurrent.max(1))),
    };
    let (health, router) = vlm_proto::grpc_server().await;
    let svc = LlmServiceServer::new(server)
        .max_decoding_message_size(vlm_proto::MAX_MESSAGE_BYTES)
        .max_encoding_message_size(vlm_proto::MAX_MESSAGE_BYTES);
    let router = router.add_service(svc);
    tracing::info!(addr = %listener.local_addr()?, model = %cfg.model.display(), "llm-svc listening");
    let (model, random_weights, max_context, max_concurrent) = (
        cfg.model.clone(),
        cfg.random_weights,
        cfg.max_context,
        cfg.max_concurrent,
    );
    let what = format!("the language model from {}", cfg.model.display());
    let load = vlm_proto::load_model(engine, what, move || -> Result<_, Error> {
        let weights = Weights::open_or_random(&model, random_weights)?;
        let e = Engine::load(&model, &weights, backend()?, max_context)?;
        weights.finish();
        // Each request allocates its cache for prompt + max_tokens (up to max_context) when it
        // starts: the worst case is what a memory budget (Jetson's shared pool) must hold.
        let per_token = crate::KvCache::<B>::bytes_per_token(&e.config().text);
        tracing::info!(
            kib_per_token = per_token / 1024,
            max_context = e.max_context(),
            max_concurrent,
            worst_case_gib =
                (per_token * e.max_context() * max_concurrent) as f64 / (1u64 << 30) as f64,
            "KV cache budget (--max-context x --max-concurrent)"
        );
        Ok(e)
    });
    let name = <LlmServiceServer<LlmServer<B>> as tonic::server::NamedService>::NAME;
    vlm_proto::run_service(router, listener, health, name, load, shutdown).await
}
