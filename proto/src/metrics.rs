//! Prometheus metrics over HTTP: every service serves its own (`--metrics-listen`), so each
//! can be scraped where it runs; `vlm serve`, one process, shows all three on the gateway's.

use std::future::Future;

use prometheus::{Encoder, Registry, TextEncoder};

/// The Prometheus text exposition of every metric in `registries`.
pub fn render(registries: &[Registry]) -> String {
    // One family per name: registries of replicas of one service (told apart by a label) hold
    // the same names, and the text format allows each name once.
    let mut families: Vec<prometheus::proto::MetricFamily> = Vec::new();
    for family in registries.iter().flat_map(|r| r.gather()) {
        match families.iter_mut().find(|f| f.name() == family.name()) {
            Some(f) => f.mut_metric().extend(family.get_metric().iter().cloned()),
            None => families.push(family),
        }
    }
    let mut buf = Vec::new();
    TextEncoder::new()
        .encode(&families, &mut buf)
        .expect("text encoding of gathered metrics");
    String::from_utf8(buf).expect("Prometheus text is UTF-8")
}

/// Serves `GET /metrics` (and `GET /` with a pointer to it) for `registries` on `listener`
/// until `shutdown`.
pub async fn serve(
    listener: tokio::net::TcpListener,
    registries: Vec<Registry>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    use axum::routing::get;
    tracing::info!(addr = %listener.local_addr()?, "metrics at /metrics");
    let app = axum::Router::new()
        .route(
            "/metrics",
            get(move || {
                let text = render(&registries);
                async move {
                    (
                        [(
                            axum::http::header::CONTENT_TYPE,
                            "text/plain; version=0.0.4",
                        )],
                        text,
                    )
                }
            }),
        )
        .route("/", get(|| async { "Prometheus metrics: GET /metrics\n" }));
    axum::serve(listener, app)
        .with_graceful_shutdown(shutdown)
        .await?;
    Ok(())
}

/// Binds `addr` (when given) and serves `registries` there in the background until
/// `shutdown`: a service binary's `--metrics-listen`. Fails only if the address cannot be bound.
pub async fn listen(
    addr: Option<std::net::SocketAddr>,
    registries: Vec<Registry>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    if let Some(addr) = addr {
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .map_err(|e| anyhow::anyhow!("cannot listen for metrics on {addr}: {e}"))?;
        tokio::spawn(async move {
            if let Err(e) = serve(listener, registries, shutdown).await {
                tracing::error!(error = %e, "metrics server stopped");
            }
        });
    }
    Ok(())
}

/// Runs `service` (a service binary's server, to its end) with `registries` served at `addr`
/// (when given) beside it, as [`listen`] does; the metrics endpoint stops when the service
/// returns. Fails without running the service if the address cannot be bound.
pub async fn beside(
    addr: Option<std::net::SocketAddr>,
    registries: Vec<Registry>,
    service: impl Future<Output = anyhow::Result<()>>,
) -> anyhow::Result<()> {
    // Dropping `stop` when the service returns ends the wait on `stopped`.
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    listen(addr, registries, async move {
        let _ = stopped.await;
    })
    .await?;
    let result = service.await;
    drop(stop);
    result
}
