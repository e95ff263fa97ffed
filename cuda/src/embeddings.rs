//! Rows that leave one stage for the other: an image's embeddings and DeepStack features, from
//! the vision tower to the text model, in process or over the wire.
//!
//! The CPU reference keeps them f32. A GPU downloads them as f16 (its GEMMs take f16 operands
//! anyway), which is also the wire's element type: half the bytes to download, send and
//! upload, and no pass over the values on the host at either end. f16 rows are held as shared
//! bytes ([`HalfTensor`]), so a received message's buffer or a shared-memory mapping is read
//! in place and uploaded from there.

use std::borrow::Cow;
use std::ops::Range;

use bytes::Bytes;
use half::f16;
use half::slice::HalfFloatSliceExt;

use crate::handoff::DeviceRows;
use crate::{Error, HostTensor, Result};

/// Index of the first f16 value (little-endian bytes) whose exponent bits are all ones: an
/// infinity or a NaN. Four values (eight bytes) at a time, a block without a branch a value (a
/// 448 px image's 6.4 MB of features in ~0.5 ms, 3x a value-by-value search), then the block
/// that has one searched value by value.
fn first_f16_non_finite(bytes: &[u8]) -> Option<usize> {
    const EXPONENT: u16 = 0x7c00;
    // The exponent, lowest and highest bits of each of a u64's four f16 lanes.
    const EXPONENTS: u64 = 0x7c00_7c00_7c00_7c00;
    const LOW: u64 = 0x0001_0001_0001_0001;
    const HIGH: u64 = 0x8000_8000_8000_8000;
    let lane = |b: &[u8]| u16::from_le_bytes([b[0], b[1]]) & EXPONENT == EXPONENT;
    const BLOCK: usize = 512;
    for (k, block) in bytes.chunks(BLOCK).enumerate() {
        let words = block.chunks_exact(8);
        let tail = words.remainder();
        // A lane of x is zero where the value's exponent is all ones; `(x - low) & !x & high`
        // sets a lane's top bit exactly where that lane is zero (no lane of x has its top bit
        // set, so no borrow crosses into the next).
        let hit = words.fold(0u64, |acc, w| {
            let x = (u64::from_le_bytes(w.try_into().expect("8 bytes")) & EXPONENTS) ^ EXPONENTS;
            acc | (x.wrapping_sub(LOW) & !x & HIGH)
        });
        if hit != 0 || tail.chunks_exact(2).any(lane) {
            let at = block.chunks_exact(2).position(lane)?;
            return Some(k * BLOCK / 2 + at);
        }
    }
    None
}

/// Index of the first f32 value past f16's range: NaN, an infinity or |v| > 65504. With the
/// sign cleared, an f32's bits order as its magnitude does, and NaNs and infinities order above
/// every finite value, so one unsigned comparison a value covers all three. Blocks of 512 are
/// tested without a branch a value (the loop vectorizes), then the block that has one is
/// searched value by value.
fn first_f32_beyond_f16(values: &[f32]) -> Option<usize> {
    const F16_MAX_BITS: u32 = 0x477f_e000; // 65504.0f32
    let beyond = |v: &f32| (v.to_bits() & 0x7fff_ffff) > F16_MAX_BITS;
    const BLOCK: usize = 512;
    for (k, block) in values.chunks(BLOCK).enumerate() {
        if block.iter().fold(false, |acc, v| acc | beyond(v)) {
            return block.iter().position(beyond).map(|at| k * BLOCK + at);
        }
    }
    None
}

/// A row-major f16 tensor in host memory over shared little-endian bytes: cloning it and
/// taking rows of it copy nothing.
#[derive(Clone, Debug, PartialEq)]
pub struct HalfTensor {
    shape: Vec<usize>,
    /// `2 x` the element count. Not necessarily 2-aligned (a slice of a received message).
    bytes: Bytes,
}

/// A vector owned by a [`Bytes`] and read as its raw bytes.
struct OwnedHalves(Vec<f16>);

impl AsRef<[u8]> for OwnedHalves {
    fn as_ref(&self) -> &[u8] {
        bytemuck::cast_slice(&self.0)
    }
}

// The bytes are the values in memory order, which is the wire's order only on little-endian
// hosts (every target we build for).
#[cfg(target_endian = "big")]
compile_error!("HalfTensor reads f16 bytes as little-endian");

impl HalfTensor {
    /// `bytes` (little-endian f16 values) as a tensor of `shape`; the sizes must agree.
    pub fn from_bytes(shape: impl Into<Vec<usize>>, bytes: Bytes) -> Result<Self> {
        let shape = shape.into();
        let needed = shape
            .iter()
            .try_fold(2usize, |n, &d| n.checked_mul(d))
            .ok_or_else(|| {
                Error::shape(
                    "HalfTensor::from_bytes",
                    format!("shape {shape:?} has more elements than can exist"),
                )
            })?;
        if needed != bytes.len() {
            return Err(Error::shape(
                "HalfTensor::from_bytes",
                format!(
                    "shape {shape:?} holds {needed} bytes of f16, got {}",
                    bytes.len()
                ),
            ));
        }
        Ok(Self { shape, bytes })
    }

    /// `values` as a tensor of `shape`, without a copy.
    pub fn from_values(shape: impl Into<Vec<usize>>, values: Vec<f16>) -> Result<Self> {
        Self::from_bytes(shape, Bytes::from_owner(OwnedHalves(values)))
    }

    /// `t` rounded to f16 (to nearest, ties to even).
    pub fn from_f32(t: &HostTensor) -> Self {
        let mut values = vec![f16::ZERO; t.len()];
        values.convert_from_f32_slice(t.data());
        Self::from_values(t.shape(), values).expect("same element count")
    }

    /// The values widened to f32 (exact).
    pub fn to_f32(&self) -> HostTensor {
        let mut out = vec![0f32; self.len()];
        match bytemuck::try_cast_slice::<u8, f16>(&self.bytes) {
            Ok(values) => values.convert_to_f32_slice(&mut out),
            // Unaligned bytes: through one aligned copy.
            Err(_) => {
                bytemuck::pod_collect_to_vec::<u8, f16>(&self.bytes).convert_to_f32_slice(&mut out)
            }
        }
        HostTensor::new(self.shape.clone(), out).expect("same element count")
    }

    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// The values' bytes, little-endian f16 in row-major order.
    pub fn bytes(&self) -> &Bytes {
        &self.bytes
    }

    pub fn len(&self) -> usize {
        self.bytes.len() / 2
    }

    pub fn is_empty(&self) -> bool {
        self.bytes.is_empty()
    }

    /// Size of the last dimension (1 for a scalar).
    pub fn cols(&self) -> usize {
        self.shape.last().copied().unwrap_or(1)
    }

    /// Number of rows of the matrix view `[rows, last_dim]`.
    pub fn rows(&self) -> usize {
        self.len().checked_div(self.cols()).unwrap_or(0)
    }

    /// Rows `start..end` of the matrix view, sharing these bytes.
    pub fn slice_rows(&self, start: usize, end: usize) -> Result<Self> {
        check_rows("HalfTensor::slice_rows", start, end, self.rows())?;
        let row = 2 * self.cols();
        Self::from_bytes(
            vec![end - start, self.cols()],
            self.bytes.slice(start * row..end * row),
        )
    }
}

fn on_device(op: &'static str) -> Error {
    Error::shape(
        op,
        "the rows are on a device; only the backend that holds them reads them",
    )
}

fn check_rows(op: &'static str, start: usize, end: usize, rows: usize) -> Result<()> {
    if start > end || end > rows {
        return Err(Error::shape(
            op,
            format!("rows {start}..{end} of a tensor with {rows} rows"),
        ));
    }
    Ok(())
}

/// An image's embeddings (or one set of its DeepStack features), `[tokens, hidden]`: on the
/// host in the precision the backend that made them computes in
/// ([`crate::Backend::download_embeddings`]), or still on the device, handed over inside one
/// process ([`crate::handoff`]).
#[derive(Clone, Debug, PartialEq)]
pub enum Embeddings {
    F32(HostTensor),
    F16(HalfTensor),
    Device(DeviceRows),
}

impl Embeddings {
    pub fn shape(&self) -> &[usize] {
        match self {
            Embeddings::F32(t) => t.shape(),
            Embeddings::F16(t) => t.shape(),
            Embeddings::Device(t) => t.shape(),
        }
    }

    /// Number of rows of the matrix view `[rows, last_dim]`.
    pub fn rows(&self) -> usize {
        let shape = self.shape();
        let cols = shape.last().copied().unwrap_or(1);
        shape
            .iter()
            .product::<usize>()
            .checked_div(cols)
            .unwrap_or(0)
    }

    /// Whether the values are on the host (not [`Embeddings::Device`]).
    pub fn on_host(&self) -> bool {
        !matches!(self, Embeddings::Device(_))
    }

    /// The values as f32: borrowed where they are f32 already, widened (exactly) from f16;
    /// an error for rows on a device (the backend that holds them reads them).
    pub fn to_f32(&self) -> Result<Cow<'_, HostTensor>> {
        match self {
            Embeddings::F32(t) => Ok(Cow::Borrowed(t)),
            Embeddings::F16(t) => Ok(Cow::Owned(t.to_f32())),
            Embeddings::Device(_) => Err(on_device("Embeddings::to_f32")),
        }
    }

    /// Index of the first value f16 cannot hold (NaN, an infinity, or a magnitude past f16's
    /// 65504), for embeddings on the host (rows on a device are not read: they come from our own
    /// vision tower in this process). A GPU holds the rows in f16, where such a value is an
    /// infinity or a NaN; and even the f32 CPU path squares the rows in RMSNorm, so a sender's
    /// 1e38 overflows there. Either way it would reach every logit after it, so receivers
    /// refuse such rows up front.
    pub fn first_beyond_f16(&self) -> Option<usize> {
        match self {
            Embeddings::F32(t) => first_f32_beyond_f16(t.data()),
            Embeddings::F16(t) => first_f16_non_finite(t.bytes()),
            Embeddings::Device(_) => None,
        }
    }

    /// What stands for the values in a hash (the prefix cache's image identity): their bytes
    /// as held on the host (f32 or f16, little-endian), or a device tensor's identity.
    pub fn content(&self) -> &[u8] {
        match self {
            Embeddings::F32(t) => bytemuck::cast_slice(t.data()),
            Embeddings::F16(t) => t.bytes(),
            Embeddings::Device(t) => t.identity(),
        }
    }

    /// Rows `start..end` of host embeddings (f16 rows share their bytes).
    pub fn slice_rows(&self, start: usize, end: usize) -> Result<Self> {
        Ok(match self {
            Embeddings::F32(t) => Embeddings::F32(t.slice_rows(start, end)?),
            Embeddings::F16(t) => Embeddings::F16(t.slice_rows(start, end)?),
            Embeddings::Device(_) => return Err(on_device("Embeddings::slice_rows")),
        })
    }

    /// The given rows of each part (host embeddings), stacked in order: f16 if every part is
    /// f16 (their bytes copied once), f32 otherwise. Parts must have the same row width.
    pub fn concat_rows(parts: &[(&Embeddings, Range<usize>)]) -> Result<Self> {
        let Some((first, _)) = parts.first() else {
            return Err(Error::shape("Embeddings::concat_rows", "nothing to stack"));
        };
        let cols = *first.shape().last().unwrap_or(&1);
        let mut rows = 0;
        for (part, range) in parts {
            if part.shape().last() != Some(&cols) {
                return Err(Error::shape(
                    "Embeddings::concat_rows",
                    format!("row widths differ: {cols} and {:?}", part.shape()),
                ));
            }
            check_rows(
                "Embeddings::concat_rows",
                range.start,
                range.end,
                part.rows(),
            )?;
            rows += range.len();
        }
        if parts.iter().all(|(p, _)| matches!(p, Embeddings::F16(_))) {
            let mut bytes = Vec::with_capacity(rows * cols * 2);
            for (part, range) in parts {
                bytes.extend_from_slice(
                    &part.content()[range.start * cols * 2..range.end * cols * 2],
                );
            }
            return Ok(Embeddings::F16(HalfTensor::from_bytes(
                vec![rows, cols],
                bytes.into(),
            )?));
        }
        let mut data = Vec::with_capacity(rows * cols);
        for (part, range) in parts {
            data.extend_from_slice(&part.to_f32()?.data()[range.start * cols..range.end * cols]);
        }
        Ok(Embeddings::F32(HostTensor::new(vec![rows, cols], data)?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tensor(rows: usize, cols: usize) -> HostTensor {
        let data = (0..rows * cols).map(|i| i as f32 * 0.5 - 3.0).collect();
        HostTensor::new(vec![rows, cols], data).unwrap()
    }

    #[test]
    fn half_tensors_round_trip_exact_values_and_check_their_size() {
        let t = tensor(3, 4);
        let h = HalfTensor::from_f32(&t);
        assert_eq!(h.shape(), &[3, 4]);
        assert_eq!(
            h.to_f32(),
            t,
            "multiples of 0.5 below 2048 are exact in f16"
        );
        let err = HalfTensor::from_bytes(vec![3, 4], h.bytes().slice(1..)).unwrap_err();
        assert!(err.to_string().contains("holds 24 bytes"), "{err}");
        assert!(HalfTensor::from_bytes(vec![1 << 62, 8], Bytes::new()).is_err());
    }

    #[test]
    fn the_first_value_f16_cannot_hold_is_found_in_either_precision() {
        let t = tensor(2, 3);
        assert_eq!(Embeddings::F32(t.clone()).first_beyond_f16(), None);
        assert_eq!(
            Embeddings::F16(HalfTensor::from_f32(&t)).first_beyond_f16(),
            None
        );
        for (at, bad) in [(4, f32::NAN), (1, f32::INFINITY), (5, f32::NEG_INFINITY)] {
            let mut data = t.data().to_vec();
            data[at] = bad;
            let t = HostTensor::new(vec![2, 3], data).unwrap();
            assert_eq!(Embeddings::F32(t.clone()).first_beyond_f16(), Some(at));
            let h = Embeddings::F16(HalfTensor::from_f32(&t));
            assert_eq!(h.first_beyond_f16(), Some(at), "{bad} in f16");
        }
        // Past the first block, in a block's 8-byte words and in its tail, at odd addresses.
        for (len, at) in [(3, 2), (700, 699), (700, 300), (1030, 1027), (9, 8)] {
            let mut data = vec![0.25f32; len];
            data[at] = f32::NAN;
            let t = HostTensor::new(vec![1, len], data).unwrap();
            assert_eq!(Embeddings::F32(t.clone()).first_beyond_f16(), Some(at));
            let h = HalfTensor::from_f32(&t);
            let mut shifted = vec![0u8; h.bytes().len() + 1];
            shifted[1..].copy_from_slice(h.bytes());
            let odd =
                HalfTensor::from_bytes(vec![1, len], Bytes::from(shifted).slice(1..)).unwrap();
            assert_eq!(
                Embeddings::F16(odd).first_beyond_f16(),
                Some(at),
                "{len} {at}"
            );
        }
        // 65504 is f16's largest finite value, not an infinity; in f32, what lies past it is
        // refused too (what bf16 on the wire can hold, up to 3.4e38, is widened to f32).
        let max = HostTensor::new(vec![1, 2], vec![65504.0, -65504.0]).unwrap();
        assert_eq!(Embeddings::F32(max.clone()).first_beyond_f16(), None);
        assert_eq!(
            Embeddings::F16(HalfTensor::from_f32(&max)).first_beyond_f16(),
            None
        );
        for (at, big) in [(0, 65505.0f32), (1, -65520.0), (700, -1.7e38), (1029, 1e6)] {
            let mut data = vec![-65504.0f32; 1030];
            data[at] = big;
            let t = HostTensor::new(vec![1, 1030], data).unwrap();
            assert_eq!(Embeddings::F32(t).first_beyond_f16(), Some(at), "{big}");
        }
    }

    /// A received message's bytes may start at an odd address.
    #[test]
    fn unaligned_bytes_read_the_same_values() {
        let h = HalfTensor::from_f32(&tensor(2, 5));
        let mut shifted = vec![0u8; h.bytes().len() + 1];
        shifted[1..].copy_from_slice(h.bytes());
        let odd = HalfTensor::from_bytes(vec![2, 5], Bytes::from(shifted).slice(1..)).unwrap();
        assert_eq!(odd.to_f32(), h.to_f32());
    }

    #[test]
    fn rows_slice_and_stack_in_either_precision() {
        let (a, b) = (tensor(4, 3), tensor(2, 3));
        let (ha, hb) = (
            Embeddings::F16(HalfTensor::from_f32(&a)),
            Embeddings::F16(HalfTensor::from_f32(&b)),
        );
        let sliced = ha.slice_rows(1, 3).unwrap();
        assert_eq!(
            sliced.to_f32().unwrap().into_owned(),
            a.slice_rows(1, 3).unwrap()
        );
        assert!(ha.slice_rows(3, 5).is_err());

        let want = HostTensor::concat_rows(&[a.slice_rows(2, 4).unwrap(), b.clone()]).unwrap();
        let halves = Embeddings::concat_rows(&[(&ha, 2..4), (&hb, 0..2)]).unwrap();
        assert!(matches!(halves, Embeddings::F16(_)), "all f16 stays f16");
        assert_eq!(halves.to_f32().unwrap().into_owned(), want);
        let fa = Embeddings::F32(a.clone());
        let mixed = Embeddings::concat_rows(&[(&fa, 2..4), (&hb, 0..2)]).unwrap();
        assert_eq!(mixed, Embeddings::F32(want));
        let narrow = Embeddings::F32(tensor(1, 2));
        assert!(Embeddings::concat_rows(&[(&fa, 0..1), (&narrow, 0..1)]).is_err());
        // Rows on a device are read by their backend only.
        let dev = Embeddings::Device(DeviceRows::new(vec![4, 3], a.clone(), b"id".to_vec()));
        assert_eq!((dev.rows(), dev.content()), (4, &b"id"[..]));
        assert!(dev.to_f32().is_err() && dev.slice_rows(0, 1).is_err());
        assert!(Embeddings::concat_rows(&[(&fa, 0..1), (&dev, 0..1)]).is_err());
    }
}
