//! Test support: start the real `vision-svc`, `llm-svc` and `gateway` binaries on free loopback
//! ports, with their logs in files, and an in-test OTLP receiver that collects their spans.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

pub mod clients;

use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};

pub fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("fixtures/tiny-qwen3-vl")
}

/// A workspace binary, built next to this test executable by `cargo test --workspace` (or in
/// `VLM_E2E_BIN_DIR`, for a cargo whose `build-dir` keeps test executables elsewhere).
pub fn bin(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("test executable path");
    let dir = std::env::var_os("VLM_E2E_BIN_DIR").map_or_else(
        || {
            exe.parent()
                .and_then(Path::parent)
                .expect("target/<profile>/deps/..")
                .to_path_buf()
        },
        PathBuf::from,
    );
    let path = dir.join(name);
    assert!(
        path.is_file(),
        "{} is missing: run the tests with `cargo test --workspace`, which builds every binary",
        path.display()
    );
    path
}

/// A port nobody listens on right now, for a service started next.
///
/// Taken below Linux's ephemeral range (32768 and up): a port the kernel hands out with
/// `bind(0)` can be taken, before the service binds it, as the local port of some outgoing
/// connection, which made the stack fail to start now and then. Ports here are only ever
/// used by a bind, and the counter keeps the tests of one process from picking the same one.
pub fn free_port() -> u16 {
    use std::sync::atomic::{AtomicU16, Ordering};
    static NEXT: AtomicU16 = AtomicU16::new(0);
    // Test binaries run one after another; spread each over its own stretch anyway.
    let base = 20_000 + (std::process::id() % 100) as u16 * 120;
    for _ in 0..12_000 {
        let port = 20_000 + (base - 20_000 + NEXT.fetch_add(1, Ordering::Relaxed)) % 12_000;
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
    panic!("no free port between 20000 and 32000")
}

/// A running service binary; killed when dropped.
pub struct Proc {
    pub name: String,
    child: Option<Child>,
    log: PathBuf,
}

impl Proc {
    pub fn spawn(name: &str, args: &[String], env: &[(&str, String)], dir: &Path) -> Proc {
        let log = dir.join(format!("{name}-{}.log", free_port()));
        let file = std::fs::File::create(&log).expect("log file");
        let mut cmd = Command::new(bin(name));
        cmd.args(args)
            .env("RUST_LOG", "info")
            .env("NO_COLOR", "1")
            .stdout(Stdio::null())
            .stderr(file);
        for (k, v) in env {
            cmd.env(k, v);
        }
        let child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {name}: {e}"));
        Proc {
            name: name.to_string(),
            child: Some(child),
            log,
        }
    }

    /// The process id (for reading its memory use from /proc).
    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("running").id()
    }

    /// Everything the process logged so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Waits until the log contains `needle`, up to `timeout`.
    pub async fn wait_for_log(&self, needle: &str, timeout: Duration) -> bool {
        let end = Instant::now() + timeout;
        while Instant::now() < end {
            if self.log().contains(needle) {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        false
    }

    /// Sends `signal` (a `kill` name: "TERM", "KILL", "STOP") without waiting.
    pub fn signal(&self, signal: &str) {
        let pid = self.pid().to_string();
        let ok = Command::new("kill")
            .args([&format!("-{signal}"), &pid])
            .status()
            .is_ok_and(|s| s.success());
        assert!(ok, "kill -{signal} {pid} ({}) failed", self.name);
    }

    /// `kill -9`, then reaps the process (its port is free when this returns).
    pub fn kill9(&mut self) {
        self.signal("KILL");
        let mut child = self.child.take().expect("running");
        let _ = child.wait();
    }

    /// Whether the process is still running (false once it has exited or been killed).
    pub fn alive(&mut self) -> bool {
        self.child
            .as_mut()
            .is_some_and(|c| c.try_wait().ok().flatten().is_none())
    }

    /// The exit status once the process exits, or `None` if it is still running after
    /// `timeout` (it is left running).
    pub async fn wait_exit(&mut self, timeout: Duration) -> Option<ExitStatus> {
        let end = Instant::now() + timeout;
        loop {
            if let Some(status) = self
                .child
                .as_mut()
                .expect("running")
                .try_wait()
                .expect("wait")
            {
                self.child = None;
                return Some(status);
            }
            if Instant::now() > end {
                return None;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Resident memory, in KiB.
    pub fn rss_kib(&self) -> Option<u64> {
        rss_kib(self.pid())
    }

    /// SIGTERM, then the exit status (killed after 10 s).
    pub async fn terminate(&mut self) -> ExitStatus {
        let mut child = self.child.take().expect("running");
        let _ = Command::new("kill")
            .args(["-TERM", &child.id().to_string()])
            .status();
        let end = Instant::now() + Duration::from_secs(10);
        loop {
            if let Some(status) = child.try_wait().expect("wait") {
                return status;
            }
            if Instant::now() > end {
                let _ = child.kill();
                return child.wait().expect("wait");
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

#[derive(Default, Clone)]
pub struct StackOptions {
    pub gateway_args: Vec<String>,
    pub llm_args: Vec<String>,
    /// OTLP endpoint for all three (an [`OtlpReceiver`]).
    pub otlp: Option<String>,
    /// Leave llm-svc out (its port is still reserved in `llm_port`).
    pub without_llm: bool,
    pub vision_args: Vec<String>,
    /// Give vision-svc and llm-svc a `--metrics-listen` port each (`Stack::vision_metrics`,
    /// `Stack::llm_metrics`).
    pub service_metrics: bool,
}

pub struct Stack {
    pub vision: Proc,
    pub vision_port: u16,
    pub llm: Option<Proc>,
    pub gateway: Proc,
    pub grpc: String,
    pub http: String,
    pub llm_port: u16,
    pub dir: PathBuf,
    /// URL of vision-svc's `/metrics` (with `StackOptions::service_metrics`).
    pub vision_metrics: Option<String>,
    /// URL of llm-svc's `/metrics` (with `StackOptions::service_metrics`).
    pub llm_metrics: Option<String>,
    env: Vec<(&'static str, String)>,
    llm_args: Vec<String>,
    vision_args: Vec<String>,
}

fn spawn_vision(port: u16, extra: &[String], env: &[(&str, String)], dir: &Path) -> Proc {
    let mut args = vec![
        "--listen".to_string(),
        format!("127.0.0.1:{port}"),
        "--model".to_string(),
        fixture().display().to_string(),
    ];
    args.extend(extra.iter().cloned());
    Proc::spawn("vision-svc", &args, env, dir)
}

/// Resident memory of process `pid` (VmRSS of /proc/<pid>/status), in KiB.
pub fn rss_kib(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
}

/// The text of a Prometheus `/metrics` page.
pub async fn metrics_page(url: &str) -> String {
    reqwest::get(url)
        .await
        .unwrap_or_else(|e| panic!("GET {url}: {e}"))
        .text()
        .await
        .unwrap_or_else(|e| panic!("GET {url}: {e}"))
}

/// One sample of a Prometheus text page, by its full name with labels (0 when absent, as
/// Prometheus shows a labelled series only once it has been touched).
pub fn metric(page: &str, sample: &str) -> f64 {
    page.lines()
        .find_map(|l| {
            l.strip_prefix(sample)?
                .strip_prefix(' ')?
                .trim()
                .parse()
                .ok()
        })
        .unwrap_or(0.0)
}

fn tmpdir() -> PathBuf {
    let d = std::env::temp_dir().join(format!("vlm-e2e-{}-{}", std::process::id(), free_port()));
    std::fs::create_dir_all(&d).expect("temp dir");
    d
}

impl Stack {
    pub async fn start(opts: StackOptions) -> Stack {
        let dir = tmpdir();
        let model = fixture().display().to_string();
        let (vp, lp, gp, hp) = (free_port(), free_port(), free_port(), free_port());
        let mut env: Vec<(&'static str, String)> = vec![("OTEL_BSP_SCHEDULE_DELAY", "50".into())];
        if let Some(ep) = &opts.otlp {
            env.push(("OTEL_EXPORTER_OTLP_ENDPOINT", ep.clone()));
        }
        let s = |v: &str| v.to_string();
        let (mut vision_args, mut llm_args) = (opts.vision_args.clone(), opts.llm_args.clone());
        let (mut vision_metrics, mut llm_metrics) = (None, None);
        if opts.service_metrics {
            let (vm, lm) = (free_port(), free_port());
            vision_args.extend([s("--metrics-listen"), format!("127.0.0.1:{vm}")]);
            llm_args.extend([s("--metrics-listen"), format!("127.0.0.1:{lm}")]);
            vision_metrics = Some(format!("http://127.0.0.1:{vm}/metrics"));
            llm_metrics = Some(format!("http://127.0.0.1:{lm}/metrics"));
        }
        let vision = spawn_vision(vp, &vision_args, &env, &dir);
        let mut gw_args = vec![
            s("--grpc-listen"),
            format!("127.0.0.1:{gp}"),
            s("--http-listen"),
            format!("127.0.0.1:{hp}"),
            s("--model"),
            model.clone(),
            s("--vision-addr"),
            format!("127.0.0.1:{vp}"),
            s("--llm-addr"),
            format!("127.0.0.1:{lp}"),
        ];
        gw_args.extend(opts.gateway_args.iter().cloned());
        let gateway = Proc::spawn("gateway", &gw_args, &env, &dir);
        let mut stack = Stack {
            vision,
            vision_port: vp,
            llm: None,
            gateway,
            grpc: format!("http://127.0.0.1:{gp}"),
            http: format!("http://127.0.0.1:{hp}"),
            llm_port: lp,
            dir,
            vision_metrics,
            llm_metrics,
            env,
            llm_args,
            vision_args,
        };
        if opts.without_llm {
            stack.wait_listening(Duration::from_secs(30)).await;
        } else {
            stack.start_llm();
            stack.wait_healthy(Duration::from_secs(60)).await;
        }
        stack
    }

    /// URL of vision-svc's gRPC port.
    pub fn vision_addr(&self) -> String {
        format!("http://127.0.0.1:{}", self.vision_port)
    }

    /// Starts vision-svc again on its port (after it was killed or stopped).
    pub fn restart_vision(&mut self) {
        self.vision = spawn_vision(self.vision_port, &self.vision_args, &self.env, &self.dir);
    }

    /// Starts llm-svc on the reserved port (again).
    pub fn start_llm(&mut self) {
        let mut args = vec![
            "--listen".to_string(),
            format!("127.0.0.1:{}", self.llm_port),
            "--model".to_string(),
            fixture().display().to_string(),
        ];
        args.extend(self.llm_args.iter().cloned());
        self.llm = Some(Proc::spawn("llm-svc", &args, &self.env, &self.dir));
    }

    /// Waits until the gateway answers HTTP at all (healthy or not).
    pub async fn wait_listening(&self, timeout: Duration) {
        let end = Instant::now() + timeout;
        while Instant::now() < end {
            if reqwest::get(format!("{}/health", self.http)).await.is_ok() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        panic!(
            "gateway not listening after {timeout:?}:\n{}",
            self.gateway.log()
        );
    }

    /// Waits until the gateway's /health reports every upstream SERVING.
    pub async fn wait_healthy(&self, timeout: Duration) {
        let end = Instant::now() + timeout;
        let client = reqwest::Client::new();
        while Instant::now() < end {
            if let Ok(r) = client.get(format!("{}/health", self.http)).send().await {
                if r.status().is_success() {
                    return;
                }
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        panic!(
            "stack not healthy after {timeout:?}\n--- gateway ---\n{}\n--- vision ---\n{}\n--- llm ---\n{}",
            self.gateway.log(),
            self.vision.log(),
            self.llm.as_ref().map(|l| l.log()).unwrap_or_default()
        );
    }
}

/// One span as received over OTLP, flattened.
#[derive(Clone, Debug)]
pub struct ReceivedSpan {
    pub service: String,
    pub name: String,
    pub trace_id: Vec<u8>,
    pub span_id: Vec<u8>,
    pub parent_span_id: Vec<u8>,
    /// Its string attributes, as (key, value).
    pub strings: Vec<(String, String)>,
}

impl ReceivedSpan {
    /// The string attribute `key`, if the span has one.
    pub fn string(&self, key: &str) -> Option<&str> {
        self.strings
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }
}

/// The value of an OTLP attribute that is a string.
fn string_value(v: &opentelemetry_proto::tonic::common::v1::AnyValue) -> Option<String> {
    match &v.value {
        Some(opentelemetry_proto::tonic::common::v1::any_value::Value::StringValue(s)) => {
            Some(s.clone())
        }
        _ => None,
    }
}

/// A minimal OTLP/gRPC trace collector listening on loopback.
#[derive(Clone, Default)]
pub struct OtlpReceiver {
    pub spans: Arc<Mutex<Vec<ReceivedSpan>>>,
}

#[tonic::async_trait]
impl TraceService for OtlpReceiver {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        let mut out = self.spans.lock().expect("lock");
        for rs in request.into_inner().resource_spans {
            let service = rs
                .resource
                .as_ref()
                .and_then(|r| r.attributes.iter().find(|a| a.key == "service.name"))
                .and_then(|a| a.value.as_ref())
                .and_then(string_value)
                .unwrap_or_default();
            for ss in rs.scope_spans {
                for sp in ss.spans {
                    out.push(ReceivedSpan {
                        service: service.clone(),
                        name: sp.name,
                        trace_id: sp.trace_id,
                        span_id: sp.span_id,
                        parent_span_id: sp.parent_span_id,
                        strings: sp
                            .attributes
                            .iter()
                            .filter_map(|a| Some((a.key.clone(), string_value(a.value.as_ref()?)?)))
                            .collect(),
                    });
                }
            }
        }
        Ok(tonic::Response::new(ExportTraceServiceResponse {
            partial_success: None,
        }))
    }
}

impl OtlpReceiver {
    /// Starts the receiver on a free loopback port; returns it and its endpoint URL.
    pub async fn start() -> (OtlpReceiver, String) {
        Self::start_at("127.0.0.1:0").await
    }

    /// Starts the receiver on `addr` (host:port); returns it and its endpoint URL.
    pub async fn start_at(addr: &str) -> (OtlpReceiver, String) {
        let recv = OtlpReceiver::default();
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .unwrap_or_else(|e| panic!("cannot bind the OTLP receiver to {addr}: {e}"));
        let addr = listener.local_addr().expect("addr");
        let svc = TraceServiceServer::new(recv.clone());
        tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(svc)
                .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
        );
        (recv, format!("http://{addr}"))
    }
}
