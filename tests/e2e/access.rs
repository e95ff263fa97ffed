//! Who gets in, and what tools and collectors see: the three real binaries on loopback with
//! the gateway's API key (HTTP 401 / gRPC UNAUTHENTICATED without it, health and metrics
//! open, the key in no log even at debug level), TLS on the public ports and mutual TLS to the
//! services (with certificates made here by a throwaway CA), clear start-up errors for bad
//! certificate files, gRPC reflection in both v1 and v1alpha on all three servers, and log
//! lines that are JSON when asked and never carry terminal colour codes when piped.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use e2e::{fixture, free_port, Proc};
use futures::StreamExt;
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, KeyPair,
    KeyUsagePurpose,
};
use serde_json::{json, Value};
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint, Identity};
use tonic::Code;
use vlm_proto::pb::gateway_client::GatewayClient;
use vlm_proto::pb::{self, content_part::Part};

const KEY: &str = "vlm-test-key-7f3a9c2e";
const WRONG_KEY: &str = "vlm-wrong-key-0b1d5e88";

fn tmpdir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("vlm-access-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// PEM files of a throwaway CA, a server certificate for 127.0.0.1 and localhost, a client
/// certificate, and a second CA that signed neither.
struct Certs {
    ca: PathBuf,
    server_cert: PathBuf,
    server_key: PathBuf,
    client_cert: PathBuf,
    client_key: PathBuf,
    ca_pem: String,
    client_cert_pem: String,
    client_key_pem: String,
}

fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p
}

impl Certs {
    fn make(dir: &Path) -> Certs {
        let mut ca = CertificateParams::new(Vec::<String>::new()).unwrap();
        ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca.distinguished_name
            .push(DnType::CommonName, "vlm test CA");
        ca.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let ca_key = KeyPair::generate().unwrap();
        let ca_cert = ca.self_signed(&ca_key).unwrap();
        let leaf = |names: Vec<String>, usage: ExtendedKeyUsagePurpose| {
            let mut p = CertificateParams::new(names).unwrap();
            p.extended_key_usages = vec![usage];
            let key = KeyPair::generate().unwrap();
            let cert = p.signed_by(&key, &ca_cert, &ca_key).unwrap();
            (cert.pem(), key.serialize_pem())
        };
        let (server_pem, server_key_pem) = leaf(
            vec!["127.0.0.1".into(), "localhost".into()],
            ExtendedKeyUsagePurpose::ServerAuth,
        );
        let (client_pem, client_key_pem) =
            leaf(vec!["gateway".into()], ExtendedKeyUsagePurpose::ClientAuth);
        Certs {
            ca: write(dir, "ca.pem", &ca_cert.pem()),
            server_cert: write(dir, "server.pem", &server_pem),
            server_key: write(dir, "server-key.pem", &server_key_pem),
            client_cert: write(dir, "client.pem", &client_pem),
            client_key: write(dir, "client-key.pem", &client_key_pem),
            ca_pem: ca_cert.pem(),
            client_cert_pem: client_pem,
            client_key_pem,
        }
    }
}

fn s(v: impl ToString) -> String {
    v.to_string()
}

fn path(p: &Path) -> String {
    p.display().to_string()
}

/// The three binaries, started with extra flags and environment of our own.
struct Stack {
    vision: Proc,
    llm: Proc,
    gateway: Proc,
    vision_port: u16,
    llm_port: u16,
    grpc_port: u16,
    http_port: u16,
}

#[derive(Default)]
struct Options {
    vision_args: Vec<String>,
    llm_args: Vec<String>,
    gateway_args: Vec<String>,
    /// Environment for all three (after the harness's own RUST_LOG=info, NO_COLOR=1).
    env: Vec<(&'static str, String)>,
}

impl Stack {
    fn start(o: Options, dir: &Path) -> Stack {
        let model = path(&fixture());
        let (vp, lp, gp, hp) = (free_port(), free_port(), free_port(), free_port());
        let service = |name: &str, port: u16, extra: &[String]| {
            let mut args = vec![s("--listen"), format!("127.0.0.1:{port}")];
            args.extend([s("--model"), model.clone()]);
            args.extend(extra.iter().cloned());
            Proc::spawn(name, &args, &o.env, dir)
        };
        let vision = service("vision-svc", vp, &o.vision_args);
        let llm = service("llm-svc", lp, &o.llm_args);
        let mut args = vec![
            s("--grpc-listen"),
            format!("127.0.0.1:{gp}"),
            s("--http-listen"),
            format!("127.0.0.1:{hp}"),
            s("--model"),
            model,
            s("--vision-addr"),
            format!("127.0.0.1:{vp}"),
            s("--llm-addr"),
            format!("127.0.0.1:{lp}"),
        ];
        args.extend(o.gateway_args);
        let gateway = Proc::spawn("gateway", &args, &o.env, dir);
        Stack {
            vision,
            llm,
            gateway,
            vision_port: vp,
            llm_port: lp,
            grpc_port: gp,
            http_port: hp,
        }
    }

    /// Waits until `GET {base}/health` (no key) answers 200: both upstreams SERVING.
    async fn wait_healthy(&self, http: &reqwest::Client, base: &str) {
        let end = Instant::now() + Duration::from_secs(90);
        while Instant::now() < end {
            if let Ok(r) = http.get(format!("{base}/health")).send().await {
                if r.status().is_success() {
                    return;
                }
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        panic!(
            "not healthy\n--- gateway ---\n{}\n--- vision ---\n{}\n--- llm ---\n{}",
            self.gateway.log(),
            self.vision.log(),
            self.llm.log()
        );
    }
}

fn chat_body() -> Value {
    json!({"model": "tiny", "max_tokens": 4, "temperature": 0,
           "messages": [{"role": "user", "content": "Hello"}]})
}

fn grpc_chat() -> pb::ChatRequest {
    pb::ChatRequest {
        messages: vec![pb::ChatMessage {
            role: "user".into(),
            content: vec![pb::ContentPart {
                part: Some(Part::Text("Hello".into())),
            }],
            ..Default::default()
        }],
        max_tokens: Some(4),
        temperature: Some(0.0),
        ..Default::default()
    }
}

/// A gRPC request with `authorization: Bearer <key>` when a key is given.
fn with_key<T>(msg: T, key: Option<&str>) -> tonic::Request<T> {
    let mut r = tonic::Request::new(msg);
    if let Some(k) = key {
        r.metadata_mut()
            .insert("authorization", format!("Bearer {k}").parse().unwrap());
    }
    r
}

async fn channel(url: String, tls: Option<ClientTlsConfig>) -> Result<Channel, String> {
    let mut ep = Endpoint::from_shared(url).unwrap();
    if let Some(tls) = tls {
        ep = ep.tls_config(tls).unwrap();
    }
    ep.connect_timeout(Duration::from_secs(5))
        .connect()
        .await
        .map_err(|e| format!("{e:?}"))
}

async fn health_status(ch: Channel) -> Result<i32, tonic::Status> {
    tonic_health::pb::health_client::HealthClient::new(ch)
        .check(tonic_health::pb::HealthCheckRequest {
            service: String::new(),
        })
        .await
        .map(|r| r.into_inner().status)
}

/// The services reflection lists on `ch`, through `grpc.reflection.v1` or `v1alpha`.
macro_rules! list_services {
    ($version:ident, $ch:expr) => {{
        use tonic_reflection::pb::$version::server_reflection_client::ServerReflectionClient;
        use tonic_reflection::pb::$version::server_reflection_request::MessageRequest;
        use tonic_reflection::pb::$version::server_reflection_response::MessageResponse;
        use tonic_reflection::pb::$version::ServerReflectionRequest;
        let req = ServerReflectionRequest {
            host: String::new(),
            message_request: Some(MessageRequest::ListServices(String::new())),
        };
        let mut resp = ServerReflectionClient::new($ch)
            .server_reflection_info(tokio_stream::once(req))
            .await
            .expect(concat!("reflection ", stringify!($version), " answers"))
            .into_inner();
        match resp.next().await.unwrap().unwrap().message_response {
            Some(MessageResponse::ListServicesResponse(list)) => list
                .service
                .into_iter()
                .map(|s| s.name)
                .collect::<Vec<String>>(),
            other => panic!("no service list: {other:?}"),
        }
    }};
}

/// With a key set (from a file), at debug log level: HTTP without, with a wrong and with the
/// right key gives 401, 401, 200; gRPC UNAUTHENTICATED, UNAUTHENTICATED, OK; health, metrics
/// and reflection answer without it; and no process logs the key or the wrong one. The same
/// stack shows reflection v1 and v1alpha on all three servers, JSON logs from vision-svc
/// (`--log-format json`), and no colour codes in any piped log even with NO_COLOR unset.
#[tokio::test(flavor = "multi_thread")]
async fn the_api_key_guards_http_and_grpc_and_never_reaches_the_logs() {
    let dir = tmpdir("key");
    let key_file = write(&dir, "api-key", &format!("{KEY}\n"));
    let stack = Stack::start(
        Options {
            vision_args: vec![s("--log-format"), s("json")],
            gateway_args: vec![s("--api-key-file"), path(&key_file)],
            env: vec![("RUST_LOG", s("debug")), ("NO_COLOR", s(""))],
            ..Default::default()
        },
        &dir,
    );
    let http = reqwest::Client::new();
    let base = format!("http://127.0.0.1:{}", stack.http_port);
    stack.wait_healthy(&http, &base).await;

    // HTTP.
    let chat = |key: Option<&str>| {
        let mut r = http
            .post(format!("{base}/v1/chat/completions"))
            .json(&chat_body());
        if let Some(k) = key {
            r = r.bearer_auth(k);
        }
        r.send()
    };
    for (key, label) in [(None, "no key"), (Some(WRONG_KEY), "a wrong key")] {
        let r = chat(key).await.unwrap();
        assert_eq!(r.status(), 401, "{label}");
        let challenge = r.headers()["www-authenticate"]
            .to_str()
            .unwrap()
            .to_string();
        assert!(challenge.starts_with("Bearer"), "{challenge}");
        let body: Value = r.json().await.unwrap();
        assert_eq!(body["error"]["code"], "invalid_api_key", "{body}");
        assert_eq!(body["error"]["type"], "invalid_request_error", "{body}");
        assert!(!body.to_string().contains(KEY), "{body}");
    }
    let r = chat(Some(KEY)).await.unwrap();
    assert_eq!(r.status(), 200);
    let body: Value = r.json().await.unwrap();
    assert!(
        body["choices"][0]["message"]["content"].is_string(),
        "{body}"
    );
    // A header that is not `Bearer <key>` (the key alone) is refused too.
    let r = http
        .get(format!("{base}/v1/models"))
        .header("authorization", KEY)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401);
    let r = http
        .get(format!("{base}/v1/models"))
        .bearer_auth(KEY)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    for open in ["health", "metrics"] {
        let r = http.get(format!("{base}/{open}")).send().await.unwrap();
        assert_eq!(r.status(), 200, "/{open} stays open");
    }

    // gRPC.
    let grpc = format!("http://127.0.0.1:{}", stack.grpc_port);
    let ch = channel(grpc.clone(), None).await.unwrap();
    let mut client = GatewayClient::new(ch.clone());
    for key in [None, Some(WRONG_KEY)] {
        let status = client.chat(with_key(grpc_chat(), key)).await.unwrap_err();
        assert_eq!(status.code(), Code::Unauthenticated, "{status:?}");
        assert!(!status.message().contains(KEY));
        let status = client
            .chat_stream(with_key(grpc_chat(), key))
            .await
            .unwrap_err();
        assert_eq!(status.code(), Code::Unauthenticated, "{status:?}");
    }
    let answer = client
        .chat(with_key(grpc_chat(), Some(KEY)))
        .await
        .unwrap()
        .into_inner();
    assert!(answer.usage.unwrap().completion_tokens > 0);
    assert_eq!(
        health_status(ch.clone()).await.unwrap(),
        tonic_health::pb::health_check_response::ServingStatus::Serving as i32,
        "grpc.health.v1 answers without the key"
    );

    // Reflection, both versions, on all three servers (the gateway's without the key).
    for (port, service) in [
        (stack.grpc_port, "vlm.v1.Gateway"),
        (stack.vision_port, "vlm.v1.VisionService"),
        (stack.llm_port, "vlm.v1.LlmService"),
    ] {
        let ch = channel(format!("http://127.0.0.1:{port}"), None)
            .await
            .unwrap();
        for names in [
            list_services!(v1, ch.clone()),
            list_services!(v1alpha, ch.clone()),
        ] {
            for want in [service, "grpc.health.v1.Health"] {
                assert!(names.iter().any(|n| n == want), "{port}: {names:?}");
            }
        }
    }

    // Logs: debug level, no key, no colour codes; vision-svc's every line is JSON.
    let logs = [
        ("gateway", stack.gateway.log()),
        ("vision-svc", stack.vision.log()),
        ("llm-svc", stack.llm.log()),
    ];
    for (name, log) in &logs {
        assert!(
            log.contains("DEBUG") || log.contains("\"DEBUG\""),
            "{name}: not at debug level"
        );
        for secret in [KEY, WRONG_KEY] {
            assert!(!log.contains(secret), "{name} logged an API key:\n{log}");
        }
        assert!(
            !log.contains("\x1b["),
            "{name}: colour codes in a piped log"
        );
    }
    let vision_log = &logs[1].1;
    let mut lines = 0;
    for line in vision_log.lines().filter(|l| !l.trim().is_empty()) {
        let v: Value = serde_json::from_str(line)
            .unwrap_or_else(|e| panic!("vision-svc log line is not JSON ({e}): {line}"));
        assert!(
            v["level"].is_string() && v["timestamp"].is_string(),
            "{line}"
        );
        lines += 1;
    }
    assert!(
        vision_log.contains("\"message\":\"ready; serving\""),
        "{vision_log}"
    );
    eprintln!("vision-svc: {lines} JSON log lines");
}

/// HTTPS and gRPC over TLS on the gateway's public ports, mutual TLS from the gateway to both
/// services: the services refuse a client without a certificate (or plaintext), accept one
/// with a certificate from the CA, and the whole chain answers a chat.
#[tokio::test(flavor = "multi_thread")]
async fn tls_on_the_public_ports_and_mutual_tls_to_the_services() {
    let dir = tmpdir("tls");
    let c = Certs::make(&dir);
    let service_tls = vec![
        s("--tls-cert"),
        path(&c.server_cert),
        s("--tls-key"),
        path(&c.server_key),
        s("--tls-client-ca"),
        path(&c.ca),
    ];
    let stack = Stack::start(
        Options {
            vision_args: service_tls.clone(),
            llm_args: service_tls,
            gateway_args: vec![
                s("--tls-cert"),
                path(&c.server_cert),
                s("--tls-key"),
                path(&c.server_key),
                s("--upstream-tls-ca"),
                path(&c.ca),
                s("--upstream-tls-cert"),
                path(&c.client_cert),
                s("--upstream-tls-key"),
                path(&c.client_key),
            ],
            ..Default::default()
        },
        &dir,
    );
    let https = reqwest::Client::builder()
        .add_root_certificate(reqwest::Certificate::from_pem(c.ca_pem.as_bytes()).unwrap())
        .build()
        .unwrap();
    let base = format!("https://127.0.0.1:{}", stack.http_port);
    // Healthy over HTTPS means the gateway reached both services over mutual TLS.
    stack.wait_healthy(&https, &base).await;
    let r = https
        .post(format!("{base}/v1/chat/completions"))
        .json(&chat_body())
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let body: Value = r.json().await.unwrap();
    assert!(
        body["usage"]["completion_tokens"].as_u64().unwrap() > 0,
        "{body}"
    );
    // Plain HTTP to the HTTPS port gets no answer; a client that does not trust the CA
    // cannot connect.
    let plain = reqwest::Client::new()
        .get(format!("http://127.0.0.1:{}/health", stack.http_port))
        .timeout(Duration::from_secs(5))
        .send()
        .await;
    assert!(plain.is_err() || !plain.unwrap().status().is_success());
    assert!(reqwest::Client::new()
        .get(format!("{base}/health"))
        .send()
        .await
        .is_err());

    // gRPC over TLS to the gateway.
    let ca = Certificate::from_pem(&c.ca_pem);
    let trust = ClientTlsConfig::new().ca_certificate(ca.clone());
    let ch = channel(
        format!("https://127.0.0.1:{}", stack.grpc_port),
        Some(trust.clone()),
    )
    .await
    .unwrap();
    let answer = GatewayClient::new(ch)
        .chat(grpc_chat())
        .await
        .unwrap()
        .into_inner();
    assert!(answer.usage.unwrap().completion_tokens > 0);

    // The services: only a client with a certificate from the CA gets in.
    let identity = Identity::from_pem(&c.client_cert_pem, &c.client_key_pem);
    for port in [stack.vision_port, stack.llm_port] {
        let url = format!("https://127.0.0.1:{port}");
        // Without a client certificate the handshake or the first call fails.
        let refused = match channel(url.clone(), Some(trust.clone())).await {
            Err(_) => true,
            Ok(ch) => health_status(ch).await.is_err(),
        };
        assert!(refused, "{port} admitted a client without a certificate");
        let plaintext = match channel(format!("http://127.0.0.1:{port}"), None).await {
            Err(_) => true,
            Ok(ch) => health_status(ch).await.is_err(),
        };
        assert!(plaintext, "{port} answered plaintext");
        let ch = channel(url, Some(trust.clone().identity(identity.clone())))
            .await
            .unwrap();
        assert_eq!(
            health_status(ch).await.unwrap(),
            tonic_health::pb::health_check_response::ServingStatus::Serving as i32
        );
        // `vlm health`, the containers' check, with and without a client certificate.
        let mut check = vec![
            s("health"),
            s("--addr"),
            format!("127.0.0.1:{port}"),
            s("--tls-ca"),
            path(&c.ca),
        ];
        let alone = std::process::Command::new(e2e::bin("vlm"))
            .args(&check)
            .output()
            .unwrap();
        assert!(!alone.status.success(), "vlm health without a certificate");
        check.extend([
            s("--tls-cert"),
            path(&c.client_cert),
            s("--tls-key"),
            path(&c.client_key),
        ]);
        let out = std::process::Command::new(e2e::bin("vlm"))
            .args(&check)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "vlm health {check:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        // --tls-domain is the name checked: one the certificate does not carry fails.
        let misnamed = std::process::Command::new(e2e::bin("vlm"))
            .args(&check)
            .args(["--tls-domain", "vision-svc"])
            .output()
            .unwrap();
        assert!(
            !misnamed.status.success(),
            "a certificate for another name passed"
        );
    }
}

/// Runs `bin` with `args` until it exits (it must, before loading anything); its stderr.
fn start_error(bin: &str, args: &[String]) -> String {
    let out = std::process::Command::new(e2e::bin(bin))
        .args(args)
        .env("NO_COLOR", "1")
        .output()
        .unwrap();
    assert!(!out.status.success(), "{bin} {args:?} started");
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// A missing, non-PEM or mismatched certificate or key stops each binary at once with an
/// error that names the file.
#[test]
fn bad_certificate_files_stop_the_start_naming_the_file() {
    let dir = tmpdir("bad-certs");
    let c = Certs::make(&dir);
    let junk = write(&dir, "junk.pem", "not a certificate\n");
    let missing = dir.join("missing.pem");
    let model = path(&fixture());
    let gateway = |cert: &Path, key: &Path| {
        let port = free_port();
        vec![
            s("--model"),
            model.clone(),
            s("--grpc-listen"),
            format!("127.0.0.1:{port}"),
            s("--http-listen"),
            format!("127.0.0.1:{}", free_port()),
            s("--tls-cert"),
            path(cert),
            s("--tls-key"),
            path(key),
        ]
    };
    let cases: Vec<(&str, Vec<String>, PathBuf, &str)> = vec![
        (
            "gateway",
            gateway(&missing, &c.server_key),
            missing.clone(),
            "cannot read the TLS certificate",
        ),
        (
            "gateway",
            gateway(&junk, &c.server_key),
            junk.clone(),
            "holds no PEM certificate",
        ),
        (
            "gateway",
            gateway(&c.server_cert, &junk),
            junk.clone(),
            "holds no usable private key",
        ),
        (
            "gateway",
            gateway(&c.server_cert, &c.client_key),
            c.client_key.clone(),
            "does not go with the certificate",
        ),
        (
            "vision-svc",
            vec![
                s("--model"),
                model.clone(),
                s("--listen"),
                format!("127.0.0.1:{}", free_port()),
                s("--tls-cert"),
                path(&c.server_cert),
                s("--tls-key"),
                path(&c.server_key),
                s("--tls-client-ca"),
                path(&missing),
            ],
            missing.clone(),
            "cannot read the client CA certificate",
        ),
        (
            "llm-svc",
            vec![
                s("--model"),
                model.clone(),
                s("--listen"),
                format!("127.0.0.1:{}", free_port()),
                s("--tls-cert"),
                path(&junk),
                s("--tls-key"),
                path(&c.server_key),
            ],
            junk.clone(),
            "holds no PEM certificate",
        ),
        (
            "gateway",
            {
                let mut a = gateway(&c.server_cert, &c.server_key);
                a.extend([s("--api-key-file"), path(&missing)]);
                a
            },
            missing.clone(),
            "cannot read the API key file",
        ),
    ];
    for (bin, args, file, what) in cases {
        let err = start_error(bin, &args);
        assert!(
            err.contains(what) && err.contains(&path(&file)),
            "{bin}: want {what:?} naming {}, got:\n{err}",
            file.display()
        );
    }
}

/// `vlm serve` takes the same key: 401 without it, 200 with it, /health open.
#[tokio::test(flavor = "multi_thread")]
async fn vlm_serve_takes_the_api_key_too() {
    let dir = tmpdir("serve");
    let (hp, gp) = (free_port(), free_port());
    let serve = Proc::spawn(
        "vlm",
        &[
            s("serve"),
            s("--model"),
            path(&fixture()),
            s("--http-port"),
            s(hp),
            s("--grpc-port"),
            s(gp),
        ],
        &[("VLM_API_KEY", s(KEY))],
        &dir,
    );
    let http = reqwest::Client::new();
    let base = format!("http://127.0.0.1:{hp}");
    let end = Instant::now() + Duration::from_secs(90);
    loop {
        if let Ok(r) = http.get(format!("{base}/health")).send().await {
            if r.status().is_success() {
                break;
            }
        }
        assert!(
            Instant::now() < end,
            "vlm serve not healthy:\n{}",
            serve.log()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let models = |key: Option<&str>| {
        let mut r = http.get(format!("{base}/v1/models"));
        if let Some(k) = key {
            r = r.bearer_auth(k);
        }
        r.send()
    };
    assert_eq!(models(None).await.unwrap().status(), 401);
    assert_eq!(models(Some(WRONG_KEY)).await.unwrap().status(), 401);
    assert_eq!(models(Some(KEY)).await.unwrap().status(), 200);
    let status = GatewayClient::new(
        channel(format!("http://127.0.0.1:{gp}"), None)
            .await
            .unwrap(),
    )
    .chat(grpc_chat())
    .await
    .unwrap_err();
    assert_eq!(status.code(), Code::Unauthenticated);
    assert!(!serve.log().contains(KEY));
}
