//! The vision tower's hyper-parameters (`config.json` → `vision_config`). The image
//! processor's settings are the contract's ([`vlm_proto::image::PreprocessConfig`]): the
//! gateway counts image tokens by them too.

use std::path::Path;

use serde::Deserialize;
use vlm_compute::files;

use crate::{Error, Result};

#[derive(Clone, Debug, Deserialize)]
pub struct VisionConfig {
    pub depth: usize,
    pub hidden_size: usize,
    pub hidden_act: String,
    pub intermediate_size: usize,
    pub num_heads: usize,
    #[serde(default = "default_in_channels")]
    pub in_channels: usize,
    pub patch_size: usize,
    pub spatial_merge_size: usize,
    pub temporal_patch_size: usize,
    pub out_hidden_size: usize,
    pub num_position_embeddings: usize,
    #[serde(default)]
    pub deepstack_visual_indexes: Vec<usize>,
    /// transformers 5.x: `{"rope_type": "axial", "rope_theta": 10000}`; absent in 4.x files.
    #[serde(default)]
    pub rope_parameters: Option<RopeParameters>,
    #[serde(default)]
    pub rope_theta: Option<f64>,
}

#[derive(Clone, Debug, Deserialize)]
pub struct RopeParameters {
    pub rope_theta: Option<f64>,
}

fn default_in_channels() -> usize {
    3
}

impl VisionConfig {
    pub fn from_dir(dir: &Path) -> Result<Self> {
        let path = dir.join("config.json");
        let v = files::read_json(&path)?;
        let vc = files::require(&path, &v, "vision_config")?.clone();
        let cfg: VisionConfig = files::parse(&path, "vision_config", vc)?;
        cfg.validate(&path)?;
        Ok(cfg)
    }

    fn validate(&self, path: &Path) -> Result<()> {
        let bad = |m: String| {
            Err(Error::Config(format!(
                "{}: vision_config: {m}",
                path.display()
            )))
        };
        if self.num_heads == 0 || self.hidden_size % self.num_heads != 0 {
            return bad(format!(
                "hidden_size {} is not a multiple of num_heads {}",
                self.hidden_size, self.num_heads
            ));
        }
        if self.head_dim() % 4 != 0 {
            return bad(format!(
                "head dim {} must be a multiple of 4 for 2-D rotary",
                self.head_dim()
            ));
        }
        let side = self.pos_grid_side();
        if side.checked_mul(side) != Some(self.num_position_embeddings) {
            return bad(format!(
                "num_position_embeddings {} is not a square",
                self.num_position_embeddings
            ));
        }
        let merged = [self.spatial_merge_size; 2]
            .into_iter()
            .try_fold(self.hidden_size, |n, m| n.checked_mul(m));
        if merged.is_none_or(|n| n == 0) {
            return bad(format!(
                "hidden_size {} x spatial_merge_size {}² (the mergers' width) is empty or too large",
                self.hidden_size, self.spatial_merge_size
            ));
        }
        let patch_dim = [self.temporal_patch_size, self.patch_size, self.patch_size]
            .into_iter()
            .try_fold(self.in_channels, |n, m| n.checked_mul(m));
        if patch_dim.is_none_or(|n| n == 0) {
            return bad(format!(
                "a patch of in_channels {} x temporal_patch_size {} x patch_size {}² elements \
                 is empty or too large",
                self.in_channels, self.temporal_patch_size, self.patch_size
            ));
        }
        if let Some(&i) = self
            .deepstack_visual_indexes
            .iter()
            .find(|&&i| i >= self.depth)
        {
            return bad(format!(
                "deepstack_visual_indexes has {i}, but depth is {}",
                self.depth
            ));
        }
        if !matches!(self.hidden_act.as_str(), "gelu_pytorch_tanh" | "gelu") {
            return bad(format!(
                "hidden_act `{}` is not supported (gelu_pytorch_tanh or gelu)",
                self.hidden_act
            ));
        }
        Ok(())
    }

    pub fn head_dim(&self) -> usize {
        self.hidden_size / self.num_heads
    }

    /// Side of the learned square position-embedding grid (48 for the 8B model).
    pub fn pos_grid_side(&self) -> usize {
        (self.num_position_embeddings as f64).sqrt().round() as usize
    }

    pub fn rope_theta(&self) -> f64 {
        self.rope_parameters
            .as_ref()
            .and_then(|r| r.rope_theta)
            .or(self.rope_theta)
            .unwrap_or(10_000.0)
    }

    /// Elements of one flattened patch: C · T · P · P.
    pub fn patch_dim(&self) -> usize {
        self.in_channels * self.temporal_patch_size * self.patch_size * self.patch_size
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tmpdir(name: &str) -> std::path::PathBuf {
        let d = std::env::temp_dir().join(format!("vlm-vcfg-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn missing_files_and_keys_are_named() {
        let d = tmpdir("missing");
        std::fs::write(d.join("config.json"), r#"{"vision_config": {"depth": 2}}"#).unwrap();
        let err = VisionConfig::from_dir(&d).unwrap_err().to_string();
        assert!(
            err.contains("config.json") && err.contains("vision_config"),
            "{err}"
        );
    }

    /// Sizes no product of which fits a usize are refused by name (the fuzzer's checkpoint
    /// target once found `num_position_embeddings` 2^64 - 1 overflowing its square).
    #[test]
    fn sizes_past_usize_are_refused() {
        let committed =
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/tiny-qwen3-vl");
        let config: serde_json::Value =
            serde_json::from_slice(&std::fs::read(committed.join("config.json")).unwrap()).unwrap();
        for (key, value) in [
            ("num_position_embeddings", u64::MAX),
            ("patch_size", u64::MAX / 2),
            ("in_channels", 0),
            ("spatial_merge_size", u64::MAX / 4),
        ] {
            let mut config = config.clone();
            config["vision_config"][key] = value.into();
            let d = tmpdir(key);
            std::fs::write(d.join("config.json"), config.to_string()).unwrap();
            let err = VisionConfig::from_dir(&d).unwrap_err().to_string();
            assert!(err.contains(key), "{key}: {err}");
        }
    }

    #[test]
    fn reads_the_committed_8b_config() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/models/qwen3-vl-8b");
        let cfg = VisionConfig::from_dir(&path).unwrap();
        assert_eq!((cfg.depth, cfg.hidden_size, cfg.head_dim()), (27, 1152, 72));
        assert_eq!(cfg.pos_grid_side(), 48);
        assert_eq!(cfg.deepstack_visual_indexes, vec![8, 16, 24]);
        assert_eq!(cfg.rope_theta(), 10_000.0);
    }
}
