//! Prometheus metrics of the gateway, served at `GET /metrics` (with, under `vlm serve`, the
//! metrics of the model services running in the same process).

use prometheus::{
    Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge, Opts, Registry,
};

/// Latency buckets from 1 ms to ~30 s.
fn buckets() -> Vec<f64> {
    prometheus::exponential_buckets(0.001, 2.0, 16).expect("valid buckets")
}

#[derive(Clone)]
pub struct Metrics {
    registry: Registry,
    /// Other registries shown on the same page (the model services of `vlm serve`).
    also: Vec<Registry>,
    /// Finished requests by API ("grpc", "http") and outcome (the error type, or "ok").
    pub requests: IntCounterVec,
    /// Requests being served now.
    pub in_flight: IntGauge,
    /// From request arrival to the first generated token.
    pub time_to_first_token: Histogram,
    /// Between consecutive tokens of one stream.
    pub inter_token_latency: Histogram,
    /// Vision-service round trip per image, transfer included.
    pub vision_seconds: HistogramVec,
    pub generated_tokens: IntCounter,
    pub prompt_tokens: IntCounter,
    /// Image URLs read, by outcome: "ok" (fetched), "cached", "file", or why it was refused.
    pub media_fetches: IntCounterVec,
    /// Bytes of images fetched over the network (cache hits not counted).
    pub media_fetch_bytes: IntCounter,
}

impl Metrics {
    pub fn new() -> Self {
        let registry = Registry::new();
        let requests = IntCounterVec::new(
            Opts::new(
                "vlm_requests_total",
                "Finished chat requests by API and outcome",
            ),
            &["api", "outcome"],
        )
        .expect("valid metric");
        let in_flight = IntGauge::new(
            "vlm_requests_in_flight",
            "Chat requests being served (queue depth)",
        )
        .expect("valid metric");
        let ttft = Histogram::with_opts(
            HistogramOpts::new(
                "vlm_time_to_first_token_seconds",
                "Request arrival to first token",
            )
            .buckets(buckets()),
        )
        .expect("valid metric");
        let itl = Histogram::with_opts(
            HistogramOpts::new(
                "vlm_inter_token_latency_seconds",
                "Time between consecutive tokens",
            )
            .buckets(buckets()),
        )
        .expect("valid metric");
        let vision = HistogramVec::new(
            HistogramOpts::new("vlm_vision_seconds", "Vision service round trip per image")
                .buckets(buckets()),
            &["outcome"],
        )
        .expect("valid metric");
        let generated = IntCounter::new("vlm_generated_tokens_total", "Tokens generated")
            .expect("valid metric");
        let prompt = IntCounter::new("vlm_prompt_tokens_total", "Prompt tokens processed")
            .expect("valid metric");
        let media_fetches = IntCounterVec::new(
            Opts::new(
                "vlm_media_fetches_total",
                "Image URLs read by the gateway, by outcome",
            ),
            &["outcome"],
        )
        .expect("valid metric");
        let media_fetch_bytes = IntCounter::new(
            "vlm_media_fetch_bytes_total",
            "Bytes of images fetched from image URLs",
        )
        .expect("valid metric");
        for m in [
            Box::new(requests.clone()) as Box<dyn prometheus::core::Collector>,
            Box::new(in_flight.clone()),
            Box::new(ttft.clone()),
            Box::new(itl.clone()),
            Box::new(vision.clone()),
            Box::new(generated.clone()),
            Box::new(prompt.clone()),
            Box::new(media_fetches.clone()),
            Box::new(media_fetch_bytes.clone()),
        ] {
            registry.register(m).expect("unique metric names");
        }
        Self {
            registry,
            also: Vec::new(),
            requests,
            in_flight,
            time_to_first_token: ttft,
            inter_token_latency: itl,
            vision_seconds: vision,
            generated_tokens: generated,
            prompt_tokens: prompt,
            media_fetches,
            media_fetch_bytes,
        }
    }

    /// Shows the metrics of `registry` too (services in this process).
    pub fn also_show(&mut self, registry: Registry) {
        self.also.push(registry);
    }

    /// The Prometheus text exposition of every metric.
    pub fn render(&self) -> String {
        let mut all = vec![self.registry.clone()];
        all.extend(self.also.iter().cloned());
        vlm_proto::metrics::render(&all)
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}
