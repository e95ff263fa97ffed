//! The vision stage: encoded image bytes in, image embeddings for the language model out.
//!
//! ```text
//! bytes ──preprocess──▶ patches [N, C·T·P·P] + grid (t, h, w)
//!       ──VisionModel──▶ embeddings [N/4, out_hidden] + DeepStack features (one per tapped block)
//! ```
//! [`VisionEncoder`] bundles both for callers (the `vlm` CLI, the VisionService server).

mod batcher;
pub mod cache;
mod config;
mod error;
pub mod metrics;
mod model;
pub mod preprocess;
pub mod server;

use std::path::Path;

pub use config::VisionConfig;
pub use error::{Error, Result};
pub use model::{Delivery, VisionModel, VisionOutput};
pub use preprocess::{DecodeLimits, PatchValues, Patches};
use vlm_compute::{Backend, Weights};
pub use vlm_proto::image::PreprocessConfig;

/// Preprocessing settings plus the vision tower, loaded from one checkpoint directory.
pub struct VisionEncoder<B: Backend> {
    pub preprocess: PreprocessConfig,
    pub limits: DecodeLimits,
    pub model: VisionModel<B>,
}

impl<B: Backend> VisionEncoder<B> {
    /// Loads `config.json` (vision part), the image-processor settings and `model.visual.*`.
    pub fn load(dir: &Path, weights: &Weights, backend: B) -> Result<Self> {
        let config = VisionConfig::from_dir(dir)?;
        let preprocess = PreprocessConfig::from_dir(dir)?;
        if preprocess.patch_size != config.patch_size
            || preprocess.merge_size != config.spatial_merge_size
            || preprocess.temporal_patch_size != config.temporal_patch_size
        {
            return Err(Error::Config(format!(
                "image processor (patch {}, merge {}, temporal {}) disagrees with vision_config in config.json (patch {}, merge {}, temporal {})",
                preprocess.patch_size,
                preprocess.merge_size,
                preprocess.temporal_patch_size,
                config.patch_size,
                config.spatial_merge_size,
                config.temporal_patch_size
            )));
        }
        let model = VisionModel::new(config, weights, backend)?;
        Ok(Self {
            preprocess,
            limits: DecodeLimits::default(),
            model,
        })
    }

    /// Decodes and preprocesses `bytes`, then runs the vision tower.
    pub fn encode_image(&self, bytes: &[u8]) -> Result<VisionOutput> {
        let patches = preprocess::preprocess(bytes, &self.preprocess, &self.limits)?;
        self.model.forward(&patches)
    }

    /// [`Self::encode_image`] for the language stage in this process on the same backend: the
    /// outputs stay where the tower computed them ([`Delivery::Device`]; on a GPU nothing is
    /// downloaded and uploaded again), known to its prefix cache by the image's cache key.
    pub fn encode_image_for_this_process(&self, bytes: &[u8]) -> Result<VisionOutput> {
        let patches = preprocess::preprocess(bytes, &self.preprocess, &self.limits)?;
        let identity = cache::key(bytes, vlm_proto::pb::Dtype::F32, &self.preprocess).to_vec();
        let mut out = self
            .model
            .forward_delivered(&[patches], &[Delivery::Device { identity }])?;
        Ok(out.pop().expect("one output per image"))
    }
}
