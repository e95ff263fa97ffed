//! The CPU reference backend: every op of [`Backend`] in plain f32, parallel over rows with
//! rayon, GEMMs through `matrixmultiply` (multi-threaded). This is the twin each CUDA kernel is
//! tested against and the path CI runs, so it favours obvious correctness over speed.

use rayon::prelude::*;

use crate::backend::{AttnMask, Backend, GeluKind, PagedBatch, QkvToCache, SampleIo};
use crate::kv::{CpuCache, KvData};
use crate::{Error, HostTensor, KvFormat, Result};

/// Rows per rayon task for cheap elementwise/row ops: below this, threading costs more than it saves.
const MIN_ROWS_PER_TASK: usize = 16;

#[derive(Clone, Copy, Debug, Default)]
pub struct CpuBackend;

impl CpuBackend {
    pub fn new() -> Self {
        Self
    }
}

fn check_same(op: &'static str, a: &HostTensor, b: &HostTensor) -> Result<()> {
    if a.shape() != b.shape() {
        return Err(Error::shape(
            op,
            format!("shapes differ: {:?} vs {:?}", a.shape(), b.shape()),
        ));
    }
    Ok(())
}

fn check_width(op: &'static str, x: &HostTensor, w: &HostTensor) -> Result<()> {
    if w.len() != x.cols() {
        return Err(Error::shape(
            op,
            format!(
                "weight has {} elements, rows of {:?} have {}",
                w.len(),
                x.shape(),
                x.cols()
            ),
        ));
    }
    Ok(())
}

/// Applies `f` to every row of `x` (matrix view), in parallel, into a tensor of the same shape.
fn map_rows(x: &HostTensor, f: impl Fn(&[f32], &mut [f32]) + Sync) -> HostTensor {
    let c = x.cols().max(1);
    let mut out = HostTensor::zeros(x.shape().to_vec());
    out.data_mut()
        .par_chunks_mut(c)
        .with_min_len(MIN_ROWS_PER_TASK)
        .zip(x.data().par_chunks(c))
        .for_each(|(o, r)| f(r, o));
    out
}

fn map_elems(x: &HostTensor, f: impl Fn(f32) -> f32 + Sync) -> HostTensor {
    map_rows(x, |r, o| {
        for (o, &v) in o.iter_mut().zip(r) {
            *o = f(v);
        }
    })
}

fn gelu_tanh(x: f32) -> f32 {
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    0.5 * x * (1.0 + (SQRT_2_OVER_PI * (x + 0.044_715 * x * x * x)).tanh())
}

fn gelu_erf(x: f32) -> f32 {
    0.5 * x * (1.0 + libm::erff(x * std::f32::consts::FRAC_1_SQRT_2))
}

/// A token id, row or cache slot: must be below `limit`.
fn index_value(op: &'static str, v: u32, limit: usize) -> Result<usize> {
    if (v as usize) < limit {
        Ok(v as usize)
    } else {
        Err(Error::shape(op, format!("index {v} is outside 0..{limit}")))
    }
}

/// Rows here are slots of the first dimension (a KV cache `[slots, heads, d]` is written with
/// `[n, heads * d]` rows): checks that `src` holds `rows.len()` such slots and that every row
/// index is in range, and returns the slot width.
fn check_rows(
    op: &'static str,
    dst: &HostTensor,
    rows: &[usize],
    src: &HostTensor,
) -> Result<usize> {
    let slots = dst.shape().first().copied().unwrap_or(0);
    let width = dst.len().checked_div(slots).unwrap_or(0);
    if src.len() != rows.len() * width {
        return Err(Error::shape(
            op,
            format!(
                "{} rows of width {width} into {:?}, source is {:?}",
                rows.len(),
                dst.shape(),
                src.shape()
            ),
        ));
    }
    if let Some(&bad) = rows.iter().find(|&&r| r >= slots) {
        return Err(Error::shape(
            op,
            format!("row {bad} out of range for {:?}", dst.shape()),
        ));
    }
    Ok(width)
}

/// One KV head's rows in a cache `[slots, heads, d]` (keys and values alike).
struct KvRows<'a> {
    k: KvData<'a>,
    v: KvData<'a>,
    heads: usize,
    head: usize,
    d: usize,
}

/// `out = softmax(q · K[keys]ᵀ · scale) · V[keys]` for one query and head, keys in order:
/// the one attention loop of `attention` and `paged_attention`, so both sum alike.
fn attend(
    q: &[f32],
    keys: impl Iterator<Item = usize> + Clone,
    kv: &KvRows,
    scale: f32,
    scores: &mut Vec<f32>,
    out: &mut [f32],
) {
    let row = |slot: usize| (slot * kv.heads + kv.head) * kv.d;
    scores.clear();
    let mut max = f32::NEG_INFINITY;
    for slot in keys.clone() {
        let s = kv.k.dot(row(slot), q) * scale;
        max = max.max(s);
        scores.push(s);
    }
    let mut denom = 0.0;
    for s in scores.iter_mut() {
        *s = (*s - max).exp();
        denom += *s;
    }
    out.fill(0.0);
    for (slot, p) in keys.zip(scores.iter()) {
        kv.v.add_scaled(row(slot), p / denom, out);
    }
}

impl Backend for CpuBackend {
    type Tensor = HostTensor;
    type Weight = HostTensor;
    type Graph = ();
    type Ids = Vec<u32>;
    type Cache = CpuCache;
    const WEIGHT_BYTES: usize = 4;
    const CACHE_BYTES: usize = 4;

    fn name(&self) -> &'static str {
        "cpu"
    }

    fn upload(&self, t: &HostTensor) -> Result<HostTensor> {
        Ok(t.clone())
    }

    fn weight_bytes(&self, w: &HostTensor) -> usize {
        w.len() * std::mem::size_of::<f32>()
    }

    fn upload_weight(&self, t: &HostTensor) -> Result<HostTensor> {
        Ok(t.clone())
    }

    fn copy(&self, dst: &mut HostTensor, src: &HostTensor) -> Result<()> {
        self.write(dst, src.data())
    }

    fn upload_ids(&self, values: &[u32]) -> Result<Vec<u32>> {
        Ok(values.to_vec())
    }

    fn write_ids_at(&self, dst: &mut Vec<u32>, at: usize, values: &[u32]) -> Result<()> {
        if at + values.len() > dst.len() {
            return Err(Error::shape(
                "write_ids",
                format!(
                    "{} ids at {at} into a buffer of {}",
                    values.len(),
                    dst.len()
                ),
            ));
        }
        dst[at..at + values.len()].copy_from_slice(values);
        Ok(())
    }

    fn download_ids(&self, ids: &Vec<u32>, n: usize) -> Result<Vec<u32>> {
        ids.get(..n).map(<[u32]>::to_vec).ok_or_else(|| {
            Error::shape(
                "download_ids",
                format!("{n} ids from a buffer of {}", ids.len()),
            )
        })
    }

    fn zeros_cache(
        &self,
        slots: usize,
        heads: usize,
        dim: usize,
        format: KvFormat,
    ) -> Result<CpuCache> {
        CpuCache::zeros(slots, heads, dim, format)
    }

    /// Every format on any shape: FP8 is stored as bytes and read back through
    /// [`crate::kv::fp8_load`].
    fn check_kv_format(&self, format: KvFormat, _heads: usize, _dim: usize) -> Result<()> {
        format.check().map(|_| ())
    }

    fn download_cache(&self, cache: &CpuCache) -> Result<HostTensor> {
        Ok(cache.to_host())
    }

    fn sample_rows(&self, logits: &HostTensor, io: SampleIo<'_, Self>) -> Result<()> {
        use crate::sampling::{
            mask_words, sample_masked_row, RowParams, LOGPROB_COLS, MAX_TOP_LOGPROBS, NO_SLOT,
        };
        let (rows, vocab) = (logits.rows(), logits.cols());
        let words = crate::sampling::SAMPLE_WORDS;
        let mask_len = mask_words(vocab);
        if io.params.len() < rows * words
            || io.masks.len() < rows * mask_len
            || io.picks.len() < rows
            || io.logprobs.len() < rows * LOGPROB_COLS
            || io.top_ids.len() < rows * MAX_TOP_LOGPROBS
        {
            return Err(Error::shape(
                "sample_rows",
                format!("{rows} rows of {:?} into buffers too small", logits.shape()),
            ));
        }
        let out = io.logprobs.data_mut();
        for r in 0..rows {
            let p = RowParams::from_words(&io.params[r * words..(r + 1) * words]);
            let bias_at = 2 * p.bias_start as usize..2 * (p.bias_start + p.bias_len) as usize;
            let bias: Vec<(u32, f32)> = io
                .bias
                .get(bias_at)
                .ok_or_else(|| Error::shape("sample_rows", format!("row {r}: bias range")))?
                .chunks(2)
                .map(|w| (w[0], f32::from_bits(w[1])))
                .collect();
            if bias.iter().any(|&(t, _)| t as usize >= vocab) {
                return Err(Error::shape("sample_rows", format!("row {r}: bias token")));
            }
            let counts = if p.slot == NO_SLOT {
                None
            } else {
                let at = p.slot as usize * vocab;
                Some(io.counts.get_mut(at..at + vocab).ok_or_else(|| {
                    Error::shape("sample_rows", format!("row {r}: count slot {}", p.slot))
                })?)
            };
            let mask = p
                .masked
                .then(|| &io.masks[r * mask_len..(r + 1) * mask_len]);
            let pick = sample_masked_row(logits.row(r), &p, &bias, mask, counts);
            io.picks[r] = pick.token;
            let row = &mut out[r * LOGPROB_COLS..(r + 1) * LOGPROB_COLS];
            row[0] = pick.logprob;
            for (i, &(id, lp)) in pick.top.iter().enumerate() {
                row[1 + i] = lp;
                io.top_ids[r * MAX_TOP_LOGPROBS + i] = id;
            }
        }
        Ok(())
    }

    fn replay(&self, _: &()) -> Result<()> {
        // Nothing is ever recorded on the CPU (`record` returns None).
        Ok(())
    }

    fn download(&self, t: &HostTensor) -> Result<HostTensor> {
        Ok(t.clone())
    }

    fn zeros(&self, shape: &[usize]) -> Result<HostTensor> {
        Ok(HostTensor::zeros(shape.to_vec()))
    }

    fn shape<'a>(&self, t: &'a HostTensor) -> &'a [usize] {
        t.shape()
    }

    fn reshape(&self, t: HostTensor, shape: &[usize]) -> Result<HostTensor> {
        t.reshape(shape.to_vec())
    }

    fn linear(&self, x: &HostTensor, w: &HostTensor, b: Option<&HostTensor>) -> Result<HostTensor> {
        let (n, k) = (x.rows(), x.cols());
        let [m, wk] = w.shape() else {
            return Err(Error::shape(
                "linear",
                format!("weight must be 2-D, got {:?}", w.shape()),
            ));
        };
        let m = *m;
        if *wk != k {
            return Err(Error::shape(
                "linear",
                format!("input {:?} against weight {:?}", x.shape(), w.shape()),
            ));
        }
        let mut out = HostTensor::zeros(vec![n, m]);
        if let Some(b) = b {
            if b.len() != m {
                return Err(Error::shape(
                    "linear",
                    format!("bias {:?} for {m} outputs", b.shape()),
                ));
            }
            for row in out.data_mut().chunks_mut(m) {
                row.copy_from_slice(b.data());
            }
        }
        if n == 0 || m == 0 || k == 0 {
            return Ok(out);
        }
        let beta = if b.is_some() { 1.0 } else { 0.0 };
        // SAFETY: the pointers cover n*k, m*k and n*m f32s with the strides given: x is [n, k]
        // row-major, w is [m, k] row-major read as its transpose [k, m] (row stride 1, column
        // stride k), out is [n, m] row-major. The three buffers do not overlap.
        unsafe {
            matrixmultiply::sgemm(
                n,
                k,
                m,
                1.0,
                x.data().as_ptr(),
                k as isize,
                1,
                w.data().as_ptr(),
                1,
                k as isize,
                beta,
                out.data_mut().as_mut_ptr(),
                m as isize,
                1,
            );
        }
        out.reshape(
            x.shape()[..x.shape().len() - 1]
                .iter()
                .copied()
                .chain([m])
                .collect::<Vec<_>>(),
        )
    }

    fn add(&self, a: &HostTensor, b: &HostTensor) -> Result<HostTensor> {
        check_same("add", a, b)?;
        let data = a.data().iter().zip(b.data()).map(|(x, y)| x + y).collect();
        HostTensor::new(a.shape().to_vec(), data)
    }

    fn layer_norm(
        &self,
        x: &HostTensor,
        w: &HostTensor,
        b: &HostTensor,
        eps: f32,
    ) -> Result<HostTensor> {
        check_width("layer_norm", x, w)?;
        check_width("layer_norm", x, b)?;
        let (w, b) = (w.data(), b.data());
        Ok(map_rows(x, |r, o| {
            let n = r.len() as f32;
            let mean = r.iter().sum::<f32>() / n;
            let var = r.iter().map(|v| (v - mean) * (v - mean)).sum::<f32>() / n;
            let inv = 1.0 / (var + eps).sqrt();
            for i in 0..r.len() {
                o[i] = (r[i] - mean) * inv * w[i] + b[i];
            }
        }))
    }

    fn rms_norm(&self, x: &HostTensor, w: &HostTensor, eps: f32) -> Result<HostTensor> {
        check_width("rms_norm", x, w)?;
        let w = w.data();
        Ok(map_rows(x, |r, o| {
            let ms = r.iter().map(|v| v * v).sum::<f32>() / r.len() as f32;
            let inv = 1.0 / (ms + eps).sqrt();
            for i in 0..r.len() {
                o[i] = w[i] * (r[i] * inv);
            }
        }))
    }

    fn gelu(&self, x: &HostTensor, kind: GeluKind) -> Result<HostTensor> {
        Ok(match kind {
            GeluKind::Tanh => map_elems(x, gelu_tanh),
            GeluKind::Erf => map_elems(x, gelu_erf),
        })
    }

    fn silu_mul(&self, gate: &HostTensor, up: &HostTensor) -> Result<HostTensor> {
        check_same("silu_mul", gate, up)?;
        let data = gate
            .data()
            .par_iter()
            .zip(up.data())
            .map(|(&g, &u)| g / (1.0 + (-g).exp()) * u)
            .collect();
        HostTensor::new(gate.shape().to_vec(), data)
    }

    fn swiglu(&self, x: &HostTensor, gate_up: &HostTensor) -> Result<HostTensor> {
        let m2 = gate_up.shape().first().copied().unwrap_or(0);
        if gate_up.shape().len() != 2 || m2 % 2 != 0 {
            return Err(Error::shape(
                "swiglu",
                format!("gate_up must be [2m, k], got {:?}", gate_up.shape()),
            ));
        }
        let y = self.linear(x, gate_up, None)?;
        let m = m2 / 2;
        let mut out = HostTensor::zeros(vec![y.rows(), m]);
        out.data_mut()
            .par_chunks_mut(m.max(1))
            .zip(y.data().par_chunks(m2.max(1)))
            .for_each(|(o, r)| {
                let (gate, up) = r.split_at(m);
                for ((o, &g), &u) in o.iter_mut().zip(gate).zip(up) {
                    *o = g / (1.0 + (-g).exp()) * u;
                }
            });
        Ok(out)
    }

    fn stack_weights(&self, parts: &[&HostTensor]) -> Result<HostTensor> {
        let owned: Vec<HostTensor> = parts.iter().map(|&p| p.clone()).collect();
        HostTensor::concat_rows(&owned)
    }

    fn qkv_to_cache(
        &self,
        qkv: &HostTensor,
        how: &QkvToCache<Self>,
        k_cache: &mut CpuCache,
        v_cache: &mut CpuCache,
    ) -> Result<HostTensor> {
        let [_, hkv, d] = k_cache.shape();
        let hq = how.q_heads;
        let n = qkv.rows();
        if qkv.cols() != (hq + 2 * hkv) * d
            || how.slots.len() != n
            || v_cache.shape() != k_cache.shape()
        {
            return Err(Error::shape(
                "qkv_to_cache",
                format!(
                    "qkv {:?} for {hq} + 2 x {hkv} heads of {d}, {} slots, caches {:?} and {:?}",
                    qkv.shape(),
                    how.slots.len(),
                    k_cache.shape(),
                    v_cache.shape()
                ),
            ));
        }
        // Split the columns, then the same steps as the unfused model: norm, rotate, write.
        let cols = |from: usize, heads: usize| -> Result<HostTensor> {
            let mut data = Vec::with_capacity(n * heads * d);
            for r in 0..n {
                data.extend_from_slice(&qkv.row(r)[from * d..(from + heads) * d]);
            }
            HostTensor::new(vec![n, heads, d], data)
        };
        let normed_rotated = |x: HostTensor, w: Option<(&HostTensor, f32)>| match w {
            Some((w, eps)) => self.rope(&self.rms_norm(&x, w, eps)?, how.cos, how.sin),
            None => self.rope(&x, how.cos, how.sin),
        };
        let norm = how.qk_norm.as_ref();
        let q = normed_rotated(cols(0, hq)?, norm.map(|n| (n.q, n.eps)))?;
        let k = normed_rotated(cols(hq, hkv)?, norm.map(|n| (n.k, n.eps)))?;
        self.write_kv(k_cache, how.slots, &k)?;
        self.write_kv(v_cache, how.slots, &cols(hq + hkv, hkv)?)?;
        Ok(q)
    }

    fn rope(&self, x: &HostTensor, cos: &HostTensor, sin: &HostTensor) -> Result<HostTensor> {
        let [n, h, d] = *x.shape() else {
            return Err(Error::shape(
                "rope",
                format!("x must be [tokens, heads, head_dim], got {:?}", x.shape()),
            ));
        };
        if cos.shape() != [n, d] || sin.shape() != [n, d] || d % 2 != 0 {
            return Err(Error::shape(
                "rope",
                format!(
                    "x {:?} with cos {:?}, sin {:?}",
                    x.shape(),
                    cos.shape(),
                    sin.shape()
                ),
            ));
        }
        let half = d / 2;
        let mut out = HostTensor::zeros(vec![n, h, d]);
        out.data_mut()
            .par_chunks_mut(h * d)
            .zip(x.data().par_chunks(h * d))
            .enumerate()
            .for_each(|(t, (o, xt))| {
                let (c, s) = (cos.row(t), sin.row(t));
                for (oh, xh) in o.chunks_mut(d).zip(xt.chunks(d)) {
                    for i in 0..half {
                        oh[i] = xh[i] * c[i] - xh[i + half] * s[i];
                        oh[i + half] = xh[i + half] * c[i + half] + xh[i] * s[i + half];
                    }
                }
            });
        Ok(out)
    }

    fn attention(
        &self,
        q: &HostTensor,
        k: &HostTensor,
        v: &HostTensor,
        kv_len: usize,
        mask: AttnMask,
    ) -> Result<HostTensor> {
        let [nq, hq, d] = *q.shape() else {
            return Err(Error::shape(
                "attention",
                format!("q must be 3-D, got {:?}", q.shape()),
            ));
        };
        let [slots, hkv, dk] = *k.shape() else {
            return Err(Error::shape(
                "attention",
                format!("k must be 3-D, got {:?}", k.shape()),
            ));
        };
        if v.shape() != k.shape() || dk != d || hkv == 0 || hq % hkv != 0 || kv_len > slots {
            return Err(Error::shape(
                "attention",
                format!(
                    "q {:?}, k {:?}, v {:?}, kv_len {kv_len}",
                    q.shape(),
                    k.shape(),
                    v.shape()
                ),
            ));
        }
        if let AttnMask::Causal { first_query_slot } = mask {
            if first_query_slot + nq > kv_len {
                return Err(Error::shape(
                    "attention",
                    format!("{nq} queries from slot {first_query_slot} beyond kv_len {kv_len}"),
                ));
            }
        }
        let group = hq / hkv;
        let scale = 1.0 / (d as f32).sqrt();
        let (kd, vd) = (KvData::F32(k.data()), KvData::F32(v.data()));
        let mut out = HostTensor::zeros(vec![nq, hq * d]);
        // One task per (query, head): each writes its own d-wide slice of the output.
        out.data_mut().par_chunks_mut(d).enumerate().for_each_init(
            Vec::new,
            |scores: &mut Vec<f32>, (task, o)| {
                let (i, h) = (task / hq, task % hq);
                let kvh = h / group;
                let visible = match mask {
                    AttnMask::Full => kv_len,
                    AttnMask::Causal { first_query_slot } => first_query_slot + i + 1,
                };
                let qv = &q.data()[(i * hq + h) * d..][..d];
                let kv = KvRows {
                    k: kd,
                    v: vd,
                    heads: hkv,
                    head: kvh,
                    d,
                };
                attend(qv, 0..visible, &kv, scale, scores, o);
            },
        );
        Ok(out)
    }

    fn embedding(&self, table: &HostTensor, ids: &Vec<u32>) -> Result<HostTensor> {
        let (vocab, h) = (table.rows(), table.cols());
        let mut data = Vec::with_capacity(ids.len() * h);
        for &id in ids {
            data.extend_from_slice(table.row(index_value("embedding", id, vocab)?));
        }
        HostTensor::new(vec![ids.len(), h], data)
    }

    fn gather_rows(&self, x: &HostTensor, rows: &Vec<u32>) -> Result<HostTensor> {
        let (n, c) = (x.rows(), x.cols());
        let mut data = Vec::with_capacity(rows.len() * c);
        for &r in rows {
            data.extend_from_slice(x.row(index_value("gather_rows", r, n)?));
        }
        HostTensor::new(vec![rows.len(), c], data)
    }

    fn weighted_gather(
        &self,
        table: &HostTensor,
        index: &[u32],
        weights: &[f32],
        taps: usize,
    ) -> Result<HostTensor> {
        if taps == 0 || index.len() != weights.len() || index.len() % taps != 0 {
            return Err(Error::shape(
                "weighted_gather",
                format!(
                    "{} indices, {} weights, {taps} taps",
                    index.len(),
                    weights.len()
                ),
            ));
        }
        if let Some(&bad) = index.iter().find(|&&i| i as usize >= table.rows()) {
            return Err(Error::shape(
                "weighted_gather",
                format!("index {bad} outside a table of {} rows", table.rows()),
            ));
        }
        let n = index.len() / taps;
        let h = table.cols();
        let mut out = HostTensor::zeros(vec![n, h]);
        out.data_mut()
            .par_chunks_mut(h)
            .enumerate()
            .for_each(|(i, o)| {
                for t in 0..taps {
                    let w = weights[i * taps + t];
                    for (o, x) in o.iter_mut().zip(table.row(index[i * taps + t] as usize)) {
                        *o += w * x;
                    }
                }
            });
        Ok(out)
    }

    fn slice_rows(&self, x: &HostTensor, start: usize, end: usize) -> Result<HostTensor> {
        x.slice_rows(start, end)
    }

    fn write(&self, dst: &mut HostTensor, values: &[f32]) -> Result<()> {
        if values.len() != dst.len() {
            return Err(Error::shape(
                "write",
                format!("{} values into {:?}", values.len(), dst.shape()),
            ));
        }
        dst.data_mut().copy_from_slice(values);
        Ok(())
    }

    fn write_kv(&self, cache: &mut CpuCache, slots: &Vec<u32>, rows: &HostTensor) -> Result<()> {
        let [limit, heads, dim] = cache.shape();
        let width = heads * dim;
        if rows.len() != slots.len() * width {
            return Err(Error::shape(
                "write_kv",
                format!(
                    "{} rows {:?} into a cache of {:?}",
                    slots.len(),
                    rows.shape(),
                    cache.shape()
                ),
            ));
        }
        let rows_at = slots
            .iter()
            .map(|&s| index_value("write_kv", s, limit))
            .collect::<Result<Vec<_>>>()?;
        for (i, slot) in rows_at.into_iter().enumerate() {
            cache.set_slot(slot, &rows.data()[i * width..(i + 1) * width]);
        }
        Ok(())
    }

    fn paged_attention(
        &self,
        q: &HostTensor,
        k: &CpuCache,
        v: &CpuCache,
        batch: &PagedBatch<Self>,
    ) -> Result<HostTensor> {
        let [rows, hq, d] = *q.shape() else {
            return Err(Error::shape(
                "paged_attention",
                format!("q must be [rows, heads, d], got {:?}", q.shape()),
            ));
        };
        let [slots, hkv, dk] = k.shape();
        let bs = batch.block_size;
        if v.shape() != k.shape() || dk != d || hkv == 0 || hq % hkv != 0 || bs == 0 {
            return Err(Error::shape(
                "paged_attention",
                format!(
                    "q {:?}, k {:?}, v {:?}, block size {bs}",
                    q.shape(),
                    k.shape(),
                    v.shape()
                ),
            ));
        }
        // Each query row's key slots (its sequence's) and how many it sees, checked up front.
        let mut per_row: Vec<Option<std::sync::Arc<Vec<usize>>>> = vec![None; rows];
        let mut visible = vec![0usize; rows];
        let meta = batch.seqs;
        if meta.len() < batch.num_seqs * 4 {
            return Err(Error::shape(
                "paged_attention",
                format!(
                    "{} sequences, {} metadata entries",
                    batch.num_seqs,
                    meta.len()
                ),
            ));
        }
        for s in 0..batch.num_seqs {
            let [q0, n, kv_len, off] = [0, 1, 2, 3].map(|i| meta[4 * s + i] as usize);
            if q0 + n > rows || n > kv_len {
                return Err(Error::shape(
                    "paged_attention",
                    format!("sequence {s}: {n} queries at row {q0} of {rows}, {kv_len} keys"),
                ));
            }
            let key_slots = (0..kv_len)
                .map(|j| {
                    let block = *batch.blocks.get(off + j / bs).ok_or_else(|| {
                        Error::shape(
                            "paged_attention",
                            format!("sequence {s}: block list too short"),
                        )
                    })? as usize;
                    let slot = block * bs + j % bs;
                    if slot >= slots {
                        return Err(Error::shape(
                            "paged_attention",
                            format!("sequence {s}: slot {slot} outside a cache of {slots}"),
                        ));
                    }
                    Ok(slot)
                })
                .collect::<Result<Vec<_>>>()?;
            let key_slots = std::sync::Arc::new(key_slots);
            for i in 0..n {
                per_row[q0 + i] = Some(key_slots.clone());
                visible[q0 + i] = kv_len - n + i + 1;
            }
        }
        let group = hq / hkv;
        let scale = 1.0 / (d as f32).sqrt();
        let (kd, vd) = (k.data(), v.data());
        let mut out = HostTensor::zeros(vec![rows, hq * d]);
        // One task per (row, head), as `attention`: the same sums in the same order whatever
        // else is in the batch, so a sequence's result does not depend on its neighbours.
        out.data_mut().par_chunks_mut(d).enumerate().for_each_init(
            Vec::new,
            |scores: &mut Vec<f32>, (task, o)| {
                let (i, h) = (task / hq, task % hq);
                let Some(keys) = &per_row[i] else { return };
                let kvh = h / group;
                let qv = &q.data()[(i * hq + h) * d..][..d];
                let kv = KvRows {
                    k: kd,
                    v: vd,
                    heads: hkv,
                    head: kvh,
                    d,
                };
                attend(
                    qv,
                    keys[..visible[i]].iter().copied(),
                    &kv,
                    scale,
                    scores,
                    o,
                );
            },
        );
        Ok(out)
    }

    fn scatter_rows(&self, dst: &mut HostTensor, rows: &[usize], src: &HostTensor) -> Result<()> {
        let w = check_rows("scatter_rows", dst, rows, src)?;
        for (i, &r) in rows.iter().enumerate() {
            dst.data_mut()[r * w..(r + 1) * w].copy_from_slice(&src.data()[i * w..(i + 1) * w]);
        }
        Ok(())
    }

    fn add_rows(&self, dst: &mut HostTensor, rows: &[usize], src: &HostTensor) -> Result<()> {
        let w = check_rows("add_rows", dst, rows, src)?;
        for (i, &r) in rows.iter().enumerate() {
            let s = &src.data()[i * w..(i + 1) * w];
            for (d, s) in dst.data_mut()[r * w..(r + 1) * w].iter_mut().zip(s) {
                *d += s;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(shape: &[usize], data: &[f32]) -> HostTensor {
        HostTensor::new(shape.to_vec(), data.to_vec()).unwrap()
    }

    #[test]
    fn linear_matches_hand_computed_product_with_bias() {
        let b = CpuBackend;
        let x = t(&[2, 3], &[1., 2., 3., 4., 5., 6.]);
        let w = t(&[2, 3], &[1., 0., -1., 0.5, 0.5, 0.5]);
        let bias = t(&[2], &[10., 20.]);
        let y = b.linear(&x, &w, Some(&bias)).unwrap();
        assert_eq!(y.shape(), &[2, 2]);
        assert_eq!(
            y.data(),
            &[1. - 3. + 10., 3. + 20., 4. - 6. + 10., 7.5 + 20.]
        );
    }

    #[test]
    fn linear_rejects_mismatched_inner_dim() {
        let b = CpuBackend;
        let err = b
            .linear(&t(&[1, 3], &[0.; 3]), &t(&[2, 4], &[0.; 8]), None)
            .unwrap_err();
        assert!(matches!(err, Error::Shape { op: "linear", .. }), "{err}");
    }

    #[test]
    fn causal_attention_first_query_sees_only_itself() {
        let b = CpuBackend;
        // 2 queries, 1 head, d=2; values are distinct so the output tells which keys were used.
        let q = t(&[2, 1, 2], &[1., 0., 0., 1.]);
        let k = t(&[2, 1, 2], &[1., 0., 0., 1.]);
        let v = t(&[2, 1, 2], &[1., 2., 3., 4.]);
        let y = b
            .attention(
                &q,
                &k,
                &v,
                2,
                AttnMask::Causal {
                    first_query_slot: 0,
                },
            )
            .unwrap();
        assert_eq!(&y.data()[..2], &[1., 2.]);
        // Second query sees both keys; scores (0, 1)/sqrt(2) -> weights favour key 1.
        let w1 = 1.0 / (1.0 + (-1.0f32 / 2f32.sqrt()).exp());
        let expect = [(1. - w1) * 1. + w1 * 3., (1. - w1) * 2. + w1 * 4.];
        for (a, e) in y.data()[2..].iter().zip(expect) {
            assert!((a - e).abs() < 1e-6, "{a} vs {e}");
        }
    }

    #[test]
    fn grouped_query_heads_share_kv_heads() {
        let b = CpuBackend;
        // 4 query heads over 2 kv heads: heads 0,1 read kv head 0; heads 2,3 read kv head 1.
        let q = t(&[1, 4, 1], &[1., 1., 1., 1.]);
        let k = t(&[1, 2, 1], &[1., 1.]);
        let v = t(&[1, 2, 1], &[5., 7.]);
        let y = b.attention(&q, &k, &v, 1, AttnMask::Full).unwrap();
        assert_eq!(y.data(), &[5., 5., 7., 7.]);
    }

    #[test]
    fn rope_rotates_pairs_across_halves() {
        let b = CpuBackend;
        let x = t(&[1, 1, 4], &[1., 2., 3., 4.]);
        let (c, s) = (0.6f32, 0.8f32);
        let cos = t(&[1, 4], &[c, 1., c, 1.]);
        let sin = t(&[1, 4], &[s, 0., s, 0.]);
        let y = b.rope(&x, &cos, &sin).unwrap();
        let e = [1. * c - 3. * s, 2., 3. * c + 1. * s, 4.];
        for (a, e) in y.data().iter().zip(e) {
            assert!((a - e).abs() < 1e-6);
        }
    }

    #[test]
    fn norms_match_definitions() {
        let b = CpuBackend;
        let x = t(&[1, 4], &[1., 2., 3., 4.]);
        let ones = t(&[4], &[1.; 4]);
        let zeros = t(&[4], &[0.; 4]);
        let ln = b.layer_norm(&x, &ones, &zeros, 0.0).unwrap();
        let sd = 1.25f32.sqrt();
        for (a, e) in ln
            .data()
            .iter()
            .zip([-1.5 / sd, -0.5 / sd, 0.5 / sd, 1.5 / sd])
        {
            assert!((a - e).abs() < 1e-6);
        }
        let rms = b.rms_norm(&x, &ones, 0.0).unwrap();
        let r = 7.5f32.sqrt();
        for (a, e) in rms.data().iter().zip([1. / r, 2. / r, 3. / r, 4. / r]) {
            assert!((a - e).abs() < 1e-6);
        }
    }

    #[test]
    fn gelu_variants_match_reference_values() {
        // torch.nn.functional.gelu(torch.tensor([-1., 0.5, 2.]), approximate=...)
        let b = CpuBackend;
        let x = t(&[3], &[-1., 0.5, 2.]);
        let tanh = b.gelu(&x, GeluKind::Tanh).unwrap();
        let erf = b.gelu(&x, GeluKind::Erf).unwrap();
        for (a, e) in tanh.data().iter().zip([-0.158_808, 0.345_714, 1.954_598]) {
            assert!((a - e).abs() < 1e-5, "{a} vs {e}");
        }
        for (a, e) in erf.data().iter().zip([-0.158_655, 0.345_731, 1.954_5]) {
            assert!((a - e).abs() < 1e-5, "{a} vs {e}");
        }
    }

    #[test]
    fn row_updates_write_kv_scatter_and_add() {
        let b = CpuBackend;
        let mut cache = b.zeros_cache(3, 2, 1, KvFormat::Native).unwrap();
        b.write_kv(&mut cache, &vec![2, 0], &t(&[2, 2], &[1., 2., 3., 4.]))
            .unwrap();
        assert_eq!(cache.to_host().data(), &[3., 4., 0., 0., 1., 2.]);
        assert!(b
            .write_kv(&mut cache, &vec![3], &t(&[1, 2], &[0.; 2]))
            .is_err());
        let mut x = t(&[3, 2], &[0.; 6]);
        b.scatter_rows(&mut x, &[2, 0], &t(&[2, 2], &[1., 1., 2., 2.]))
            .unwrap();
        b.add_rows(&mut x, &[2], &t(&[1, 2], &[10., 10.])).unwrap();
        assert_eq!(x.data(), &[2., 2., 0., 0., 11., 11.]);
        assert_eq!(
            b.gather_rows(&x, &vec![2, 2, 0]).unwrap().data(),
            &[11., 11., 11., 11., 2., 2.]
        );
    }

    /// An FP8 cache keeps e4m3 bytes of `x / scale` (nearest even, clamped at ±448) and reads
    /// back their values times the scale; a scale that is no number is refused.
    #[test]
    fn an_fp8_cache_stores_rounded_saturated_bytes() {
        let b = CpuBackend;
        let mut cache = b
            .zeros_cache(2, 1, 4, KvFormat::Fp8 { scale: 0.5 })
            .unwrap();
        let row = [1.0, 0.53, -300.0, 5.0];
        b.write_kv(&mut cache, &vec![1], &t(&[1, 4], &row)).unwrap();
        // 0.53 / 0.5 = 1.06 -> 1.0; -600 -> -448; 10 -> 10 (exact).
        assert_eq!(
            cache.to_host().data(),
            &[0., 0., 0., 0., 1.0, 0.5, -224.0, 5.0]
        );
        assert_eq!(cache.format(), KvFormat::Fp8 { scale: 0.5 });
        for bad in [0.0, f32::NAN] {
            let err = b
                .zeros_cache(2, 1, 4, KvFormat::Fp8 { scale: bad })
                .unwrap_err();
            assert!(matches!(err, Error::KvCacheDtype { .. }), "{err}");
        }
        assert!(b
            .check_kv_format(KvFormat::Fp8 { scale: 1.0 }, 8, 128)
            .is_ok());
    }

    #[test]
    fn paged_attention_reads_each_sequence_through_its_block_list() {
        // Every value is an e4m3 one (times the scale): FP8 caches give the same answer.
        for format in [
            KvFormat::Native,
            KvFormat::Fp8 { scale: 1.0 },
            KvFormat::Fp8 { scale: 0.5 },
        ] {
            paged_attention_through_block_lists(format);
        }
    }

    fn paged_attention_through_block_lists(format: KvFormat) {
        let b = CpuBackend;
        // Blocks of 2 slots; 4 blocks. The decoding sequence owns block [0] (one key), the
        // other blocks [3, 1] (three keys). Values tell which keys were read.
        let mut k = b.zeros_cache(8, 1, 1, format).unwrap();
        let mut v = b.zeros_cache(8, 1, 1, format).unwrap();
        // Keys all equal: attention averages the visible values.
        b.write_kv(&mut k, &(0..8).collect(), &t(&[8, 1], &[0.; 8]))
            .unwrap();
        // slot: 0 1 2 3 4 5 6 7
        b.write_kv(
            &mut v,
            &(0..8).collect(),
            &t(&[8, 1], &[9., 0., 3., 0., 0., 0., 1., 2.]),
        )
        .unwrap();
        // Rows: the decoding sequence's one query first, then the other's two queries at
        // positions 1 and 2 (a prefill chunk after one cached key).
        let seqs = vec![0, 1, 1, 0, 1, 2, 3, 1];
        let blocks = vec![0, 3, 1];
        let batch = PagedBatch::<CpuBackend> {
            seqs: &seqs,
            blocks: &blocks,
            num_seqs: 2,
            decode_seqs: 1,
            max_queries: 2,
            max_keys: 3,
            block_size: 2,
        };
        let q = t(&[4, 1, 1], &[1.; 4]);
        let y = b.paged_attention(&q, &k, &v, &batch).unwrap();
        // Row 0 sees slot 0 (9). Row 1, at position 1, sees slots 6, 7 -> 1.5.
        // Row 2: position 2 sees slots 6, 7, 2 -> 2. Row 3 belongs to no sequence.
        assert_eq!(y.data(), &[9., 1.5, 2., 0.]);
        let bad = vec![0, 1, 1, 9];
        let batch = PagedBatch::<CpuBackend> {
            seqs: &bad,
            num_seqs: 1,
            ..batch
        };
        assert!(b.paged_attention(&q, &k, &v, &batch).is_err());
    }

    #[test]
    fn embedding_rejects_ids_outside_vocab() {
        let b = CpuBackend;
        let table = t(&[2, 2], &[1., 2., 3., 4.]);
        assert_eq!(
            b.embedding(&table, &vec![1, 0]).unwrap().data(),
            &[3., 4., 1., 2.]
        );
        assert!(b.embedding(&table, &vec![2]).is_err());
    }
}
