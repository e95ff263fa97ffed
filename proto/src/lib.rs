//! The shared contract and plumbing of the three services.
//!
//! - [`pb`]: the generated `vlm.v1` messages, clients and servers (`proto/vlm/v1/vlm.proto`).
//! - [`tensor`]: raw little-endian f32/f16/bf16 tensors on the wire.
//! - [`metrics`]: Prometheus metrics served over HTTP.
//! - [`telemetry`]: logs and traces for every process, OpenTelemetry export, and W3C trace
//!   context carried in gRPC metadata so one request is one trace across processes.
//! - [`tls`]: TLS and mutual TLS on the gRPC hops and the gateway's HTTPS port.
//! - [`shm`]: the same-host path for embeddings (shared memory instead of gRPC bytes);
//!   [`headers`]: the metadata names in which llm-svc names its domains.
//! - [`sampling`]: a request's sampling parameters, their limits and checks, on the wire;
//!   [`constraint`]: how JSON written under a grammar is laid out.
//! - [`image`]: which images are accepted and how many prompt tokens each becomes;
//!   [`checkpoint`]: reading the checkpoint's JSON files it takes its settings from.
//! - [`MAX_MESSAGE_BYTES`] and [`shutdown_signal`], which every server uses, and
//!   [`service_main`], the process of each model service.

pub mod checkpoint;
pub mod constraint;
pub mod headers;
pub mod image;
pub mod metrics;
pub mod prefix;
pub mod sampling;
pub mod shm;
pub mod telemetry;
pub mod tensor;
pub mod tls;

/// Generated from `proto/vlm/v1/vlm.proto`.
pub mod pb {
    tonic::include_proto!("vlm.v1");

    /// Encoded file descriptor set, for gRPC reflection.
    pub const FILE_DESCRIPTOR_SET: &[u8] = tonic::include_file_descriptor_set!("vlm_descriptor");

    /// An image's tensors, in the order they travel (and share a segment): the embeddings,
    /// then each DeepStack feature.
    macro_rules! image_tensors {
        ($message:ty) => {
            impl $message {
                pub fn tensors(&self) -> impl Iterator<Item = &Tensor> {
                    self.embeddings.iter().chain(&self.deepstack)
                }

                pub fn tensors_mut(&mut self) -> impl Iterator<Item = &mut Tensor> {
                    self.embeddings.iter_mut().chain(self.deepstack.iter_mut())
                }

                /// Bytes of all its tensors' values, inside the message or in shared memory.
                pub fn payload_bytes(&self) -> usize {
                    self.tensors().map(crate::tensor::payload_bytes).sum()
                }

                /// Whether its embeddings wait upstream, named by a shared-memory segment or a
                /// device handoff, instead of travelling inside the message: the first llm-svc
                /// that gets it takes them, and a request that fails first lets them go.
                pub fn held_by_name(&self) -> bool {
                    !self.shm_segment.is_empty() || self.device_handle != 0
                }
            }
        };
    }
    image_tensors!(EncodeResponse);
    image_tensors!(ImageEmbeddings);

    impl ImageEmbeddings {
        /// Lets go of what it holds by name that any process on the host may let go of: its
        /// shared-memory segment, removed. A device handoff belongs to the process that made
        /// it (only that process can free it, and it expires there), so a caller outside it
        /// can do no more. Its embeddings are then gone for whoever would have taken them.
        pub fn release_on_host(&self) {
            drop(crate::shm::Segment::new(&self.shm_segment));
        }
    }
}

/// Largest gRPC message any of our servers or clients sends or accepts: 256 MiB. Embeddings
/// of a large image at 8B sizes reach ~60 MiB in f16 (see the .proto header), images up to the
/// decoder's 64 Mpx limit can be large too; tonic's 4 MiB default would refuse both.
pub const MAX_MESSAGE_BYTES: usize = 256 * 1024 * 1024;

/// HTTP/2 flow control for the hops between the services, which carry megabytes of embeddings
/// in one message: with hyper's defaults (1-2 MiB windows, 16 KiB frames) a 448x448 image's
/// 6.4 MB crosses in ~400 frames and several window round trips, a large image's 60 MB in
/// thousands. Windows are credit, not buffers allocated up front. Only the model services and
/// the gateway's clients of them use these: the public ports keep the defaults, so a client
/// cannot make the gateway hold more for it.
pub mod internal_hop {
    /// Bytes a stream may have in flight before the receiver acknowledges them.
    pub const STREAM_WINDOW: u32 = 16 << 20;
    /// The same for all streams of one connection.
    pub const CONNECTION_WINDOW: u32 = 64 << 20;
    /// Largest HTTP/2 DATA frame the receiver accepts.
    pub const MAX_FRAME: u32 = 1 << 20;
    /// Streams the peer may reset before the server has taken them, per connection. hyper
    /// allows 20 (a guard against "rapid reset" floods from the internet) and past that closes
    /// the connection with ENHANCE_YOUR_CALM, failing every stream on it. The gateway carries
    /// all its calls to a replica over one connection and cancels each whose client went away
    /// or whose deadline passed, so a burst of cancellations on a busy host passes 20 and took
    /// the streams beside them down (the soak saw it). The peer here is our own gateway.
    pub const MAX_PENDING_ACCEPT_RESETS: usize = 1 << 16;
    /// Streams the client side remembers having reset, and for how long. A cancelled call
    /// still has frames on the wire (tokens sent before the RST_STREAM arrived), and HTTP/2
    /// ignores them only for a stream it remembers: h2 keeps 50, for 1 s. A frame for a
    /// forgotten stream is answered with a reset of its own, and past 1024 of those over the
    /// connection's life (`http2_max_local_error_reset_streams`) h2 closes the connection
    /// with ENHANCE_YOUR_CALM, failing every call on it: after hours of clients leaving, or a
    /// minute of them on a busy host (the soak saw it). Remembering 65,536 for 10 s covers any
    /// burst of cancellations a replica's connection carries, and the error limit is lifted,
    /// as the peer is our own service.
    pub const REMEMBERED_RESETS: usize = 1 << 16;
    pub const RESET_MEMORY: std::time::Duration = std::time::Duration::from_secs(10);

    /// `endpoint` (a client of vision-svc or llm-svc) with the hop's windows, frame size and
    /// reset memory.
    pub fn endpoint(endpoint: tonic::transport::Endpoint) -> tonic::transport::Endpoint {
        endpoint
            .initial_stream_window_size(STREAM_WINDOW)
            .initial_connection_window_size(CONNECTION_WINDOW)
            .max_frame_size(MAX_FRAME)
            .http2_max_concurrent_reset_streams(REMEMBERED_RESETS)
            .http2_reset_stream_duration(RESET_MEMORY)
            .http2_max_local_error_reset_streams(None)
    }
}

/// Whom a gRPC server serves: the public (the gateway's port) or the other services (the
/// model services' ports, with [`internal_hop`]'s flow control).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Audience {
    Public,
    Internal,
}

/// A gRPC server with the parts every service has: `grpc.health.v1` (the returned reporter
/// starts NOT_SERVING; set it once the model is loaded) and reflection for `vlm.v1` and health,
/// in both versions clients use (`grpc.reflection.v1`: grpcurl and grpcui of late, Postman;
/// `v1alpha`: older grpcurl, Python's grpcio-reflection). With `tls`, every connection is TLS
/// (and, if it names a client CA, mutual TLS).
pub async fn grpc_server(
    tls: Option<tonic::transport::ServerTlsConfig>,
    audience: Audience,
) -> anyhow::Result<(
    tonic_health::server::HealthReporter,
    tonic::transport::server::Router,
)> {
    let (reporter, health) = tonic_health::server::health_reporter();
    reporter
        .set_service_status("", tonic_health::ServingStatus::NotServing)
        .await;
    let reflection = || {
        tonic_reflection::server::Builder::configure()
            .register_encoded_file_descriptor_set(pb::FILE_DESCRIPTOR_SET)
            .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
    };
    const VALID: &str = "descriptor sets are generated at build time and valid";
    let mut builder = tonic::transport::Server::builder();
    if audience == Audience::Internal {
        builder = builder
            .initial_stream_window_size(internal_hop::STREAM_WINDOW)
            .initial_connection_window_size(internal_hop::CONNECTION_WINDOW)
            .max_frame_size(internal_hop::MAX_FRAME)
            .http2_max_pending_accept_reset_streams(Some(internal_hop::MAX_PENDING_ACCEPT_RESETS));
    }
    if let Some(tls) = tls {
        builder = builder
            .tls_config(tls)
            .map_err(|e| anyhow::anyhow!("cannot set up TLS: {e}"))?;
    }
    let router = builder
        .add_service(health)
        .add_service(reflection().build_v1().expect(VALID))
        .add_service(reflection().build_v1alpha().expect(VALID));
    Ok((reporter, router))
}

/// The `load` of [`run_service`] for a model service: `build` runs on a blocking thread
/// (reading weights, compiling kernels) and its model goes into `cell`, where the handlers
/// find it; a failure names `what` was being loaded.
pub async fn load_model<M, E>(
    cell: std::sync::Arc<std::sync::OnceLock<M>>,
    what: String,
    build: impl FnOnce() -> Result<M, E> + Send + 'static,
) -> anyhow::Result<()>
where
    M: Send + Sync + 'static,
    E: std::fmt::Display + Send + 'static,
{
    let model = tokio::task::spawn_blocking(build)
        .await?
        .map_err(|e| anyhow::anyhow!("cannot load {what}: {e}"))?;
    let _ = cell.set(model);
    Ok(())
}

/// Runs a service's life: serve `router` on `listener` at once (health NOT_SERVING), run
/// `load` (the model), then mark `service` and the server SERVING until `shutdown`; then mark
/// NOT_SERVING, stop accepting, and drain in-flight calls. A failed load stops the server and
/// is returned.
pub async fn run_service(
    router: tonic::transport::server::Router,
    listener: tokio::net::TcpListener,
    health: tonic_health::server::HealthReporter,
    service: &'static str,
    load: impl std::future::Future<Output = anyhow::Result<()>>,
    shutdown: impl std::future::Future<Output = ()>,
) -> anyhow::Result<()> {
    use tonic_health::ServingStatus;
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    use tokio_stream::StreamExt;
    // TCP_NODELAY on every accepted connection: tonic sets it only on listeners it binds
    // itself, and without it Nagle's algorithm and delayed ACKs hold small frames (a streamed
    // token, a unary reply) back by up to 40 ms.
    let incoming = tokio_stream::wrappers::TcpListenerStream::new(listener).map(|conn| {
        conn.inspect(|tcp| {
            let _ = tcp.set_nodelay(true);
        })
    });
    let serving = tokio::spawn(router.serve_with_incoming_shutdown(incoming, async move {
        let _ = stop_rx.await;
    }));
    let mut shutdown = std::pin::pin!(shutdown);
    let loaded = tokio::select! {
        r = load => Some(r),
        _ = &mut shutdown => None,
    };
    let result = match loaded {
        Some(Ok(())) => {
            health
                .set_service_status(service, ServingStatus::Serving)
                .await;
            health.set_service_status("", ServingStatus::Serving).await;
            tracing::info!(service, "ready; serving");
            shutdown.await;
            Ok(())
        }
        Some(Err(e)) => Err(e),
        None => Ok(()),
    };
    health
        .set_service_status(service, ServingStatus::NotServing)
        .await;
    health
        .set_service_status("", ServingStatus::NotServing)
        .await;
    let _ = stop_tx.send(());
    serving.await??;
    tracing::info!(service, "stopped");
    result
}

/// A binary's exit: 0, or 1 after printing the error chain on one line (no backtrace dump).
pub fn exit_code(result: anyhow::Result<()>) -> std::process::ExitCode {
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

/// What a model service's binary hands its server ([`service_main`]): TLS as its flags ask,
/// its bound port, the registry its metrics go to, and the shutdown signal.
pub struct ServiceStart {
    pub tls: Option<tonic::transport::ServerTlsConfig>,
    pub listener: tokio::net::TcpListener,
    pub registry: prometheus::Registry,
    /// [`shutdown_signal`].
    pub shutdown: std::pin::Pin<Box<dyn std::future::Future<Output = ()>>>,
}

/// The process of a model service (vision-svc, llm-svc): logs and traces set up as `name`,
/// TLS read and `listen` bound (a bad certificate or a taken port stops the start), then the
/// server `serve` makes of them runs until SIGTERM or ctrl-c, with its metrics served at
/// `metrics_listen` beside it; the traces are flushed before it returns.
pub async fn service_main<F, Fut>(
    name: &str,
    log: telemetry::LogArgs,
    tls: &tls::ServiceTlsArgs,
    listen: std::net::SocketAddr,
    metrics_listen: Option<std::net::SocketAddr>,
    serve: F,
) -> anyhow::Result<()>
where
    F: FnOnce(ServiceStart) -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<()>>,
{
    let telemetry = telemetry::init(name, log.log_format);
    let tls = tls.server_config()?;
    let listener = tokio::net::TcpListener::bind(listen).await?;
    let registry = prometheus::Registry::new();
    let service = serve(ServiceStart {
        tls,
        listener,
        registry: registry.clone(),
        shutdown: Box::pin(shutdown_signal()),
    });
    let result = metrics::beside(metrics_listen, vec![registry], service).await;
    telemetry.shutdown();
    result
}

/// Resolves on SIGTERM or ctrl-c: the start of a graceful shutdown.
pub async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {},
        _ = term => {},
    }
    tracing::info!("shutdown signal received");
}

/// Reads the `grpc-timeout` header (the caller's deadline), as a duration from now.
pub fn grpc_timeout(metadata: &tonic::metadata::MetadataMap) -> Option<std::time::Duration> {
    let v = metadata.get("grpc-timeout")?.to_str().ok()?;
    let (num, unit) = v.split_at(v.len().checked_sub(1)?);
    let n: u64 = num.parse().ok()?;
    use std::time::Duration;
    Some(match unit {
        "H" => Duration::from_secs(n * 3600),
        "M" => Duration::from_secs(n * 60),
        "S" => Duration::from_secs(n),
        "m" => Duration::from_millis(n),
        "u" => Duration::from_micros(n),
        "n" => Duration::from_nanos(n),
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grpc_timeouts_parse_all_units() {
        let mut m = tonic::metadata::MetadataMap::new();
        for (v, ms) in [("2S", 2000), ("150m", 150), ("1M", 60_000), ("3000000n", 3)] {
            m.insert("grpc-timeout", v.parse().unwrap());
            assert_eq!(grpc_timeout(&m).unwrap().as_millis(), ms, "{v}");
        }
        m.insert("grpc-timeout", "x".parse().unwrap());
        assert!(grpc_timeout(&m).is_none());
    }
}
