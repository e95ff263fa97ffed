//! Prometheus metrics over HTTP: every service serves its own (`--metrics-listen`), so each
//! can be scraped where it runs; `vlm serve`, one process, shows all three on the gateway's.

use std::future::Future;

use prometheus::{Encoder, Registry, TextEncoder};

/// The Prometheus text exposition of every metric in `registries`.
pub fn render(registries: &[Registry]) -> String {
    let families: Vec<_> = registries.iter().flat_map(|r| r.gather()).collect();
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
