//! The LlmService gRPC server: `Generate(prompt ids + image embeddings) -> stream of tokens`.
//!
//! Handlers never touch the device: a request is checked, then handed to the [`Engine`] (one
//! loop per device that batches every request it holds), and a small task relays its tokens to
//! the client. When the client goes away the relay stops, drops the engine's stream, and the
//! engine frees the request's cache blocks at its next step. The caller's deadline
//! (`grpc-timeout`) goes to the engine with the request. At most `max_concurrent` requests are
//! in the engine (running or queued); more get RESOURCE_EXHAUSTED at once. A bad request gets
//! INVALID_ARGUMENT before it takes a place. Image embeddings come inside the request, or, on
//! one host, in shared-memory segments that are mapped and unlinked as the request is read
//! (`vlm_proto::shm`); every response names this service's shared-memory domain in its headers.

use std::future::Future;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::{Arc, OnceLock};
use std::time::Instant;

use tokio::sync::{mpsc, Semaphore};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};
use tracing::{field::Empty, info_span, Instrument};
use vlm_compute::{handoff, Backend, Embeddings, HalfTensor, HostTensor, OnDevice};
use vlm_proto::pb::llm_service_server::{LlmService, LlmServiceServer};
use vlm_proto::pb::{self, FinishReason as PbFinish, GenerateResponse, Usage};
use vlm_proto::{headers, shm, telemetry, tensor};

use crate::{
    Engine, EngineConfig, Error, Event, FinishReason, GenerateRequest, ImageInput, TokenLogprob,
};

pub struct ServeConfig {
    pub model: PathBuf,
    /// Random weights of the model's config from this seed instead of its checkpoint (for
    /// benchmarks and smoke tests of sizes whose weights are not at hand).
    pub random_weights: Option<u64>,
    /// `--quantize` and `--quantize-lm-head`: matrices quantized at load.
    pub weights: crate::cli::WeightArgs,
    /// Requests in the engine at once (running or queued); more get RESOURCE_EXHAUSTED.
    pub max_concurrent: usize,
    /// Context, KV cache size, batch limits, prefix caching.
    pub engine: EngineConfig,
    /// Where the engine's metrics are registered (the service's own, or one `vlm serve`
    /// shares between its services).
    pub registry: prometheus::Registry,
    /// TLS (or mutual TLS) on the gRPC port; `None`: plaintext.
    pub tls: Option<tonic::transport::ServerTlsConfig>,
    /// Name this process and device in the `vlm-device-domain` header, so that a vision-svc
    /// in the same process hands its embeddings over on the device (`vlm serve`); a service
    /// alone in its process has no one to take them from.
    pub device_handoff: bool,
}

pub struct LlmServer {
    engine: Arc<OnceLock<Engine>>,
    permits: Arc<Semaphore>,
    max_concurrent: usize,
    /// [`shm::domain`], sent in every response's headers so the gateway can offer the
    /// same-host path; `None`: no shared memory here.
    shm_domain: Option<tonic::metadata::AsciiMetadataValue>,
    /// [`handoff::domain`] of this process and backend, sent the same way when
    /// [`ServeConfig::device_handoff`] is on.
    device_domain: Option<tonic::metadata::AsciiMetadataValue>,
}

fn image_from_pb(
    index: usize,
    mut img: pb::ImageEmbeddings,
    segment: Option<bytes::Bytes>,
) -> Result<ImageInput, Error> {
    let bad = |message: String| Error::BadImage { index, message };
    if let Some(segment) = &segment {
        for t in img.tensors_mut() {
            tensor::attach(t, segment).map_err(bad)?;
        }
    }
    // f16 (what vision-svc sends) stays as the received bytes, or the mapped segment's, until
    // the step that uploads it; other dtypes are widened to f32 here.
    let host = |t: &pb::Tensor| -> Result<Embeddings, Error> {
        match tensor::f16_bytes(t).map_err(bad)? {
            Some((shape, bytes)) => HalfTensor::from_bytes(shape, bytes).map(Embeddings::F16),
            None => {
                let (shape, data) = tensor::decode(t).map_err(bad)?;
                HostTensor::new(shape, data).map(Embeddings::F32)
            }
        }
        .map_err(|e| bad(e.to_string()))
    };
    let [t, h, w] = img.grid_thw[..] else {
        return Err(bad(format!(
            "grid_thw must have 3 entries, got {}",
            img.grid_thw.len()
        )));
    };
    let grid_thw = [t as usize, h as usize, w as usize];
    if img.device_handle != 0 {
        // Kept on the device by vision-svc in this process: the tensors themselves, each
        // with the encoding's identity for the prefix cache.
        let mut tensors = handoff::take::<Vec<Embeddings>>(img.device_handle)
            .filter(|t| !t.is_empty())
            .ok_or_else(|| {
                bad(format!(
                    "no embeddings are held under device handle {:#x} in this process (taken \
                     already, older than {} s, or sent by a vision-svc elsewhere)",
                    img.device_handle,
                    handoff::TTL.as_secs()
                ))
            })?;
        let embeds = tensors.remove(0);
        return Ok(ImageInput {
            embeds,
            deepstack: tensors,
            grid_thw,
        });
    }
    let embeds = host(
        img.embeddings
            .as_ref()
            .ok_or_else(|| bad("no embeddings".into()))?,
    )?;
    Ok(ImageInput {
        embeds,
        deepstack: img.deepstack.iter().map(host).collect::<Result<_, _>>()?,
        grid_thw,
    })
}

/// A generated token's logprobs as the wire carries them.
pub fn logprobs_to_pb(lp: TokenLogprob) -> pb::TokenLogprobs {
    let (top_ids, top_logprobs) = lp.top.into_iter().unzip();
    pb::TokenLogprobs {
        logprob: lp.logprob,
        top_ids,
        top_logprobs,
    }
}

/// A `GenerateRequest` off the wire as the engine takes it (tensors decoded, shared-memory
/// segments mapped and their names removed); the engine's `validate` checks the rest.
pub fn request_from_pb(mut req: pb::GenerateRequest) -> Result<GenerateRequest, Error> {
    let s = req.sampling.unwrap_or_default();
    // Every segment is taken (its name removed) before any image is checked, so a bad
    // image leaves none of the request's segments behind.
    let images = std::mem::take(&mut req.images);
    let segments: Vec<Result<Option<bytes::Bytes>, String>> = images
        .iter()
        .map(|img| {
            (!img.shm_segment.is_empty())
                .then(|| shm::take(&img.shm_segment))
                .transpose()
        })
        .collect();
    Ok(GenerateRequest {
        images: images
            .into_iter()
            .zip(segments)
            .enumerate()
            .map(|(index, (img, segment))| {
                let segment = segment.map_err(|message| Error::BadImage { index, message })?;
                image_from_pb(index, img, segment)
            })
            .collect::<Result<_, _>>()?,
        prompt: req.prompt_token_ids,
        sampling: vlm_proto::sampling::from_pb(s),
        max_new_tokens: req.max_new_tokens as usize,
        ignore_eos: req.ignore_eos,
        return_logits: false,
        constraint: req.constraint,
    })
}

type TokenStream =
    Pin<Box<dyn tokio_stream::Stream<Item = Result<GenerateResponse, Status>> + Send>>;

#[tonic::async_trait]
impl LlmService for LlmServer {
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
            let Some(engine) = self.engine.get() else {
                return Err(Error::Loading);
            };
            // Checked before it takes a place: a bad request is INVALID_ARGUMENT even when
            // the service is full.
            let req = request.into_inner();
            // Images' segments are mapped, and embeddings sent as f32 or bf16 converted (tens
            // of megabytes for a large image), off the runtime's threads.
            let req = if req.images.is_empty() {
                request_from_pb(req)?
            } else {
                let unpack = info_span!("unpack", images = req.images.len());
                tokio::task::spawn_blocking(move || unpack.in_scope(|| request_from_pb(req)))
                    .await
                    .map_err(|e| Error::Engine(format!("unpacking the embeddings failed: {e}")))??
            };
            // A grammar is compiled here, once (milliseconds for a large schema): off the
            // runtime's threads.
            let checked = if req.constraint.is_some() {
                let engine = engine.clone();
                let compile = info_span!("compile_grammar");
                tokio::task::spawn_blocking(move || compile.in_scope(|| engine.check_request(req)))
                    .await
                    .map_err(|e| Error::Engine(format!("compiling the grammar failed: {e}")))??
            } else {
                engine.check_request(req)?
            };
            let overloaded = Error::Overloaded {
                limit: self.max_concurrent,
            };
            let permit = self.permits.clone().try_acquire_owned();
            let permit = permit.map_err(|_| overloaded)?;
            let stream = engine.submit_checked(checked, deadline, tracing::Span::current())?;
            Ok((permit, stream))
        };
        let (permit, mut stream) = setup.instrument(span.clone()).await?;

        let (tx, rx) = mpsc::channel::<Result<GenerateResponse, Status>>(32);
        tokio::spawn(
            async move {
                let _permit = permit;
                while let Some(event) = stream.recv().await {
                    let (msg, last) = match event {
                        Event::Token { id, logprob, .. } => (
                            Ok(GenerateResponse {
                                token_ids: vec![id],
                                logprobs: logprob.map(logprobs_to_pb).into_iter().collect(),
                                ..Default::default()
                            }),
                            false,
                        ),
                        Event::Finished(gen) => {
                            let span = tracing::Span::current();
                            span.record("generated_tokens", gen.tokens.len());
                            span.record("finish_reason", gen.finish.as_str());
                            let finish = match gen.finish {
                                FinishReason::Length => PbFinish::Length,
                                FinishReason::Eos | FinishReason::Stopped => PbFinish::Stop,
                            };
                            let msg = GenerateResponse {
                                finish_reason: finish as i32,
                                usage: Some(Usage {
                                    prompt_tokens: gen.prompt_tokens as u32,
                                    completion_tokens: gen.tokens.len() as u32,
                                }),
                                ..Default::default()
                            };
                            (Ok(msg), true)
                        }
                        Event::Failed(e) => (Err(Status::from(e)), true),
                    };
                    // The client has gone: dropping `stream` tells the engine to stop.
                    if tx.send(msg).await.is_err() || last {
                        break;
                    }
                }
            }
            .instrument(span),
        );
        let mut response = Response::new(Box::pin(ReceiverStream::new(rx)) as TokenStream);
        if let Some(domain) = &self.shm_domain {
            response
                .metadata_mut()
                .insert(headers::SHM_DOMAIN, domain.clone());
        }
        if let Some(domain) = &self.device_domain {
            response
                .metadata_mut()
                .insert(headers::DEVICE_DOMAIN, domain.clone());
        }
        Ok(response)
    }
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

/// Serves LlmService on `listener` until `shutdown`; `backend` opens the device and the model
/// loads on it in the background (health NOT_SERVING meanwhile).
pub async fn serve<B: Backend>(
    cfg: ServeConfig,
    backend: impl FnOnce() -> vlm_compute::Result<B> + Send + 'static,
    listener: tokio::net::TcpListener,
    shutdown: impl Future<Output = ()>,
) -> anyhow::Result<()> {
    let engine = Arc::new(OnceLock::new());
    let max_concurrent = cfg.max_concurrent.max(1);
    let server = LlmServer {
        engine: engine.clone(),
        permits: Arc::new(Semaphore::new(max_concurrent)),
        max_concurrent,
        shm_domain: shm::domain().and_then(|d| d.parse().ok()),
        device_domain: cfg
            .device_handoff
            .then(|| handoff::domain(std::any::type_name::<B>()).parse().ok())
            .flatten(),
    };
    let (health, router) =
        vlm_proto::grpc_server(cfg.tls.clone(), vlm_proto::Audience::Internal).await?;
    let svc = LlmServiceServer::new(server)
        .max_decoding_message_size(vlm_proto::MAX_MESSAGE_BYTES)
        .max_encoding_message_size(vlm_proto::MAX_MESSAGE_BYTES);
    let router = router.add_service(svc);
    tracing::info!(addr = %listener.local_addr()?, model = %cfg.model.display(), "llm-svc listening");
    let what = format!("the language model from {}", cfg.model.display());
    let ServeConfig {
        model,
        random_weights,
        weights: weight_args,
        engine: engine_cfg,
        registry,
        ..
    } = cfg;
    let load = vlm_proto::load_model(engine, what, move || -> Result<_, Error> {
        let weights = weight_args.open(&model, random_weights)?;
        let e = Engine::load(&model, &weights, backend()?, engine_cfg, &registry)?;
        weights.finish();
        Ok(e)
    });
    let name = <LlmServiceServer<LlmServer> as tonic::server::NamedService>::NAME;
    vlm_proto::run_service(router, listener, health, name, load, shutdown).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn logprobs_cross_the_wire_best_first() {
        let lp = logprobs_to_pb(TokenLogprob {
            logprob: -0.25,
            top: vec![(5, -0.25), (9, -1.5)],
        });
        assert_eq!(
            (lp.top_ids, lp.top_logprobs),
            (vec![5, 9], vec![-0.25, -1.5])
        );
    }

    #[test]
    fn device_handles_are_taken_once_and_unknown_ones_refused() {
        let rows = |n| {
            let t = HostTensor::zeros(vec![n, 4]);
            Embeddings::Device(handoff::DeviceRows::new(vec![n, 4], t, b"id".to_vec()))
        };
        let id = handoff::deposit(vec![rows(2), rows(2)]);
        let image = |id| pb::GenerateRequest {
            images: vec![pb::ImageEmbeddings {
                grid_thw: vec![1, 2, 4],
                device_handle: id,
                ..Default::default()
            }],
            ..Default::default()
        };
        let req = request_from_pb(image(id)).unwrap();
        assert_eq!(req.images[0].embeds.shape(), &[2, 4]);
        assert_eq!(req.images[0].deepstack.len(), 1);
        for again in [id, 12345] {
            let err = request_from_pb(image(again)).unwrap_err();
            assert!(
                matches!(err, Error::BadImage { index: 0, .. })
                    && err.to_string().contains("no embeddings are held"),
                "{err}"
            );
        }
    }

    /// A server of the checkpoint in `dir` on the CPU, one request at a time, no shared memory.
    fn one_place_server(dir: &std::path::Path) -> LlmServer {
        let weights = vlm_compute::Weights::open(dir).unwrap();
        let engine = Engine::load(
            dir,
            &weights,
            vlm_compute::CpuBackend::new(),
            EngineConfig::default(),
            &prometheus::Registry::new(),
        )
        .unwrap();
        let cell = Arc::new(OnceLock::new());
        let _ = cell.set(engine);
        LlmServer {
            engine: cell,
            permits: Arc::new(Semaphore::new(1)),
            max_concurrent: 1,
            shm_domain: None,
            device_domain: None,
        }
    }

    #[tokio::test]
    async fn a_bad_request_gets_invalid_argument_even_when_every_place_is_taken() {
        let server = one_place_server(&vlm_compute::golden::tiny_fixture(env!(
            "CARGO_MANIFEST_DIR"
        )));
        let vocab = server.engine.get().unwrap().config().text.vocab_size as u32;
        let generate = |prompt: Vec<u32>, max_new_tokens: u32| {
            server.generate(Request::new(pb::GenerateRequest {
                prompt_token_ids: prompt,
                max_new_tokens,
                ..Default::default()
            }))
        };
        let full = server.permits.clone().try_acquire_owned().unwrap();
        for (what, prompt) in [("empty", vec![]), ("out of vocabulary", vec![1, vocab])] {
            let s = generate(prompt, 2).await.err().unwrap();
            assert_eq!(s.code(), tonic::Code::InvalidArgument, "{what}: {s:?}");
        }
        let s = generate(vec![1, 2, 3], 2).await.err().unwrap();
        assert_eq!(s.code(), tonic::Code::ResourceExhausted, "{s:?}");
        assert!(s.message().contains("limit of 1 requests"), "{s:?}");
        drop(full);
        assert!(generate(vec![1, 2, 3], 2).await.is_ok());
    }

    /// A text-only checkpoint (Qwen3ForCausalLM) answers text and refuses images at the door,
    /// saying why.
    #[tokio::test]
    async fn a_text_only_model_refuses_images_with_invalid_argument() {
        use tokio_stream::StreamExt;
        let server = one_place_server(&vlm_compute::golden::fixture(
            env!("CARGO_MANIFEST_DIR"),
            "tiny-qwen3",
        ));
        let hidden = server.engine.get().unwrap().config().text.hidden_size;
        let image = pb::ImageEmbeddings {
            grid_thw: vec![1, 2, 2],
            embeddings: Some(tensor::encode(
                &[1, hidden],
                &vec![0.5; hidden],
                pb::Dtype::F32,
            )),
            ..Default::default()
        };
        let s = server
            .generate(Request::new(pb::GenerateRequest {
                prompt_token_ids: vec![1, 2, 3],
                images: vec![image],
                max_new_tokens: 2,
                ..Default::default()
            }))
            .await
            .err()
            .unwrap();
        assert_eq!(s.code(), tonic::Code::InvalidArgument, "{s:?}");
        assert!(
            s.message().contains("text-only") && s.message().contains("Qwen3ForCausalLM"),
            "{s:?}"
        );

        let mut stream = server
            .generate(Request::new(pb::GenerateRequest {
                prompt_token_ids: vec![401, 84, 82],
                max_new_tokens: 3,
                ignore_eos: true,
                ..Default::default()
            }))
            .await
            .unwrap()
            .into_inner();
        let mut tokens = 0;
        while let Some(msg) = stream.next().await {
            tokens += msg.unwrap().token_ids.len();
        }
        assert_eq!(tokens, 3);
    }

    /// A constraint travels the wire: a schema that does not compile is INVALID_ARGUMENT with
    /// llguidance's reason (compiled before the request takes a place); one that does holds
    /// the answer to it.
    #[tokio::test]
    async fn constraints_are_compiled_at_the_door_and_hold_the_answer() {
        use tokio_stream::StreamExt;
        let server = one_place_server(&vlm_compute::golden::tiny_fixture(env!(
            "CARGO_MANIFEST_DIR"
        )));
        let generate = |schema: &str| {
            server.generate(Request::new(pb::GenerateRequest {
                prompt_token_ids: vec![40, 41, 42],
                max_new_tokens: 16,
                constraint: Some(pb::Constraint {
                    grammar: Some(pb::constraint::Grammar::JsonSchema(schema.into())),
                    after_token: None,
                }),
                ..Default::default()
            }))
        };
        let full = server.permits.clone().try_acquire_owned().unwrap();
        let s = generate(r#"{"type": "object", "properties": 5}"#)
            .await
            .err()
            .unwrap();
        assert_eq!(s.code(), tonic::Code::InvalidArgument, "{s:?}");
        assert!(s.message().contains("constraint"), "{s:?}");
        drop(full);
        let mut stream = generate(r#"{"enum": ["left", "right"]}"#)
            .await
            .unwrap()
            .into_inner();
        let (mut tokens, mut finish) = (Vec::new(), 0);
        while let Some(msg) = stream.next().await {
            let msg = msg.unwrap();
            tokens.extend(msg.token_ids);
            finish = msg.finish_reason;
        }
        assert_eq!(finish, pb::FinishReason::Stop as i32);
        let tok = tokenizers::Tokenizer::from_file(
            vlm_compute::golden::tiny_fixture(env!("CARGO_MANIFEST_DIR")).join("tokenizer.json"),
        )
        .unwrap();
        let text = tok.decode(&tokens, true).unwrap();
        assert!(text == r#""left""# || text == r#""right""#, "{text:?}");
    }
}
