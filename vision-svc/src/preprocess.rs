//! Image bytes → normalized patches, exactly as transformers' `Qwen2VLImageProcessor` (the PIL
//! backend, which Qwen3-VL uses) does it:
//!
//! 1. decode (PNG, JPEG, WebP, GIF first frame) under [`DecodeLimits`], convert to RGB
//!    (alpha dropped, as PIL's `convert("RGB")`);
//! 2. `smart_resize`: both sides to multiples of patch·merge (32), pixel count within
//!    `[min_pixels, max_pixels]`, aspect ratio kept — Python's round-half-to-even included;
//! 3. bicubic resampling bit-exact with Pillow's (fixed-point, horizontal pass then vertical,
//!    8-bit between passes), so pixel values match HF's to float rounding for lossless inputs;
//! 4. rescale by 1/255, normalize by mean/std;
//! 5. repeat the frame `temporal_patch_size` times and cut `[C, T, P, P]` patches ordered by
//!    2×2 merge windows, so that four consecutive patches form one merged token.
//!
//! Steps 1-3 run here; 4 becomes a table of each channel's 256 values, and 4-5 run where the
//! tower does ([`vlm_compute::Backend::patchify`], [`vlm_compute::patches`]): a GPU takes the
//! image's bytes instead of values four times their size.

use std::io::Cursor;

use image::{ImageFormat, ImageReader};
use rayon::prelude::*;
use vlm_compute::patches::{patchify, PatchLayout};
use vlm_compute::HostTensor;

use vlm_proto::image::smart_resize;
pub use vlm_proto::image::DecodeLimits;

use crate::{Error, PreprocessConfig, Result};

/// One image, cut into patches for the vision tower.
#[derive(Clone, Debug)]
pub struct Patches {
    pub values: PatchValues,
    /// Patch grid (temporal, height, width); the LLM sees `t·h·w / merge²` tokens.
    pub grid_thw: [usize; 3],
}

/// What a [`Patches`]' values are, or are made from.
#[derive(Clone, Debug)]
pub enum PatchValues {
    /// The image at its final size, and the table that rescales and normalizes each channel's
    /// byte (`vlm_compute::patches`): the tower's backend cuts the patches
    /// ([`vlm_compute::Backend::patchify`]). A GPU gets the bytes, a quarter of the values' size.
    Image {
        image: RgbImage,
        table: Vec<f32>,
        layout: PatchLayout,
    },
    /// The values themselves, `[t·h·w, C·T·P·P]`, rows in merge-window order (HF's
    /// `pixel_values`).
    Values(HostTensor),
}

impl Patches {
    /// How many patches (rows of values).
    pub fn rows(&self) -> usize {
        self.grid_thw.iter().product()
    }

    /// The values on the host, `[rows, C·T·P·P]` (cut from the image where that is what this
    /// holds).
    pub fn to_values(&self) -> Result<HostTensor> {
        Ok(match &self.values {
            PatchValues::Values(v) => v.clone(),
            PatchValues::Image {
                image,
                table,
                layout,
            } => patchify(&image.data, image.height, image.width, table, *layout)?,
        })
    }
}

/// A decoded RGB image, row-major, 3 bytes per pixel.
#[derive(Clone, Debug)]
pub struct RgbImage {
    pub width: usize,
    pub height: usize,
    pub data: Vec<u8>,
}

/// [`vlm_proto::image::check_header`] (the header against `limits`, before anything is
/// allocated for the pixels), with the vision stage's errors.
pub fn check_header(bytes: &[u8], limits: &DecodeLimits) -> Result<(ImageFormat, u32, u32)> {
    Ok(vlm_proto::image::check_header(bytes, limits)?)
}

/// Decodes `bytes` into RGB under `limits`; the format is sniffed from the content. The header
/// is checked first ([`check_header`]); the decoder then runs under `image::Limits`, so a
/// file whose data disagrees with its header cannot allocate past `max_alloc` either.
pub fn decode(bytes: &[u8], limits: &DecodeLimits) -> Result<RgbImage> {
    let (format, _, _) = check_header(bytes, limits)?;
    let mut reader = ImageReader::with_format(Cursor::new(bytes), format);
    let mut l = image::Limits::default();
    l.max_image_width = Some(limits.max_side);
    l.max_image_height = Some(limits.max_side);
    l.max_alloc = Some(limits.max_alloc);
    reader.limits(l);
    let img = reader.decode().map_err(|e| match e {
        image::ImageError::Limits(l) => Error::ImageTooLarge(l.to_string()),
        other => Error::BadImage(format!("{format:?}: {other}")),
    })?;
    let rgb = img.into_rgb8();
    Ok(RgbImage {
        width: rgb.width() as usize,
        height: rgb.height() as usize,
        data: rgb.into_raw(),
    })
}

// ---- Pillow-exact bicubic resampling (libImaging/Resample.c) ----

/// Fixed-point precision Pillow uses for 8-bit images.
const PRECISION_BITS: u32 = 32 - 8 - 2;

fn bicubic_filter(x: f64) -> f64 {
    // Keys cubic with a = -0.5, support 2 (Pillow's BICUBIC).
    const A: f64 = -0.5;
    let x = x.abs();
    if x < 1.0 {
        ((A + 2.0) * x - (A + 3.0)) * x * x + 1.0
    } else if x < 2.0 {
        (((x - 5.0) * x + 8.0) * x - 4.0) * A
    } else {
        0.0
    }
}

/// For each output index: the first input index, the tap count, and fixed-point weights.
struct Taps {
    bounds: Vec<(usize, usize)>,
    ksize: usize,
    weights: Vec<i32>,
}

fn precompute_taps(in_size: usize, out_size: usize) -> Taps {
    let scale = in_size as f64 / out_size as f64;
    let filterscale = scale.max(1.0);
    let support = 2.0 * filterscale;
    let ksize = support.ceil() as usize * 2 + 1;
    let mut bounds = Vec::with_capacity(out_size);
    let mut weights = vec![0i32; out_size * ksize];
    let mut k = vec![0f64; ksize];
    for xx in 0..out_size {
        let center = (xx as f64 + 0.5) * scale;
        let ss = 1.0 / filterscale;
        // C's (int) cast truncates toward zero, as `as i64` does.
        let xmin = ((center - support + 0.5) as i64).max(0);
        let xmax = ((center + support + 0.5) as i64).min(in_size as i64) - xmin;
        let (xmin, xmax) = (xmin as usize, xmax.max(0) as usize);
        let mut ww = 0.0;
        for (x, kx) in k.iter_mut().enumerate().take(xmax) {
            let w = bicubic_filter((x as f64 + xmin as f64 - center + 0.5) * ss);
            *kx = w;
            ww += w;
        }
        for x in 0..xmax {
            let v = if ww != 0.0 { k[x] / ww } else { k[x] };
            let scaled = v * (1u32 << PRECISION_BITS) as f64;
            weights[xx * ksize + x] = if v < 0.0 {
                (-0.5 + scaled) as i32
            } else {
                (0.5 + scaled) as i32
            };
        }
        bounds.push((xmin, xmax));
    }
    Taps {
        bounds,
        ksize,
        weights,
    }
}

fn clip8(acc: i64) -> u8 {
    (acc >> PRECISION_BITS).clamp(0, 255) as u8
}

/// Resamples along x: `src` is `rows` × `in_w` RGB, output `rows` × `out_w`.
fn resample_horizontal(src: &[u8], rows: usize, in_w: usize, out_w: usize, taps: &Taps) -> Vec<u8> {
    let mut out = vec![0u8; rows * out_w * 3];
    out.par_chunks_mut(out_w * 3)
        .enumerate()
        .for_each(|(y, orow)| {
            let srow = &src[y * in_w * 3..(y + 1) * in_w * 3];
            for xx in 0..out_w {
                let (xmin, n) = taps.bounds[xx];
                let k = &taps.weights[xx * taps.ksize..][..n];
                for c in 0..3 {
                    let mut acc: i64 = 1 << (PRECISION_BITS - 1);
                    for (x, &kw) in k.iter().enumerate() {
                        acc += srow[(xmin + x) * 3 + c] as i64 * kw as i64;
                    }
                    orow[xx * 3 + c] = clip8(acc);
                }
            }
        });
    out
}

/// Resamples along y: `src` is `in_h` × `width` RGB (rows offset by `first_row`).
fn resample_vertical(
    src: &[u8],
    width: usize,
    out_h: usize,
    first_row: usize,
    taps: &Taps,
) -> Vec<u8> {
    let mut out = vec![0u8; out_h * width * 3];
    out.par_chunks_mut(width * 3)
        .enumerate()
        .for_each(|(yy, orow)| {
            let (ymin, n) = taps.bounds[yy];
            let k = &taps.weights[yy * taps.ksize..][..n];
            for (i, o) in orow.iter_mut().enumerate() {
                let mut acc: i64 = 1 << (PRECISION_BITS - 1);
                for (y, &kw) in k.iter().enumerate() {
                    acc += src[(ymin - first_row + y) * width * 3 + i] as i64 * kw as i64;
                }
                *o = clip8(acc);
            }
        });
    out
}

/// Pillow's `Image.resize(size, BICUBIC)` for an RGB image.
pub fn resize_bicubic(img: &RgbImage, out_w: usize, out_h: usize) -> RgbImage {
    let (in_w, in_h) = (img.width, img.height);
    let need_h = out_w != in_w;
    let need_v = out_h != in_h;
    let htaps = precompute_taps(in_w, out_w);
    let vtaps = precompute_taps(in_h, out_h);
    // Pillow (13) runs the vertical pass first when it removes more than twice as many rows as
    // the horizontal pass removes columns; the 8-bit rounding between passes makes the order
    // visible. Rule found by comparing both orders with Pillow on 300 random size pairs.
    let vertical_first =
        need_h && need_v && (in_h as i64 - out_h as i64) > 2 * (in_w as i64 - out_w as i64).max(0);
    let data = if vertical_first {
        let tmp = resample_vertical(&img.data, in_w, out_h, 0, &vtaps);
        resample_horizontal(&tmp, out_h, in_w, out_w, &htaps)
    } else {
        let (mut data, mut width, mut first_row) = (img.data.clone(), in_w, 0);
        if need_h {
            // Only the source rows the vertical pass reads are resampled horizontally.
            let (first, last) = if need_v {
                let (lo, _) = vtaps.bounds[0];
                let (hi, n) = vtaps.bounds[out_h - 1];
                (lo, hi + n)
            } else {
                (0, in_h)
            };
            let rows = &img.data[first * in_w * 3..last * in_w * 3];
            data = resample_horizontal(rows, last - first, in_w, out_w, &htaps);
            width = out_w;
            first_row = first;
        }
        if need_v {
            data = resample_vertical(&data, width, out_h, first_row, &vtaps);
        }
        data
    };
    RgbImage {
        width: out_w,
        height: out_h,
        data,
    }
}

/// Decodes, resizes, normalizes and patchifies one image.
/// Decodes, resizes, normalizes and patchifies one image.
pub fn preprocess(bytes: &[u8], cfg: &PreprocessConfig, limits: &DecodeLimits) -> Result<Patches> {
    let img = decode(bytes, limits)?;
    image_patches(img, cfg)
}

/// Everything after decoding that happens on the host: the resize, and the table that rescales
/// and normalizes. The tower's backend cuts the patches from the result.
pub fn image_patches(img: RgbImage, cfg: &PreprocessConfig) -> Result<Patches> {
    let factor = cfg.factor();
    let (h, w) = if cfg.do_resize {
        smart_resize(
            img.height,
            img.width,
            factor,
            cfg.min_pixels,
            cfg.max_pixels,
        )?
    } else {
        if img.height % factor != 0 || img.width % factor != 0 {
            return Err(Error::BadImage(format!(
                "image is {}x{}; with do_resize off both sides must be multiples of {factor}",
                img.width, img.height
            )));
        }
        (img.height, img.width)
    };
    let image = if (h, w) == (img.height, img.width) {
        img
    } else {
        resize_bicubic(&img, w, h)
    };
    // Each channel's 256 normalized values, computed as HF computes each pixel (f64
    // rescale, then f32 (x - mean) / std), so a lookup gives the same bits.
    let table: Vec<f32> = (0..3)
        .flat_map(|c| {
            (0..256).map(move |byte| {
                let mut v = byte as f32;
                if cfg.do_rescale {
                    v = (byte as f64 * cfg.rescale_factor) as f32;
                }
                if cfg.do_normalize {
                    v = (v - cfg.image_mean[c]) / cfg.image_std[c];
                }
                v
            })
        })
        .collect();
    let layout = PatchLayout {
        patch: cfg.patch_size,
        merge: cfg.merge_size,
        temporal: cfg.temporal_patch_size,
    };
    Ok(Patches {
        values: PatchValues::Image {
            image,
            table,
            layout,
        },
        grid_thw: [1, h / cfg.patch_size, w / cfg.patch_size],
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The header's count is the one preprocessing gives, for every fixture image (each of a
    /// different size and format) and for sizes that smart_resize scales up and down.
    #[test]
    fn image_tokens_from_the_header_equal_what_preprocessing_gives() {
        let dir = vlm_compute::golden::tiny_fixture(env!("CARGO_MANIFEST_DIR"));
        let cfg = PreprocessConfig::from_dir(&dir).unwrap();
        let limits = DecodeLimits::default();
        let mut images: Vec<Vec<u8>> = std::fs::read_dir(dir.join("images"))
            .unwrap()
            .map(|e| std::fs::read(e.unwrap().path()).unwrap())
            .collect();
        for (w, h) in [(7, 300), (1000, 33), (640, 480)] {
            let mut png = Vec::new();
            image::RgbImage::from_pixel(w, h, image::Rgb([9, 9, 9]))
                .write_to(&mut Cursor::new(&mut png), image::ImageFormat::Png)
                .unwrap();
            images.push(png);
        }
        for bytes in &images {
            let [t, gh, gw] = preprocess(bytes, &cfg, &limits).unwrap().grid_thw;
            let want = t * gh * gw / (cfg.merge_size * cfg.merge_size);
            let counted = vlm_proto::image::image_tokens(bytes, &cfg, &limits).unwrap();
            assert_eq!(counted, want);
        }
    }

    #[test]
    fn identity_resize_is_exact_and_constant_images_stay_constant() {
        let img = RgbImage {
            width: 5,
            height: 3,
            data: (0..45).map(|i| (i * 5) as u8).collect(),
        };
        assert_eq!(resize_bicubic(&img, 5, 3).data, img.data);
        let flat = RgbImage {
            width: 7,
            height: 9,
            data: vec![77; 7 * 9 * 3],
        };
        let r = resize_bicubic(&flat, 32, 20);
        assert!(r.data.iter().all(|&v| v == 77));
    }

    #[test]
    fn rejects_garbage_empty_and_truncated_input() {
        let limits = DecodeLimits::default();
        assert!(matches!(decode(b"", &limits), Err(Error::BadImage(_))));
        assert!(matches!(
            decode(b"hello world", &limits),
            Err(Error::BadImage(_))
        ));
        let mut png = Vec::new();
        image::RgbImage::from_pixel(40, 40, image::Rgb([1, 2, 3]))
            .write_to(&mut Cursor::new(&mut png), ImageFormat::Png)
            .unwrap();
        assert!(decode(&png, &limits).is_ok());
        let err = decode(&png[..png.len() / 2], &limits).unwrap_err();
        assert!(matches!(err, Error::BadImage(_)), "{err}");
    }

    #[test]
    fn gif_first_frame_and_grayscale_png_become_rgb() {
        let mut gif = Vec::new();
        image::RgbaImage::from_pixel(33, 17, image::Rgba([200, 10, 10, 255]))
            .write_to(&mut Cursor::new(&mut gif), ImageFormat::Gif)
            .unwrap();
        let img = decode(&gif, &DecodeLimits::default()).unwrap();
        assert_eq!(
            (img.width, img.height, img.data.len()),
            (33, 17, 33 * 17 * 3)
        );
        let mut png = Vec::new();
        image::GrayImage::from_pixel(5, 4, image::Luma([77]))
            .write_to(&mut Cursor::new(&mut png), ImageFormat::Png)
            .unwrap();
        let img = decode(&png, &DecodeLimits::default()).unwrap();
        assert!(
            img.data.iter().all(|&v| v == 77),
            "gray replicated to R, G and B"
        );
    }

    #[test]
    fn rejects_images_over_the_limits_before_decoding() {
        let mut png = Vec::new();
        image::RgbImage::from_pixel(300, 200, image::Rgb([0, 0, 0]))
            .write_to(&mut Cursor::new(&mut png), ImageFormat::Png)
            .unwrap();
        let limits = DecodeLimits {
            max_side: 256,
            ..Default::default()
        };
        let err = decode(&png, &limits).unwrap_err();
        assert!(matches!(err, Error::ImageTooLarge(_)), "{err}");
        assert!(err.to_string().contains("300x200"), "{err}");
    }

    #[test]
    fn decompression_bomb_header_is_rejected_without_allocating() {
        // A valid PNG claiming 100000 x 100000 pixels whose data is a few bytes of zlib.
        let mut ihdr = Vec::new();
        ihdr.extend_from_slice(&100_000u32.to_be_bytes());
        ihdr.extend_from_slice(&100_000u32.to_be_bytes());
        ihdr.extend_from_slice(&[8, 2, 0, 0, 0]);
        let mut png = b"\x89PNG\r\n\x1a\n".to_vec();
        for (kind, data) in [
            (&b"IHDR"[..], &ihdr[..]),
            (b"IDAT", b"\x78\x9c\x03\x00\x00\x00\x00\x01"),
            (b"IEND", b""),
        ] {
            png.extend_from_slice(&(data.len() as u32).to_be_bytes());
            let mut body = kind.to_vec();
            body.extend_from_slice(data);
            png.extend_from_slice(&body);
            png.extend_from_slice(&crc32fast::hash(&body).to_be_bytes());
        }
        let err = decode(&png, &DecodeLimits::default()).unwrap_err();
        assert!(matches!(err, Error::ImageTooLarge(_)), "{err}");
    }
}
