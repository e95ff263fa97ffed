//! vision-svc's work on one `Encode` request: decode (PNG, JPEG, WebP, GIF) under the
//! service's limits, `smart_resize`, Pillow-exact bicubic, normalize, patchify, then the ViT
//! (the tiny one, so that odd patch grids reach the position-embedding interpolation too).

use vision_svc::preprocess::{self, RgbImage};
use vision_svc::{DecodeLimits, Patches, PreprocessConfig};

use super::{fixture, text};
use crate::Outcome;

/// What must hold of any patches preprocessing returns.
fn check_patches(p: &Patches, cfg: &PreprocessConfig) {
    let [t, h, w] = p.grid_thw;
    let patch_dim = 3 * cfg.temporal_patch_size * cfg.patch_size * cfg.patch_size;
    assert_eq!(t, 1, "an image is one temporal patch");
    assert!(h > 0 && w > 0, "empty patch grid {:?}", p.grid_thw);
    assert!(
        h % cfg.merge_size == 0 && w % cfg.merge_size == 0,
        "grid {:?} is not a multiple of the merge size",
        p.grid_thw
    );
    let values = p.to_values().expect("preprocessed patches cut");
    assert_eq!(values.shape(), [t * h * w, patch_dim]);
    assert!(
        values.data().iter().all(|v| v.is_finite()),
        "non-finite pixel values"
    );
}

/// Encoded image bytes, as `EncodeRequest.image`.
pub fn encoded_image(data: &[u8]) -> Outcome {
    let f = fixture();
    let patches = preprocess::preprocess(data, &f.vision.preprocess, &DecodeLimits::default())
        .map_err(text)?;
    check_patches(&patches, &f.vision.preprocess);
    let out = f.vision.model.forward(&patches).map_err(text)?;
    let [_, h, w] = patches.grid_thw;
    let merge = f.vision.preprocess.merge_size;
    assert_eq!(
        out.embeds.shape()[0],
        h / merge * (w / merge),
        "one embedding per merged patch"
    );
    Ok(())
}

/// Already-decoded pixels of any size (the first four bytes: width and height, 1 to 512,
/// then the pixels, repeated to fill the image): resize and patchify, whatever the aspect
/// ratio, without the decoder standing in the way.
pub fn raw_pixels(data: &[u8]) -> Outcome {
    if data.len() < 5 {
        return Err("too short: width, height and at least one byte of pixels".into());
    }
    let width = u16::from_le_bytes([data[0], data[1]]) as usize % 512 + 1;
    let height = u16::from_le_bytes([data[2], data[3]]) as usize % 512 + 1;
    let pixels = &data[4..];
    let img = RgbImage {
        width,
        height,
        data: pixels
            .iter()
            .copied()
            .cycle()
            .take(width * height * 3)
            .collect(),
    };
    let cfg = &fixture().vision.preprocess;
    let patches = preprocess::image_patches(img, cfg).map_err(text)?;
    check_patches(&patches, cfg);
    // Resampling a flat image gives the same flat image: every normalized value equal.
    if pixels.len() <= 3 && pixels.chunks(3).all(|c| c.iter().all(|&v| v == pixels[0])) {
        let values = patches.to_values().map_err(text)?;
        let first = values.data()[0];
        assert!(
            values.data().iter().all(|&v| v == first),
            "a flat {width}x{height} image of {} did not stay flat",
            pixels[0]
        );
    }
    Ok(())
}
