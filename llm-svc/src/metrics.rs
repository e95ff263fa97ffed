//! What the engine reports to Prometheus (served by llm-svc itself, and by `vlm serve` beside
//! the other services' metrics). Gauges describe the present (and return to 0 when idle);
//! counters and histograms accumulate.

use prometheus::{
    exponential_buckets, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec,
    IntGauge, IntGaugeVec, Opts, Registry,
};

#[derive(Clone)]
pub struct EngineMetrics {
    pub registry: Registry,
    pub kv_blocks_in_use: IntGauge,
    pub kv_blocks_total: IntGauge,
    /// Sequences by state: running (admitted, holding cache blocks) and waiting.
    pub sequences: IntGaugeVec,
    pub prefix_queried_tokens: IntCounter,
    pub prefix_hit_tokens: IntCounter,
    pub preemptions: IntCounter,
    /// Step durations by kind: "decode" (every sequence one token; replayed from a recording
    /// where the backend records) or "mixed" (prefill chunks in it; run op by op).
    pub step_seconds: HistogramVec,
    /// Tokens computed per step (decodes count one each).
    pub step_tokens: Histogram,
    pub prompt_tokens: IntCounter,
    pub generated_tokens: IntCounter,
    /// Finished requests by outcome (stop, length, cancelled, deadline, error).
    pub requests: IntCounterVec,
}

impl EngineMetrics {
    /// Metrics registered in `registry` (a service's own, or one `vlm serve` shares).
    pub fn new(registry: &Registry) -> Self {
        fn reg<T: prometheus::core::Collector + Clone + 'static>(r: &Registry, m: T) -> T {
            // Registering the same name twice is a programming error, caught by the tests.
            r.register(Box::new(m.clone()))
                .expect("metric names are unique");
            m
        }
        let r = registry;
        let gauge = |name: &str, help: &str| reg(r, IntGauge::new(name, help).expect("valid"));
        let counter = |name: &str, help: &str| reg(r, IntCounter::new(name, help).expect("valid"));
        Self {
            registry: r.clone(),
            kv_blocks_in_use: gauge(
                "vlm_llm_kv_blocks_in_use",
                "KV cache blocks held by sequences",
            ),
            kv_blocks_total: gauge(
                "vlm_llm_kv_blocks_total",
                "KV cache blocks allocated at start-up",
            ),
            sequences: reg(
                r,
                IntGaugeVec::new(
                    Opts::new("vlm_llm_sequences", "Sequences in the engine by state"),
                    &["state"],
                )
                .expect("valid"),
            ),
            prefix_queried_tokens: counter(
                "vlm_llm_prefix_cache_queried_tokens_total",
                "Prompt tokens looked up in the prefix cache",
            ),
            prefix_hit_tokens: counter(
                "vlm_llm_prefix_cache_hit_tokens_total",
                "Prompt tokens found already computed in the prefix cache",
            ),
            preemptions: counter(
                "vlm_llm_preemptions_total",
                "Sequences that gave their KV blocks back to be recomputed later",
            ),
            step_seconds: reg(
                r,
                HistogramVec::new(
                    HistogramOpts::new("vlm_llm_step_seconds", "Duration of an engine step")
                        .buckets(exponential_buckets(0.0005, 2.0, 14).expect("valid")),
                    &["kind"],
                )
                .expect("valid"),
            ),
            step_tokens: reg(
                r,
                Histogram::with_opts(
                    HistogramOpts::new("vlm_llm_step_tokens", "Tokens computed in one step")
                        .buckets(exponential_buckets(1.0, 2.0, 14).expect("valid")),
                )
                .expect("valid"),
            ),
            prompt_tokens: counter("vlm_llm_prompt_tokens_total", "Prompt tokens admitted"),
            generated_tokens: counter("vlm_llm_generated_tokens_total", "Tokens generated"),
            requests: reg(
                r,
                IntCounterVec::new(
                    Opts::new("vlm_llm_requests_total", "Finished requests by outcome"),
                    &["outcome"],
                )
                .expect("valid"),
            ),
        }
    }
}
