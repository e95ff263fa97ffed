//! FP8 (e4m3) weights: the e4m3fn number format, the matrix every FP8 checkpoint layout is read
//! into ([`Fp8Matrix`]), its readers and `--quantize fp8`.
//!
//! An [`Fp8Matrix`] is `[out, in]` e4m3fn bytes and a grid of f32 scales, one per block of
//! `block[0]` rows by `block[1]` columns (the last block of each dim may be partial), so that
//! `w[o, i] = e4m3(q[o, i]) * scale[o / block[0], i / block[1]]`, the product taken in f32: what
//! transformers' `Fp8Dequantize` (FineGrainedFP8) and compressed-tensors' float decompression
//! compute. A scale per tensor is one block of `[out, in]`, one per output channel blocks of
//! `[1, in]`. Layouts (as the tools write them):
//!
//! - transformers' FineGrainedFP8 (`quant_method: fp8`; Qwen's FP8 releases, DeepSeek-V3):
//!   `weight` F8_E4M3 `[out, in]`, `weight_scale_inv` `[ceil(out / 128), ceil(in / 128)]` for
//!   `weight_block_size: [128, 128]` (f32 in transformers' own, bf16 in some releases). Despite
//!   the name it multiplies: it is `amax / 448` of its block.
//! - compressed-tensors `float-quantized` (llm-compressor's FP8_DYNAMIC, FP8_BLOCK): `weight`
//!   F8_E4M3, `weight_scale` `[out, 1]` (strategy channel), `[ceil(out / b0), ceil(in / b1)]`
//!   (strategy block, `block_structure: [b0, b1]`) or `[1]` (strategy tensor).
//!
//! Activations: schemes that quantize them dynamically (FP8_DYNAMIC per token, FP8_BLOCK per
//! group of 128, FineGrainedFP8's `activation_scheme: dynamic`) run weight-only on the CPU,
//! which is what the fixtures' references compute; on sm_90 every GEMM of a 128 x 128-block
//! matrix quantizes them per row and [`ACT_GROUP`] columns ([`quantize_rows`];
//! cuda/src/cuda/w8a8.rs), and decode's GEMVs of it round their rows the same way.

use crate::{Error, HostTensor, Result, WeightPrefix};

/// e4m3fn's largest finite value.
pub const E4M3_MAX: f32 = 448.0;

/// The value of every e4m3fn byte: sign, 4 exponent bits (bias 7), 3 mantissa bits; exponent 0
/// is subnormal (`m * 2^-9`); no infinities; 0x7F and 0xFF are NaN.
pub const E4M3: [f32; 256] = e4m3_table();

const fn e4m3_table() -> [f32; 256] {
    let mut t = [0.0f32; 256];
    let mut b = 0;
    while b < 256 {
        let (e, m) = ((b >> 3) & 0xF, (b & 7) as f32);
        let mag = if e == 0xF && b & 7 == 7 {
            f32::NAN
        } else if e == 0 {
            m * (1.0 / 512.0)
        } else {
            // 2^(e - 7), exactly: f32 exponent field e - 7 + 127.
            (1.0 + m / 8.0) * f32::from_bits(((e + 120) as u32) << 23)
        };
        t[b] = if b & 0x80 != 0 { -mag } else { mag };
        b += 1;
    }
    t
}

/// Whether e4m3fn byte `b` is NaN.
pub fn e4m3_is_nan(b: u8) -> bool {
    b & 0x7F == 0x7F
}

/// `x` rounded to the nearest e4m3fn value, ties to even (as torch's `.to(float8_e4m3fn)`),
/// saturating at ±448 (torch gives NaN past 464: callers clamp first, as transformers does).
/// NaN stays NaN.
pub fn f32_to_e4m3(x: f32) -> u8 {
    if x.is_nan() {
        return 0x7F;
    }
    let sign = if x.is_sign_negative() { 0x80 } else { 0 };
    let a = x.abs();
    // The positive values are codes 0..=126, increasing: the first at least `a`.
    let hi = E4M3[..127].partition_point(|&v| v < a);
    let code = if hi == 0 {
        0
    } else if hi == 127 {
        126
    } else {
        let (lo, up) = (E4M3[hi - 1], E4M3[hi]);
        let (dl, du) = (a - lo, up - a);
        if dl < du || (dl == du && (hi - 1) % 2 == 0) {
            hi - 1
        } else {
            hi
        }
    };
    sign | code as u8
}

/// An FP8 matrix `[out, inp]`: e4m3fn bytes and a scale per block.
#[derive(Clone, Debug, PartialEq)]
pub struct Fp8Matrix {
    pub out: usize,
    pub inp: usize,
    /// Rows and columns one scale covers: `[out, inp]` for one scale, `[1, inp]` one a row.
    pub block: [usize; 2],
    /// e4m3fn bytes, row-major `[out, inp]`.
    pub q: Vec<u8>,
    /// `[ceil(out / block[0]), ceil(inp / block[1])]`, row-major: what each value multiplies by.
    pub scales: Vec<f32>,
}

impl Fp8Matrix {
    /// The scale grid's shape, `[ceil(out / block[0]), ceil(inp / block[1])]`.
    pub fn grid(&self) -> [usize; 2] {
        [
            self.out.div_ceil(self.block[0]),
            self.inp.div_ceil(self.block[1]),
        ]
    }

    /// The f32 matrix `[out, inp]`: each value times its block's scale, in f32.
    pub fn dequantize(&self) -> HostTensor {
        use rayon::prelude::*;
        let [_, cols] = self.grid();
        let mut data = vec![0.0f32; self.out * self.inp];
        data.par_chunks_mut(self.inp.max(1))
            .enumerate()
            .for_each(|(o, row)| {
                let s = &self.scales[(o / self.block[0]) * cols..][..cols];
                let q = &self.q[o * self.inp..(o + 1) * self.inp];
                for (i, (v, &b)) in row.iter_mut().zip(q).enumerate() {
                    *v = E4M3[b as usize] * s[i / self.block[1]];
                }
            });
        HostTensor::new(vec![self.out, self.inp], data).expect("shape matches")
    }

    fn check(&self, name: &str) -> Result<()> {
        let [r, c] = self.grid();
        if self.block[0] > 0
            && self.block[1] > 0
            && self.q.len() == self.out * self.inp
            && self.scales.len() == r * c
        {
            Ok(())
        } else {
            Err(Error::Quantized {
                name: name.to_string(),
                problem: format!(
                    "inconsistent FP8 matrix: [{}, {}] in blocks of {:?}, {} values, {} scales",
                    self.out,
                    self.inp,
                    self.block,
                    self.q.len(),
                    self.scales.len()
                ),
            })
        }
    }
}

/// What an FP8 checkpoint's scales cover.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fp8Scales {
    /// One for the whole matrix.
    Tensor,
    /// One per output channel (row).
    Channel,
    /// One per block of `[rows, cols]`.
    Block([usize; 2]),
}

impl Fp8Scales {
    /// Rows and columns one scale covers in a matrix `[out, inp]`.
    pub fn block(self, out: usize, inp: usize) -> [usize; 2] {
        match self {
            Fp8Scales::Tensor => [out.max(1), inp.max(1)],
            Fp8Scales::Channel => [1, inp.max(1)],
            Fp8Scales::Block(b) => b,
        }
    }
}

impl std::fmt::Display for Fp8Scales {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Fp8Scales::Tensor => f.write_str("a scale per tensor"),
            Fp8Scales::Channel => f.write_str("a scale per output channel"),
            Fp8Scales::Block([r, c]) => write!(f, "{r}x{c} block scales"),
        }
    }
}

/// Reads the FP8 module under `w` `[out, inp]`: `weight` F8_E4M3 and the scale tensor `scale`
/// (`weight_scale_inv` or `weight_scale`, F32/F16/BF16) laid out as `scales` says. A scale grid
/// that disagrees with the weight's shape is an error naming the scale tensor and both shapes.
pub fn read_fp8(
    w: &WeightPrefix,
    out: usize,
    inp: usize,
    scale: &str,
    scales: Fp8Scales,
) -> Result<Fp8Matrix> {
    let block = scales.block(out, inp);
    let grid = [out.div_ceil(block[0]), inp.div_ceil(block[1])];
    let got = w.shape_of(scale)?;
    // A single scale may be stored as a scalar or [1], a row's as [out] or [out, 1].
    let fits = got == grid
        || (grid == [1, 1] && (got.is_empty() || got == [1]))
        || (grid[1] == 1 && got == [grid[0]]);
    if !fits {
        return Err(Error::Quantized {
            name: w.name(scale),
            problem: format!(
                "its shape {got:?} does not match the weight's [{out}, {inp}] with {scales} \
                 (expected {grid:?})"
            ),
        });
    }
    let q = w.get_fp8("weight", &[out, inp])?;
    let s = w.get(scale, &got)?.into_data();
    let m = Fp8Matrix {
        out,
        inp,
        block,
        q,
        scales: s,
    };
    m.check(&w.name("weight"))?;
    Ok(m)
}

/// Rows and columns a scale covers under `--quantize fp8` (Qwen's and DeepSeek-V3's block).
pub const FP8_BLOCK: [usize; 2] = [128, 128];

/// `--quantize fp8`: round-to-nearest e4m3 with a scale per [`FP8_BLOCK`] block, computed as
/// transformers' FineGrainedFP8 quantizer does (so the result is the form of a Qwen FP8
/// checkpoint): per block `s = 448 / amax` (1 for an all-zero block), values
/// `e4m3(clamp(w * s, ±448))`, stored scale `1 / s` (about `amax / 448`), all in f32.
pub fn quantize_fp8(w: &HostTensor) -> Fp8Matrix {
    quantize_fp8_in_blocks(w, FP8_BLOCK)
}

/// [`quantize_fp8`] with a scale per `block` (rows, columns) instead: the twin tests' FP8
/// weights in groups of columns other than 128, as per-channel and finer-grained checkpoints
/// have them.
pub fn quantize_fp8_in_blocks(w: &HostTensor, block: [usize; 2]) -> Fp8Matrix {
    use rayon::prelude::*;
    let (out, inp) = (w.shape()[0], w.shape()[1]);
    let (rows, cols) = (out.div_ceil(block[0]), inp.div_ceil(block[1]));
    let data = w.data();
    let amax: Vec<f32> = (0..rows * cols)
        .into_par_iter()
        .map(|b| {
            let (br, bc) = (b / cols, b % cols);
            let mut m = 0.0f32;
            for o in br * block[0]..((br + 1) * block[0]).min(out) {
                for i in bc * block[1]..((bc + 1) * block[1]).min(inp) {
                    m = m.max(data[o * inp + i].abs());
                }
            }
            m
        })
        .collect();
    let mul: Vec<f32> = amax
        .iter()
        .map(|&a| if a > 0.0 { E4M3_MAX / a } else { 1.0 })
        .collect();
    let mut q = vec![0u8; out * inp];
    q.par_chunks_mut(inp.max(1))
        .enumerate()
        .for_each(|(o, row)| {
            for (i, b) in row.iter_mut().enumerate() {
                let s = mul[(o / block[0]) * cols + i / block[1]];
                *b = f32_to_e4m3((data[o * inp + i] * s).clamp(-E4M3_MAX, E4M3_MAX));
            }
        });
    Fp8Matrix {
        out,
        inp,
        block,
        q,
        scales: mul.iter().map(|s| 1.0 / s).collect(),
    }
}

/// Columns of an activation row that share one scale in the W8A8 GEMM (prefill and batches of
/// FP8 weights on Hopper: cuBLASLt's `VEC128_32F`), as Qwen's FP8 checkpoints say
/// (`activation_scheme: dynamic` with 128-column blocks) and vLLM and transformers compute.
pub const ACT_GROUP: usize = 128;

/// `x` `[n, k]` (k a multiple of [`ACT_GROUP`]) as the W8A8 GEMM quantizes its activations
/// (weights_f16.cu's `quant_rows_f8`, bit for bit): per row and group of [`ACT_GROUP`]
/// columns, `s = amax / 448` (1 where the group is all zeros) and bytes `e4m3(x / s)`, to
/// nearest even, saturating (transformers' `act_quant` and vLLM's `per_token_group_quant_fp8`
/// compute the same). Returns the bytes, row-major, and the scales `[k / ACT_GROUP, n]`:
/// group-major, a group's scales for every row together, as cuBLASLt reads them.
pub fn quantize_rows(x: &[f32], n: usize, k: usize) -> (Vec<u8>, Vec<f32>) {
    assert_eq!(x.len(), n * k, "x is [n, k]");
    assert_eq!(k % ACT_GROUP, 0, "k is whole groups");
    let groups = k / ACT_GROUP;
    let mut q = vec![0u8; n * k];
    let mut scales = vec![0f32; groups * n];
    for r in 0..n {
        for g in 0..groups {
            let at = r * k + g * ACT_GROUP;
            let vals = &x[at..at + ACT_GROUP];
            let amax = vals.iter().fold(0f32, |m, v| m.max(v.abs()));
            let s = if amax > 0.0 { amax / E4M3_MAX } else { 1.0 };
            for (b, v) in q[at..at + ACT_GROUP].iter_mut().zip(vals) {
                *b = f32_to_e4m3(v / s);
            }
            scales[g * n + r] = s;
        }
    }
    (q, scales)
}

#[cfg(test)]
mod tests {
    use super::*;

    // torch 2.14.0+cu130 torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float(), as f32 bits
    const TORCH_E4M3: [u32; 256] = [
        0x00000000, 0x3b000000, 0x3b800000, 0x3bc00000, 0x3c000000, 0x3c200000, 0x3c400000,
        0x3c600000, 0x3c800000, 0x3c900000, 0x3ca00000, 0x3cb00000, 0x3cc00000, 0x3cd00000,
        0x3ce00000, 0x3cf00000, 0x3d000000, 0x3d100000, 0x3d200000, 0x3d300000, 0x3d400000,
        0x3d500000, 0x3d600000, 0x3d700000, 0x3d800000, 0x3d900000, 0x3da00000, 0x3db00000,
        0x3dc00000, 0x3dd00000, 0x3de00000, 0x3df00000, 0x3e000000, 0x3e100000, 0x3e200000,
        0x3e300000, 0x3e400000, 0x3e500000, 0x3e600000, 0x3e700000, 0x3e800000, 0x3e900000,
        0x3ea00000, 0x3eb00000, 0x3ec00000, 0x3ed00000, 0x3ee00000, 0x3ef00000, 0x3f000000,
        0x3f100000, 0x3f200000, 0x3f300000, 0x3f400000, 0x3f500000, 0x3f600000, 0x3f700000,
        0x3f800000, 0x3f900000, 0x3fa00000, 0x3fb00000, 0x3fc00000, 0x3fd00000, 0x3fe00000,
        0x3ff00000, 0x40000000, 0x40100000, 0x40200000, 0x40300000, 0x40400000, 0x40500000,
        0x40600000, 0x40700000, 0x40800000, 0x40900000, 0x40a00000, 0x40b00000, 0x40c00000,
        0x40d00000, 0x40e00000, 0x40f00000, 0x41000000, 0x41100000, 0x41200000, 0x41300000,
        0x41400000, 0x41500000, 0x41600000, 0x41700000, 0x41800000, 0x41900000, 0x41a00000,
        0x41b00000, 0x41c00000, 0x41d00000, 0x41e00000, 0x41f00000, 0x42000000, 0x42100000,
        0x42200000, 0x42300000, 0x42400000, 0x42500000, 0x42600000, 0x42700000, 0x42800000,
        0x42900000, 0x42a00000, 0x42b00000, 0x42c00000, 0x42d00000, 0x42e00000, 0x42f00000,
        0x43000000, 0x43100000, 0x43200000, 0x43300000, 0x43400000, 0x43500000, 0x43600000,
        0x43700000, 0x43800000, 0x43900000, 0x43a00000, 0x43b00000, 0x43c00000, 0x43d00000,
        0x43e00000, 0x7ff00000, 0x80000000, 0xbb000000, 0xbb800000, 0xbbc00000, 0xbc000000,
        0xbc200000, 0xbc400000, 0xbc600000, 0xbc800000, 0xbc900000, 0xbca00000, 0xbcb00000,
        0xbcc00000, 0xbcd00000, 0xbce00000, 0xbcf00000, 0xbd000000, 0xbd100000, 0xbd200000,
        0xbd300000, 0xbd400000, 0xbd500000, 0xbd600000, 0xbd700000, 0xbd800000, 0xbd900000,
        0xbda00000, 0xbdb00000, 0xbdc00000, 0xbdd00000, 0xbde00000, 0xbdf00000, 0xbe000000,
        0xbe100000, 0xbe200000, 0xbe300000, 0xbe400000, 0xbe500000, 0xbe600000, 0xbe700000,
        0xbe800000, 0xbe900000, 0xbea00000, 0xbeb00000, 0xbec00000, 0xbed00000, 0xbee00000,
        0xbef00000, 0xbf000000, 0xbf100000, 0xbf200000, 0xbf300000, 0xbf400000, 0xbf500000,
        0xbf600000, 0xbf700000, 0xbf800000, 0xbf900000, 0xbfa00000, 0xbfb00000, 0xbfc00000,
        0xbfd00000, 0xbfe00000, 0xbff00000, 0xc0000000, 0xc0100000, 0xc0200000, 0xc0300000,
        0xc0400000, 0xc0500000, 0xc0600000, 0xc0700000, 0xc0800000, 0xc0900000, 0xc0a00000,
        0xc0b00000, 0xc0c00000, 0xc0d00000, 0xc0e00000, 0xc0f00000, 0xc1000000, 0xc1100000,
        0xc1200000, 0xc1300000, 0xc1400000, 0xc1500000, 0xc1600000, 0xc1700000, 0xc1800000,
        0xc1900000, 0xc1a00000, 0xc1b00000, 0xc1c00000, 0xc1d00000, 0xc1e00000, 0xc1f00000,
        0xc2000000, 0xc2100000, 0xc2200000, 0xc2300000, 0xc2400000, 0xc2500000, 0xc2600000,
        0xc2700000, 0xc2800000, 0xc2900000, 0xc2a00000, 0xc2b00000, 0xc2c00000, 0xc2d00000,
        0xc2e00000, 0xc2f00000, 0xc3000000, 0xc3100000, 0xc3200000, 0xc3300000, 0xc3400000,
        0xc3500000, 0xc3600000, 0xc3700000, 0xc3800000, 0xc3900000, 0xc3a00000, 0xc3b00000,
        0xc3c00000, 0xc3d00000, 0xc3e00000, 0xfff00000,
    ];
    // (f32 bits, torch's e4m3fn byte): x.to(torch.float8_e4m3fn) for every midpoint between
    // neighbouring positive values (ties to even), a value of each 9th code, and a few others
    const TORCH_ENCODE: [(u32, u8); 152] = [
        (0x3a800000, 0x00),
        (0x3b400000, 0x02),
        (0x3ba00000, 0x02),
        (0x3be00000, 0x04),
        (0x3c100000, 0x04),
        (0x3c300000, 0x06),
        (0x3c500000, 0x06),
        (0x3c700000, 0x08),
        (0x3c880000, 0x08),
        (0x3c980000, 0x0a),
        (0x3ca80000, 0x0a),
        (0x3cb80000, 0x0c),
        (0x3cc80000, 0x0c),
        (0x3cd80000, 0x0e),
        (0x3ce80000, 0x0e),
        (0x3cf80000, 0x10),
        (0x3d080000, 0x10),
        (0x3d180000, 0x12),
        (0x3d280000, 0x12),
        (0x3d380000, 0x14),
        (0x3d480000, 0x14),
        (0x3d580000, 0x16),
        (0x3d680000, 0x16),
        (0x3d780000, 0x18),
        (0x3d880000, 0x18),
        (0x3d980000, 0x1a),
        (0x3da80000, 0x1a),
        (0x3db80000, 0x1c),
        (0x3dc80000, 0x1c),
        (0x3dd80000, 0x1e),
        (0x3de80000, 0x1e),
        (0x3df80000, 0x20),
        (0x3e080000, 0x20),
        (0x3e180000, 0x22),
        (0x3e280000, 0x22),
        (0x3e380000, 0x24),
        (0x3e480000, 0x24),
        (0x3e580000, 0x26),
        (0x3e680000, 0x26),
        (0x3e780000, 0x28),
        (0x3e880000, 0x28),
        (0x3e980000, 0x2a),
        (0x3ea80000, 0x2a),
        (0x3eb80000, 0x2c),
        (0x3ec80000, 0x2c),
        (0x3ed80000, 0x2e),
        (0x3ee80000, 0x2e),
        (0x3ef80000, 0x30),
        (0x3f080000, 0x30),
        (0x3f180000, 0x32),
        (0x3f280000, 0x32),
        (0x3f380000, 0x34),
        (0x3f480000, 0x34),
        (0x3f580000, 0x36),
        (0x3f680000, 0x36),
        (0x3f780000, 0x38),
        (0x3f880000, 0x38),
        (0x3f980000, 0x3a),
        (0x3fa80000, 0x3a),
        (0x3fb80000, 0x3c),
        (0x3fc80000, 0x3c),
        (0x3fd80000, 0x3e),
        (0x3fe80000, 0x3e),
        (0x3ff80000, 0x40),
        (0x40080000, 0x40),
        (0x40180000, 0x42),
        (0x40280000, 0x42),
        (0x40380000, 0x44),
        (0x40480000, 0x44),
        (0x40580000, 0x46),
        (0x40680000, 0x46),
        (0x40780000, 0x48),
        (0x40880000, 0x48),
        (0x40980000, 0x4a),
        (0x40a80000, 0x4a),
        (0x40b80000, 0x4c),
        (0x40c80000, 0x4c),
        (0x40d80000, 0x4e),
        (0x40e80000, 0x4e),
        (0x40f80000, 0x50),
        (0x41080000, 0x50),
        (0x41180000, 0x52),
        (0x41280000, 0x52),
        (0x41380000, 0x54),
        (0x41480000, 0x54),
        (0x41580000, 0x56),
        (0x41680000, 0x56),
        (0x41780000, 0x58),
        (0x41880000, 0x58),
        (0x41980000, 0x5a),
        (0x41a80000, 0x5a),
        (0x41b80000, 0x5c),
        (0x41c80000, 0x5c),
        (0x41d80000, 0x5e),
        (0x41e80000, 0x5e),
        (0x41f80000, 0x60),
        (0x42080000, 0x60),
        (0x42180000, 0x62),
        (0x42280000, 0x62),
        (0x42380000, 0x64),
        (0x42480000, 0x64),
        (0x42580000, 0x66),
        (0x42680000, 0x66),
        (0x42780000, 0x68),
        (0x42880000, 0x68),
        (0x42980000, 0x6a),
        (0x42a80000, 0x6a),
        (0x42b80000, 0x6c),
        (0x42c80000, 0x6c),
        (0x42d80000, 0x6e),
        (0x42e80000, 0x6e),
        (0x42f80000, 0x70),
        (0x43080000, 0x70),
        (0x43180000, 0x72),
        (0x43280000, 0x72),
        (0x43380000, 0x74),
        (0x43480000, 0x74),
        (0x43580000, 0x76),
        (0x43680000, 0x76),
        (0x43780000, 0x78),
        (0x43880000, 0x78),
        (0x43980000, 0x7a),
        (0x43a80000, 0x7a),
        (0x43b80000, 0x7c),
        (0x43c80000, 0x7c),
        (0x43d80000, 0x7e),
        (0x00000000, 0x00),
        (0x3c900000, 0x09),
        (0x3d200000, 0x12),
        (0x3db00000, 0x1b),
        (0x3e400000, 0x24),
        (0x3ed00000, 0x2d),
        (0x3f600000, 0x36),
        (0x3ff00000, 0x3f),
        (0x40800000, 0x48),
        (0x41100000, 0x51),
        (0x41a00000, 0x5a),
        (0x42300000, 0x63),
        (0x42c00000, 0x6c),
        (0x43500000, 0x75),
        (0x43e00000, 0x7e),
        (0x3089705f, 0x00),
        (0x3a800000, 0x00),
        (0x3ac00000, 0x01),
        (0x43dff333, 0x7e),
        (0x43e00000, 0x7e),
        (0x3e99999a, 0x2a),
        (0xbe99999a, 0xaa),
        (0xbe880000, 0xa8),
        (0x3f880000, 0x38),
        (0x3f980000, 0x3a),
        (0xbb400000, 0x82),
    ];

    #[test]
    fn e4m3_decodes_as_torch_does() {
        for (b, &bits) in TORCH_E4M3.iter().enumerate() {
            let (ours, torch) = (E4M3[b], f32::from_bits(bits));
            if torch.is_nan() {
                assert!(ours.is_nan() && e4m3_is_nan(b as u8), "{b:#04x}");
            } else {
                assert_eq!(ours.to_bits(), bits, "{b:#04x}: {ours} vs {torch}");
                assert!(!e4m3_is_nan(b as u8), "{b:#04x}");
            }
        }
        assert_eq!(E4M3[0x7E], E4M3_MAX);
        assert_eq!(E4M3[0x01], 2f32.powi(-9));
    }

    #[test]
    fn e4m3_rounds_as_torch_does() {
        for &(bits, want) in &TORCH_ENCODE {
            let x = f32::from_bits(bits);
            assert_eq!(f32_to_e4m3(x), want, "{x}");
        }
        assert_eq!(f32_to_e4m3(1e6), 0x7E);
        assert_eq!(f32_to_e4m3(-1e6), 0xFE);
        assert!(e4m3_is_nan(f32_to_e4m3(f32::NAN)));
    }

    /// The same matrix through transformers 5.17's `Fp8Quantize._quantize_one` (FineGrainedFP8,
    /// block [128, 128]): `n = arange(256 * 384)`, `w = ((n * 7919) % 1000 - 500) / 1e4` as f32
    /// `[256, 384]`, then `w[3, 5] = 0.9`, `w[200, 300] = -1e-4`, `w[130:, :128] = 0`. Its
    /// `weight_scale_inv` (f32 bits) and the FNV-1a hash of its e4m3 bytes.
    #[test]
    fn quantize_matches_transformers_fine_grained_fp8() {
        let mut data: Vec<f32> = (0..256u64 * 384)
            .map(|n| ((n * 7919 % 1000) as f32 - 500.0) / 1e4)
            .collect();
        data[3 * 384 + 5] = 0.9;
        data[200 * 384 + 300] = -1e-4;
        for o in 130..256 {
            data[o * 384..o * 384 + 128].fill(0.0);
        }
        let m = quantize_fp8(&HostTensor::new(vec![256, 384], data).unwrap());
        let scales: Vec<u32> = m.scales.iter().map(|s| s.to_bits()).collect();
        let want = [
            0x3b03a83a, 0x38ea0ea1, 0x38ea0ea1, 0x38e91ef5, 0x38ea0ea1, 0x38ea0ea1,
        ];
        assert_eq!(scales, want);
        let hash = m.q.iter().fold(0xcbf29ce484222325u64, |h, &b| {
            (h ^ b as u64).wrapping_mul(0x100000001b3)
        });
        assert_eq!(hash, 0x54b3fe542ee63b61);
    }

    #[test]
    fn quantize_keeps_each_block_within_half_a_step() {
        // 200 x 300: partial blocks in both dims, and blocks of very different ranges.
        let mut w = crate::random::uniform_tensor(&[200, 300], 9, 0.05);
        w.data_mut()[0] = 3.0;
        let m = quantize_fp8(&w);
        assert_eq!((m.block, m.grid()), ([128, 128], [2, 3]));
        // The block holding the 3.0 has the larger scale; its largest value maps to 448.
        assert_eq!(m.scales[0], 1.0 / (448.0 / 3.0));
        assert_eq!(E4M3[m.q[0] as usize], 448.0);
        let back = m.dequantize();
        for (k, (a, b)) in w.data().iter().zip(back.data()).enumerate() {
            // e4m3 keeps 3 mantissa bits: half a step is 1/16 of the value's binade, and
            // values below 2^-6 (in units of the scale) are subnormal, steps of 2^-9.
            let s = m.scales[(k / 300 / 128) * 3 + (k % 300) / 128];
            let slack = (a.abs() / 16.0).max(s * 2f32.powi(-10)) * 1.0001;
            assert!((a - b).abs() <= slack, "[{k}] {a} vs {b}");
        }
        let zero = quantize_fp8(&HostTensor::new(vec![2, 2], vec![0.0; 4]).unwrap());
        assert_eq!(
            (zero.scales.clone(), zero.q.clone()),
            (vec![1.0], vec![0; 4])
        );
    }

    /// ops_f32.cu's `div_by_scale`: x / s from the reciprocal by two FMA corrections, which the
    /// GPU's activation quantization uses in place of a division a value.
    fn div_by_scale(v: f32, s: f32, inv: f32) -> f32 {
        let mut q = v * inv;
        q = (-q).mul_add(s, v).mul_add(inv, q);
        (-q).mul_add(s, v).mul_add(inv, q).copysign(v)
    }

    #[test]
    fn the_gpus_division_by_a_scale_is_the_division() {
        // Every f16 value (both signs, and -0) against the scales of a spread of group maxima:
        // every 61st positive f16, and each binade's first and last (where a reciprocal's
        // rounding is at its worst), all as quantize_rows computes them. Every maximum
        // (`step_by(1)`: about 10^9 pairs, 13 s in release) passed on 2026-11-29.
        let f16s = || (0u16..0x7c00).map(|b| half::f16::from_bits(b).to_f32());
        let binade_edges = (0u16..31).flat_map(|e| [e << 10, (e << 10) | 0x3ff]);
        let amaxes = (1u16..0x7c00)
            .step_by(61)
            .chain(binade_edges)
            .map(|b| half::f16::from_bits(b).to_f32())
            .filter(|&a| a > 0.0);
        let mut checked = 0u64;
        for amax in amaxes {
            let s = amax / E4M3_MAX;
            let inv = 1.0 / s;
            for v in f16s().take_while(|&v| v <= amax) {
                for v in [v, -v] {
                    let (want, got) = (v / s, div_by_scale(v, s, inv));
                    assert_eq!(want.to_bits(), got.to_bits(), "{v} / {s}: {want} vs {got}");
                    checked += 1;
                }
            }
        }
        assert!(checked > 5_000_000, "{checked} pairs");
    }

    #[test]
    fn activation_rows_quantize_per_group_of_128() {
        // Two rows of two groups: row 0's first group has amax 56 (a power of two times 448:
        // its scale 1/8 and every value exact), its second is all zeros (scale 1); row 1 holds
        // random values whose largest maps to 448 exactly.
        let (n, k) = (2, 256);
        let mut x = vec![0f32; n * k];
        for (i, v) in x[..128].iter_mut().enumerate() {
            *v = E4M3[i % 126] / 8.0 * if i % 2 == 0 { 1.0 } else { -1.0 };
        }
        x[5] = -56.0;
        let noise = crate::random::uniform_tensor(&[k], 4, 3.0);
        x[k..].copy_from_slice(noise.data());
        let (q, s) = quantize_rows(&x, n, k);
        // Group-major scales: [group 0: rows 0, 1], [group 1: rows 0, 1].
        assert_eq!((s[0], s[2]), (0.125, 1.0));
        for (i, b) in q[..128].iter().enumerate() {
            assert_eq!(E4M3[*b as usize] * s[0], x[i], "row 0 [{i}]");
        }
        assert!(q[128..256].iter().all(|&b| b == 0));
        for g in 0..2 {
            let (vals, bytes) = (&x[k + g * 128..][..128], &q[k + g * 128..][..128]);
            let amax = vals.iter().fold(0f32, |m, v| m.max(v.abs()));
            let sc = s[g * n + 1];
            assert_eq!(sc, amax / 448.0);
            assert!(bytes.iter().any(|&b| E4M3[b as usize].abs() == 448.0));
            for (v, b) in vals.iter().zip(bytes) {
                // Half an e4m3 step: 1/16 of the value's binade, 2^-10 of the scale below 2^-6.
                let slack = (v.abs() / 16.0).max(sc * 2f32.powi(-10)) * 1.0001;
                assert!((E4M3[*b as usize] * sc - v).abs() <= slack, "{v} -> {b:#x}");
            }
        }
    }
}
