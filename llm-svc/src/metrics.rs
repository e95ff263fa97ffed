//! What the engine reports to Prometheus (served by llm-svc itself, and by `vlm serve` beside
//! the other services' metrics). Gauges describe the present (and return to 0 when idle);
//! counters and histograms accumulate.

use prometheus::{
    exponential_buckets, Gauge, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec,
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
    /// Host time a step spent computing its grammars' token masks (steps with grammars only;
    /// it overlaps the forward pass on the device).
    pub grammar_mask_seconds: Histogram,
    pub prompt_tokens: IntCounter,
    pub generated_tokens: IntCounter,
    /// Finished requests by outcome (stop, length, cancelled, deadline, error).
    pub requests: IntCounterVec,
}

/// vLLM's names for the engine's load, read from ours at each scrape, so routers that read
/// vLLM's metrics (llm-d's endpoint picker, Dynamo, SGLang's gateway) read llm-svc unchanged:
/// `vllm:num_requests_running`, `vllm:num_requests_waiting` and `vllm:kv_cache_usage_perc`
/// (the share of KV blocks in use, 0 to 1).
struct VllmNames {
    sequences: IntGaugeVec,
    kv_blocks_in_use: IntGauge,
    kv_blocks_total: IntGauge,
    running: Gauge,
    waiting: Gauge,
    kv_usage: Gauge,
}

impl VllmNames {
    fn new(sequences: &IntGaugeVec, in_use: &IntGauge, total: &IntGauge) -> Self {
        let gauge = |name: &str, help: &str| Gauge::new(name, help).expect("valid");
        Self {
            sequences: sequences.clone(),
            kv_blocks_in_use: in_use.clone(),
            kv_blocks_total: total.clone(),
            running: gauge(
                "vllm:num_requests_running",
                "Requests running (vLLM's name for vlm_llm_sequences{state=\"running\"})",
            ),
            waiting: gauge(
                "vllm:num_requests_waiting",
                "Requests waiting (vLLM's name for vlm_llm_sequences{state=\"waiting\"})",
            ),
            kv_usage: gauge(
                "vllm:kv_cache_usage_perc",
                "Share of KV cache blocks in use, 0 to 1 (vLLM's name)",
            ),
        }
    }
}

impl prometheus::core::Collector for VllmNames {
    fn desc(&self) -> Vec<&prometheus::core::Desc> {
        [&self.running, &self.waiting, &self.kv_usage]
            .into_iter()
            .flat_map(|g| g.desc())
            .collect()
    }

    fn collect(&self) -> Vec<prometheus::proto::MetricFamily> {
        let state = |s: &str| self.sequences.with_label_values(&[s]).get() as f64;
        self.running.set(state("running"));
        self.waiting.set(state("waiting"));
        let total = self.kv_blocks_total.get().max(1) as f64;
        self.kv_usage
            .set(self.kv_blocks_in_use.get() as f64 / total);
        [&self.running, &self.waiting, &self.kv_usage]
            .into_iter()
            .flat_map(|g| g.collect())
            .collect()
    }
}

impl EngineMetrics {
    /// Metrics registered in `registry` (a service's own, or one `vlm serve` shares), with
    /// vLLM's names for the load beside ours ([`VllmNames`]).
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
        let m = Self {
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
            grammar_mask_seconds: reg(
                r,
                Histogram::with_opts(
                    HistogramOpts::new(
                        "vlm_llm_grammar_mask_seconds",
                        "Host time of one step's grammar token masks (all its constrained sequences)",
                    )
                    .buckets(exponential_buckets(0.000_05, 2.0, 14).expect("valid")),
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
        };
        r.register(Box::new(VllmNames::new(
            &m.sequences,
            &m.kv_blocks_in_use,
            &m.kv_blocks_total,
        )))
        .expect("metric names are unique");
        m
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vllms_names_read_the_engines_load() {
        let r = Registry::new();
        let m = EngineMetrics::new(&r);
        m.sequences.with_label_values(&["running"]).set(3);
        m.sequences.with_label_values(&["waiting"]).set(2);
        m.kv_blocks_total.set(200);
        m.kv_blocks_in_use.set(50);
        let value = |name: &str| {
            r.gather()
                .iter()
                .find(|f| f.name() == name)
                .map(|f| f.get_metric()[0].get_gauge().get_value())
                .unwrap_or_else(|| panic!("{name} not exported"))
        };
        assert_eq!(value("vllm:num_requests_running"), 3.0);
        assert_eq!(value("vllm:num_requests_waiting"), 2.0);
        assert_eq!(value("vllm:kv_cache_usage_perc"), 0.25);
        let text = prometheus::TextEncoder::new()
            .encode_to_string(&r.gather())
            .unwrap();
        assert!(text.contains("vllm:kv_cache_usage_perc 0.25"), "{text}");
    }
}
