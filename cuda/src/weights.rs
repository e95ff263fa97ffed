//! Checkpoint weights in the Hugging Face safetensors layout.
//!
//! `model.safetensors`, or shards listed in `model.safetensors.index.json`, memory mapped; a
//! tensor is read by name, its shape checked against what the config implies, and converted
//! from F32/F16/BF16 to f32 (I8/I32/I64 are the packed tensors of quantized checkpoints, F8_E4M3
//! the values of FP8 ones, read by `crate::quant`). A linear layer's matrix comes through [`WeightPrefix::load_matrix`], in
//! whatever format the checkpoint stores it. A progress bar (hidden when stderr is not a
//! terminal) counts the tensors read.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use indicatif::{ProgressBar, ProgressStyle};
use memmap2::Mmap;
use safetensors::{Dtype, SafeTensors};

use crate::quant::{QuantConfig, QuantizeTo, QUANTIZE_GROUP};
use crate::random::RandomInit;
use crate::{files, Error, HostTensor, Result};

/// Storage dtype of a checkpoint tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WeightDtype {
    F32,
    F16,
    BF16,
    /// Integer tensors of quantized checkpoints (packed values, zero points, group indices).
    I8,
    I32,
    I64,
    /// FP8 checkpoints' values (e4m3fn), read only with their scales.
    F8E4M3,
}

impl WeightDtype {
    fn width(self) -> usize {
        match self {
            WeightDtype::F32 | WeightDtype::I32 => 4,
            WeightDtype::F16 | WeightDtype::BF16 => 2,
            WeightDtype::I8 | WeightDtype::F8E4M3 => 1,
            WeightDtype::I64 => 8,
        }
    }
}

struct Entry {
    file: usize,
    dtype: WeightDtype,
    shape: Vec<usize>,
    /// Byte range of the data within the mapped file.
    start: usize,
    end: usize,
}

struct Shard {
    path: PathBuf,
    map: Mmap,
}

/// The files of the checkpoint in `dir`: the shards its index names (each once, sorted), or
/// the single file.
fn shard_names(dir: &Path) -> Result<Vec<String>> {
    let single = dir.join("model.safetensors");
    let index = dir.join("model.safetensors.index.json");
    if index.is_file() {
        let v = files::read_json(&index)?;
        let map = files::require(&index, &v, "weight_map")?;
        let map = map.as_object().ok_or_else(|| Error::BadKey {
            path: index.clone(),
            key: "weight_map".into(),
            problem: "is not an object".into(),
        })?;
        let mut names: Vec<String> = map
            .values()
            .filter_map(|f| f.as_str().map(str::to_string))
            .collect();
        names.sort();
        names.dedup();
        Ok(names)
    } else if single.is_file() {
        Ok(vec!["model.safetensors".into()])
    } else {
        Err(Error::NoWeights {
            dir: dir.to_path_buf(),
        })
    }
}

impl Shard {
    /// Maps the safetensors file at `path` (shard number `file`) and adds its tensors, as its
    /// header lists them, to `entries`.
    fn map(path: PathBuf, file: usize, entries: &mut HashMap<String, Entry>) -> Result<Self> {
        let f = std::fs::File::open(&path).map_err(|source| Error::Io {
            path: path.clone(),
            source,
        })?;
        // SAFETY: the file is opened read-only and the map is never written; a checkpoint
        // modified while being served is outside what we can guard against.
        let map = unsafe { Mmap::map(&f) }.map_err(|source| Error::Io {
            path: path.clone(),
            source,
        })?;
        let bad = |message: String| Error::BadSafetensors {
            path: path.clone(),
            message,
        };
        let (header_len, meta) =
            SafeTensors::read_metadata(&map).map_err(|e| bad(e.to_string()))?;
        let base = 8 + header_len;
        for (tname, info) in meta.tensors() {
            let dtype = match info.dtype {
                Dtype::F32 => WeightDtype::F32,
                Dtype::F16 => WeightDtype::F16,
                Dtype::BF16 => WeightDtype::BF16,
                Dtype::I8 => WeightDtype::I8,
                Dtype::I32 => WeightDtype::I32,
                Dtype::I64 => WeightDtype::I64,
                Dtype::F8_E4M3 => WeightDtype::F8E4M3,
                other => {
                    return Err(Error::UnsupportedDtype {
                        name: tname,
                        dtype: format!("{other:?}"),
                    })
                }
            };
            let (start, end) = (base + info.data_offsets.0, base + info.data_offsets.1);
            if end > map.len() {
                return Err(bad(format!(
                    "tensor `{tname}` extends past the end of the file"
                )));
            }
            entries.insert(
                tname,
                Entry {
                    file,
                    dtype,
                    shape: info.shape.clone(),
                    start,
                    end,
                },
            );
        }
        Ok(Shard { path, map })
    }
}

pub struct Weights {
    dir: PathBuf,
    shards: Vec<Shard>,
    entries: HashMap<String, Entry>,
    progress: ProgressBar,
    /// Set for [`Weights::random`]: every tensor asked for is generated from this seed.
    random_seed: Option<u64>,
    /// The checkpoint's quantization format (`config.json`'s `quantization_config`).
    quant: Option<QuantConfig>,
    /// `--quantize`: what the decoder's f16/bf16 matrices become at load.
    quantize: Option<QuantizeTo>,
    /// `--quantize-lm-head`: an f16/bf16 `lm_head` becomes 8-bit at load.
    quantize_lm_head: bool,
    /// What rounding the matrices to f16 loses (backends that store them so), summed at load.
    audit: std::sync::Mutex<F16Audit>,
}

/// f16's largest finite value and smallest normal one.
const F16_MAX: f32 = 65504.0;
const F16_MIN_NORMAL: f32 = 6.103_515_6e-5;

/// What converting matrices, embedding tables and quantization scales to f16 (the GPU's weight
/// format) loses: values below f16's normal range keep fewer bits (and under 2^-24 become 0).
/// Values past its range would become inf, and are an error, as is an inf or NaN in the
/// checkpoint ([`F16Audit::check`]).
#[derive(Debug, Default, Clone, PartialEq)]
pub struct F16Audit {
    /// Values checked.
    pub values: u64,
    /// Nonzero values below f16's smallest normal, 6.1e-5.
    pub subnormal: u64,
    /// The tensor with the most of them, and how many.
    pub worst: Option<(String, u64)>,
}

impl F16Audit {
    /// Counts `data` (tensor `name`), or an error naming it when a value is not finite or
    /// past f16's range.
    fn check(&mut self, name: &str, data: &[f32]) -> Result<()> {
        use rayon::prelude::*;
        let (bad, subnormal) = data
            .par_iter()
            .map(|&v| {
                let a = v.abs();
                let bad = (!a.is_finite() || a > F16_MAX).then_some(v);
                (bad, (a > 0.0 && a < F16_MIN_NORMAL) as u64)
            })
            .reduce(|| (None, 0), |(b1, s1), (b2, s2)| (b1.or(b2), s1 + s2));
        if let Some(value) = bad {
            return Err(Error::NotF16 {
                name: name.to_string(),
                value,
            });
        }
        self.values += data.len() as u64;
        self.subnormal += subnormal;
        if subnormal > self.worst.as_ref().map_or(0, |w| w.1) {
            self.worst = Some((name.to_string(), subnormal));
        }
        Ok(())
    }
}

impl Weights {
    /// Opens the weights of the checkpoint in `dir`: the single-file layout or a sharded one.
    pub fn open(dir: &Path) -> Result<Self> {
        let mut shards = Vec::new();
        let mut entries = HashMap::new();
        for (file, name) in shard_names(dir)?.iter().enumerate() {
            shards.push(Shard::map(dir.join(name), file, &mut entries)?);
        }
        let mut dtypes: Vec<&str> = entries
            .values()
            .map(|e| match e.dtype {
                WeightDtype::F32 => "f32",
                WeightDtype::F16 => "f16",
                WeightDtype::BF16 => "bf16",
                WeightDtype::I8 => "i8",
                WeightDtype::I32 => "i32",
                WeightDtype::I64 => "i64",
                WeightDtype::F8E4M3 => "f8_e4m3",
            })
            .collect();
        dtypes.sort_unstable();
        dtypes.dedup();
        tracing::info!(dir = %dir.display(), tensors = entries.len(), shards = shards.len(), dtypes = ?dtypes, "opened checkpoint");
        let progress = ProgressBar::new(entries.len() as u64).with_style(
            ProgressStyle::with_template("loading weights {bar:30} {pos}/{len} tensors {elapsed}")
                .expect("valid template"),
        );
        let config = dir.join("config.json");
        let quant = if config.is_file() {
            QuantConfig::from_config(&config, &files::read_json(&config)?)?
        } else {
            None
        };
        if let Some(q) = &quant {
            tracing::info!(format = ?q, "quantized checkpoint");
        }
        Ok(Self {
            dir: dir.to_path_buf(),
            shards,
            entries,
            progress,
            random_seed: None,
            quant,
            quantize: None,
            quantize_lm_head: false,
            audit: Default::default(),
        })
    }

    /// `--quantize`: the decoder's f16/bf16 matrices quantized at load
    /// ([`QuantizeTo::applies_to`] says which). An error for a checkpoint that is quantized
    /// already.
    pub fn quantize(mut self, to: Option<QuantizeTo>) -> Result<Self> {
        if let (Some(to), Some(q)) = (to, &self.quant) {
            return Err(Error::Quantized {
                name: self.dir.join("config.json").display().to_string(),
                problem: format!(
                    "--quantize {to:?} asked of a checkpoint that is quantized already ({q:?})"
                ),
            });
        }
        self.quantize = to;
        Ok(self)
    }

    /// `--quantize-lm-head`: `lm_head` quantized at load to 8 bits (symmetric, a scale per row
    /// and [`QUANTIZE_GROUP`] columns), whatever the rest of the checkpoint is: decoding reads
    /// it every token (1.24 GB of an 8B model's ~4.9 GB a token at 4 bits), as llama.cpp's
    /// quantized GGUFs do theirs. A checkpoint that ties it to the embedding table, stores it
    /// quantized already, or has rows that are not whole groups is refused when the model loads.
    pub fn quantize_lm_head(mut self, on: bool) -> Self {
        self.quantize_lm_head = on;
        self
    }

    /// Whether `--quantize-lm-head` was given.
    pub fn quantizing_lm_head(&self) -> bool {
        self.quantize_lm_head
    }

    /// `--quantize`, if given.
    pub fn quantizing(&self) -> Option<QuantizeTo> {
        self.quantize
    }

    /// The checkpoint's quantization format, if it has one.
    pub fn quant_config(&self) -> Option<&QuantConfig> {
        self.quant.as_ref()
    }

    /// The checkpoint's weights, or with `random_seed` [`Weights::random`] ones of its config.
    pub fn open_or_random(dir: &Path, random_seed: Option<u64>) -> Result<Self> {
        match random_seed {
            Some(seed) => Ok(Self::random(dir, seed)),
            None => Self::open(dir),
        }
    }

    /// Weights that do not come from a file: each tensor is generated when first asked for,
    /// from `seed` and its name (so the same name always gets the same values), with whatever
    /// shape the config implies. For running and measuring the real model sizes without a
    /// checkpoint: norm weights are 1, biases 0, matrices uniform with unit output variance
    /// (see [`RandomInit`]).
    pub fn random(config_dir: &Path, seed: u64) -> Self {
        Self {
            dir: config_dir.to_path_buf(),
            shards: Vec::new(),
            entries: HashMap::new(),
            progress: ProgressBar::hidden(),
            random_seed: Some(seed),
            quant: None,
            quantize: None,
            quantize_lm_head: false,
            audit: Default::default(),
        }
    }

    /// How tensor `name` is generated, when these are random weights.
    pub fn random_init(&self, name: &str, shape: &[usize]) -> Option<RandomInit> {
        self.random_seed
            .map(|seed| RandomInit::for_tensor(seed, name, shape))
    }

    pub fn contains(&self, name: &str) -> bool {
        self.random_seed.is_some() || self.entries.contains_key(name)
    }

    /// Whether these are [`Weights::random`] ones, which answer for every name.
    pub fn is_random(&self) -> bool {
        self.random_seed.is_some()
    }

    /// The entry of tensor `name` with its bytes, checked to hold `shape` of its dtype.
    fn entry(&self, name: &str, shape: &[usize]) -> Result<(&Entry, &[u8])> {
        let e = self.entries.get(name).ok_or_else(|| Error::MissingTensor {
            name: name.to_string(),
            dir: self.dir.clone(),
        })?;
        if e.shape != shape {
            return Err(Error::WeightShape {
                name: name.to_string(),
                expected: shape.to_vec(),
                got: e.shape.clone(),
            });
        }
        let bytes = &self.shards[e.file].map[e.start..e.end];
        let n: usize = shape.iter().product();
        if bytes.len() != n * e.dtype.width() {
            return Err(Error::BadSafetensors {
                path: self.shards[e.file].path.clone(),
                message: format!(
                    "tensor `{name}` holds {} bytes, its shape {shape:?} needs {}",
                    bytes.len(),
                    n * e.dtype.width()
                ),
            });
        }
        Ok((e, bytes))
    }

    /// The stored shape of tensor `name`.
    pub fn shape_of(&self, name: &str) -> Result<Vec<usize>> {
        self.entries
            .get(name)
            .map(|e| e.shape.clone())
            .ok_or_else(|| Error::MissingTensor {
                name: name.to_string(),
                dir: self.dir.clone(),
            })
    }

    /// Reads tensor `name`, which must have exactly `shape`, as f32 (from F32, F16, BF16, and
    /// the integer dtypes, whose values are small whole numbers in quantized checkpoints).
    pub fn get(&self, name: &str, shape: &[usize]) -> Result<HostTensor> {
        if let Some(init) = self.random_init(name, shape) {
            return Ok(init.host(shape));
        }
        let (e, bytes) = self.entry(name, shape)?;
        let data: Vec<f32> = match e.dtype {
            WeightDtype::F32 => bytes
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect(),
            WeightDtype::F16 => bytes
                .chunks_exact(2)
                .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
            WeightDtype::BF16 => bytes
                .chunks_exact(2)
                .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
            WeightDtype::I8 => bytes.iter().map(|&b| b as i8 as f32).collect(),
            WeightDtype::I32 => bytes
                .chunks_exact(4)
                .map(|b| i32::from_le_bytes([b[0], b[1], b[2], b[3]]) as f32)
                .collect(),
            WeightDtype::I64 => bytes
                .chunks_exact(8)
                .map(|b| i64::from_le_bytes(b.try_into().expect("8 bytes")) as f32)
                .collect(),
            // Without its scale an FP8 value means nothing: only `get_fp8` reads them, for a
            // module the quantization config says is FP8.
            WeightDtype::F8E4M3 => {
                return Err(Error::UnsupportedDtype {
                    name: name.to_string(),
                    dtype: "F8_E4M3 without the FP8 quantization_config that gives its scales"
                        .into(),
                })
            }
        };
        self.progress.inc(1);
        HostTensor::new(shape.to_vec(), data)
    }

    /// Reads the i32 tensor `name` of exactly `shape` (packed quantized values, group indices).
    pub fn get_i32(&self, name: &str, shape: &[usize]) -> Result<Vec<i32>> {
        let (e, bytes) = self.entry(name, shape)?;
        if e.dtype != WeightDtype::I32 {
            return Err(Error::UnsupportedDtype {
                name: name.to_string(),
                dtype: format!("{:?} where its format stores I32", e.dtype),
            });
        }
        self.progress.inc(1);
        Ok(bytes
            .chunks_exact(4)
            .map(|b| i32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect())
    }

    /// Reads the i8 tensor `name` of exactly `shape` (compressed-tensors' int-quantized values).
    pub fn get_i8(&self, name: &str, shape: &[usize]) -> Result<Vec<i8>> {
        let (e, bytes) = self.entry(name, shape)?;
        if e.dtype != WeightDtype::I8 {
            return Err(Error::UnsupportedDtype {
                name: name.to_string(),
                dtype: format!("{:?} where its format stores I8", e.dtype),
            });
        }
        self.progress.inc(1);
        Ok(bytes.iter().map(|&b| b as i8).collect())
    }

    /// Reads the F8_E4M3 tensor `name` of exactly `shape` as its bytes (FP8 checkpoints'
    /// values, [`crate::quant::fp8`]); a NaN in it (0x7F, 0xFF: e4m3fn has no infinities) is an
    /// error naming the tensor.
    pub fn get_fp8(&self, name: &str, shape: &[usize]) -> Result<Vec<u8>> {
        let (e, bytes) = self.entry(name, shape)?;
        if e.dtype != WeightDtype::F8E4M3 {
            return Err(Error::UnsupportedDtype {
                name: name.to_string(),
                dtype: format!("{:?} where its format stores F8_E4M3", e.dtype),
            });
        }
        if let Some(at) = bytes
            .iter()
            .position(|&b| crate::quant::fp8::e4m3_is_nan(b))
        {
            return Err(Error::Quantized {
                name: name.to_string(),
                problem: format!(
                    "holds NaN (byte {:#04x}) at index {at}: the checkpoint is damaged",
                    bytes[at]
                ),
            });
        }
        self.progress.inc(1);
        Ok(bytes.to_vec())
    }

    /// Clears the progress bar once a model is built, and logs what f16 conversion lost.
    pub fn finish(&self) {
        self.progress.finish_and_clear();
        let audit = self.f16_audit();
        if audit.subnormal > 0 {
            let (worst, n) = audit.worst.clone().unwrap_or_default();
            tracing::warn!(
                subnormal = audit.subnormal,
                of = audit.values,
                worst_tensor = %worst,
                worst_count = n,
                "weights below f16's normal range (6.1e-5) keep fewer bits on the GPU"
            );
        } else if audit.values > 0 {
            tracing::info!(
                values = audit.values,
                "every weight converts to f16 with full precision"
            );
        }
    }

    /// What f16 conversion of the weights read so far loses ([`F16Audit`]).
    pub fn f16_audit(&self) -> F16Audit {
        self.audit.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Audits `data` (tensor `name`) for a backend that stores weights as f16.
    fn audit<B: crate::Backend>(&self, name: &str, data: &[f32]) -> Result<()> {
        if B::WEIGHT_BYTES != 2 {
            return Ok(());
        }
        self.audit
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .check(name, data)
    }

    /// A view that prefixes every name with `prefix.` (like candle's `VarBuilder::pp`).
    pub fn pp(&self, prefix: &str) -> WeightPrefix<'_> {
        WeightPrefix {
            weights: self,
            prefix: prefix.to_string(),
        }
    }
}

/// The weights under one module path, e.g. `model.visual.blocks.3`.
pub struct WeightPrefix<'a> {
    weights: &'a Weights,
    prefix: String,
}

impl WeightPrefix<'_> {
    fn full(&self, name: &str) -> String {
        if self.prefix.is_empty() {
            name.to_string()
        } else {
            format!("{}.{name}", self.prefix)
        }
    }

    /// A deeper prefix: `pp("blocks").pp(3)`.
    pub fn pp(&self, name: impl std::fmt::Display) -> Self {
        WeightPrefix {
            weights: self.weights,
            prefix: self.full(&name.to_string()),
        }
    }

    pub fn contains(&self, name: &str) -> bool {
        self.weights.contains(&self.full(name))
    }

    /// The full name of `prefix.name`, for errors.
    pub fn name(&self, name: &str) -> String {
        self.full(name)
    }

    /// The stored shape of `prefix.name`.
    pub fn shape_of(&self, name: &str) -> Result<Vec<usize>> {
        self.weights.shape_of(&self.full(name))
    }

    /// Reads the i32 tensor `prefix.name` of exactly `shape`.
    pub fn get_i32(&self, name: &str, shape: &[usize]) -> Result<Vec<i32>> {
        self.weights.get_i32(&self.full(name), shape)
    }

    /// Reads the i8 tensor `prefix.name` of exactly `shape`.
    pub fn get_i8(&self, name: &str, shape: &[usize]) -> Result<Vec<i8>> {
        self.weights.get_i8(&self.full(name), shape)
    }

    /// Reads the F8_E4M3 tensor `prefix.name` of exactly `shape`, as its bytes.
    pub fn get_fp8(&self, name: &str, shape: &[usize]) -> Result<Vec<u8>> {
        self.weights.get_fp8(&self.full(name), shape)
    }

    /// The matrix `[out, inp]` of the linear layer under this prefix, in whatever format the
    /// checkpoint stores it (f16/bf16/f32 `weight`, or a quantized format's tensors), or
    /// quantized at load under `--quantize`: what `nn::Linear` is built from.
    pub fn load_matrix<B: crate::Backend>(
        &self,
        backend: &B,
        out: usize,
        inp: usize,
    ) -> Result<B::Weight> {
        let lm_head = self.weights.quantize_lm_head && self.prefix == "lm_head";
        if let Some(q) = self.weights.quant.as_ref().filter(|q| q.holds(self)) {
            if lm_head {
                return Err(Error::Quantized {
                    name: self.full("weight"),
                    problem: format!(
                        "--quantize-lm-head asked of an lm_head the checkpoint stores quantized \
                         already ({q:?})"
                    ),
                });
            }
            let m = q.read(self, out, inp)?;
            return self.upload_quantized(backend, m);
        }
        if lm_head && inp % QUANTIZE_GROUP != 0 {
            return Err(Error::Quantized {
                name: self.full("weight"),
                problem: format!(
                    "--quantize-lm-head needs rows of whole groups of {QUANTIZE_GROUP}; \
                     lm_head's rows have {inp} values"
                ),
            });
        }
        let to = match self.weights.quantize {
            Some(to) if to.applies_to(&self.prefix, inp) => Some(to),
            _ => lm_head.then_some(QuantizeTo::Int8),
        };
        match to {
            Some(to) => {
                let full = self.full("weight");
                match self.weights.random_init(&full, &[out, inp]) {
                    // FP8 quantizes the random f32 values on the host (below).
                    Some(RandomInit::Uniform { key, bound }) if to != QuantizeTo::Fp8 => {
                        backend.random_int_weight(&[out, inp], key, bound, to)
                    }
                    _ => {
                        let m = to.quantize(&self.weights.get(&full, &[out, inp])?);
                        self.upload_quantized(backend, m)
                    }
                }
            }
            _ => self.load_weight(backend, "weight", &[out, inp]),
        }
    }

    /// Uploads a quantized matrix, auditing what a backend that stores f16 keeps of it: the
    /// integer formats' scales, or the FP8 matrix's values (which batches and prefill read
    /// dequantized to f16, and a matrix the FP8 kernels cannot take is stored as).
    fn upload_quantized<B: crate::Backend>(
        &self,
        backend: &B,
        m: crate::quant::QuantMatrix,
    ) -> Result<B::Weight> {
        use crate::quant::QuantMatrix;
        if B::WEIGHT_BYTES == 2 {
            match &m {
                QuantMatrix::Int(_) => self.weights.audit::<B>(&self.full("scales"), m.scales())?,
                QuantMatrix::Fp8(f) => self
                    .weights
                    .audit::<B>(&self.full("weight"), f.dequantize().data())?,
            }
        }
        backend.upload_quantized(&m)
    }

    /// Reads `prefix.name` with exactly `shape`, as f32 on the host.
    pub fn get(&self, name: &str, shape: &[usize]) -> Result<HostTensor> {
        self.weights.get(&self.full(name), shape)
    }

    /// Reads `prefix.name` with exactly `shape` and uploads it to `backend`; random matrices
    /// are generated by the backend itself (on the GPU for CUDA).
    pub fn load<B: crate::Backend>(
        &self,
        backend: &B,
        name: &str,
        shape: &[usize],
    ) -> Result<B::Tensor> {
        let full = self.full(name);
        match self.weights.random_init(&full, shape) {
            Some(RandomInit::Uniform { key, bound }) => backend.random_uniform(shape, key, bound),
            _ => backend.upload(&self.weights.get(&full, shape)?),
        }
    }

    /// As [`WeightPrefix::load`], for a matrix of `linear` or an embedding table, stored in the
    /// backend's weight format.
    pub fn load_weight<B: crate::Backend>(
        &self,
        backend: &B,
        name: &str,
        shape: &[usize],
    ) -> Result<B::Weight> {
        let full = self.full(name);
        match self.weights.random_init(&full, shape) {
            Some(RandomInit::Uniform { key, bound }) => backend.random_weight(shape, key, bound),
            _ => {
                let t = self.weights.get(&full, shape)?;
                self.weights.audit::<B>(&full, t.data())?;
                backend.upload_weight(&t)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use safetensors::tensor::TensorView;

    fn write(dir: &Path, file: &str, tensors: &[(&str, Dtype, Vec<usize>, Vec<u8>)]) {
        let views: Vec<(String, TensorView)> = tensors
            .iter()
            .map(|(n, d, s, b)| (n.to_string(), TensorView::new(*d, s.clone(), b).unwrap()))
            .collect();
        safetensors::serialize_to_file(views, None, &dir.join(file)).unwrap();
    }

    fn tmpdir(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("vlm-weights-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn reads_f32_f16_bf16_and_checks_shapes() {
        let dir = tmpdir("dtypes");
        let vals = [1.5f32, -2.0, 0.25];
        let f32b: Vec<u8> = vals.iter().flat_map(|v| v.to_le_bytes()).collect();
        let f16b: Vec<u8> = vals
            .iter()
            .flat_map(|v| half::f16::from_f32(*v).to_le_bytes())
            .collect();
        let bf16b: Vec<u8> = vals
            .iter()
            .flat_map(|v| half::bf16::from_f32(*v).to_le_bytes())
            .collect();
        write(
            &dir,
            "model.safetensors",
            &[
                ("a", Dtype::F32, vec![3], f32b),
                ("b", Dtype::F16, vec![1, 3], f16b),
                ("c", Dtype::BF16, vec![3, 1], bf16b),
                ("i", Dtype::F64, vec![1], vec![0; 8]),
            ],
        );
        let err = Weights::open(&dir).err().unwrap();
        assert!(
            matches!(err, Error::UnsupportedDtype { ref name, .. } if name == "i"),
            "{err}"
        );

        std::fs::remove_file(dir.join("model.safetensors")).unwrap();
        let f32b: Vec<u8> = vals.iter().flat_map(|v| v.to_le_bytes()).collect();
        let f16b: Vec<u8> = vals
            .iter()
            .flat_map(|v| half::f16::from_f32(*v).to_le_bytes())
            .collect();
        let bf16b: Vec<u8> = vals
            .iter()
            .flat_map(|v| half::bf16::from_f32(*v).to_le_bytes())
            .collect();
        write(
            &dir,
            "model.safetensors",
            &[
                ("a", Dtype::F32, vec![3], f32b),
                ("b", Dtype::F16, vec![1, 3], f16b),
                ("c", Dtype::BF16, vec![3, 1], bf16b),
            ],
        );
        let w = Weights::open(&dir).unwrap();
        assert_eq!(w.get("a", &[3]).unwrap().data(), &vals);
        assert_eq!(w.get("b", &[1, 3]).unwrap().data(), &vals);
        assert_eq!(w.get("c", &[3, 1]).unwrap().data(), &vals);
        let err = w.get("a", &[4]).unwrap_err();
        assert!(matches!(err, Error::WeightShape { .. }), "{err}");
        let err = w.get("nope", &[1]).unwrap_err();
        assert!(err.to_string().contains("`nope`"), "{err}");
    }

    #[test]
    fn f16_conversion_is_audited() {
        let mut a = F16Audit::default();
        a.check("w", &[0.5, 1e-6, -3e-5, 0.0, 65504.0]).unwrap();
        a.check("v", &[1e-7, 2.0]).unwrap();
        assert_eq!((a.values, a.subnormal), (7, 3));
        assert_eq!(a.worst, Some(("w".to_string(), 2)));
        for bad in [f32::INFINITY, f32::NAN, 70000.0, -1e9] {
            let e = a.check("x.weight", &[1.0, bad]).unwrap_err().to_string();
            assert!(e.contains("`x.weight`") && e.contains("f16"), "{e}");
        }
        assert_eq!(a.values, 7, "a refused tensor is not counted");
    }

    #[test]
    fn sharded_checkpoints_follow_the_index() {
        let dir = tmpdir("sharded");
        let one = 1.0f32.to_le_bytes().to_vec();
        let two = 2.0f32.to_le_bytes().to_vec();
        write(
            &dir,
            "model-00001-of-00002.safetensors",
            &[("x", Dtype::F32, vec![1], one)],
        );
        write(
            &dir,
            "model-00002-of-00002.safetensors",
            &[("y", Dtype::F32, vec![1], two)],
        );
        std::fs::write(
            dir.join("model.safetensors.index.json"),
            r#"{"weight_map": {"x": "model-00001-of-00002.safetensors", "y": "model-00002-of-00002.safetensors"}}"#,
        )
        .unwrap();
        let w = Weights::open(&dir).unwrap();
        assert_eq!(w.get("y", &[1]).unwrap().data(), &[2.0]);
        assert_eq!(w.get("x", &[1]).unwrap().data(), &[1.0]);
    }

    #[test]
    fn random_weights_are_deterministic_per_name_and_shaped_by_the_caller() {
        let w = Weights::random(Path::new("."), 7);
        let a = w.get("layers.0.mlp.up_proj.weight", &[3, 1 << 20]).unwrap();
        assert_eq!(
            a,
            w.get("layers.0.mlp.up_proj.weight", &[3, 1 << 20]).unwrap()
        );
        assert_ne!(
            a,
            w.get("layers.1.mlp.up_proj.weight", &[3, 1 << 20]).unwrap()
        );
        let bound = (3.0f32 / (1 << 20) as f32).sqrt();
        assert!(a.data().iter().all(|v| v.abs() <= bound));
        assert!(w
            .get("input_layernorm.weight", &[4])
            .unwrap()
            .data()
            .iter()
            .all(|&v| v == 1.0));
        assert!(w
            .get("qkv.bias", &[4])
            .unwrap()
            .data()
            .iter()
            .all(|&v| v == 0.0));
        assert!(w.contains("lm_head.weight"));
    }

    #[test]
    fn truncated_files_and_empty_dirs_are_reported() {
        let dir = tmpdir("bad");
        assert!(matches!(
            Weights::open(&dir).err().unwrap(),
            Error::NoWeights { .. }
        ));
        std::fs::write(
            dir.join("model.safetensors"),
            b"\x10\x00\x00\x00\x00\x00\x00\x00{\"a\":",
        )
        .unwrap();
        let err = Weights::open(&dir).err().unwrap();
        assert!(matches!(err, Error::BadSafetensors { .. }), "{err}");
    }
}
