//! The ViT's input from an image's bytes: each pixel's channels through a lookup table (the
//! processor's rescale and normalization, folded into 256 values a channel), cut into patches
//! in Qwen2-VL's layout. [`patchify`] is the CPU's version and the reference of the GPU's
//! (`Backend::patchify`), which uploads the bytes, a quarter of the values' size, and computes
//! the values on the device.

use rayon::prelude::*;

use crate::{Error, HostTensor, Result};

/// Entries of a lookup table: 256 values for each of the three channels, channel-major.
pub const TABLE_LEN: usize = 3 * 256;

/// How an image's pixels become the ViT's patches: `patch`×`patch` pixels a patch, each
/// repeated over `temporal` frames (an image is one frame, shown `temporal` times), the patches
/// ordered by `merge`×`merge` windows (the windows row by row, the patches of a window row by
/// row), as Qwen2-VL's image processor cuts them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PatchLayout {
    pub patch: usize,
    pub merge: usize,
    pub temporal: usize,
}

impl PatchLayout {
    /// Values a patch: 3 channels × `temporal` frames × `patch`².
    pub fn patch_dim(&self) -> usize {
        3 * self.temporal * self.patch * self.patch
    }

    /// The patch grid (rows, columns) of a `height`×`width` image, which must be cut into whole
    /// merge windows; `bytes` and `table` are the lengths given with it.
    pub fn grid(
        &self,
        height: usize,
        width: usize,
        bytes: usize,
        table: usize,
    ) -> Result<(usize, usize)> {
        let side = self.patch * self.merge;
        let bad = |message: String| Err(Error::shape("patchify", message));
        if self.patch == 0 || self.merge == 0 || self.temporal == 0 {
            return bad(format!("{self:?} has a zero"));
        }
        if height == 0 || width == 0 || height % side != 0 || width % side != 0 {
            return bad(format!(
                "a {width}x{height} image is not cut into whole {side}x{side} windows"
            ));
        }
        if bytes < height * width * 3 {
            return bad(format!("{bytes} bytes for a {width}x{height} RGB image"));
        }
        if table != TABLE_LEN {
            return bad(format!("a table of {table} values, not {TABLE_LEN}"));
        }
        Ok((height / self.patch, width / self.patch))
    }
}

/// The patches of the `height`×`width` RGB image `rgb` (3 bytes a pixel, row-major):
/// `[patches, layout.patch_dim()]`; inside a patch (channel, frame, y, x), every frame the same.
pub fn patchify(
    rgb: &[u8],
    height: usize,
    width: usize,
    table: &[f32],
    layout: PatchLayout,
) -> Result<HostTensor> {
    let (gh, gw) = layout.grid(height, width, rgb.len(), table.len())?;
    let (p, m, t) = (layout.patch, layout.merge, layout.temporal);
    let patch_dim = layout.patch_dim();
    let mut out = vec![0f32; gh * gw * patch_dim];
    // One pass, in parallel, from the bytes straight into the patches.
    out.par_chunks_mut(patch_dim)
        .enumerate()
        .for_each(|(idx, patch)| {
            let (inner, window) = (idx % (m * m), idx / (m * m));
            let (wr, wc) = (window / (gw / m), window % (gw / m));
            let (py, px) = (wr * m + inner / m, wc * m + inner % m);
            let frame = p * p;
            for (c, channel) in patch.chunks_exact_mut(t * frame).enumerate() {
                let lut = &table[c * 256..(c + 1) * 256];
                let (first, repeats) = channel.split_at_mut(frame);
                for (y, row) in first.chunks_exact_mut(p).enumerate() {
                    let src = &rgb[((py * p + y) * width + px * p) * 3..][..3 * p];
                    for (o, pixel) in row.iter_mut().zip(src.chunks_exact(3)) {
                        *o = lut[pixel[c] as usize];
                    }
                }
                for copy in repeats.chunks_exact_mut(frame) {
                    copy.copy_from_slice(first);
                }
            }
        });
    HostTensor::new(vec![gh * gw, patch_dim], out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every value is its pixel's byte through its channel's table, at the place the layout
    /// gives: checked against a direct formula, one element at a time.
    #[test]
    fn each_value_is_its_pixels_table_entry() {
        let layout = PatchLayout {
            patch: 2,
            merge: 2,
            temporal: 2,
        };
        let (h, w) = (8, 12);
        let rgb: Vec<u8> = (0..h * w * 3).map(|i| (i * 7 % 256) as u8).collect();
        let table: Vec<f32> = (0..TABLE_LEN).map(|i| i as f32 * 0.5 - 3.0).collect();
        let out = patchify(&rgb, h, w, &table, layout).unwrap();
        let (gw, dim) = (w / 2, layout.patch_dim());
        assert_eq!(out.shape(), [h / 2 * gw, dim]);
        for (i, &v) in out.data().iter().enumerate() {
            let (idx, r) = (i / dim, i % dim);
            let (c, y, x) = (r / 8, r % 4 / 2, r % 2);
            let (window, inner) = (idx / 4, idx % 4);
            let py = window / (gw / 2) * 2 + inner / 2;
            let px = window % (gw / 2) * 2 + inner % 2;
            let byte = rgb[((py * 2 + y) * w + px * 2 + x) * 3 + c];
            assert_eq!(v, table[c * 256 + byte as usize], "element {i}");
        }
        assert!(patchify(&rgb, h, w + 1, &table, layout).is_err());
        assert!(patchify(&rgb[1..], h, w, &table, layout).is_err());
    }
}
