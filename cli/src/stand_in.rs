//! A stand-in llm-svc, to measure the gateway alone (`vlm load --stand-in-llm MS`, `vlm serve
//! --stand-in-llm MS`): it answers `Generate` as the engine does on a GPU, without a model.
//!
//! Every `step` it hands one token to each request it holds, all in the same instant, as the
//! engine's batched decode step does (a GPU steps in about 10 ms at batch 64 on the 8B
//! shapes); tokens are drawn at random from the tokenizer's ordinary vocabulary, so the
//! gateway detokenizes real text. A request gets exactly `max_new_tokens` tokens (eos never
//! comes), then its finish reason and usage. Between the step and the wire it takes the same
//! path as llm-svc's tokens (an unbounded channel per request, a relay task, a bounded
//! channel to tonic), so only the model's work is missing: what the stack spends beyond it is
//! the gateway's, the client's and the gRPC hop's.

use std::path::Path;
use std::pin::Pin;
use std::time::Duration;

use anyhow::Context;
use rand::{Rng, SeedableRng};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};
use vlm_proto::pb::llm_service_server::{LlmService, LlmServiceServer};
use vlm_proto::pb::{self, FinishReason, GenerateResponse, Usage};

/// A request the stepper holds.
struct Running {
    tokens: mpsc::UnboundedSender<GenerateResponse>,
    left: u32,
    prompt_tokens: u32,
    max_new_tokens: u32,
}

/// The service: requests go to the stepper.
struct StandInLlm {
    submit: mpsc::UnboundedSender<Running>,
}

type TokenStream =
    Pin<Box<dyn tokio_stream::Stream<Item = Result<GenerateResponse, Status>> + Send>>;

#[tonic::async_trait]
impl LlmService for StandInLlm {
    type GenerateStream = TokenStream;

    async fn generate(
        &self,
        request: Request<pb::GenerateRequest>,
    ) -> Result<Response<TokenStream>, Status> {
        let req = request.into_inner();
        if req.max_new_tokens == 0 || req.prompt_token_ids.is_empty() {
            return Err(Status::invalid_argument(
                "the stand-in llm-svc needs a prompt and max_new_tokens of at least 1",
            ));
        }
        let (tokens, mut from_step) = mpsc::unbounded_channel();
        self.submit
            .send(Running {
                tokens,
                left: req.max_new_tokens,
                prompt_tokens: req.prompt_token_ids.len() as u32,
                max_new_tokens: req.max_new_tokens,
            })
            .map_err(|_| Status::unavailable("the stand-in's stepper has stopped"))?;
        // As llm-svc's relay: the step's channel to a bounded one that tonic reads.
        let (tx, rx) = mpsc::channel::<Result<GenerateResponse, Status>>(32);
        tokio::spawn(async move {
            while let Some(msg) = from_step.recv().await {
                let last = msg.finish_reason != 0;
                if tx.send(Ok(msg)).await.is_err() || last {
                    break;
                }
            }
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }
}

/// Hands every held request one token each `step` until `submit` closes.
async fn stepper(step: Duration, vocab: Vec<u32>, mut submit: mpsc::UnboundedReceiver<Running>) {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(0);
    let mut running: Vec<Running> = Vec::new();
    let mut ticks = tokio::time::interval(step);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        if running.is_empty() {
            // Idle, as the engine: the next request starts the steps again.
            match submit.recv().await {
                Some(r) => running.push(r),
                None => return,
            }
            ticks.reset();
        }
        ticks.tick().await;
        loop {
            match submit.try_recv() {
                Ok(r) => running.push(r),
                Err(mpsc::error::TryRecvError::Empty) => break,
                Err(mpsc::error::TryRecvError::Disconnected) if running.is_empty() => return,
                Err(mpsc::error::TryRecvError::Disconnected) => break,
            }
        }
        running.retain_mut(|r| {
            let token = vocab[rng.random_range(0..vocab.len())];
            r.left -= 1;
            let sent = r.tokens.send(GenerateResponse {
                token_ids: vec![token],
                ..Default::default()
            });
            if sent.is_err() {
                return false;
            }
            if r.left > 0 {
                return true;
            }
            let _ = r.tokens.send(GenerateResponse {
                finish_reason: FinishReason::Length as i32,
                usage: Some(Usage {
                    prompt_tokens: r.prompt_tokens,
                    completion_tokens: r.max_new_tokens,
                }),
                ..Default::default()
            });
            false
        });
    }
}

/// The ids the stand-in draws from: every token of the model's tokenizer that is not an added
/// (special) one.
fn ordinary_tokens(model: &Path) -> anyhow::Result<Vec<u32>> {
    let path = model.join("tokenizer.json");
    let tokenizer = tokenizers::Tokenizer::from_file(&path)
        .map_err(|e| anyhow::anyhow!("cannot load the tokenizer {}: {e}", path.display()))?;
    let added = tokenizer.get_added_tokens_decoder();
    let ids: Vec<u32> = (0..tokenizer.get_vocab_size(true) as u32)
        .filter(|id| !added.contains_key(id) && tokenizer.id_to_token(*id).is_some())
        .collect();
    anyhow::ensure!(!ids.is_empty(), "{} has no ordinary tokens", path.display());
    Ok(ids)
}

/// Serves the stand-in on `listener` until `shutdown`, drawing tokens from `model`'s tokenizer
/// and stepping every `step`.
pub async fn serve(
    model: &Path,
    step: Duration,
    listener: tokio::net::TcpListener,
    shutdown: impl std::future::Future<Output = ()>,
) -> anyhow::Result<()> {
    anyhow::ensure!(
        !step.is_zero(),
        "the stand-in llm-svc needs a step of more than 0 ms"
    );
    let vocab = ordinary_tokens(model).context("the stand-in llm-svc")?;
    let (submit, submitted) = mpsc::unbounded_channel();
    tokio::spawn(stepper(step, vocab, submitted));
    let (health, router) = vlm_proto::grpc_server(None, vlm_proto::Audience::Internal).await?;
    let svc = LlmServiceServer::new(StandInLlm { submit })
        .max_decoding_message_size(vlm_proto::MAX_MESSAGE_BYTES)
        .max_encoding_message_size(vlm_proto::MAX_MESSAGE_BYTES);
    tracing::info!(addr = %listener.local_addr()?, step_ms = step.as_secs_f64() * 1e3, "stand-in llm-svc listening (no model: a token per request every step)");
    let name = <LlmServiceServer<StandInLlm> as tonic::server::NamedService>::NAME;
    let router = router.add_service(svc);
    vlm_proto::run_service(router, listener, health, name, async { Ok(()) }, shutdown).await
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::StreamExt;

    #[tokio::test]
    async fn every_request_gets_its_tokens_a_step_apart_then_its_finish() {
        let (submit, submitted) = mpsc::unbounded_channel();
        tokio::spawn(stepper(Duration::from_millis(5), vec![7, 8, 9], submitted));
        let llm = StandInLlm { submit };
        let request = |n| {
            Request::new(pb::GenerateRequest {
                prompt_token_ids: vec![1, 2, 3],
                max_new_tokens: n,
                ..Default::default()
            })
        };
        let (a, b) = tokio::join!(llm.generate(request(3)), llm.generate(request(5)));
        for (stream, n) in [(a, 3), (b, 5)] {
            let msgs: Vec<GenerateResponse> = stream
                .unwrap()
                .into_inner()
                .map(Result::unwrap)
                .collect()
                .await;
            assert_eq!(msgs.len(), n + 1);
            assert!(msgs[..n]
                .iter()
                .all(|m| m.token_ids.len() == 1 && (7..=9).contains(&m.token_ids[0])));
            let last = msgs.last().unwrap();
            assert_eq!(last.finish_reason, FinishReason::Length as i32);
            assert_eq!(last.usage.unwrap().completion_tokens, n as u32);
        }
        assert!(llm.generate(request(0)).await.is_err());
    }
}
