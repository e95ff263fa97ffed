//! Failover through the real orchestrator and gRPC service, against stand-in llm-svc
//! replicas on loopback ports: a replica that fails before its first token costs the client
//! nothing (the request goes once to another replica), one that fails after it ends the stream
//! with UNAVAILABLE naming the replica, and nothing reaches the client twice.

use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use tokio_stream::wrappers::TcpListenerStream;
use vlm_proto::pb::gateway_server::Gateway;
use vlm_proto::pb::llm_service_server::{LlmService, LlmServiceServer};
use vlm_proto::pb::{self, content_part::Part};

use crate::chat::ChatTokenizer;
use crate::grpc::GatewayService;
use crate::metrics::Metrics;
use crate::orchestrator::Orchestrator;
use crate::request::RequestLimits;
use crate::upstream::Upstreams;

/// How a stand-in replica answers a Generate.
#[derive(Clone, Copy)]
enum Answer {
    /// Two tokens, then the finish.
    Tokens,
    /// Headers, then UNAVAILABLE before any token.
    FailBeforeFirst,
    /// One token, then UNAVAILABLE.
    FailAfterFirst,
}

struct StandIn {
    answer: Answer,
    calls: Arc<AtomicUsize>,
}

type Steps =
    Pin<Box<dyn futures::Stream<Item = Result<pb::GenerateResponse, tonic::Status>> + Send>>;

fn token(id: u32) -> Result<pb::GenerateResponse, tonic::Status> {
    Ok(pb::GenerateResponse {
        token_ids: vec![id],
        ..Default::default()
    })
}

#[tonic::async_trait]
impl LlmService for StandIn {
    type GenerateStream = Steps;

    async fn generate(
        &self,
        _: tonic::Request<pb::GenerateRequest>,
    ) -> Result<tonic::Response<Steps>, tonic::Status> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        let gone = || Err(tonic::Status::unavailable("the engine went away"));
        let steps: Vec<Result<pb::GenerateResponse, tonic::Status>> = match self.answer {
            Answer::Tokens => vec![
                token(100),
                token(101),
                Ok(pb::GenerateResponse {
                    finish_reason: pb::FinishReason::Length as i32,
                    ..Default::default()
                }),
            ],
            Answer::FailBeforeFirst => vec![gone()],
            Answer::FailAfterFirst => vec![token(100), gone()],
        };
        Ok(tonic::Response::new(Box::pin(futures::stream::iter(steps))))
    }
}

/// A stand-in replica on a loopback port: its address and its count of calls.
async fn replica(answer: Answer) -> (String, Arc<AtomicUsize>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let calls = Arc::new(AtomicUsize::new(0));
    let svc = LlmServiceServer::new(StandIn {
        answer,
        calls: calls.clone(),
    });
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(svc)
            .serve_with_incoming(TcpListenerStream::new(listener)),
    );
    (addr, calls)
}

/// The gateway's gRPC service over llm-svc replicas at `llm` (tried in this order first).
fn gateway(llm: &[String]) -> GatewayService {
    let dir = crate::tiny_fixture();
    let image_token = crate::checkpoint::ModelIds::read(&dir)
        .unwrap()
        .image_token_id;
    let chat = ChatTokenizer::from_dir(&dir, image_token).unwrap();
    let orchestrator = Orchestrator::new(
        chat,
        Some(Upstreams::new("vision-svc", &["127.0.0.1:1".into()], None).unwrap()),
        Upstreams::new("llm-svc", llm, None).unwrap(),
        RequestLimits::default(),
        4,
        Metrics::new(),
    );
    GatewayService {
        orchestrator: Arc::new(orchestrator),
        default_max_tokens: 4,
        request_timeout: Duration::from_secs(10),
    }
}

fn hi() -> tonic::Request<pb::ChatRequest> {
    tonic::Request::new(pb::ChatRequest {
        messages: vec![pb::ChatMessage {
            role: "user".into(),
            content: vec![pb::ContentPart {
                part: Some(Part::Text("hi".into())),
            }],
            ..Default::default()
        }],
        ..Default::default()
    })
}

#[tokio::test]
async fn a_replica_failing_before_the_first_token_is_ejected_and_the_request_retried_elsewhere() {
    let (bad, bad_calls) = replica(Answer::FailBeforeFirst).await;
    let (good, good_calls) = replica(Answer::Tokens).await;
    let gw = gateway(&[bad.clone(), good]);
    for _ in 0..3 {
        let out = gw.chat(hi()).await.expect("served by the other replica");
        assert_eq!(out.into_inner().token_ids, [100, 101]);
    }
    assert_eq!(
        bad_calls.load(Ordering::SeqCst),
        1,
        "ejected after its failure"
    );
    assert_eq!(good_calls.load(Ordering::SeqCst), 3);
    assert!(!gw.orchestrator.llm.admitted(&bad));

    // Streamed too: the client sees the other replica's tokens, once each.
    let (bad, _) = replica(Answer::FailBeforeFirst).await;
    let (good, _) = replica(Answer::Tokens).await;
    let gw = gateway(&[bad, good]);
    let mut stream = gw.chat_stream(hi()).await.unwrap().into_inner();
    let mut ids = Vec::new();
    while let Some(chunk) = stream.next().await {
        ids.extend(chunk.expect("no error reaches the client").token_ids);
    }
    assert_eq!(ids, [100, 101]);
}

#[tokio::test]
async fn a_stream_under_way_fails_with_unavailable_naming_the_replica_and_is_not_retried() {
    let (bad, bad_calls) = replica(Answer::FailAfterFirst).await;
    let (good, good_calls) = replica(Answer::Tokens).await;
    let gw = gateway(&[bad.clone(), good]);
    let mut stream = gw.chat_stream(hi()).await.unwrap().into_inner();
    let mut ids = Vec::new();
    let mut error = None;
    while let Some(chunk) = stream.next().await {
        match chunk {
            Ok(c) => ids.extend(c.token_ids),
            Err(e) => error = Some(e),
        }
    }
    assert_eq!(ids, [100], "the one token, once");
    let e = error.expect("the stream fails");
    assert_eq!(e.code(), tonic::Code::Unavailable);
    assert!(e.message().contains(&bad), "{e:?}");
    assert_eq!(bad_calls.load(Ordering::SeqCst), 1);
    assert_eq!(
        good_calls.load(Ordering::SeqCst),
        0,
        "no retry after the first token"
    );
}
