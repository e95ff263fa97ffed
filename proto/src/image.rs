//! The image rule both sides of the vision hop agree on: which images are accepted
//! ([`check_header`], under [`DecodeLimits`]), the checkpoint's image-processor settings
//! ([`PreprocessConfig`]), and how many prompt tokens an image becomes ([`image_tokens`], with
//! transformers' [`smart_resize`]). vision-svc preprocesses and encodes by it; the gateway counts
//! an image's tokens by it from the header alone, so it can build the prompt while the image is
//! being encoded. Defined here once, so the two counts cannot drift apart.

use std::io::Cursor;
use std::path::Path;

use image::{ImageFormat, ImageReader};
use serde::Deserialize;

use crate::checkpoint;

/// Why an image, or the settings it is read by, is refused. vision-svc maps each variant to
/// its own error of the same name and message.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The bytes are not an image we can read: unknown format, truncated or corrupt data.
    #[error("cannot decode image: {0}")]
    BadImage(String),
    /// The image is outside what we accept (dimensions, memory).
    #[error("image rejected: {0}")]
    ImageTooLarge(String),
    #[error("image rejected: {0}")]
    BadAspectRatio(String),
    /// The checkpoint's image-processor settings are inconsistent or unsupported.
    #[error("vision config: {0}")]
    Config(String),
    /// The settings file cannot be read.
    #[error(transparent)]
    Checkpoint(#[from] checkpoint::Error),
}

pub type Result<T> = std::result::Result<T, Error>;

/// Bounds applied while decoding, before any large allocation happens.
#[derive(Clone, Debug)]
pub struct DecodeLimits {
    /// Largest accepted width or height of the encoded image, in pixels.
    pub max_side: u32,
    /// Largest accepted width × height.
    pub max_pixels: u64,
    /// Largest allocation the decoder may make, in bytes.
    pub max_alloc: u64,
}

impl Default for DecodeLimits {
    fn default() -> Self {
        // 64 Mpx covers any camera; the decoder allocates at most 4 bytes per pixel plus slack.
        Self {
            max_side: 16_384,
            max_pixels: 64 * 1024 * 1024,
            max_alloc: 512 * 1024 * 1024,
        }
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
            (legacy.clone(), "", checkpoint::read_json(&legacy)?)
        } else if combined.is_file() {
            let v = checkpoint::read_json(&combined)?;
            let section = checkpoint::require(&combined, &v, "image_processor")?.clone();
            (combined.clone(), "image_processor", section)
        } else {
            return Err(Error::Config(format!(
                "no image-processor settings in {}: expected preprocessor_config.json or processor_config.json",
                dir.display()
            )));
        };
        let raw: RawPreprocess = checkpoint::parse(&path, key, value)?;
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

/// Checks what the image's header declares against `limits`, reading the header only: the
/// format must be one we decode, the size nonzero and within the limits. A decompression bomb
/// (a small file declaring a huge image) is refused here, before anything is allocated for
/// its pixels, and cheaply enough for a server to check a request before it takes a place.
pub fn check_header(bytes: &[u8], limits: &DecodeLimits) -> Result<(ImageFormat, u32, u32)> {
    if bytes.is_empty() {
        return Err(Error::BadImage("the image is empty (0 bytes)".into()));
    }
    let reader = ImageReader::new(Cursor::new(bytes))
        .with_guessed_format()
        .map_err(|e| Error::BadImage(e.to_string()))?;
    let format = reader.format().ok_or_else(|| {
        Error::BadImage("unrecognized format; PNG, JPEG, WebP and GIF are supported".into())
    })?;
    if !matches!(
        format,
        ImageFormat::Png | ImageFormat::Jpeg | ImageFormat::WebP | ImageFormat::Gif
    ) {
        return Err(Error::BadImage(format!(
            "{format:?} is not supported; PNG, JPEG, WebP and GIF are"
        )));
    }
    let (w, h) = reader
        .into_dimensions()
        .map_err(|e| Error::BadImage(format!("{format:?}: {e}")))?;
    if w == 0 || h == 0 {
        return Err(Error::BadImage(format!(
            "{format:?} image has size {w}x{h}"
        )));
    }
    if w > limits.max_side || h > limits.max_side || (w as u64) * (h as u64) > limits.max_pixels {
        return Err(Error::ImageTooLarge(format!(
            "{format:?} declares {w}x{h} pixels, over the limit of {} per side and {} in total",
            limits.max_side, limits.max_pixels
        )));
    }
    Ok((format, w, h))
}

/// Python's `round()`: halves go to the even neighbour (`round(2.5) == 2`).
fn round_half_even(x: f64) -> f64 {
    let r = x.round();
    if (x - x.trunc()).abs() == 0.5 && r % 2.0 != 0.0 {
        r - x.signum()
    } else {
        r
    }
}

/// transformers' `smart_resize`: the (height, width) an image of `height`×`width` is resized to.
pub fn smart_resize(
    height: usize,
    width: usize,
    factor: usize,
    min_pixels: u64,
    max_pixels: u64,
) -> Result<(usize, usize)> {
    let (h, w, f) = (height as f64, width as f64, factor as f64);
    let ratio = h.max(w) / h.min(w);
    if ratio > 200.0 {
        return Err(Error::BadAspectRatio(format!(
            "{width}x{height} has aspect ratio {ratio:.1}; it must be at most 200"
        )));
    }
    let mut h_bar = round_half_even(h / f) * f;
    let mut w_bar = round_half_even(w / f) * f;
    if h_bar * w_bar > max_pixels as f64 {
        let beta = (h * w / max_pixels as f64).sqrt();
        h_bar = f.max((h / beta / f).floor() * f);
        w_bar = f.max((w / beta / f).floor() * f);
    } else if h_bar * w_bar < min_pixels as f64 {
        let beta = (min_pixels as f64 / (h * w)).sqrt();
        h_bar = (h * beta / f).ceil() * f;
        w_bar = (w * beta / f).ceil() * f;
    }
    Ok((h_bar as usize, w_bar as usize))
}

/// How many image tokens of the LLM prompt `bytes` becomes, from its header alone (what
/// vision-svc's preprocessing produces, without decoding it): callers can build the prompt while
/// the image is being encoded.
pub fn image_tokens(bytes: &[u8], cfg: &PreprocessConfig, limits: &DecodeLimits) -> Result<usize> {
    let (_, width, height) = check_header(bytes, limits)?;
    image_tokens_of_size(width as usize, height as usize, cfg)
}

/// How many image tokens an image of `width`×`height` pixels becomes.
pub fn image_tokens_of_size(width: usize, height: usize, cfg: &PreprocessConfig) -> Result<usize> {
    let (h, w) = if cfg.do_resize {
        smart_resize(height, width, cfg.factor(), cfg.min_pixels, cfg.max_pixels)?
    } else {
        (height, width)
    };
    // One token per merge_size x merge_size patches (one frame: an image).
    Ok((h / cfg.factor()) * (w / cfg.factor()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tmpdir(name: &str) -> std::path::PathBuf {
        let d = std::env::temp_dir().join(format!("vlm-image-{name}-{}", std::process::id()));
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
    }

    #[test]
    fn python_rounding_is_half_to_even() {
        assert_eq!(round_half_even(2.5), 2.0);
        assert_eq!(round_half_even(3.5), 4.0);
        assert_eq!(round_half_even(2.4), 2.0);
        assert_eq!(round_half_even(2.6), 3.0);
    }

    #[test]
    fn smart_resize_matches_transformers_branches() {
        // Values from transformers' smart_resize(h, w, 32, min, max).
        assert_eq!(smart_resize(75, 100, 32, 4096, 32768).unwrap(), (64, 96));
        assert_eq!(smart_resize(140, 300, 32, 4096, 32768).unwrap(), (96, 256));
        assert_eq!(smart_resize(30, 40, 32, 4096, 32768).unwrap(), (64, 96));
        // 80/32 = 2.5 rounds to 2 (banker's rounding), 144/32 = 4.5 rounds to 4.
        assert_eq!(smart_resize(80, 144, 32, 1024, 1 << 20).unwrap(), (64, 128));
        assert_eq!(
            smart_resize(448, 448, 32, 65536, 16777216).unwrap(),
            (448, 448)
        );
        assert!(matches!(
            smart_resize(10, 2010, 32, 1, 1 << 30),
            Err(Error::BadAspectRatio(_))
        ));
    }
}
