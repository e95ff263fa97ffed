//! `vlm_cli::stack::LocalStack`, the one way `vlm serve`, `vlm bench` and `vlm load` start the
//! three services in process: it serves the bundled tiny model through both public APIs (with
//! logprobs when asked) and stops cleanly, and a model that cannot load fails `ready` with the service's name and its
//! error instead of waiting out the timeout.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use vlm_cli::stack::{LocalStack, StackConfig};
use vlm_compute::CpuBackend;
use vlm_proto::pb::content_part::Part;
use vlm_proto::pb::{
    content_part, gateway_client::GatewayClient, ChatMessage, ChatRequest, ContentPart,
};

/// The bundled tiny model (found from the gateway's directory when the test program runs on
/// another machine, as on the GPU one).
fn fixture() -> PathBuf {
    vlm_compute::golden::tiny_fixture(env!("CARGO_MANIFEST_DIR"))
}

/// A loopback stack serving `dir` on the CPU, ready.
async fn ready_on_cpu(dir: PathBuf) -> LocalStack {
    let mut stack = LocalStack::start(StackConfig::loopback(dir), || Ok(CpuBackend::new()))
        .await
        .unwrap();
    stack.ready(Duration::from_secs(60)).await.unwrap();
    stack
}

/// A gRPC chat of one user message made of `parts`, every other field its default.
fn user_chat(parts: Vec<content_part::Part>) -> ChatRequest {
    ChatRequest {
        messages: vec![ChatMessage {
            role: "user".into(),
            content: parts
                .into_iter()
                .map(|part| ContentPart { part: Some(part) })
                .collect(),
            ..Default::default()
        }],
        ..Default::default()
    }
}

/// POSTs `body` to the `/v1/chat/completions` of the stack at `http_addr`.
async fn post_chat(http_addr: SocketAddr, body: &serde_json::Value) -> reqwest::Response {
    reqwest::Client::new()
        .post(format!("http://{http_addr}/v1/chat/completions"))
        .json(body)
        .send()
        .await
        .unwrap()
}

/// The value of the sample `name` (with its labels, if any) on the stack's `/metrics` page at
/// `http_addr`; 0 when the page has none.
async fn metric(http_addr: SocketAddr, name: &str) -> f64 {
    let page = reqwest::get(format!("http://{http_addr}/metrics"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    page.lines()
        .find_map(|l| l.strip_prefix(name)?.trim().parse().ok())
        .unwrap_or(0.0)
}

/// The JSON chunks of an SSE body, `[DONE]` left out.
fn sse_chunks(sse: &str) -> impl Iterator<Item = serde_json::Value> + '_ {
    sse.lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|data| *data != "[DONE]")
        .map(|data| serde_json::from_str(data).unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serves_the_tiny_model_and_stops() {
    let stack = ready_on_cpu(fixture()).await;
    let mut client = GatewayClient::connect(format!("http://{}", stack.grpc_addr))
        .await
        .unwrap();
    let request = ChatRequest {
        max_tokens: Some(3),
        ignore_eos: true,
        ..user_chat(vec![Part::Text("hello".into())])
    };
    let answer = client.chat(request.clone()).await.unwrap().into_inner();
    assert_eq!(answer.token_ids.len(), 3);
    // The same request over HTTP, streamed with the token ids: every token comes in some
    // chunk, those whose text is still an incomplete character included.
    let body = serde_json::json!({
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": 12,
        "ignore_eos": true,
        "stream": true,
        "return_token_ids": true,
    });
    let sse = post_chat(stack.http_addr, &body)
        .await
        .text()
        .await
        .unwrap();
    let mut streamed: Vec<u32> = Vec::new();
    for chunk in sse_chunks(&sse) {
        if let Some(ids) = chunk["choices"][0]["token_ids"].as_array() {
            streamed.extend(ids.iter().map(|i| i.as_u64().unwrap() as u32));
        }
    }
    let unary = client
        .chat(ChatRequest {
            max_tokens: Some(12),
            ..request
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(streamed, unary.token_ids, "{sse}");
    stack.stop().await.unwrap();
}

/// Logprobs from the engine through both APIs: one entry per generated token with as many
/// alternatives as asked, best first; greedy's pick is the best of the raw logprobs; the two
/// APIs agree.
/// A text-only checkpoint (tiny Qwen3ForCausalLM) served with no vision-svc: its chats give
/// HF's greedy tokens over HTTP, and an image gets 400 naming why, with nothing upstream asked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_text_only_model_serves_without_a_vision_service_and_refuses_images() {
    let dir = vlm_compute::golden::fixture(env!("CARGO_MANIFEST_DIR"), "tiny-qwen3");
    let stack = ready_on_cpu(dir.clone()).await;
    let golden = vlm_compute::golden::Golden::open(&dir).unwrap();
    let case = golden.manifest()["cases"][0].clone();
    let (_, hf_tokens) = golden
        .ints(&format!("case.{}.tokens", case["name"].as_str().unwrap()))
        .unwrap();
    let body = serde_json::json!({
        "messages": case["messages"],
        "max_tokens": hf_tokens.len(),
        "temperature": 0,
        "ignore_eos": true,
        "return_token_ids": true,
    });
    let answer: serde_json::Value = post_chat(stack.http_addr, &body)
        .await
        .json()
        .await
        .unwrap();
    let ours: Vec<i64> = answer["choices"][0]["token_ids"]
        .as_array()
        .unwrap_or_else(|| panic!("{answer}"))
        .iter()
        .map(|t| t.as_i64().unwrap())
        .collect();
    assert_eq!(ours, hf_tokens, "{answer}");
    let png = std::fs::read(fixture().join("images/cat.png")).unwrap();
    let data_url = format!(
        "data:image/png;base64,{}",
        base64::Engine::encode(&base64::engine::general_purpose::STANDARD, png)
    );
    let body = serde_json::json!({
        "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": data_url}},
            {"type": "text", "text": "what is this?"}]}],
        "max_tokens": 2,
    });
    let refused = post_chat(stack.http_addr, &body).await;
    assert_eq!(refused.status(), 400);
    let body = refused.text().await.unwrap();
    assert!(body.contains("text-only"), "{body}");
    stack.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn logprobs_come_with_every_token_through_both_apis() {
    let stack = ready_on_cpu(fixture()).await;
    let body = serde_json::json!({
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": 5, "ignore_eos": true, "return_token_ids": true,
        "logprobs": true, "top_logprobs": 3,
    });
    let answer: serde_json::Value = post_chat(stack.http_addr, &body)
        .await
        .json()
        .await
        .unwrap();
    let choice = &answer["choices"][0];
    let content = choice["logprobs"]["content"].as_array().expect("logprobs");
    assert_eq!(content.len(), 5, "{answer}");
    assert_eq!(choice["token_ids"].as_array().unwrap().len(), 5);
    for entry in content {
        let top = entry["top_logprobs"].as_array().unwrap();
        assert_eq!(top.len(), 3, "{entry}");
        let lps: Vec<f64> = top.iter().map(|t| t["logprob"].as_f64().unwrap()).collect();
        assert!(
            lps.windows(2).all(|w| w[0] >= w[1]) && lps[0] <= 0.0,
            "{entry}"
        );
        assert_eq!(
            entry["token"], top[0]["token"],
            "greedy picks the best: {entry}"
        );
        assert_eq!(entry["bytes"], top[0]["bytes"], "{entry}");
    }

    let mut client = GatewayClient::connect(format!("http://{}", stack.grpc_addr))
        .await
        .unwrap();
    let grpc = client
        .chat(ChatRequest {
            max_tokens: Some(5),
            ignore_eos: true,
            logprobs: true,
            top_logprobs: Some(3),
            ..user_chat(vec![Part::Text("hello".into())])
        })
        .await
        .unwrap()
        .into_inner();
    let http_ids: Vec<u64> = choice["token_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| i.as_u64().unwrap())
        .collect();
    let grpc_ids: Vec<u64> = grpc.token_ids.iter().map(|&i| i as u64).collect();
    assert_eq!(grpc_ids, http_ids);
    for ((lp, &id), entry) in grpc.logprobs.iter().zip(&grpc.token_ids).zip(content) {
        assert_eq!((lp.token_id, lp.top.len(), lp.top[0].token_id), (id, 3, id));
        assert!((lp.logprob as f64 - entry["logprob"].as_f64().unwrap()).abs() < 1e-4);
    }
    assert_eq!(grpc.logprobs.len(), 5);
    stack.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_model_that_cannot_load_fails_ready_with_the_service_named() {
    // The fixture without its weights: config, tokenizer and template only.
    let dir = std::env::temp_dir().join(format!("vlm-stack-noweights-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    for f in std::fs::read_dir(fixture()).unwrap() {
        let p = f.unwrap().path();
        let name = p.file_name().unwrap().to_str().unwrap().to_string();
        if p.is_file() && !name.contains("safetensors") {
            std::fs::copy(&p, dir.join(&name)).unwrap();
        }
    }
    let mut stack = LocalStack::start(StackConfig::loopback(dir), || Ok(CpuBackend::new()))
        .await
        .unwrap();
    let err = stack
        .ready(Duration::from_secs(60))
        .await
        .expect_err("no weights, no service");
    let msg = format!("{err:#}");
    assert!(
        (msg.contains("vision-svc") || msg.contains("llm-svc"))
            && msg.contains("while the local stack was starting")
            && msg.contains("safetensors"),
        "{msg}"
    );
    assert!(
        stack.stop().await.is_err(),
        "the failed service's error comes back"
    );
}

/// The three ways embeddings go from vision-svc to llm-svc, in one process: kept on the device
/// (`vlm serve`'s default: nothing downloaded or sent), through shared memory, and inside the
/// gRPC messages (f32, as the loopback stack asks), and from vision-svc's cache (handed over
/// on the device too). Each gives the tokens `vlm run`'s in-process pipeline gives (on the
/// CPU bit for bit: f32 all the way), and a device handoff leaves nothing held once the
/// request has its answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn embeddings_on_the_device_in_shared_memory_or_in_messages_give_vlm_runs_tokens() {
    check_hops(|| Ok(CpuBackend::new())).await;
}

/// The same on a GPU (skipped without one): the device path and `vlm run` keep the ViT's f32
/// output where the shared-memory and message paths round it to f16, a difference far below
/// what moves a greedy token of the fixture (its logits agree with HF's within 5e-2 on the
/// GPU).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_same_on_a_gpu() {
    if vlm_compute::cuda::test_gpu().is_none() {
        return;
    }
    check_hops(|| vlm_compute::CudaBackend::new(0)).await;
}

async fn check_hops<B: vlm_compute::Backend + Clone>(open: fn() -> vlm_compute::Result<B>) {
    use gateway::chat::{self, Message};
    use vlm_cli::pipeline::Pipeline;

    let image = std::fs::read(fixture().join("images/cat.png")).unwrap();
    let text = "What is in the picture?";
    let png = image.clone();
    // A small cache for each engine: a GPU's pool keeps what the first one frees, so one
    // sized from the free memory would leave none for the next.
    let engine = llm_svc::EngineConfig {
        kv_cache: llm_svc::KvCacheSize::Tokens(4096),
        ..llm_svc::EngineConfig::default()
    };
    let pipeline_engine = engine.clone();
    // The pipeline waits on its engine from a thread outside the runtime, as `vlm run` does.
    let local = tokio::task::spawn_blocking(move || {
        let pipeline = Pipeline::load(&fixture(), open().unwrap(), pipeline_engine).unwrap();
        let request = gateway::request::ChatRequest {
            messages: vec![Message::user(vec![
                chat::Part::Image(png),
                chat::Part::Text(text.into()),
            ])],
            sampling: llm_svc::SamplingParams::greedy(),
            max_new_tokens: 6,
            stop: Vec::new(),
            ignore_eos: true,
            return_logits: false,
            ..Default::default()
        };
        pipeline
            .run(&request, |_, _| std::ops::ControlFlow::Continue(()))
            .unwrap()
            .generated_token_ids
    })
    .await
    .unwrap();

    let request = ChatRequest {
        max_tokens: Some(6),
        temperature: Some(0.0),
        ignore_eos: true,
        ..user_chat(vec![Part::Image(image), Part::Text(text.into())])
    };
    for (device_handoff, shared_memory, path) in [
        (true, true, "device"),
        (false, true, "shm"),
        (false, false, "grpc"),
    ] {
        let mut cfg = StackConfig::loopback(fixture());
        cfg.device_handoff = device_handoff;
        cfg.shared_memory = shared_memory;
        cfg.engine = engine.clone();
        // Every request runs the encoder: the cache would answer the second one.
        cfg.embedding_cache_bytes = 0;
        let mut stack = LocalStack::start(cfg, open).await.unwrap();
        stack.ready(Duration::from_secs(300)).await.unwrap();
        let mut client = GatewayClient::connect(format!("http://{}", stack.grpc_addr))
            .await
            .unwrap();
        // The first answer names llm-svc's domains; the second request can use them.
        for _ in 0..2 {
            let answer = client.chat(request.clone()).await.unwrap().into_inner();
            assert_eq!(answer.token_ids, local, "{path}");
        }
        let page = reqwest::get(format!("http://{}/metrics", stack.http_addr))
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        let counter = format!("vlm_vision_embedding_bytes_total{{path=\"{path}\"}}");
        let sent = page
            .lines()
            .find(|l| l.starts_with(&counter))
            .unwrap_or_else(|| panic!("no {path} embeddings counted:\n{page}"));
        assert!(!sent.ends_with(" 0"), "{sent}");
        assert_eq!(
            vlm_compute::handoff::held(),
            0,
            "{path}: a handoff left held"
        );
        stack.stop().await.unwrap();
    }

    // With the embedding cache: vision-svc caches a host copy of what it handed over (after
    // answering), and hands a hit over on the device too.
    let mut cfg = StackConfig::loopback(fixture());
    cfg.engine = engine.clone();
    let mut stack = LocalStack::start(cfg, open).await.unwrap();
    stack.ready(Duration::from_secs(300)).await.unwrap();
    let mut client = GatewayClient::connect(format!("http://{}", stack.grpc_addr))
        .await
        .unwrap();
    let mut hits = 0.0;
    for _ in 0..100 {
        let answer = client.chat(request.clone()).await.unwrap().into_inner();
        assert_eq!(answer.token_ids, local, "cache");
        hits = metric(stack.http_addr, "vlm_vision_embedding_cache_hits_total").await;
        if hits > 0.0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(hits > 0.0, "the cache never answered");
    assert_eq!(
        vlm_compute::handoff::held(),
        0,
        "cache: a handoff left held"
    );
    stack.stop().await.unwrap();
}

/// `n` choices through both APIs: a seeded sampled request's choices differ from each other,
/// choice 0 is the request of one choice, the streamed choices are the unary ones, the
/// choices after the first find the prompt computed (llm-svc's prefix cache counts their
/// hits), and a stop string ends only the choices whose text holds it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn n_choices_draw_apart_share_the_prompt_and_stop_each_on_its_own() {
    use serde_json::{json, Value};
    let stack = ready_on_cpu(fixture()).await;
    let post = |body: Value| async move {
        let resp = post_chat(stack.http_addr, &body).await;
        assert_eq!(resp.status(), 200);
        resp.text().await.unwrap()
    };
    let hits =
        || async { metric(stack.http_addr, "vlm_llm_prefix_cache_hit_tokens_total").await as u64 };
    // A prompt of several cache blocks (16 tokens each).
    let prompt =
        "Tell me a long story about a lighthouse keeper, the sea, and the ships that pass \
                  by at night, with every detail you can think of.";
    let request = |n: u32, extra: Value| {
        let mut body = json!({
            "messages": [{"role": "user", "content": prompt}],
            "n": n, "seed": 5, "temperature": 1.0, "max_tokens": 16, "ignore_eos": true,
            "return_token_ids": true,
        });
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        body
    };
    let choices = |body: &str| -> Vec<(String, Vec<u64>, String)> {
        let v: Value = serde_json::from_str(body).unwrap();
        v["choices"]
            .as_array()
            .unwrap()
            .iter()
            .enumerate()
            .map(|(i, c)| {
                assert_eq!(c["index"], i, "{body}");
                let ids = c["token_ids"].as_array().unwrap();
                (
                    c["message"]["content"].as_str().unwrap().to_string(),
                    ids.iter().map(|t| t.as_u64().unwrap()).collect(),
                    c["finish_reason"].as_str().unwrap().to_string(),
                )
            })
            .collect()
    };

    let before = hits().await;
    let body = post(request(3, json!({}))).await;
    let three = choices(&body);
    let v: Value = serde_json::from_str(&body).unwrap();
    let prompt_tokens = v["usage"]["prompt_tokens"].as_u64().unwrap();
    assert_eq!(v["usage"]["completion_tokens"], 48, "{body}");
    assert!(prompt_tokens > 32, "{prompt_tokens} prompt tokens");
    // The second and third choices each found every full block but the last token's.
    let full_blocks = (prompt_tokens - 1) / 16 * 16;
    assert_eq!(hits().await - before, 2 * full_blocks, "{body}");
    assert_eq!(three.len(), 3);
    for (i, (_, ids, finish)) in three.iter().enumerate() {
        assert_eq!((ids.len(), finish.as_str()), (16, "length"), "choice {i}");
        for (j, other) in three.iter().enumerate().take(i) {
            assert_ne!(ids, &other.1, "choices {j} and {i} drew alike");
        }
    }
    let one = choices(&post(request(1, json!({}))).await);
    assert_eq!(
        one[0].1, three[0].1,
        "choice 0 is the request of one choice"
    );
    assert_eq!(choices(&post(request(3, json!({}))).await), three, "seeded");

    // Streamed: each choice's chunks carry its index; together they are the unary choices.
    let sse = post(request(3, json!({"stream": true}))).await;
    let mut streamed = vec![(Vec::new(), 0); 3];
    for chunk in sse_chunks(&sse) {
        let c = &chunk["choices"][0];
        let i = c["index"].as_u64().unwrap() as usize;
        if let Some(ids) = c["token_ids"].as_array() {
            streamed[i]
                .0
                .extend(ids.iter().map(|t| t.as_u64().unwrap()));
        }
        streamed[i].1 += c["finish_reason"].is_string() as usize;
    }
    for (i, (ids, finishes)) in streamed.iter().enumerate() {
        assert_eq!((ids, *finishes), (&three[i].1, 1), "choice {i}: {sse}");
    }

    // A stop string found in choice 1's text and not in choice 0's: choice 1 (and any other
    // that holds it) ends before it, choice 0 runs to its length.
    let text1: Vec<char> = three[1].0.chars().collect();
    let stop = text1
        .windows(2)
        .map(|w| w.iter().collect::<String>())
        .find(|s| !three[0].0.contains(s.as_str()) && !s.trim().is_empty())
        .expect("choice 1 has two characters choice 0 lacks");
    let stopped = choices(&post(request(3, json!({ "stop": stop }))).await);
    for (i, ((text, _, _), (cut, _, finish))) in three.iter().zip(&stopped).enumerate() {
        match text.find(&stop) {
            Some(at) => assert_eq!(
                (cut.as_str(), finish.as_str()),
                (&text[..at], "stop"),
                "{i}"
            ),
            None => assert_eq!((cut, finish.as_str()), (text, "length"), "{i}"),
        }
    }
    assert_eq!(stopped[1].2, "stop");

    // gRPC: the same choices.
    let mut client = GatewayClient::connect(format!("http://{}", stack.grpc_addr))
        .await
        .unwrap();
    let grpc = client
        .chat(ChatRequest {
            n: Some(3),
            seed: Some(5),
            temperature: Some(1.0),
            max_tokens: Some(16),
            ignore_eos: true,
            ..user_chat(vec![Part::Text(prompt.into())])
        })
        .await
        .unwrap()
        .into_inner();
    let grpc_ids: Vec<Vec<u64>> = grpc
        .choices
        .iter()
        .map(|c| c.token_ids.iter().map(|&t| t as u64).collect())
        .collect();
    let http_ids: Vec<Vec<u64>> = three.iter().map(|c| c.1.clone()).collect();
    assert_eq!(grpc_ids, http_ids);
    stack.stop().await.unwrap();
}

/// `n` choices of a chat with an image: the image is encoded once and its embeddings go with
/// every choice, whose prompt (image tokens included) is computed once; greedy choices are
/// all the answer of one choice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn n_choices_of_an_image_chat_encode_it_once() {
    let stack = ready_on_cpu(fixture()).await;
    let sample = |name| metric(stack.http_addr, name);
    let image = std::fs::read(fixture().join("images/cat.png")).unwrap();
    let request = |n| ChatRequest {
        n,
        max_tokens: Some(6),
        ignore_eos: true,
        ..user_chat(vec![
            Part::Image(image.clone()),
            Part::Text("What is in the picture?".into()),
        ])
    };
    let mut client = GatewayClient::connect(format!("http://{}", stack.grpc_addr))
        .await
        .unwrap();
    let encodes = "vlm_vision_seconds_count{outcome=\"ok\"}";
    let hits = "vlm_llm_prefix_cache_hit_tokens_total";
    let (encoded, hit) = (sample(encodes).await, sample(hits).await);
    let three = client.chat(request(Some(3))).await.unwrap().into_inner();
    assert_eq!(sample(encodes).await - encoded, 1.0, "encoded once");
    let prompt_tokens = three.usage.unwrap().prompt_tokens as f64;
    let full_blocks = ((prompt_tokens - 1.0) / 16.0).floor() * 16.0;
    assert!(full_blocks >= 16.0, "{prompt_tokens} prompt tokens");
    assert_eq!(sample(hits).await - hit, 2.0 * full_blocks);
    let one = client.chat(request(None)).await.unwrap().into_inner();
    assert_eq!(three.choices.len(), 3);
    for c in &three.choices {
        assert_eq!(c.token_ids, one.token_ids, "greedy: every choice alike");
    }
    assert_eq!(vlm_compute::handoff::held(), 0, "a handoff left held");
    stack.stop().await.unwrap();
}
