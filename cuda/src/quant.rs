//! Quantized weights (W4A16, W8A16, FP8): the checkpoint formats people download, read into
//! one form per number format, and round-to-nearest quantization of an f16/bf16 checkpoint at
//! load. FP8 (e4m3 values with block scales) is its own form, [`fp8::Fp8Matrix`] (see [`fp8`]);
//! a module's matrix is a [`QuantMatrix`], one or the other.
//!
//! Every integer format is read into an [`IntMatrix`]: unsigned values of `bits` bits, row-major
//! `[out, in]`, and per row a scale and an (integer) zero point for each `group` input
//! columns, so that `w[o, i] = (q[o, i] - zero[o, i / group]) * scale[o, i / group]`. GPTQ's
//! act order keeps its groups contiguous through a column permutation ([`IntMatrix::perm`]).
//! The CPU backend dequantizes this at load (exactly: every value is a small integer times an
//! f16/bf16 scale); the CUDA backend repacks it for its kernels.
//!
//! Which format a checkpoint has is its `config.json`'s `quantization_config`
//! ([`QuantConfig::from_config`]); which modules are quantized is per tensor: a module whose
//! packed tensors are present (`weight_packed`, `qweight`, or FP8's scale beside `weight`) is
//! read through the format, one that has a plain `weight` (the ViT, `lm_head`, the embeddings,
//! whatever the `ignore` / `modules_to_not_convert` list named) stays f16. Formats (layouts as
//! the tools write them; FP8's in [`fp8`]):
//!
//! - compressed-tensors `pack-quantized` (llm-compressor): `weight_packed` i32 `[out, in / (32 /
//!   bits)]`, values along the input dim, low bits first, each stored plus `2^(bits-1)`;
//!   `weight_scale` `[out, groups]`; `weight_zero_point` (asymmetric only) packed the same way
//!   along the output dim, `[ceil(out / (32 / bits)), groups]`; `weight_shape`; optional
//!   `weight_g_idx`. `int-quantized`: `weight` i8 `[out, in]` with the same scales.
//! - AutoAWQ GEMM: `qweight` i32 `[in, out / 8]`, packed along the output dim in AWQ's order
//!   (nibble j holds column `[0, 2, 4, 6, 1, 3, 5, 7][j]` of each eight), `qzeros` i32 `[groups,
//!   out / 8]` packed the same, `scales` `[groups, out]`.
//! - GPTQ: `qweight` i32 `[in / 8, out]` packed along the input dim in order, `qzeros` i32
//!   `[groups, out / 8]` in order (v1 stores each zero minus one, `checkpoint_format: gptq_v2`
//!   does not), `scales` `[groups, out]`, `g_idx` `[in]` (each input column's group; with
//!   `desc_act` not in order).

pub mod fp8;

use std::path::Path;

use serde_json::Value;

use crate::{Error, HostTensor, Result, WeightPrefix};
use fp8::{Fp8Matrix, Fp8Scales};

/// A quantized module's matrix, in the form of its number format.
#[derive(Clone, Debug, PartialEq)]
pub enum QuantMatrix {
    Int(IntMatrix),
    Fp8(Fp8Matrix),
}

impl QuantMatrix {
    /// The f32 matrix `[out, inp]` it means.
    pub fn dequantize(&self) -> HostTensor {
        match self {
            QuantMatrix::Int(m) => m.dequantize(),
            QuantMatrix::Fp8(m) => m.dequantize(),
        }
    }

    /// Its scales, whatever they cover (for the f16 audit of backends that store them so).
    pub fn scales(&self) -> &[f32] {
        match self {
            QuantMatrix::Int(m) => &m.scales,
            QuantMatrix::Fp8(m) => &m.scales,
        }
    }
}

/// A matrix `[out, inp]` of `bits`-bit integers with a scale and zero point per row and group.
#[derive(Clone, Debug, PartialEq)]
pub struct IntMatrix {
    pub out: usize,
    pub inp: usize,
    /// 4 or 8.
    pub bits: u32,
    /// Input columns sharing a scale and zero point (`inp` for one per row).
    pub group: usize,
    /// The values, unsigned, one a byte, row-major `[out, inp]` in stored column order.
    pub q: Vec<u8>,
    /// `[out, inp / group]`.
    pub scales: Vec<f32>,
    /// `[out, inp / group]`, whole numbers in `0..2^bits`.
    pub zeros: Vec<f32>,
    /// Stored column `j` is the matrix's column `perm[j]` (GPTQ act order, sorted by group);
    /// `None` when columns are in order.
    pub perm: Option<Vec<u32>>,
}

impl IntMatrix {
    pub fn groups(&self) -> usize {
        self.inp / self.group
    }

    /// The f32 matrix `[out, inp]`, in the checkpoint's column order.
    pub fn dequantize(&self) -> HostTensor {
        let (g, groups) = (self.group, self.groups());
        let mut data = vec![0.0f32; self.out * self.inp];
        for o in 0..self.out {
            let row = &mut data[o * self.inp..(o + 1) * self.inp];
            for j in 0..self.inp {
                let s = o * groups + j / g;
                let v = (self.q[o * self.inp + j] as f32 - self.zeros[s]) * self.scales[s];
                let col = self.perm.as_ref().map_or(j, |p| p[j] as usize);
                row[col] = v;
            }
        }
        HostTensor::new(vec![self.out, self.inp], data).expect("shape matches")
    }

    fn check(&self, name: &str) -> Result<()> {
        let groups = self.inp / self.group.max(1);
        let ok = self.group > 0
            && self.inp % self.group == 0
            && self.q.len() == self.out * self.inp
            && self.scales.len() == self.out * groups
            && self.zeros.len() == self.out * groups
            && self.perm.as_ref().is_none_or(|p| p.len() == self.inp);
        if ok {
            Ok(())
        } else {
            Err(Error::Quantized {
                name: name.to_string(),
                problem: format!(
                    "inconsistent shapes: [{}, {}] in groups of {}, {} values, {} scales, {} zeros",
                    self.out,
                    self.inp,
                    self.group,
                    self.q.len(),
                    self.scales.len(),
                    self.zeros.len()
                ),
            })
        }
    }
}

/// `--quantize`: what an f16/bf16 checkpoint's decoder matrices become at load.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QuantizeTo {
    /// 8-bit, symmetric (zero 128), a scale per row and 128 columns.
    Int8,
    /// 4-bit, asymmetric (min-max, integer zero point), a scale and zero per row and 128
    /// columns.
    Int4,
    /// e4m3 with a scale per 128x128 block: the layout of Qwen's FP8 checkpoints
    /// ([`fp8::quantize_fp8`]).
    Fp8,
}

/// Columns a scale covers under `--quantize`.
pub const QUANTIZE_GROUP: usize = 128;

impl QuantizeTo {
    pub fn bits(self) -> u32 {
        match self {
            QuantizeTo::Int8 | QuantizeTo::Fp8 => 8,
            QuantizeTo::Int4 => 4,
        }
    }

    /// Whether the matrix `name` `[out, inp]` is quantized: the text decoder's projections,
    /// never the vision tower, `lm_head` or the embeddings (as published W4A16 checkpoints
    /// leave them), and only where whole groups of [`QUANTIZE_GROUP`] columns fit. The rest
    /// stay f16.
    pub fn applies_to(self, name: &str, inp: usize) -> bool {
        !name.contains("visual")
            && !name.contains("lm_head")
            && !name.contains("embed")
            && inp % QUANTIZE_GROUP == 0
    }

    /// Round-to-nearest quantization of `w` `[out, inp]` in groups of [`QUANTIZE_GROUP`]
    /// (FP8: blocks of [`fp8::FP8_BLOCK`]): lower quality than AWQ or GPTQ, which choose
    /// scales from calibration data; this is what makes an f16 checkpoint (or
    /// `--random-weights`) run at the quantized speed.
    pub fn quantize(self, w: &HostTensor) -> QuantMatrix {
        match self {
            QuantizeTo::Fp8 => QuantMatrix::Fp8(fp8::quantize_fp8(w)),
            QuantizeTo::Int8 | QuantizeTo::Int4 => QuantMatrix::Int(self.quantize_int(w)),
        }
    }

    fn quantize_int(self, w: &HostTensor) -> IntMatrix {
        self.quantize_int_grouped(w, QUANTIZE_GROUP.min(w.shape()[1]))
    }

    /// [`Self::quantize`] of an integer kind in groups of `group` columns (which must divide
    /// the row): checkpoints come with groups of 32, 64 or 128.
    pub fn quantize_int_grouped(self, w: &HostTensor, group: usize) -> IntMatrix {
        let (out, inp) = (w.shape()[0], w.shape()[1]);
        assert!(
            group > 0 && inp % group == 0,
            "groups of {group} in rows of {inp}"
        );
        let groups = inp / group;
        let max_q = ((1u32 << self.bits()) - 1) as f32;
        let mut q = vec![0u8; out * inp];
        let mut scales = vec![0.0f32; out * groups];
        let mut zeros = vec![0.0f32; out * groups];
        for o in 0..out {
            for g in 0..groups {
                let vals = &w.data()[o * inp + g * group..o * inp + (g + 1) * group];
                let (scale, zero) = match self {
                    QuantizeTo::Int8 => {
                        let amax = vals.iter().fold(0.0f32, |m, v| m.max(v.abs()));
                        (amax / 127.0, 128.0)
                    }
                    QuantizeTo::Fp8 => unreachable!("FP8 quantizes through fp8::quantize_fp8"),
                    QuantizeTo::Int4 => {
                        let lo = vals.iter().fold(0.0f32, |m, &v| m.min(v));
                        let hi = vals.iter().fold(0.0f32, |m, &v| m.max(v));
                        let s = (hi - lo) / max_q;
                        (s, if s > 0.0 { (-lo / s).round() } else { 0.0 })
                    }
                };
                // Scales are stored in f16 on the GPU: round here so both backends agree.
                let scale = half::f16::from_f32(scale).to_f32();
                scales[o * groups + g] = scale;
                zeros[o * groups + g] = zero;
                for (i, &v) in vals.iter().enumerate() {
                    let x = if scale > 0.0 {
                        (v / scale + zero).round()
                    } else {
                        zero
                    };
                    q[o * inp + g * group + i] = x.clamp(0.0, max_q) as u8;
                }
            }
        }
        IntMatrix {
            out,
            inp,
            bits: self.bits(),
            group,
            q,
            scales,
            zeros,
            perm: None,
        }
    }
}

/// A random-weight model's matrix `[out, inp]` under `--quantize int8|int4` (FP8 quantizes the
/// random f32 values instead): value `i` (row-major) is
/// the top `bits` bits of [`crate::random::bits`]`(key, i)`, zero points the middle of the
/// range and one f16 scale that spreads the values over `[-bound, bound)`, as
/// [`crate::random::uniform`] would. The GPU fills the same values (`fill_random_int`).
pub fn random_int(out: usize, inp: usize, key: u64, bound: f32, to: QuantizeTo) -> IntMatrix {
    use rayon::prelude::*;
    let bits = to.bits();
    let group = QUANTIZE_GROUP.min(inp);
    let half_range = (1u32 << (bits - 1)) as f32;
    let q: Vec<u8> = (0..(out * inp) as u64)
        .into_par_iter()
        .map(|i| (crate::random::bits(key, i) >> (64 - bits)) as u8)
        .collect();
    let groups = inp / group;
    IntMatrix {
        out,
        inp,
        bits,
        group,
        q,
        scales: vec![random_int_scale(bound, bits); out * groups],
        zeros: vec![half_range; out * groups],
        perm: None,
    }
}

/// The scale of [`random_int`]'s matrices, rounded to f16 as the GPU stores it.
pub fn random_int_scale(bound: f32, bits: u32) -> f32 {
    half::f16::from_f32(bound / (1u32 << (bits - 1)) as f32).to_f32()
}

impl std::fmt::Display for QuantizeTo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            QuantizeTo::Int8 => "int8",
            QuantizeTo::Int4 => "int4",
            QuantizeTo::Fp8 => "fp8",
        })
    }
}

impl std::str::FromStr for QuantizeTo {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "int8" => Ok(QuantizeTo::Int8),
            "int4" => Ok(QuantizeTo::Int4),
            "fp8" => Ok(QuantizeTo::Fp8),
            other => Err(format!(
                "unknown quantization `{other}`: use int8, int4 or fp8"
            )),
        }
    }
}

impl std::fmt::Display for QuantConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            QuantConfig::CompressedTensors { packed: true, .. } => {
                f.write_str("compressed-tensors pack-quantized")
            }
            QuantConfig::CompressedTensors { packed: false, .. } => {
                f.write_str("compressed-tensors int-quantized")
            }
            QuantConfig::Awq { .. } => f.write_str("AWQ"),
            QuantConfig::Gptq { v2: false, .. } => f.write_str("GPTQ"),
            QuantConfig::Gptq { v2: true, .. } => f.write_str("GPTQ v2"),
            QuantConfig::Fp8 {
                layout: Fp8Layout::FineGrained,
                scales,
            } => write!(f, "FP8 e4m3 (FineGrainedFP8), {scales}"),
            QuantConfig::Fp8 {
                layout: Fp8Layout::CompressedTensors,
                scales,
            } => write!(f, "compressed-tensors float-quantized FP8 e4m3, {scales}"),
        }
    }
}

/// A checkpoint's `quantization_config`: which format its packed tensors are in.
#[derive(Clone, Debug, PartialEq)]
pub enum QuantConfig {
    /// compressed-tensors, weight-only integer schemes.
    CompressedTensors {
        bits: u32,
        /// `pack-quantized` (true) or `int-quantized` / `naive-quantized` (false).
        packed: bool,
        symmetric: bool,
    },
    /// AutoAWQ's GEMM layout.
    Awq { bits: u32, group: usize },
    /// GPTQ; `v2` when zeros are stored as they are (`checkpoint_format: gptq_v2`).
    Gptq { bits: u32, v2: bool },
    /// FP8 e4m3 weights ([`fp8`]).
    Fp8 {
        layout: Fp8Layout,
        scales: Fp8Scales,
    },
}

/// Which tool's FP8 layout: where the scales are and what they are called.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fp8Layout {
    /// transformers' FineGrainedFP8 (`quant_method: fp8`): `weight_scale_inv`.
    FineGrained,
    /// compressed-tensors `float-quantized`: `weight_scale`.
    CompressedTensors,
}

impl Fp8Layout {
    /// The scale tensor beside `weight`.
    pub fn scale_name(self) -> &'static str {
        match self {
            Fp8Layout::FineGrained => "weight_scale_inv",
            Fp8Layout::CompressedTensors => "weight_scale",
        }
    }
}

const SUPPORTED_METHODS: &str = "compressed-tensors (pack-quantized or int-quantized, int 4 or \
                                 8 bits, weight-only; float-quantized FP8 e4m3), fp8 \
                                 (transformers' FineGrainedFP8, e4m3), awq (version gemm, 4 \
                                 bits), gptq (4 or 8 bits)";

fn bad(path: &Path, key: &str, problem: impl Into<String>) -> Error {
    Error::BadKey {
        path: path.to_path_buf(),
        key: key.to_string(),
        problem: problem.into(),
    }
}

/// A compressed-tensors `quantization_config`'s `config_groups`, each a scheme and the modules
/// it targets: at least one, for the integer and the FP8 readers alike.
fn config_groups<'a>(path: &Path, q: &'a Value) -> Result<&'a serde_json::Map<String, Value>> {
    q.get("config_groups")
        .and_then(Value::as_object)
        .filter(|g| !g.is_empty())
        .ok_or_else(|| bad(path, "quantization_config.config_groups", "is missing"))
}

fn bits_of(path: &Path, key: &str, v: Option<&Value>, allowed: &[u64]) -> Result<u32> {
    let bits = v
        .and_then(Value::as_u64)
        .ok_or_else(|| bad(path, key, "is missing or not a number"))?;
    if allowed.contains(&bits) {
        Ok(bits as u32)
    } else {
        Err(bad(
            path,
            key,
            format!("is {bits}; supported are {allowed:?} bits"),
        ))
    }
}

/// What an FP8 checkpoint's dynamic activation scheme becomes here, said once at load: on an
/// H100/H200 the GEMMs of its 128x128-block matrices past decode's 4 rows quantize their
/// activations as it declares (W8A8, `cuda/src/cuda/w8a8.rs`) and decode's GEMVs of them round
/// theirs the same way; per-channel scales, other GPUs and the CPU leave them unquantized
/// (weight-only).
fn log_fp8_activations() {
    tracing::info!(
        "FP8 checkpoint: weights are read as they are stored; on an H100/H200 the activations \
         of 128x128-block matrices are quantized at run time as the checkpoint declares (W8A8; \
         VLM_FP8_GEMM=w8a16 turns that off), elsewhere left unquantized (weight-only)"
    );
}

impl QuantConfig {
    /// The `quantization_config` of `config` (read from `path`, for errors), if it has one.
    pub fn from_config(path: &Path, config: &Value) -> Result<Option<Self>> {
        let Some(q) = config
            .get("quantization_config")
            .or_else(|| config.get("text_config")?.get("quantization_config"))
        else {
            return Ok(None);
        };
        let method = q
            .get("quant_method")
            .and_then(Value::as_str)
            .ok_or_else(|| bad(path, "quantization_config.quant_method", "is missing"))?;
        let field = |k: &str| format!("quantization_config.{k}");
        match method {
            "compressed-tensors" => Self::compressed_tensors(path, q).map(Some),
            "awq" => {
                let version = q.get("version").and_then(Value::as_str).unwrap_or("gemm");
                if !version.eq_ignore_ascii_case("gemm") {
                    return Err(bad(
                        path,
                        &field("version"),
                        format!("is `{version}`; supported is AutoAWQ's `gemm` layout"),
                    ));
                }
                if q.get("zero_point").and_then(Value::as_bool) == Some(false) {
                    return Err(bad(
                        path,
                        &field("zero_point"),
                        "is false; AWQ without zero points is not supported",
                    ));
                }
                let group = q.get("group_size").and_then(Value::as_u64).unwrap_or(128) as usize;
                Ok(Some(QuantConfig::Awq {
                    bits: bits_of(path, &field("bits"), q.get("bits").or(q.get("w_bit")), &[4])?,
                    group,
                }))
            }
            "fp8" => Self::fine_grained_fp8(path, q).map(Some),
            "gptq" => Ok(Some(QuantConfig::Gptq {
                bits: bits_of(path, &field("bits"), q.get("bits"), &[4, 8])?,
                v2: q.get("checkpoint_format").and_then(Value::as_str) == Some("gptq_v2"),
            })),
            other => Err(bad(
                path,
                &field("quant_method"),
                format!("is `{other}`; supported are {SUPPORTED_METHODS}"),
            )),
        }
    }

    fn compressed_tensors(path: &Path, q: &Value) -> Result<Self> {
        let format = q
            .get("format")
            .and_then(Value::as_str)
            .unwrap_or("pack-quantized");
        let packed = match format {
            "pack-quantized" => true,
            "int-quantized" | "naive-quantized" => false,
            "float-quantized" => return Self::compressed_tensors_fp8(path, q),
            other => {
                return Err(bad(
                    path,
                    "quantization_config.format",
                    format!(
                        "is `{other}`; supported are pack-quantized, int-quantized and \
                         naive-quantized (integer weights) and float-quantized (FP8 e4m3)"
                    ),
                ))
            }
        };
        let groups = config_groups(path, q)?;
        let mut scheme = None;
        for (name, g) in groups {
            let key = |k: &str| format!("quantization_config.config_groups.{name}.{k}");
            if g.get("input_activations").is_some_and(|a| !a.is_null()) {
                return Err(bad(
                    path,
                    &key("input_activations"),
                    "is set; only weight-only schemes (W4A16, W8A16) are supported",
                ));
            }
            let w = g
                .get("weights")
                .ok_or_else(|| bad(path, &key("weights"), "is missing"))?;
            if let Some(t) = w.get("type").and_then(Value::as_str) {
                if t != "int" {
                    return Err(bad(
                        path,
                        &key("weights.type"),
                        format!("is `{t}`; supported is int"),
                    ));
                }
            }
            let bits = bits_of(path, &key("weights.num_bits"), w.get("num_bits"), &[4, 8])?;
            let symmetric = w.get("symmetric").and_then(Value::as_bool).unwrap_or(true);
            let this = QuantConfig::CompressedTensors {
                bits,
                packed,
                symmetric,
            };
            if scheme.as_ref().is_some_and(|s| *s != this) {
                return Err(bad(
                    path,
                    "quantization_config.config_groups",
                    "hold schemes of different bit widths or symmetry; one scheme a checkpoint \
                     is supported",
                ));
            }
            scheme = Some(this);
        }
        Ok(scheme.expect("config_groups is not empty"))
    }

    /// compressed-tensors `float-quantized`: FP8 e4m3 weights with a scale per tensor, channel
    /// or block. Dynamic input activations (FP8_DYNAMIC, FP8_BLOCK) run unquantized for now.
    fn compressed_tensors_fp8(path: &Path, q: &Value) -> Result<Self> {
        let groups = config_groups(path, q)?;
        let mut scheme = None;
        for (name, g) in groups {
            let key = |k: &str| format!("quantization_config.config_groups.{name}.{k}");
            if let Some(a) = g.get("input_activations").filter(|a| !a.is_null()) {
                if a.get("dynamic").and_then(Value::as_bool) != Some(true) {
                    return Err(bad(
                        path,
                        &key("input_activations.dynamic"),
                        "is not true; static activation scales are not supported (dynamic ones \
                         are)",
                    ));
                }
            }
            let w = g
                .get("weights")
                .ok_or_else(|| bad(path, &key("weights"), "is missing"))?;
            let t = w.get("type").and_then(Value::as_str).unwrap_or("float");
            if t != "float" {
                return Err(bad(
                    path,
                    &key("weights.type"),
                    format!("is `{t}`; float-quantized holds float weights"),
                ));
            }
            bits_of(path, &key("weights.num_bits"), w.get("num_bits"), &[8])?;
            if w.get("symmetric").and_then(Value::as_bool) == Some(false) {
                return Err(bad(
                    path,
                    &key("weights.symmetric"),
                    "is false; FP8 weights with zero points are not supported",
                ));
            }
            let strategy = w
                .get("strategy")
                .and_then(Value::as_str)
                .unwrap_or("tensor");
            let scales = match strategy {
                "tensor" => Fp8Scales::Tensor,
                "channel" => Fp8Scales::Channel,
                "block" => Fp8Scales::Block(block_of(
                    path,
                    &key("weights.block_structure"),
                    w.get("block_structure"),
                )?),
                other => {
                    return Err(bad(
                        path,
                        &key("weights.strategy"),
                        format!("is `{other}`; supported for FP8 are tensor, channel and block"),
                    ))
                }
            };
            let this = QuantConfig::Fp8 {
                layout: Fp8Layout::CompressedTensors,
                scales,
            };
            if scheme.as_ref().is_some_and(|s| *s != this) {
                return Err(bad(
                    path,
                    "quantization_config.config_groups",
                    "hold different FP8 schemes; one scheme a checkpoint is supported",
                ));
            }
            scheme = Some(this);
        }
        if scheme.is_some() {
            log_fp8_activations();
        }
        Ok(scheme.expect("config_groups is not empty"))
    }

    /// transformers' FineGrainedFP8 (`quant_method: fp8`), the layout of Qwen's FP8 releases:
    /// `fmt: e4m3`, `activation_scheme: dynamic` (see [`log_fp8_activations`]), `weight_block_size`
    /// (absent or null: a scale per tensor), `scale_fmt: float`. Other keys are ignored
    /// (`modules_to_not_convert` needs no reading: those modules are stored unquantized).
    fn fine_grained_fp8(path: &Path, q: &Value) -> Result<Self> {
        let field = |k: &str| format!("quantization_config.{k}");
        // A text field, where present, must be the one value read (`supported` says which).
        let only = |k: &str, ok: &dyn Fn(&str) -> bool, supported: &str| match q
            .get(k)
            .and_then(Value::as_str)
        {
            Some(v) if !ok(v) => Err(bad(
                path,
                &field(k),
                format!("is `{v}`; supported is {supported}"),
            )),
            _ => Ok(()),
        };
        only("fmt", &|v| v.eq_ignore_ascii_case("e4m3"), "e4m3")?;
        only(
            "activation_scheme",
            &|v| v.eq_ignore_ascii_case("dynamic"),
            "dynamic",
        )?;
        only(
            "scale_fmt",
            &|v| v == "float",
            "float (f32, f16 or bf16 scales)",
        )?;
        let scales = match q.get("weight_block_size").filter(|v| !v.is_null()) {
            None => Fp8Scales::Tensor,
            b => Fp8Scales::Block(block_of(path, &field("weight_block_size"), b)?),
        };
        log_fp8_activations();
        Ok(QuantConfig::Fp8 {
            layout: Fp8Layout::FineGrained,
            scales,
        })
    }

    /// Bits a quantized value takes.
    pub fn bits(&self) -> u32 {
        match *self {
            QuantConfig::CompressedTensors { bits, .. }
            | QuantConfig::Awq { bits, .. }
            | QuantConfig::Gptq { bits, .. } => bits,
            QuantConfig::Fp8 { .. } => 8,
        }
    }

    /// Whether the module under `w` is stored quantized in this format.
    pub fn holds(&self, w: &WeightPrefix) -> bool {
        match self {
            QuantConfig::CompressedTensors { packed: true, .. } => w.contains("weight_packed"),
            QuantConfig::CompressedTensors { packed: false, .. } => {
                w.contains("weight_scale") && w.contains("weight")
            }
            QuantConfig::Awq { .. } | QuantConfig::Gptq { .. } => w.contains("qweight"),
            QuantConfig::Fp8 { layout, .. } => {
                w.contains(layout.scale_name()) && w.contains("weight")
            }
        }
    }

    /// Reads the quantized module under `w`, `[out, inp]`.
    pub fn read(&self, w: &WeightPrefix, out: usize, inp: usize) -> Result<QuantMatrix> {
        let m = match *self {
            QuantConfig::CompressedTensors {
                bits,
                packed,
                symmetric,
            } => read_compressed_tensors(w, out, inp, bits, packed, symmetric)?,
            QuantConfig::Awq { bits, group } => read_awq(w, out, inp, bits, group)?,
            QuantConfig::Gptq { bits, v2 } => read_gptq(w, out, inp, bits, v2)?,
            QuantConfig::Fp8 { layout, scales } => {
                return Ok(QuantMatrix::Fp8(fp8::read_fp8(
                    w,
                    out,
                    inp,
                    layout.scale_name(),
                    scales,
                )?))
            }
        };
        m.check(&w.name("weight"))?;
        Ok(QuantMatrix::Int(m))
    }
}

/// A block shape `[rows, cols]` of two positive whole numbers, from `v` (config key `key`).
fn block_of(path: &Path, key: &str, v: Option<&Value>) -> Result<[usize; 2]> {
    let dims: Option<Vec<u64>> = v
        .and_then(Value::as_array)
        .and_then(|a| a.iter().map(Value::as_u64).collect());
    match dims.as_deref() {
        Some(&[r, c]) if r > 0 && c > 0 => Ok([r as usize, c as usize]),
        _ => Err(bad(
            path,
            key,
            format!(
                "is {}; expected two positive whole numbers [rows, cols]",
                v.map_or("missing".to_string(), Value::to_string)
            ),
        )),
    }
}

/// The `n`-th `bits`-bit field of a packed i32 stream, low bits first.
fn field(words: &[i32], n: usize, bits: u32) -> u8 {
    let per = (32 / bits) as usize;
    ((words[n / per] as u32 >> ((n % per) as u32 * bits)) & ((1 << bits) - 1)) as u8
}

/// A row-major `[rows, cols]` matrix of `at(row, col)`, rows filled in parallel: the formats
/// that store a matrix transposed (AWQ, GPTQ: `[in, out]`) read into ours.
fn by_rows<T: Copy + Default + Send>(
    rows: usize,
    cols: usize,
    at: impl Fn(usize, usize) -> T + Sync,
) -> Vec<T> {
    use rayon::prelude::*;
    let mut out = vec![T::default(); rows * cols];
    out.par_chunks_mut(cols.max(1))
        .enumerate()
        .for_each(|(r, row)| row.iter_mut().enumerate().for_each(|(c, v)| *v = at(r, c)));
    out
}

/// `in / groups` from a scale tensor's group count, checked.
fn group_size(w: &WeightPrefix, name: &str, inp: usize, groups: usize) -> Result<usize> {
    if groups == 0 || inp % groups != 0 {
        return Err(Error::Quantized {
            name: w.name(name),
            problem: format!("{groups} groups do not divide the {inp} input columns"),
        });
    }
    Ok(inp / groups)
}

fn read_compressed_tensors(
    w: &WeightPrefix,
    out: usize,
    inp: usize,
    bits: u32,
    packed: bool,
    symmetric: bool,
) -> Result<IntMatrix> {
    let offset = 1u32 << (bits - 1);
    let per = (32 / bits) as usize;
    let scale_shape = w.shape_of("weight_scale")?;
    let groups = match scale_shape[..] {
        [o, g] if o == out => g,
        [o] if o == out => 1,
        [1] | [] => 1,
        _ => {
            return Err(Error::WeightShape {
                name: w.name("weight_scale"),
                expected: vec![out, inp / QUANTIZE_GROUP.min(inp)],
                got: scale_shape,
            })
        }
    };
    let group = group_size(w, "weight_scale", inp, groups)?;
    let raw_scales = w.get("weight_scale", &w.shape_of("weight_scale")?)?;
    let scales = if raw_scales.data().len() == out * groups {
        raw_scales.into_data()
    } else {
        vec![raw_scales.data()[0]; out * groups]
    };
    let q: Vec<u8> = if packed {
        let words = w.get_i32("weight_packed", &[out, inp.div_ceil(per)])?;
        let row = inp.div_ceil(per);
        by_rows(out, inp, |o, i| {
            field(&words[o * row..(o + 1) * row], i, bits)
        })
    } else {
        let vals = w.get_i8("weight", &[out, inp])?;
        vals.iter()
            .map(|&v| (v as i32 + offset as i32) as u8)
            .collect()
    };
    let zeros = if symmetric || !w.contains("weight_zero_point") {
        vec![offset as f32; out * groups]
    } else {
        let shape = w.shape_of("weight_zero_point")?;
        if packed && shape == [out.div_ceil(per), groups] {
            // Packed along the output dim: column g of the zero points, rows in order.
            let words = w.get_i32("weight_zero_point", &shape)?;
            let mut z = vec![0.0f32; out * groups];
            for g in 0..groups {
                let col: Vec<i32> = (0..out.div_ceil(per))
                    .map(|r| words[r * groups + g])
                    .collect();
                for o in 0..out {
                    z[o * groups + g] = field(&col, o, bits) as f32;
                }
            }
            z
        } else {
            // Unpacked signed zero points, `[out, groups]`.
            let zp = w.get("weight_zero_point", &[out, groups])?;
            zp.data().iter().map(|&v| v + offset as f32).collect()
        }
    };
    let perm = act_order(w, "weight_g_idx", inp, group)?;
    Ok(IntMatrix::in_order(out, inp, bits, group, q, scales, zeros).with_perm(perm))
}

fn read_awq(
    w: &WeightPrefix,
    out: usize,
    inp: usize,
    bits: u32,
    group: usize,
) -> Result<IntMatrix> {
    if out % 8 != 0 || inp % group != 0 {
        return Err(Error::Quantized {
            name: w.name("qweight"),
            problem: format!(
                "[{out}, {inp}] is not whole packs of 8 outputs and groups of {group}"
            ),
        });
    }
    let groups = inp / group;
    let words = w.get_i32("qweight", &[inp, out / 8])?;
    let zwords = w.get_i32("qzeros", &[groups, out / 8])?;
    let s = w.get("scales", &[groups, out])?;
    // Nibble j of a word holds output column [0, 2, 4, 6, 1, 3, 5, 7][j] of its eight, so
    // column c is nibble AT[c].
    const AT: [u32; 8] = [0, 4, 1, 5, 2, 6, 3, 7];
    let nibble = |words: &[i32], r: usize, o: usize| -> u8 {
        ((words[r * (out / 8) + o / 8] as u32 >> (4 * AT[o % 8])) & 0xF) as u8
    };
    let q = by_rows(out, inp, |o, i| nibble(&words, i, o));
    let scales = by_rows(out, groups, |o, g| s.data()[g * out + o]);
    let zeros = by_rows(out, groups, |o, g| nibble(&zwords, g, o) as f32);
    Ok(IntMatrix::in_order(out, inp, bits, group, q, scales, zeros))
}

fn read_gptq(w: &WeightPrefix, out: usize, inp: usize, bits: u32, v2: bool) -> Result<IntMatrix> {
    let per = (32 / bits) as usize;
    let s_shape = w.shape_of("scales")?;
    let groups = match s_shape[..] {
        [g, o] if o == out => g,
        _ => {
            return Err(Error::WeightShape {
                name: w.name("scales"),
                expected: vec![inp / QUANTIZE_GROUP.min(inp), out],
                got: s_shape,
            })
        }
    };
    let group = group_size(w, "scales", inp, groups)?;
    if inp % per != 0 || out % per != 0 {
        return Err(Error::Quantized {
            name: w.name("qweight"),
            problem: format!("[{out}, {inp}] is not whole packs of {per}"),
        });
    }
    let words = w.get_i32("qweight", &[inp / per, out])?;
    let zwords = w.get_i32("qzeros", &[groups, out / per])?;
    let s = w.get("scales", &[groups, out])?;
    let q = by_rows(out, inp, |o, i| {
        let word = words[(i / per) * out + o] as u32;
        ((word >> ((i % per) as u32 * bits)) & ((1 << bits) - 1)) as u8
    });
    let scales = by_rows(out, groups, |o, g| s.data()[g * out + o]);
    // v1 stores each zero point minus one (AutoGPTQ's off-by-one, kept for compatibility).
    let bump = if v2 { 0.0 } else { 1.0 };
    let zrow = out / per;
    let zeros = by_rows(out, groups, |o, g| {
        field(&zwords[g * zrow..(g + 1) * zrow], o, bits) as f32 + bump
    });
    let perm = act_order(w, "g_idx", inp, group)?;
    Ok(IntMatrix::in_order(out, inp, bits, group, q, scales, zeros).with_perm(perm))
}

/// The permutation that sorts input columns by their group (`g_idx[i]`), when they are not in
/// order already; an error unless every group then holds `group` consecutive columns.
fn act_order(w: &WeightPrefix, name: &str, inp: usize, group: usize) -> Result<Option<Vec<u32>>> {
    if !w.contains(name) {
        return Ok(None);
    }
    let g_idx = w.get_i32(name, &[inp])?;
    if g_idx
        .iter()
        .enumerate()
        .all(|(i, &g)| g as usize == i / group)
    {
        return Ok(None);
    }
    let mut perm: Vec<u32> = (0..inp as u32).collect();
    perm.sort_by_key(|&i| g_idx[i as usize]);
    if perm
        .iter()
        .enumerate()
        .any(|(j, &i)| g_idx[i as usize] as usize != j / group)
    {
        return Err(Error::Quantized {
            name: w.name(name),
            problem: format!("its groups are not {group} columns each"),
        });
    }
    Ok(Some(perm))
}

impl IntMatrix {
    /// A matrix whose columns are stored in the checkpoint's order.
    fn in_order(
        out: usize,
        inp: usize,
        bits: u32,
        group: usize,
        q: Vec<u8>,
        scales: Vec<f32>,
        zeros: Vec<f32>,
    ) -> Self {
        IntMatrix {
            out,
            inp,
            bits,
            group,
            q,
            scales,
            zeros,
            perm: None,
        }
    }

    /// With act order (`perm`: the columns sorted by group), stored in that order.
    fn with_perm(self, perm: Option<Vec<u32>>) -> Self {
        match perm {
            Some(p) => self.permuted(p),
            None => self,
        }
    }

    /// This matrix (values in checkpoint column order, group of column `i` given by the
    /// scales' `perm`-sorted order) with its columns stored in `perm` order.
    fn permuted(mut self, perm: Vec<u32>) -> Self {
        let inp = self.inp;
        let mut q = vec![0u8; self.q.len()];
        for o in 0..self.out {
            for (j, &i) in perm.iter().enumerate() {
                q[o * inp + j] = self.q[o * inp + i as usize];
            }
        }
        self.q = q;
        self.perm = Some(perm);
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn matrix(out: usize, inp: usize, seed: u64) -> HostTensor {
        crate::random::uniform_tensor(&[out, inp], seed, 0.05)
    }

    #[test]
    fn round_to_nearest_stays_within_half_a_step() {
        for to in [QuantizeTo::Int8, QuantizeTo::Int4] {
            let w = matrix(8, 256, 3);
            let QuantMatrix::Int(q) = to.quantize(&w) else {
                panic!("{to}: not an integer matrix")
            };
            assert_eq!((q.group, q.groups()), (128, 2));
            let back = q.dequantize();
            for (o, (a, b)) in w.data().iter().zip(back.data()).enumerate() {
                let s = q.scales[(o / 256) * 2 + (o % 256) / 128];
                // Half a step, plus the f16 rounding of the scale times the largest |q - z|.
                let slack = s * (0.5 + 256.0 * 1e-3);
                assert!((a - b).abs() <= slack, "{to:?} [{o}] {a} vs {b}, step {s}");
            }
            assert!(q.q.iter().all(|&v| (v as u32) < 1 << to.bits()));
        }
    }

    #[test]
    fn which_matrices_quantize_on_load() {
        let to = QuantizeTo::Int4;
        assert!(to.applies_to("model.language_model.layers.0.mlp.down_proj", 12288));
        assert!(!to.applies_to("model.visual.blocks.0.attn.qkv", 1152));
        assert!(!to.applies_to("lm_head", 4096));
        assert!(!to.applies_to("model.layers.0.self_attn.q_proj", 64));
    }

    #[test]
    fn unsupported_configs_name_the_field() {
        let p = Path::new("config.json");
        let cfg = serde_json::json!({"quantization_config": {"quant_method": "bitsandbytes"}});
        let e = QuantConfig::from_config(p, &cfg).unwrap_err().to_string();
        assert!(
            e.contains("quant_method") && e.contains("bitsandbytes") && e.contains("awq"),
            "{e}"
        );
        let cfg = serde_json::json!({"quantization_config": {"quant_method": "gptq", "bits": 3}});
        let e = QuantConfig::from_config(p, &cfg).unwrap_err().to_string();
        assert!(e.contains("bits") && e.contains("is 3"), "{e}");
        let cfg = serde_json::json!({"quantization_config": {"quant_method": "compressed-tensors",
            "format": "nvfp4-pack-quantized", "config_groups": {}}});
        let e = QuantConfig::from_config(p, &cfg).unwrap_err().to_string();
        assert!(
            e.contains("format") && e.contains("nvfp4-pack-quantized"),
            "{e}"
        );
        let cfg = serde_json::json!({"quantization_config": {"quant_method": "compressed-tensors",
            "format": "pack-quantized", "config_groups": {"group_0": {"targets": ["Linear"],
            "weights": {"num_bits": 4, "type": "int", "symmetric": true},
            "input_activations": {"num_bits": 8}}}}});
        let e = QuantConfig::from_config(p, &cfg).unwrap_err().to_string();
        assert!(e.contains("input_activations"), "{e}");
        assert_eq!(
            QuantConfig::from_config(p, &serde_json::json!({})).unwrap(),
            None
        );
    }
}
