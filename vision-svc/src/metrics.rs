//! What vision-svc reports to Prometheus (served by vision-svc itself, and by `vlm serve`
//! beside the other services' metrics).

use prometheus::{
    exponential_buckets, Histogram, HistogramOpts, IntCounterVec, IntGauge, Opts, Registry,
};

#[derive(Clone)]
pub struct VisionMetrics {
    /// Images by outcome (ok, cached, invalid, overloaded, error, cancelled).
    pub images: IntCounterVec,
    /// Images being preprocessed or encoded now.
    pub in_flight: IntGauge,
    /// Time from an image's arrival to its embeddings (preprocessing, queueing, the ViT).
    pub encode_seconds: Histogram,
    /// Images encoded together in one ViT pass.
    pub batch_images: Histogram,
    /// Bytes of embeddings sent, by path: inside the gRPC response, or through shared memory.
    pub embedding_bytes: IntCounterVec,
}

impl VisionMetrics {
    pub fn new(registry: &Registry) -> Self {
        let images = IntCounterVec::new(
            Opts::new("vlm_vision_images_total", "Images by outcome"),
            &["outcome"],
        )
        .expect("valid");
        let in_flight = IntGauge::new(
            "vlm_vision_images_in_flight",
            "Images being preprocessed or encoded",
        )
        .expect("valid");
        let encode_seconds = Histogram::with_opts(
            HistogramOpts::new(
                "vlm_vision_encode_seconds",
                "Image arrival to embeddings, in vision-svc",
            )
            .buckets(exponential_buckets(0.001, 2.0, 16).expect("valid")),
        )
        .expect("valid");
        let batch_images = Histogram::with_opts(
            HistogramOpts::new("vlm_vision_batch_images", "Images encoded in one ViT pass")
                .buckets(vec![1.0, 2.0, 4.0, 8.0, 16.0, 32.0]),
        )
        .expect("valid");
        let embedding_bytes = IntCounterVec::new(
            Opts::new(
                "vlm_vision_embedding_bytes_total",
                "Bytes of embeddings sent, by path (grpc: in the response; shm: shared memory)",
            ),
            &["path"],
        )
        .expect("valid");
        for m in [
            Box::new(images.clone()) as Box<dyn prometheus::core::Collector>,
            Box::new(embedding_bytes.clone()),
            Box::new(in_flight.clone()),
            Box::new(encode_seconds.clone()),
            Box::new(batch_images.clone()),
        ] {
            registry.register(m).expect("metric names are unique");
        }
        Self {
            images,
            in_flight,
            encode_seconds,
            batch_images,
            embedding_bytes,
        }
    }
}
