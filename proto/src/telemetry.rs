//! Logs and traces for every process.
//!
//! [`init`] installs a `tracing` subscriber that writes logs to stderr (level from `RUST_LOG`,
//! default `info`) as text, coloured only when stderr is a terminal, or as one JSON object a
//! line for log collectors ([`LogFormat`]), and feeds spans to OpenTelemetry. When
//! `OTEL_EXPORTER_OTLP_ENDPOINT` is set, spans are exported over OTLP/gRPC (batched; the batch
//! delay follows `OTEL_BSP_SCHEDULE_DELAY`); otherwise they still get trace ids, which the
//! request spans record as a `trace_id` field so every log line of a request carries it.
//!
//! Across processes the W3C `traceparent` travels in gRPC metadata: [`inject`] on the client
//! side, [`extract`] on the server side, so one request is one trace in all three services.

use opentelemetry::propagation::{Extractor, Injector};
use opentelemetry::trace::{TraceContextExt, TracerProvider as _};
use opentelemetry::{global, Context};
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::SdkTracerProvider;
use opentelemetry_sdk::Resource;
use tonic::metadata::{KeyRef, MetadataKey, MetadataMap, MetadataValue};
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::EnvFilter;

/// How log lines are written to stderr.
#[derive(clap::ValueEnum, Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum LogFormat {
    /// Human-readable lines (ANSI colours only when stderr is a terminal).
    #[default]
    Text,
    /// One JSON object per line (`timestamp`, `level`, `fields`, `target`, `span`, `spans`),
    /// for log collectors.
    Json,
}

/// The `--log-format` flag every binary takes.
#[derive(clap::Args, Clone, Copy, Debug, Default)]
pub struct LogArgs {
    /// Log lines on stderr as text, or as one JSON object per line for log collectors.
    #[arg(
        long,
        env = "VLM_LOG_FORMAT",
        value_enum,
        default_value = "text",
        global = true
    )]
    pub log_format: LogFormat,
}

/// The stderr log layer for `format`: colours only on a terminal (and without `NO_COLOR`), so
/// piped or collected logs carry no escape codes; span timings with `VLM_LOG_SPANS=1`.
pub fn log_layer<S>(format: LogFormat) -> Box<dyn tracing_subscriber::Layer<S> + Send + Sync>
where
    S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
{
    use std::io::IsTerminal;
    // VLM_LOG_SPANS=1: a line as each span closes, with the time it was busy and idle, for
    // seeing where a request's time goes without a trace collector.
    let spans = if std::env::var_os("VLM_LOG_SPANS").is_some_and(|v| !v.is_empty() && v != "0") {
        tracing_subscriber::fmt::format::FmtSpan::CLOSE
    } else {
        tracing_subscriber::fmt::format::FmtSpan::NONE
    };
    let layer = tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        .with_span_events(spans);
    match format {
        LogFormat::Text => {
            // NO_COLOR (https://no-color.org) wins even on a terminal.
            let no_color = std::env::var_os("NO_COLOR").is_some_and(|v| !v.is_empty());
            Box::new(layer.with_ansi(std::io::stderr().is_terminal() && !no_color))
        }
        LogFormat::Json => Box::new(layer.json().with_ansi(false)),
    }
}

/// Keeps the tracer provider alive; [`Telemetry::shutdown`] flushes spans not yet exported.
pub struct Telemetry {
    provider: SdkTracerProvider,
}

impl Telemetry {
    /// Flushes and stops exporting; call last, after the server has drained.
    pub fn shutdown(self) {
        if let Err(e) = self.provider.shutdown() {
            eprintln!("telemetry shutdown: {e}");
        }
    }
}

/// Installs logging (in `format`) and tracing for a process named `service` (e.g.
/// "vision-svc"). Must run inside the tokio runtime (the OTLP exporter's connection lives
/// there).
pub fn init(service: &str, format: LogFormat) -> Telemetry {
    global::set_text_map_propagator(TraceContextPropagator::new());
    let resource = Resource::builder()
        .with_service_name(service.to_string())
        .build();
    let mut builder = SdkTracerProvider::builder().with_resource(resource);
    let endpoint = std::env::var("OTEL_EXPORTER_OTLP_ENDPOINT")
        .ok()
        .filter(|e| !e.is_empty());
    let mut export_error = None;
    if endpoint.is_some() {
        match opentelemetry_otlp::SpanExporter::builder()
            .with_tonic()
            .build()
        {
            Ok(exporter) => builder = builder.with_batch_exporter(exporter),
            Err(e) => export_error = Some(e.to_string()),
        }
    }
    let provider = builder.build();
    global::set_tracer_provider(provider.clone());
    let tracer = provider.tracer(service.to_string());
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let _ = tracing_subscriber::registry()
        .with(filter)
        .with(log_layer(format))
        .with(tracing_opentelemetry::layer().with_tracer(tracer))
        .try_init();
    match (endpoint, export_error) {
        (Some(e), None) => tracing::info!(endpoint = %e, "exporting traces over OTLP"),
        (Some(e), Some(err)) => tracing::warn!(endpoint = %e, error = %err, "OTLP export disabled"),
        (None, _) => tracing::debug!("OTEL_EXPORTER_OTLP_ENDPOINT unset: traces only in logs"),
    }
    Telemetry { provider }
}

/// The trace id of a span, as 32 hex digits.
pub fn trace_id(span: &tracing::Span) -> String {
    span.context().span().span_context().trace_id().to_string()
}

/// Makes `span` a child of the trace context in `metadata` (if any) and records its trace id
/// in the span's `trace_id` field, so logs inside it carry the id.
pub fn adopt_remote_parent(span: &tracing::Span, metadata: &MetadataMap) {
    let parent = extract(metadata);
    if parent.span().span_context().is_valid() {
        let _ = span.set_parent(parent);
    }
    span.record("trace_id", trace_id(span).as_str());
}

/// Like [`adopt_remote_parent`], for an HTTP request's `traceparent` header.
pub fn adopt_http_parent(span: &tracing::Span, headers: &tonic::codegen::http::HeaderMap) {
    let parent = extract_http(headers);
    if parent.span().span_context().is_valid() {
        let _ = span.set_parent(parent);
    }
    span.record("trace_id", trace_id(span).as_str());
}

/// Writes the current span's trace context into outgoing gRPC metadata.
pub fn inject(metadata: &mut MetadataMap) {
    let cx = tracing::Span::current().context();
    global::get_text_map_propagator(|p| p.inject_context(&cx, &mut MetadataInjector(metadata)));
}

/// Reads a trace context from incoming gRPC metadata.
pub fn extract(metadata: &MetadataMap) -> Context {
    global::get_text_map_propagator(|p| p.extract(&MetadataExtractor(metadata)))
}

/// Reads a trace context from HTTP headers (`traceparent` of an HTTP client).
pub fn extract_http(headers: &tonic::codegen::http::HeaderMap) -> Context {
    struct Headers<'a>(&'a tonic::codegen::http::HeaderMap);
    impl Extractor for Headers<'_> {
        fn get(&self, key: &str) -> Option<&str> {
            self.0.get(key).and_then(|v| v.to_str().ok())
        }
        fn keys(&self) -> Vec<&str> {
            self.0.keys().map(|k| k.as_str()).collect()
        }
    }
    global::get_text_map_propagator(|p| p.extract(&Headers(headers)))
}

struct MetadataInjector<'a>(&'a mut MetadataMap);

impl Injector for MetadataInjector<'_> {
    fn set(&mut self, key: &str, value: String) {
        if let (Ok(k), Ok(v)) = (
            MetadataKey::from_bytes(key.as_bytes()),
            MetadataValue::try_from(value.as_str()),
        ) {
            self.0.insert(k, v);
        }
    }
}

struct MetadataExtractor<'a>(&'a MetadataMap);

impl Extractor for MetadataExtractor<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }
    fn keys(&self) -> Vec<&str> {
        self.0
            .keys()
            .filter_map(|k| match k {
                KeyRef::Ascii(k) => Some(k.as_str()),
                KeyRef::Binary(_) => None,
            })
            .collect()
    }
}
