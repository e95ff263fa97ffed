//! The vision tower's hyper-parameters (`config.json` → `vision_config`) and the image
//! processor's settings (`preprocessor_config.json`, written by transformers 4.x, or the
//! `image_processor` section of `processor_config.json`, written by 5.x).

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

/// How an image becomes patches, as transformers' `Qwen2VLImageProcessor` does it.
#[derive(Clone, Debug)]
pub struct PreprocessConfig {
    pub do_resize: bool,
    pub do_rescale: bool,
    pub do_normalize: bool,
    pub rescale_factor: f64,
    pub image_mean: [f32; 3],
    pub image_std: [f32; 3],
    pub patch_size: usize,
    pub temporal_patch_size: usize,
    pub merge_size: usize,
    /// Pixel-count bounds for smart_resize (`size.shortest_edge` / `size.longest_edge`).
    pub min_pixels: u64,
    pub max_pixels: u64,
}

#[derive(Deserialize)]
struct RawPreprocess {
    #[serde(default = "yes")]
    do_resize: bool,
    #[serde(default = "yes")]
    do_rescale: bool,
    #[serde(default = "yes")]
    do_normalize: bool,
    #[serde(default = "yes")]
    do_convert_rgb: bool,
    #[serde(default = "default_rescale")]
    rescale_factor: f64,
    image_mean: [f32; 3],
    image_std: [f32; 3],
    patch_size: usize,
    #[serde(default = "two")]
    temporal_patch_size: usize,
    #[serde(default = "two")]
    merge_size: usize,
    #[serde(default)]
    size: Option<RawSize>,
    #[serde(default)]
    min_pixels: Option<u64>,
    #[serde(default)]
    max_pixels: Option<u64>,
    /// PIL resampling filter; 3 is bicubic, the only one Qwen-VL processors use.
    #[serde(default = "bicubic")]
    resample: u32,
}

#[derive(Deserialize)]
struct RawSize {
    shortest_edge: Option<u64>,
    longest_edge: Option<u64>,
}

fn yes() -> bool {
    true
}
fn two() -> usize {
    2
}
fn bicubic() -> u32 {
    3
}
fn default_rescale() -> f64 {
    1.0 / 255.0
}

impl PreprocessConfig {
    /// Reads `preprocessor_config.json`, or failing that `processor_config.json`'s
    /// `image_processor` section.
    pub fn from_dir(dir: &Path) -> Result<Self> {
        let legacy = dir.join("preprocessor_config.json");
        let combined = dir.join("processor_config.json");
        let (path, key, value) = if legacy.is_file() {
            (legacy.clone(), "", files::read_json(&legacy)?)
        } else if combined.is_file() {
            let v = files::read_json(&combined)?;
            let section = files::require(&combined, &v, "image_processor")?.clone();
            (combined.clone(), "image_processor", section)
        } else {
            return Err(Error::Config(format!(
                "no image-processor settings in {}: expected preprocessor_config.json or processor_config.json",
                dir.display()
            )));
        };
        let raw: RawPreprocess = files::parse(&path, key, value)?;
        Self::from_raw(raw, &path)
    }

    fn from_raw(raw: RawPreprocess, path: &Path) -> Result<Self> {
        let at = |k: &str| format!("{}: `{k}`", path.display());
        if raw.resample != 3 {
            return Err(Error::Config(format!(
                "{} is {}; only 3 (bicubic) is supported",
                at("resample"),
                raw.resample
            )));
        }
        if !raw.do_convert_rgb {
            return Err(Error::Config(format!(
                "{} is false; the vision tower takes 3-channel RGB",
                at("do_convert_rgb")
            )));
        }
        if raw.image_std.contains(&0.0) {
            return Err(Error::Config(format!("{} has a zero", at("image_std"))));
        }
        // As transformers: explicit min/max_pixels override `size`; then the Qwen2-VL defaults.
        let min_pixels = raw
            .min_pixels
            .or(raw.size.as_ref().and_then(|s| s.shortest_edge))
            .unwrap_or(56 * 56);
        let max_pixels = raw
            .max_pixels
            .or(raw.size.as_ref().and_then(|s| s.longest_edge))
            .unwrap_or(28 * 28 * 1280);
        if min_pixels > max_pixels || raw.patch_size == 0 || raw.merge_size == 0 {
            return Err(Error::Config(format!(
                "{}: min_pixels {min_pixels} / max_pixels {max_pixels} / patch_size {} / merge_size {} are inconsistent",
                path.display(),
                raw.patch_size,
                raw.merge_size
            )));
        }
        Ok(Self {
            do_resize: raw.do_resize,
            do_rescale: raw.do_rescale,
            do_normalize: raw.do_normalize,
            rescale_factor: raw.rescale_factor,
            image_mean: raw.image_mean,
            image_std: raw.image_std,
            patch_size: raw.patch_size,
            temporal_patch_size: raw.temporal_patch_size,
            merge_size: raw.merge_size,
            min_pixels,
            max_pixels,
        })
    }

    /// Resized sides are multiples of this (32 for Qwen3-VL).
    pub fn factor(&self) -> usize {
        self.patch_size * self.merge_size
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

    const PROC: &str = r#"{"patch_size": 16, "merge_size": 2, "temporal_patch_size": 2,
        "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
        "size": {"shortest_edge": 65536, "longest_edge": 16777216}}"#;

    #[test]
    fn reads_legacy_and_combined_processor_files() {
        let d = tmpdir("legacy");
        std::fs::write(d.join("preprocessor_config.json"), PROC).unwrap();
        let p = PreprocessConfig::from_dir(&d).unwrap();
        assert_eq!(
            (p.min_pixels, p.max_pixels, p.factor()),
            (65536, 16777216, 32)
        );

        let d = tmpdir("combined");
        std::fs::write(
            d.join("processor_config.json"),
            format!(r#"{{"processor_class": "Qwen3VLProcessor", "image_processor": {PROC}}}"#),
        )
        .unwrap();
        let p = PreprocessConfig::from_dir(&d).unwrap();
        assert_eq!(p.max_pixels, 16777216);
    }

    #[test]
    fn min_max_pixels_keys_override_size() {
        let d = tmpdir("override");
        let text = PROC.replace(
            "\"patch_size\"",
            "\"min_pixels\": 1024, \"max_pixels\": 4096, \"patch_size\"",
        );
        std::fs::write(d.join("preprocessor_config.json"), text).unwrap();
        let p = PreprocessConfig::from_dir(&d).unwrap();
        assert_eq!((p.min_pixels, p.max_pixels), (1024, 4096));
    }

    #[test]
    fn missing_files_and_keys_are_named() {
        let d = tmpdir("missing");
        let err = PreprocessConfig::from_dir(&d).unwrap_err().to_string();
        assert!(err.contains("preprocessor_config.json"), "{err}");
        std::fs::write(
            d.join("processor_config.json"),
            r#"{"image_processor": {"patch_size": 16}}"#,
        )
        .unwrap();
        let err = PreprocessConfig::from_dir(&d).unwrap_err().to_string();
        assert!(
            err.contains("processor_config.json") && err.contains("image_mean"),
            "{err}"
        );
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
