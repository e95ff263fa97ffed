//! How the paged KV cache stores its keys and values (`--kv-cache-dtype`): at the backend's own
//! width (f32 on the CPU, f16 on a GPU), or as FP8 e4m3fn bytes with a scale per cache (one
//! layer's keys, or its values), half of f16's bytes: twice the tokens in the same memory.
//!
//! A value `x` is stored as the byte `e4m3(x / scale)`, rounded to the nearest e4m3 value, ties
//! to even, and saturated at ±448 ([`crate::quant::fp8::f32_to_e4m3`] on the CPU, the hardware's
//! `cvt.rn.satfinite` on the GPU), and read back as `E4M3[byte] * scale`: vLLM's convention
//! (`k_scale`, `v_scale`). Both backends divide by multiplying with the same f32 reciprocal
//! ([`KvFormat::inv_scale`]), so a value written on either is the same byte.
//!
//! Where the scale comes from is the engine's business (llm-svc reads a checkpoint's `k_scale` /
//! `v_scale` per layer, else [`DEFAULT_FP8_SCALE`]).

use crate::quant::fp8::{f32_to_e4m3, E4M3};

/// The scale of an FP8 cache whose checkpoint gives none: 1.0, as vLLM. Values then keep e4m3's
/// own range, ±448 at 3 mantissa bits (6.25% steps at most), normal down to 2^-6, nothing below
/// 2^-10; larger ones are clamped to ±448 (never NaN).
pub const DEFAULT_FP8_SCALE: f32 = 1.0;

/// The `--kv-cache-dtype` flag: what the engine asks of its cache.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum KvCacheDtype {
    /// The backend's own width (f16 on a GPU, f32 on the CPU).
    #[default]
    Auto,
    /// FP8 e4m3fn bytes with a scale per layer's keys and per layer's values.
    Fp8,
}

impl std::str::FromStr for KvCacheDtype {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "auto" | "f16" => Ok(KvCacheDtype::Auto),
            "fp8" | "fp8_e4m3" => Ok(KvCacheDtype::Fp8),
            other => Err(format!(
                "unknown KV cache dtype `{other}`: use auto or fp8 (e4m3)"
            )),
        }
    }
}

impl std::fmt::Display for KvCacheDtype {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            KvCacheDtype::Auto => "auto",
            KvCacheDtype::Fp8 => "fp8",
        })
    }
}

/// How one cache (a layer's keys, or its values) stores its elements.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum KvFormat {
    /// The backend's own width ([`crate::Backend::CACHE_BYTES`]).
    Native,
    /// e4m3fn bytes: a value is `E4M3[byte] * scale`.
    Fp8 { scale: f32 },
}

impl KvFormat {
    /// Bytes an element takes, on a backend whose own cache width is `native`.
    pub fn element_bytes(self, native: usize) -> usize {
        match self {
            KvFormat::Native => native,
            KvFormat::Fp8 { .. } => 1,
        }
    }

    /// What a value is multiplied by before it is rounded to e4m3: `1 / scale` in f32, the one
    /// both backends use (1 for a native cache).
    pub fn inv_scale(self) -> f32 {
        match self {
            KvFormat::Native => 1.0,
            KvFormat::Fp8 { scale } => 1.0 / scale,
        }
    }

    /// What a stored value is multiplied by when read (1 for a native cache).
    pub fn scale(self) -> f32 {
        match self {
            KvFormat::Native => 1.0,
            KvFormat::Fp8 { scale } => scale,
        }
    }

    /// An error unless the scale is a positive finite number whose reciprocal is one too.
    pub fn check(self) -> crate::Result<Self> {
        let scale = self.scale();
        if scale.is_finite() && scale > 0.0 && self.inv_scale().is_finite() {
            Ok(self)
        } else {
            Err(crate::Error::KvCacheDtype {
                dtype: "fp8",
                problem: format!(
                    "a cache's scale must be a positive finite number with a finite reciprocal, got {scale}"
                ),
            })
        }
    }
}

/// `x` as stored in an FP8 cache of reciprocal scale `inv_scale`: `e4m3(x * inv_scale)`,
/// round to nearest even, saturated at ±448.
pub fn fp8_store(x: f32, inv_scale: f32) -> u8 {
    f32_to_e4m3(x * inv_scale)
}

/// The value a stored byte stands for in an FP8 cache of `scale`.
pub fn fp8_load(b: u8, scale: f32) -> f32 {
    E4M3[b as usize] * scale
}

/// The CPU backend's cache ([`crate::CpuBackend`]'s `Backend::Cache`): `[slots, heads, dim]`
/// f32 values, or FP8 bytes and their scale, read back as [`fp8_load`] gives them.
#[derive(Clone, Debug)]
pub struct CpuCache {
    shape: [usize; 3],
    store: CpuStore,
}

#[derive(Clone, Debug)]
enum CpuStore {
    F32(Vec<f32>),
    Fp8 { bytes: Vec<u8>, format: KvFormat },
}

/// A cache's elements as attention reads them: f32 values, or FP8 bytes and their scale.
#[derive(Clone, Copy)]
pub(crate) enum KvData<'a> {
    F32(&'a [f32]),
    Fp8 { bytes: &'a [u8], scale: f32 },
}

impl KvData<'_> {
    /// `Σ q[i] · x[at + i]`, in order (the value of an FP8 element taken in f32 first).
    pub(crate) fn dot(self, at: usize, q: &[f32]) -> f32 {
        match self {
            KvData::F32(x) => q.iter().zip(&x[at..at + q.len()]).map(|(a, b)| a * b).sum(),
            KvData::Fp8 { bytes, scale } => q
                .iter()
                .zip(&bytes[at..at + q.len()])
                .map(|(a, &b)| a * fp8_load(b, scale))
                .sum(),
        }
    }

    /// `out[i] += p · x[at + i]`.
    pub(crate) fn add_scaled(self, at: usize, p: f32, out: &mut [f32]) {
        match self {
            KvData::F32(x) => {
                let n = out.len();
                for (o, v) in out.iter_mut().zip(&x[at..at + n]) {
                    *o += p * v;
                }
            }
            KvData::Fp8 { bytes, scale } => {
                let n = out.len();
                for (o, &b) in out.iter_mut().zip(&bytes[at..at + n]) {
                    *o += p * fp8_load(b, scale);
                }
            }
        }
    }
}

impl CpuCache {
    /// Zeros, stored as `format` says (its scale checked).
    pub(crate) fn zeros(
        slots: usize,
        heads: usize,
        dim: usize,
        format: KvFormat,
    ) -> crate::Result<Self> {
        let n = slots * heads * dim;
        let store = match format.check()? {
            KvFormat::Native => CpuStore::F32(vec![0.0; n]),
            format => CpuStore::Fp8 {
                bytes: vec![0; n],
                format,
            },
        };
        Ok(Self {
            shape: [slots, heads, dim],
            store,
        })
    }

    /// `[slots, heads, dim]`.
    pub fn shape(&self) -> [usize; 3] {
        self.shape
    }

    /// How the elements are stored.
    pub fn format(&self) -> KvFormat {
        match &self.store {
            CpuStore::F32(_) => KvFormat::Native,
            CpuStore::Fp8 { format, .. } => *format,
        }
    }

    pub(crate) fn data(&self) -> KvData<'_> {
        match &self.store {
            CpuStore::F32(x) => KvData::F32(x),
            CpuStore::Fp8 { bytes, format } => KvData::Fp8 {
                bytes,
                scale: format.scale(),
            },
        }
    }

    /// Slot `slot` (`heads * dim` elements) set to `row`, rounded as the format stores it.
    /// The caller checks the slot and the row's width.
    pub(crate) fn set_slot(&mut self, slot: usize, row: &[f32]) {
        let w = self.shape[1] * self.shape[2];
        match &mut self.store {
            CpuStore::F32(x) => x[slot * w..(slot + 1) * w].copy_from_slice(row),
            CpuStore::Fp8 { bytes, format } => {
                let inv = format.inv_scale();
                for (b, &v) in bytes[slot * w..(slot + 1) * w].iter_mut().zip(row) {
                    *b = fp8_store(v, inv);
                }
            }
        }
    }

    /// Every element as f32, `[slots, heads, dim]`.
    pub fn to_host(&self) -> crate::HostTensor {
        let values = match &self.store {
            CpuStore::F32(x) => x.clone(),
            CpuStore::Fp8 { bytes, format } => {
                bytes.iter().map(|&b| fp8_load(b, format.scale())).collect()
            }
        };
        crate::HostTensor::new(self.shape.to_vec(), values).expect("shape matches")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Stored and read back: exact for e4m3 values times the scale, nearest-even between them,
    /// ±448 times the scale past the range (never NaN), NaN kept.
    #[test]
    fn values_round_to_nearest_even_and_saturate() {
        let f = KvFormat::Fp8 { scale: 0.5 };
        let (inv, s) = (f.inv_scale(), f.scale());
        let round = |x: f32| fp8_load(fp8_store(x, inv), s);
        for b in 0u8..=0x7E {
            let v = E4M3[b as usize] * s;
            assert_eq!(round(v), v, "byte {b:#x}");
            assert_eq!(round(-v), -v, "byte {b:#x}");
        }
        // 1.0625 lies halfway between 1.0 and 1.125 (steps of 1/8 in [1, 2)): ties go to the
        // even mantissa, 1.0; 1.1875, halfway to 1.25, goes to 1.25.
        assert_eq!(round(1.0625 * s), 1.0 * s);
        assert_eq!(round(1.1875 * s), 1.25 * s);
        assert_eq!(round(1.07 * s), 1.125 * s);
        // Past the range: clamped, also at infinity.
        assert_eq!(round(1000.0), 448.0 * s);
        assert_eq!(round(-1e30), -448.0 * s);
        assert_eq!(round(f32::INFINITY), 448.0 * s);
        assert!(round(f32::NAN).is_nan());
        // Below the smallest subnormal's half: zero.
        assert_eq!(round(2f32.powi(-11) * s), 0.0);
    }

    #[test]
    fn the_flag_reads_as_vllm_spells_it_and_a_scale_must_be_positive() {
        assert_eq!("fp8".parse(), Ok(KvCacheDtype::Fp8));
        assert_eq!("fp8_e4m3".parse(), Ok(KvCacheDtype::Fp8));
        assert_eq!("auto".parse(), Ok(KvCacheDtype::Auto));
        let err = "fp8_e5m2".parse::<KvCacheDtype>().unwrap_err();
        assert!(
            err.contains("fp8_e5m2") && err.contains("auto or fp8"),
            "{err}"
        );
        assert_eq!(KvFormat::Fp8 { scale: 0.25 }.element_bytes(2), 1);
        assert_eq!(KvFormat::Native.element_bytes(2), 2);
        for bad in [0.0, -1.0, f32::NAN, f32::INFINITY, 1e-40] {
            assert!(KvFormat::Fp8 { scale: bad }.check().is_err(), "{bad}");
        }
        assert!(KvFormat::Fp8 { scale: 0.02 }.check().is_ok());
    }
}
