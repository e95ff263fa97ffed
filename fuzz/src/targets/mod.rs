//! The fuzz targets: each feeds one input to the functions a service runs on a request, and
//! checks what must hold of the result beyond "no panic".
//!
//! They share one load of the bundled tiny checkpoint (`tests/fixtures/tiny-qwen3-vl`): its
//! image-processor settings, vision encoder, chat template and tokenizer, and an LLM engine
//! whose `validate` is llm-svc's check of a `GenerateRequest`.

pub mod checkpoint;
pub mod gateway;
pub mod grpc;
pub mod image;
pub mod media;

use std::path::PathBuf;
use std::sync::OnceLock;

use ::gateway::chat::ChatTokenizer;
use llm_svc::{Engine, EngineConfig, KvCacheSize, ModelConfig};
use vision_svc::VisionEncoder;
use vlm_compute::{CpuBackend, Weights};

/// The tiny checkpoint, loaded once per process.
pub struct Fixture {
    pub dir: PathBuf,
    pub vision: VisionEncoder<CpuBackend>,
    pub chat: ChatTokenizer,
    pub model: ModelConfig,
    pub engine: Engine,
}

/// The bundled tiny checkpoint's directory.
pub fn fixture_dir() -> PathBuf {
    vlm_compute::golden::tiny_fixture(env!("CARGO_MANIFEST_DIR"))
}

pub fn fixture() -> &'static Fixture {
    static FIXTURE: OnceLock<Fixture> = OnceLock::new();
    FIXTURE.get_or_init(|| {
        let dir = fixture_dir();
        let load = || -> Result<Fixture, String> {
            let weights = Weights::open(&dir).map_err(text)?;
            let vision = VisionEncoder::load(&dir, &weights, CpuBackend::new()).map_err(text)?;
            let model = ModelConfig::from_dir(&dir).map_err(text)?;
            let chat = ChatTokenizer::from_dir(&dir, model.image_token_id()).map_err(text)?;
            // A small cache: only `validate` is called, nothing is generated.
            let engine = Engine::load(
                &dir,
                &weights,
                CpuBackend::new(),
                EngineConfig {
                    kv_cache: KvCacheSize::Tokens(4096),
                    ..Default::default()
                },
                &prometheus::Registry::new(),
            )
            .map_err(text)?;
            weights.finish();
            Ok(Fixture {
                dir: dir.clone(),
                vision,
                chat,
                model,
                engine,
            })
        };
        load().unwrap_or_else(|e| panic!("cannot load the fixture {}: {e}", dir.display()))
    })
}

/// An error as the text a client or operator would read.
pub fn text(e: impl std::fmt::Display) -> String {
    e.to_string()
}
