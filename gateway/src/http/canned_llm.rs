//! Logprobs through the real gateway (router, orchestrator, gRPC service) from a stand-in
//! llm-svc on a loopback port that answers canned tokens with logprobs: the request's sampling
//! fields reach llm-svc whole, and each token comes back with its text and bytes, in OpenAI's
//! shape over HTTP (unary and per streamed chunk) and in `ChatTokenLogprob`s over gRPC; and a
//! request of `n` choices is `n` calls, each choice answered with its index.

use std::pin::Pin;
use std::sync::Mutex;

use axum::body::Body;
use futures::StreamExt;
use tokio_stream::wrappers::TcpListenerStream;
use tower::ServiceExt;
use vlm_proto::pb::gateway_server::Gateway;
use vlm_proto::pb::llm_service_server::{LlmService, LlmServiceServer};

use super::*;
use crate::chat::ChatTokenizer;
use crate::detok::TokenBytes;
use crate::grpc::GatewayService;
use crate::metrics::Metrics;
use crate::serve::UpstreamHealth;
use crate::upstream::Upstreams;

/// Answers every Generate with `steps` (or refuses it with their status), and keeps the
/// requests it was sent. The stand-in llm-svc of this file's tests and `canned_answers.rs`'s.
struct CannedLlm {
    steps: Result<Vec<pb::GenerateResponse>, tonic::Status>,
    seen: Arc<Mutex<Vec<pb::GenerateRequest>>>,
}

type Steps =
    Pin<Box<dyn futures::Stream<Item = Result<pb::GenerateResponse, tonic::Status>> + Send>>;

#[tonic::async_trait]
impl LlmService for CannedLlm {
    type GenerateStream = Steps;

    async fn generate(
        &self,
        request: tonic::Request<pb::GenerateRequest>,
    ) -> Result<tonic::Response<Steps>, tonic::Status> {
        self.seen.lock().unwrap().push(request.into_inner());
        let steps = self.steps.clone()?.into_iter().map(Ok);
        Ok(tonic::Response::new(Box::pin(futures::stream::iter(steps))))
    }
}

/// A gateway (its HTTP state) of `chat` in front of a [`CannedLlm`] answering `steps` on a
/// loopback port, its vision-svc nowhere (the chats are text); and the requests llm-svc saw.
pub(super) async fn gateway_of_canned_llm(
    chat: ChatTokenizer,
    vocab_size: Option<usize>,
    steps: Result<Vec<pb::GenerateResponse>, tonic::Status>,
    default_max_tokens: usize,
) -> (HttpState, Arc<Mutex<Vec<pb::GenerateRequest>>>) {
    let seen = Arc::new(Mutex::new(Vec::new()));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let llm_addr = listener.local_addr().unwrap().to_string();
    let llm = LlmServiceServer::new(CannedLlm {
        steps,
        seen: seen.clone(),
    });
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(llm)
            .serve_with_incoming(TcpListenerStream::new(listener)),
    );
    let nowhere = ["127.0.0.1:1".to_string()];
    let mut orchestrator = Orchestrator::new(
        chat,
        Some(Upstreams::new("vision-svc", &nowhere, None).unwrap()),
        Upstreams::new("llm-svc", std::slice::from_ref(&llm_addr), None).unwrap(),
        RequestLimits::default(),
        4,
        Metrics::new(),
    );
    orchestrator.vocab_size = vocab_size;
    let state = HttpState {
        orchestrator: Arc::new(orchestrator),
        model_name: "tiny".into(),
        default_max_tokens,
        request_timeout: Duration::from_secs(10),
        health: Arc::new(UpstreamHealth::new(&nowhere, &[llm_addr])),
    };
    (state, seen)
}

/// POSTs `body` to the gateway's chat completions: the status and the body's text.
pub(super) async fn post_chat(state: &HttpState, body: &Value) -> (StatusCode, String) {
    let req = axum::http::Request::post("/v1/chat/completions")
        .header("content-type", "application/json")
        .body(Body::from(body.to_string()))
        .unwrap();
    let resp = router(state.clone(), None).oneshot(req).await.unwrap();
    let status = resp.status();
    let bytes = axum::body::to_bytes(resp.into_body(), 1 << 20)
        .await
        .unwrap();
    (status, String::from_utf8(bytes.to_vec()).unwrap())
}

struct Harness {
    state: HttpState,
    seen: Arc<Mutex<Vec<pb::GenerateRequest>>>,
    /// The canned tokens: (id, its text alone, its bytes), each with the next two as its
    /// alternatives.
    tokens: Vec<(u32, String, Vec<u8>)>,
}

impl Harness {
    /// The gateway's gRPC service over this harness's orchestrator.
    fn grpc(&self) -> GatewayService {
        GatewayService {
            orchestrator: self.state.orchestrator.clone(),
            default_max_tokens: 3,
            request_timeout: Duration::from_secs(10),
        }
    }
}

/// A gRPC chat whose one user message says "hi", every other field its default.
fn hi() -> pb::ChatRequest {
    pb::ChatRequest {
        messages: vec![pb::ChatMessage {
            role: "user".into(),
            content: vec![pb::ContentPart {
                part: Some(pb::content_part::Part::Text("hi".into())),
            }],
            ..Default::default()
        }],
        ..Default::default()
    }
}

/// A gateway of the tiny fixture whose llm-svc answers three tokens, one per message, then
/// finishes (its vision-svc is nowhere: the chats are text).
async fn harness() -> Harness {
    let dir = crate::tiny_fixture();
    let image_token = crate::checkpoint::ModelIds::read(&dir)
        .unwrap()
        .image_token_id;
    let chat = ChatTokenizer::from_dir(&dir, image_token).unwrap();
    // Tokens of plain ASCII words, and one byte that starts a two-byte character.
    let tb = TokenBytes::new(chat.tokenizer());
    let mut tokens: Vec<(u32, String, Vec<u8>)> = (0..400u32)
        .map(|id| {
            let (text, bytes) = tb.text_and_bytes(id).unwrap();
            (id, text, bytes)
        })
        .filter(|(_, t, _)| t.len() > 1 && t.chars().all(|c| c.is_ascii_alphabetic()))
        .take(2)
        .collect();
    let partial = chat
        .tokenizer()
        .token_to_id("Ã")
        .expect("byte 0xC3's token");
    tokens.push((partial, "\u{FFFD}".into(), vec![0xC3]));
    assert_eq!(tokens.len(), 3);
    let steps: Vec<pb::GenerateResponse> = (0..3)
        .map(|i| pb::GenerateResponse {
            token_ids: vec![tokens[i].0],
            logprobs: vec![pb::TokenLogprobs {
                logprob: -0.5 * i as f32,
                top_ids: vec![tokens[(i + 1) % 3].0, tokens[(i + 2) % 3].0],
                top_logprobs: vec![-0.25, -3.0],
            }],
            ..Default::default()
        })
        .chain(std::iter::once(pb::GenerateResponse {
            finish_reason: pb::FinishReason::Length as i32,
            usage: Some(pb::Usage {
                prompt_tokens: 9,
                completion_tokens: 3,
            }),
            ..Default::default()
        }))
        .collect();
    let vocab = crate::checkpoint::ModelIds::read(&dir).unwrap().vocab_size;
    let (state, seen) = gateway_of_canned_llm(chat, Some(vocab), Ok(steps), 3).await;
    Harness {
        state,
        seen,
        tokens,
    }
}

impl Harness {
    async fn post(&self, body: Value) -> (StatusCode, String) {
        post_chat(&self.state, &body).await
    }

    /// The OpenAI entry of token `i` (of the canned ones) at `logprob`.
    fn entry(&self, i: usize, logprob: f32) -> Value {
        let (_, text, bytes) = &self.tokens[i];
        json!({"token": text, "logprob": logprob, "bytes": bytes})
    }

    /// The `logprobs.content` entry of canned step `i`.
    fn content(&self, i: usize) -> Value {
        let mut e = self.entry(i, -0.5 * i as f32);
        e["top_logprobs"] = json!([
            self.entry((i + 1) % 3, -0.25),
            self.entry((i + 2) % 3, -3.0)
        ]);
        e
    }
}

fn request(fields: Value) -> Value {
    let mut body = json!({"messages": [{"role": "user", "content": "hi"}]});
    for (k, v) in fields.as_object().unwrap() {
        body[k] = v.clone();
    }
    body
}

#[tokio::test]
async fn unary_answers_carry_each_tokens_logprobs_in_openai_shape() {
    let h = harness().await;
    let (status, body) = h
        .post(request(json!({
            "logprobs": true, "top_logprobs": 2, "presence_penalty": 0.5,
            "logit_bias": {"3": 1.5}, "min_p": 0.1, "user": "someone",
        })))
        .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    let want: Vec<Value> = (0..3).map(|i| h.content(i)).collect();
    assert_eq!(
        v["choices"][0]["logprobs"],
        json!({ "content": want }),
        "{body}"
    );
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    // What llm-svc was asked.
    let sent = h.seen.lock().unwrap()[0].sampling.clone().unwrap();
    assert_eq!(sent.top_logprobs, Some(2));
    assert_eq!((sent.presence_penalty, sent.min_p), (0.5, 0.1));
    assert_eq!(sent.logit_bias, [(3, 1.5)].into());
    assert_eq!(sent.repetition_penalty, Some(1.0));

    // Not asked: null, and llm-svc is asked for none.
    let (status, body) = h.post(request(json!({}))).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["choices"][0]["logprobs"], Value::Null, "{body}");
    assert_eq!(
        h.seen.lock().unwrap()[1]
            .sampling
            .as_ref()
            .unwrap()
            .top_logprobs,
        None
    );

    // A bias on a token outside the vocabulary is a 400 before llm-svc is called.
    let vocab = h.state.orchestrator.vocab_size.unwrap();
    let (status, body) = h
        .post(request(json!({"logit_bias": {vocab.to_string(): 1}})))
        .await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
    assert!(
        body.contains(&format!("`logit_bias` names token {vocab}")),
        "{body}"
    );
    assert_eq!(h.seen.lock().unwrap().len(), 2, "llm-svc was not called");
}

#[tokio::test]
async fn each_streamed_chunk_carries_the_logprobs_of_its_tokens() {
    let h = harness().await;
    let (status, body) = h
        .post(request(
            json!({"stream": true, "logprobs": true, "top_logprobs": 2}),
        ))
        .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let chunks: Vec<Value> = body
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
    let with_tokens: Vec<&Value> = chunks
        .iter()
        .filter(|c| !c["choices"][0]["logprobs"].is_null())
        .collect();
    // One chunk per step, even the one whose text (half a character) is held back.
    assert_eq!(with_tokens.len(), 3, "{body}");
    for (i, c) in with_tokens.iter().enumerate() {
        assert_eq!(
            c["choices"][0]["logprobs"],
            json!({"content": [h.content(i)]}),
            "{body}"
        );
    }
    assert_eq!(
        chunks[0]["choices"][0]["logprobs"],
        Value::Null,
        "the role chunk"
    );
    let last = chunks.last().unwrap();
    assert_eq!(last["choices"][0]["finish_reason"], "length");
    assert_eq!(last["choices"][0]["logprobs"], Value::Null);

    // Not asked: every chunk's logprobs is null.
    let (_, body) = h.post(request(json!({"stream": true}))).await;
    for d in body.lines().filter_map(|l| l.strip_prefix("data: ")) {
        if d != "[DONE]" {
            let c: Value = serde_json::from_str(d).unwrap();
            assert_eq!(c["choices"][0]["logprobs"], Value::Null, "{d}");
        }
    }
}

#[tokio::test]
async fn grpc_answers_carry_the_same_logprobs() {
    let h = harness().await;
    let grpc = h.grpc();
    let request = |top_logprobs| {
        tonic::Request::new(pb::ChatRequest {
            logprobs: true,
            top_logprobs,
            repetition_penalty: Some(1.2),
            ..hi()
        })
    };
    let out = grpc.chat(request(Some(2))).await.unwrap().into_inner();
    assert_eq!(out.logprobs.len(), 3);
    for (i, lp) in out.logprobs.iter().enumerate() {
        let (id, text, bytes) = &h.tokens[i];
        assert_eq!((lp.token_id, &lp.token, &lp.bytes), (*id, text, bytes));
        assert_eq!(lp.logprob, -0.5 * i as f32);
        let top: Vec<u32> = lp.top.iter().map(|t| t.token_id).collect();
        assert_eq!(top, vec![h.tokens[(i + 1) % 3].0, h.tokens[(i + 2) % 3].0]);
        assert_eq!(lp.top[0].token, h.tokens[(i + 1) % 3].1);
    }
    let sent = h.seen.lock().unwrap()[0].sampling.clone().unwrap();
    assert_eq!(
        (sent.top_logprobs, sent.repetition_penalty),
        (Some(2), Some(1.2))
    );

    let mut stream = grpc.chat_stream(request(None)).await.unwrap().into_inner();
    let mut per_chunk = Vec::new();
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.unwrap();
        per_chunk.push((chunk.token_ids.len(), chunk.logprobs.len()));
    }
    // A chunk per token with its logprobs; the others (the held-back half character's text
    // at the end, the finish) carry neither.
    let (with_tokens, others): (Vec<&(usize, usize)>, Vec<_>) =
        per_chunk.iter().partition(|c| c.0 > 0);
    assert_eq!(with_tokens, vec![&(1, 1); 3], "{per_chunk:?}");
    assert!(others.iter().all(|c| c.1 == 0), "{per_chunk:?}");

    // top_logprobs without logprobs is refused, as over HTTP.
    let mut bad = request(Some(2));
    bad.get_mut().logprobs = false;
    let e = grpc.chat(bad).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument);
    assert!(e.message().contains("`top_logprobs`"), "{e:?}");
}

/// The chunks of an SSE body, `[DONE]` left out.
fn sse_chunks(body: &str) -> Vec<Value> {
    body.lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .map(|d| serde_json::from_str(d).unwrap())
        .collect()
}

#[tokio::test]
async fn n_choices_are_n_generations_each_with_its_index_finish_and_logprobs() {
    let h = harness().await;
    let (status, body) = h
        .post(request(json!({
            "n": 3, "seed": 7, "temperature": 1, "logprobs": true, "top_logprobs": 2,
            "return_token_ids": true,
        })))
        .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    let choices = v["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 3, "{body}");
    let want: Vec<Value> = (0..3).map(|i| h.content(i)).collect();
    for (i, c) in choices.iter().enumerate() {
        assert_eq!(c["index"], i, "{body}");
        assert_eq!(c["finish_reason"], "length", "{body}");
        assert_eq!(c["logprobs"], json!({ "content": want }), "{body}");
        assert_eq!(c["token_ids"].as_array().unwrap().len(), 3, "{body}");
    }
    // The prompt once (as the gateway counted it: 17 tokens), every choice's tokens.
    assert_eq!(
        v["usage"],
        json!({"prompt_tokens": 17, "completion_tokens": 9, "total_tokens": 26})
    );
    // llm-svc was asked for each choice with the one seed.
    let sent: Vec<(u32, Option<u64>)> = h
        .seen
        .lock()
        .unwrap()
        .iter()
        .map(|r| r.sampling.as_ref().unwrap())
        .map(|s| (s.choice, s.seed))
        .collect();
    let mut choices_sent: Vec<u32> = sent.iter().map(|s| s.0).collect();
    choices_sent.sort_unstable();
    assert_eq!(choices_sent, [0, 1, 2]);
    assert!(sent.iter().all(|s| s.1 == Some(7)), "{sent:?}");

    // Streamed: each choice opens with its role, its chunks name it, it finishes on its own,
    // and the usage chunk comes once, after the last finish.
    let (status, body) = h
        .post(request(json!({
            "n": 2, "stream": true, "stream_options": {"include_usage": true},
            "return_token_ids": true,
        })))
        .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let chunks = sse_chunks(&body);
    for i in 0..2 {
        let mine: Vec<&Value> = chunks
            .iter()
            .filter(|c| c["choices"][0]["index"] == i)
            .collect();
        assert_eq!(
            mine[0]["choices"][0]["delta"]["role"], "assistant",
            "{body}"
        );
        let ids: usize = mine
            .iter()
            .filter_map(|c| c["choices"][0]["token_ids"].as_array())
            .map(Vec::len)
            .sum();
        assert_eq!(ids, 3, "choice {i}: {body}");
        let finishes: Vec<&Value> = mine
            .iter()
            .map(|c| &c["choices"][0]["finish_reason"])
            .filter(|f| !f.is_null())
            .collect();
        assert_eq!(finishes, [&json!("length")], "choice {i}: {body}");
    }
    let usage: Vec<&Value> = chunks.iter().filter(|c| !c["usage"].is_null()).collect();
    assert_eq!(usage.len(), 1, "{body}");
    assert_eq!(usage[0]["usage"]["completion_tokens"], 6);
    assert_eq!(usage[0]["choices"], json!([]));
    assert!(std::ptr::eq(usage[0], chunks.last().unwrap()), "{body}");

    // Out of range: a 400 naming `n`, before llm-svc is called; so is more choices than the
    // gateway's places (4 here).
    let calls = h.seen.lock().unwrap().len();
    for n in [0, 17, 5] {
        let (status, body) = h.post(request(json!({ "n": n }))).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "n {n}: {body}");
        assert!(body.contains("`n`"), "{body}");
    }
    assert_eq!(
        h.seen.lock().unwrap().len(),
        calls,
        "llm-svc was not called"
    );
}

#[tokio::test]
async fn grpc_lists_the_choices_and_tags_each_chunk_with_its_index() {
    let h = harness().await;
    let grpc = h.grpc();
    let request = |n| {
        tonic::Request::new(pb::ChatRequest {
            n,
            logprobs: true,
            ..hi()
        })
    };
    let out = grpc.chat(request(Some(3))).await.unwrap().into_inner();
    assert_eq!(out.choices.len(), 3);
    for (i, c) in out.choices.iter().enumerate() {
        assert_eq!(c.index, i as u32);
        assert_eq!((c.token_ids.len(), c.logprobs.len()), (3, 3));
        assert_eq!(c.finish_reason, pb::FinishReason::Length as i32);
    }
    // The top-level fields are choice 0, as a client that predates `n` reads them.
    assert_eq!(out.token_ids, out.choices[0].token_ids);
    assert_eq!(out.text, out.choices[0].text);
    let usage = out.usage.unwrap();
    assert_eq!((usage.prompt_tokens, usage.completion_tokens), (17, 9));
    // n unset: one choice, at the top level only.
    let out = grpc.chat(request(None)).await.unwrap().into_inner();
    assert!(out.choices.is_empty());
    assert_eq!(out.token_ids.len(), 3);

    let mut stream = grpc
        .chat_stream(request(Some(2)))
        .await
        .unwrap()
        .into_inner();
    let mut tokens = [0; 2];
    let mut finishes = [0; 2];
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.unwrap();
        tokens[chunk.index as usize] += chunk.token_ids.len();
        if chunk.finish_reason != 0 {
            finishes[chunk.index as usize] += 1;
            assert_eq!(chunk.usage.unwrap().completion_tokens, 3);
        }
    }
    assert_eq!((tokens, finishes), ([3, 3], [1, 1]));

    for n in [0, 17] {
        let e = grpc.chat(request(Some(n))).await.unwrap_err();
        assert_eq!(e.code(), tonic::Code::InvalidArgument);
        assert!(e.message().contains("`n`"), "{e:?}");
    }
}

/// `/health` marks each replica with whether the router sends it calls: the canned llm-svc is
/// routed, a vision-svc the router ejected is not, though its health check is what it is.
#[tokio::test]
async fn health_says_which_replicas_the_router_sends_calls() {
    let h = harness().await;
    let o = &h.state.orchestrator;
    let vision = o.vision.as_ref().unwrap();
    vision.eject("127.0.0.1:1");
    let llm = o.llm.addrs()[0].clone();
    let mut detail = json!([
        {"service": "llm-svc", "addr": llm, "status": "SERVING"},
        {"service": "vision-svc", "addr": "127.0.0.1:1", "status": "unreachable"},
        {"service": "llm-svc", "addr": "llm.example:50052", "status": "SERVING"},
    ]);
    with_routing(&mut detail, o);
    assert_eq!(detail[0]["routed"], json!(true), "{detail}");
    assert_eq!(detail[1]["routed"], json!(false), "{detail}");
    // A DNS name is not a replica itself (its addresses are): nothing said.
    assert!(detail[2].get("routed").is_none(), "{detail}");
}
