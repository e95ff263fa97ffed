//! Attention and what feeds it: RoPE, the per-head norm + RoPE + cache write of a step's
//! fused qkv (`qkv_to_cache`), KV cache writes, attention over contiguous keys and values (flash
//! on tensor cores, or a warp per query) and over the paged cache (split-K decode, paged flash
//! for prefill chunks), the ViT's attention from its fused q/k/v (`rope_attention_segments`:
//! split, RoPE and K/V pack in one kernel, then flash attention per image; on Hopper the pack
//! writes the wgmma kernel's tiles) and its whole attention half (`layer_norm_rope_attention`:
//! the same from the q/k/v GEMM's f16 output, between the norm of norm.rs and the GEMMs of
//! linear.rs); kernels in
//! `cuda/kernels/paged_f16.cu`, `attention_f16.cu`, `attention_sm90.cu` (wgmma, H100/H200) and
//! `ops_f32.cu`.

use std::sync::Arc;

use cudarc::driver::{
    CudaSlice, CudaView, CudaViewMut, DevicePtr, DevicePtrMut, DeviceRepr, LaunchConfig,
    PushKernelArg,
};
use half::f16;

use super::kernels::{
    decode_kernel, decode_max_splits, decode_splits, flash_smem_bytes, flash_wgmma_grid,
    flash_wgmma_partial_floats, flash_wgmma_smem_bytes, pack_rows_smem_bytes,
    paged_flash_wgmma_smem_bytes, DecodeAttention, PrefillAttention, COUNTERS, DECODE_WARPS,
    DEFAULT_SMEM, FLASH_DIMS, FLASH_KERNELS, FLASH_MIN_QUERIES, FLASH_QUERIES, FLASH_WGMMA_DP,
    FLASH_WGMMA_KERNELS, FLASH_WGMMA_KEYS, FLASH_WGMMA_MAX_D, FLASH_WGMMA_QUERIES,
    FLASH_WGMMA_THREADS, FLASH_WIDE_DIMS, FLASH_WIDE_KERNELS, FLASH_WIDE_MIN_WAVES,
    FLASH_WIDE_QUERIES, GEMV_MAX_ROWS, MAX_HEAD_DIM, PACK_ROWS, PAGED_FLASH_F8_KERNELS,
    PAGED_FLASH_KERNELS, PAGED_FLASH_WGMMA_D, PAGED_FLASH_WGMMA_KERNEL, PAGED_FLASH_WGMMA_QUERIES,
    PAGED_FLASH_WGMMA_THREADS, QKV_WARPS, ROPE_PACK16_TILED_ROWS, ROPE_PACK_F16, ROPE_PACK_F32,
    ROW_THREADS,
};
use super::launch::arg;
use super::lt::{Epilogue, LtOut, LtShape};
use super::{CudaBackend, CudaCache, CudaIds, CudaTensor};
use crate::backend::{layer_norm_rope_attention_op_by_op, rope_attention_segments_op_by_op};
use crate::{
    AttentionWeights, AttnMask, Error, KvFormat, LayerNormParams, PagedBatch, QkvToCache, Result,
};

/// One flash attention launch's sizes (`CudaBackend::flash_packed`).
#[derive(Clone, Copy)]
struct FlashShape {
    nq: usize,
    hq: usize,
    hkv: usize,
    d: usize,
    /// d padded to a compiled head dim (FLASH_DIMS).
    dp: usize,
    kv_len: usize,
    causal: bool,
    /// The key position of query 0 (causal).
    first: usize,
}

/// The sizes of the ViT's attention on the flash path (`CudaBackend::vit_attention_dims`).
#[derive(Clone, Copy)]
struct VitAttentionDims {
    /// Rows: the patches of every image in the pass.
    n: usize,
    heads: usize,
    d: usize,
    /// d padded to a compiled head dim (FLASH_DIMS).
    dp: usize,
}

/// One paged attention call's inputs, checked (`CudaBackend::paged_attention_impl`), for its
/// decode and prefill launches.
#[derive(Clone, Copy)]
struct PagedArgs<'a> {
    /// `[rows, hq, d]`.
    q: &'a CudaTensor,
    k: &'a CudaCache,
    v: &'a CudaCache,
    batch: &'a PagedBatch<'a, CudaBackend>,
    hq: usize,
    hkv: usize,
    d: usize,
}

impl CudaBackend {
    /// Every kernel that writes or reads the paged cache has an FP8 twin (`write_kv_f8`,
    /// `qkv_to_cache_f8`, `paged_decode_f8_*`, `paged_attention_rows_f8`,
    /// `paged_flash_attention_f8_*`) for the head dims the f16 ones take (up to 256): FP8 is
    /// refused only for a scale that is no number, or a head dim no kernel takes.
    pub(super) fn check_kv_format_impl(
        &self,
        format: KvFormat,
        _heads: usize,
        dim: usize,
    ) -> Result<()> {
        let KvFormat::Fp8 { .. } = format.check()? else {
            return Ok(());
        };
        if dim > MAX_HEAD_DIM || dim % 2 != 0 {
            return Err(Error::KvCacheDtype {
                dtype: "fp8",
                problem: format!(
                    "the CUDA kernels take head dims up to {MAX_HEAD_DIM} (even), this model's is {dim}"
                ),
            });
        }
        Ok(())
    }

    pub(super) fn qkv_to_cache_impl(
        &self,
        qkv: &CudaTensor,
        how: &QkvToCache<Self>,
        k_cache: &mut CudaCache,
        v_cache: &mut CudaCache,
    ) -> Result<CudaTensor> {
        let [slots, hkv, d] = k_cache.shape;
        let (hq, n) = (how.q_heads, qkv.rows());
        if qkv.cols() != (hq + 2 * hkv) * d
            || how.slots.len != n
            || v_cache.shape != k_cache.shape
            || v_cache.fp8() != k_cache.fp8()
            || d > 256
            || d % 2 != 0
            || how.cos.shape != [n, d]
            || how.sin.shape != [n, d]
            || how
                .qk_norm
                .as_ref()
                .is_some_and(|n| n.q.len() != d || n.k.len() != d)
        {
            return Err(Error::shape(
                "qkv_to_cache",
                format!(
                    "qkv {:?} for {hq} + 2 x {hkv} heads of {d}, {} slots, cos {:?}, caches {:?}",
                    qkv.shape, how.slots.len, how.cos.shape, k_cache.shape
                ),
            ));
        }
        let q = self.alloc(vec![n, hq, d])?;
        if n == 0 {
            return Ok(q);
        }
        let fp8 = k_cache.fp8();
        let name = if fp8 {
            "qkv_to_cache_f8"
        } else {
            "qkv_to_cache_f32"
        };
        let (hq_i, hkv_i, d_i, ns) = (hq as i32, hkv as i32, d as i32, slots as u32);
        let (k_inv, v_inv) = (k_cache.format.inv_scale(), v_cache.format.inv_scale());
        {
            let stream = &self.inner.stream;
            let (qkv_p, _qkv) = qkv.buf.device_ptr(stream);
            // No q/k norm (Qwen2): null weights, which the kernel reads as "rotate only".
            let norms = how.qk_norm.as_ref().map(|n| {
                let (q, k) = (n.q.buf.device_ptr(stream), n.k.buf.device_ptr(stream));
                (q, k, n.eps)
            });
            let (qn_p, kn_p, eps) = norms
                .as_ref()
                .map_or((0, 0, 0.0f32), |((q, _), (k, _), eps)| (*q, *k, *eps));
            let (cos_p, _cos) = how.cos.buf.device_ptr(stream);
            let (sin_p, _sin) = how.sin.buf.device_ptr(stream);
            let (slots_p, _slots) = how.slots.buf.device_ptr(stream);
            let (q_p, _q) = q.buf.device_ptr(stream);
            let (kc_p, _kc) = k_cache.buf.device_ptr_mut(stream);
            let (vc_p, _vc) = v_cache.buf.device_ptr_mut(stream);
            let mut args = vec![
                arg(&qkv_p),
                arg(&qn_p),
                arg(&kn_p),
                arg(&eps),
                arg(&cos_p),
                arg(&sin_p),
                arg(&slots_p),
                arg(&q_p),
                arg(&kc_p),
                arg(&vc_p),
                arg(&hq_i),
                arg(&hkv_i),
                arg(&d_i),
                arg(&ns),
            ];
            if fp8 {
                args.extend([arg(&k_inv), arg(&v_inv)]);
            }
            let heads = (hq + 2 * hkv) as u32;
            let cfg = LaunchConfig {
                grid_dim: (n as u32, heads.div_ceil(QKV_WARPS), 1),
                block_dim: (QKV_WARPS * 32, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: the arguments are qkv_to_cache_f32's (f16 caches) or qkv_to_cache_f8's
            // (FP8 caches, then their reciprocal scales), in their order (QK_WARPS warps, head
            // dims up to QK_MAX_DIM); shapes checked, both caches of one format; the kernel
            // checks every slot against the cache, and reads what the kernel before it writes
            // only after its grid_wait.
            let launched =
                unsafe { self.launch_args(name, cfg, &mut args, self.programmatic_launch()) };
            self.launched(name, launched)?;
        }
        Ok(q)
    }

    pub(super) fn rope_impl(
        &self,
        x: &CudaTensor,
        cos: &CudaTensor,
        sin: &CudaTensor,
    ) -> Result<CudaTensor> {
        let [n, h, d] = x.shape[..] else {
            return Err(Error::shape(
                "rope",
                format!("x must be [tokens, heads, head_dim], got {:?}", x.shape),
            ));
        };
        if cos.shape != [n, d] || sin.shape != [n, d] || d % 2 != 0 {
            return Err(Error::shape(
                "rope",
                format!(
                    "x {:?} with cos {:?}, sin {:?}",
                    x.shape, cos.shape, sin.shape
                ),
            ));
        }
        let mut out = self.alloc(x.shape.clone())?;
        let (hh, dd) = (h as i32, d as i32);
        let mut l = self.inner.stream.launch_builder(self.kernel("rope_f32"));
        l.arg(&*x.buf)
            .arg(&*cos.buf)
            .arg(&*sin.buf)
            .arg(Arc::get_mut(&mut out.buf).expect("fresh"))
            .arg(&hh)
            .arg(&dd);
        // SAFETY: matches rope_f32, one block per token.
        self.launched(
            "rope_f32",
            unsafe { l.launch(Self::row_config(n)) }.map(|_| ()),
        )?;
        Ok(out)
    }

    pub(super) fn attention_impl(
        &self,
        q: &CudaTensor,
        k: &CudaTensor,
        v: &CudaTensor,
        kv_len: usize,
        mask: AttnMask,
    ) -> Result<CudaTensor> {
        let [nq, hq, d] = q.shape[..] else {
            return Err(Error::shape(
                "attention",
                format!("q must be 3-D, got {:?}", q.shape),
            ));
        };
        let [slots, hkv, dk] = k.shape[..] else {
            return Err(Error::shape(
                "attention",
                format!("k must be 3-D, got {:?}", k.shape),
            ));
        };
        let first = match mask {
            AttnMask::Full => 0,
            AttnMask::Causal { first_query_slot } => first_query_slot,
        };
        let causal = matches!(mask, AttnMask::Causal { .. });
        if v.shape != k.shape
            || dk != d
            || d > MAX_HEAD_DIM
            || hkv == 0
            || hq % hkv != 0
            || kv_len > slots
            || kv_len == 0
            || (causal && first + nq > kv_len)
        {
            return Err(Error::shape(
                "attention",
                format!(
                    "q {:?}, k {:?}, v {:?}, kv_len {kv_len}, {mask:?}",
                    q.shape, k.shape, v.shape
                ),
            ));
        }
        let mut out = self.alloc(vec![nq, hq * d])?;
        let flash_dim = FLASH_DIMS.iter().copied().find(|&dp| dp >= d);
        if let (true, true, Some(dp)) = (self.inner.flash, nq >= FLASH_MIN_QUERIES, flash_dim) {
            // Keys and values to f16 [kv_len, hkv, dp] once, not once per query tile.
            let packed = hkv * kv_len * dp;
            // pack_kv_f16 writes every element (padding dims as zeros).
            let (mut kp, mut vp) = (self.alloc_f16(packed)?, self.alloc_f16(packed)?);
            let pack = "pack_kv_f16";
            let dims = [hkv, d, dp, kv_len].map(|v| v as i32);
            let mut l = self.inner.stream.launch_builder(self.kernel(pack));
            l.arg(&*k.buf).arg(&*v.buf).arg(&mut kp).arg(&mut vp);
            for v in &dims {
                l.arg(v);
            }
            // SAFETY: matches pack_kv_f16, one block per key; k and v hold kv_len <= slots
            // rows of hkv * d, kp and vp hkv * kv_len * dp halves.
            self.launched(
                pack,
                unsafe { l.launch(Self::row_config(kv_len)) }.map(|_| ()),
            )?;

            let out_buf = Arc::get_mut(&mut out.buf).expect("fresh");
            let shape = FlashShape {
                nq,
                hq,
                hkv,
                d,
                dp,
                kv_len,
                causal,
                first,
            };
            self.flash_packed(
                &q.buf.slice(..),
                [&kp.slice(..), &vp.slice(..)],
                &mut out_buf.slice_mut(..),
                shape,
            )?;
            return Ok(out);
        }
        let (hq_i, hkv_i, d_i, len_i, causal_i, first_i) = (
            hq as i32,
            hkv as i32,
            d as i32,
            kv_len as i32,
            causal as i32,
            first as i32,
        );
        let scale = 1.0f32 / (d as f32).sqrt();
        let mut l = self
            .inner
            .stream
            .launch_builder(self.kernel("attention_f32"));
        l.arg(&*q.buf)
            .arg(&*k.buf)
            .arg(&*v.buf)
            .arg(Arc::get_mut(&mut out.buf).expect("fresh"))
            .arg(&hq_i)
            .arg(&hkv_i)
            .arg(&d_i)
            .arg(&len_i)
            .arg(&causal_i)
            .arg(&first_i)
            .arg(&scale);
        let cfg = LaunchConfig {
            grid_dim: ((nq * hq).max(1) as u32, 1, 1),
            block_dim: (32, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: matches attention_f32: one warp per (query, head), shapes checked above.
        self.launched("attention_f32", unsafe { l.launch(cfg) }.map(|_| ()))?;
        Ok(out)
    }

    /// flash_attention_d{dp} (or its wide twin) over keys and values packed as PackedF16Kv
    /// (f16 [kv_len, hkv, dp]): q [nq, hq, d] and out [nq, hq * d], f32.
    fn flash_packed(
        &self,
        q: &CudaView<f32>,
        [kp, vp]: [&CudaView<f16>; 2],
        out: &mut CudaViewMut<f32>,
        s: FlashShape,
    ) -> Result<()> {
        // The wide kernel (two m-tiles a warp) for calls of many query tiles.
        let wide = FLASH_WIDE_DIMS.iter().position(|&x| x == s.dp).filter(|_| {
            s.nq.div_ceil(FLASH_WIDE_QUERIES) * s.hq
                >= FLASH_WIDE_MIN_WAVES * 2 * self.inner.sm_count
        });
        let (name, queries) = match wide {
            Some(at) => (FLASH_WIDE_KERNELS[at], FLASH_WIDE_QUERIES),
            None => {
                let at = FLASH_DIMS
                    .iter()
                    .position(|&x| x == s.dp)
                    .expect("a flash dim");
                (FLASH_KERNELS[at], FLASH_QUERIES)
            }
        };
        let cfg = LaunchConfig {
            grid_dim: (s.nq.div_ceil(queries) as u32, s.hq as u32, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: flash_smem_bytes(s.dp, queries) as u32,
        };
        self.launch_flash(name, (q, [kp, vp], out), s, cfg)
    }

    /// One launch of a packed flash kernel (`flash_attention_(wide_)d{dp}`: their arguments are
    /// the same), `cfg` sized for it by the caller.
    fn launch_flash(
        &self,
        name: &'static str,
        (q, [kp, vp], out): (&CudaView<f32>, [&CudaView<f16>; 2], &mut CudaViewMut<f32>),
        s: FlashShape,
        cfg: LaunchConfig,
    ) -> Result<()> {
        let ints = [s.nq, s.hq, s.hkv, s.d, s.kv_len, s.causal as usize, s.first].map(|v| v as i32);
        let scale = 1.0f32 / (s.d as f32).sqrt();
        let mut l = self.inner.stream.launch_builder(self.kernel(name));
        l.arg(q).arg(kp).arg(vp).arg(out);
        for v in &ints {
            l.arg(v);
        }
        l.arg(&scale);
        // SAFETY: matches the kernel `name`, each block one head's queries (flash_packed sizes
        // the grid by the kernel's queries a block); the callers check the shapes (q and out
        // nq * hq * d, k and v kv_len * hkv * dp, d <= dp); shared memory opted in at load.
        self.launched(name, unsafe { l.launch(cfg) }.map(|_| ()))
    }

    pub(super) fn rope_attention_segments_impl(
        &self,
        qkv: &CudaTensor,
        heads: usize,
        rope: [&CudaTensor; 2],
        lens: &[usize],
    ) -> Result<CudaTensor> {
        let dims = self.vit_attention_dims(qkv.rows(), qkv.cols(), heads, rope, lens);
        // Anything unusual (and every shape error, with its message) goes op by op.
        let (2, Some(dims)) = (qkv.shape.len(), dims) else {
            return rope_attention_segments_op_by_op(self, qkv, heads, rope, lens);
        };
        self.rope_pack_attend(ROPE_PACK_F32, &qkv.buf, dims, rope, lens)
    }

    pub(super) fn layer_norm_rope_attention_impl(
        &self,
        x: &mut CudaTensor,
        norm: LayerNormParams<Self>,
        attn: AttentionWeights<Self>,
        rope: [&CudaTensor; 2],
        lens: &[usize],
    ) -> Result<()> {
        let (n, cols, qkv) = (x.rows(), x.cols(), attn.qkv);
        let [m3, k] = qkv.w.shape[..] else {
            return layer_norm_rope_attention_op_by_op(self, x, norm, attn, rope, lens);
        };
        let dims = self.vit_attention_dims(n, m3, attn.heads, rope, lens);
        let qkv_shape = LtShape {
            n,
            k: cols,
            m: m3,
            out_kind: LtOut::F16,
            epilogue: Epilogue::Bias,
        };
        // The GEMVs read f32 rows; anything unusual (and every shape error, with its message)
        // goes op by op, as does a bias cuBLASLt has no algorithm for.
        let fused = n > GEMV_MAX_ROWS
            && x.shape.len() == 2
            && k == cols
            && qkv.b.is_none_or(|b| b.len() == m3)
            && (qkv.b.is_none() || self.lt_takes(&qkv_shape, qkv.w)?);
        let (true, Some(dims)) = (fused, dims) else {
            return layer_norm_rope_attention_op_by_op(self, x, norm, attn, rope, lens);
        };
        // q, k and v written once, in f16, by their GEMM (bias in its epilogue).
        let h16 = self.layer_norm_f16(x, norm)?;
        let mut qkv16 = self.alloc_f16(n * m3)?;
        match qkv.b {
            // An f16 output takes an f16 bias.
            Some(b) => self.lt_gemm(&qkv_shape, &h16, qkv.w, &self.to_f16(b)?, &mut qkv16)?,
            None => self.gemm_f16(&h16, n, qkv.w, &mut qkv16, false)?,
        }
        drop(h16);
        let proj = attn.proj;
        let proj_shape = LtShape {
            n,
            k: dims.heads * dims.d,
            m: cols,
            out_kind: LtOut::F32 { accumulate: true },
            epilogue: Epilogue::Bias,
        };
        let proj_fits = proj.w.shape == [cols, proj_shape.k]
            && proj.b.is_none_or(|b| b.len() == cols)
            && (proj.b.is_none() || self.lt_takes(&proj_shape, proj.w)?);
        if self.wgmma_attends(dims) && proj_fits {
            // The attention written in f16, the projection's operand: its GEMM adds it into x
            // (the bias in cuBLASLt's epilogue), with no f32 copy and cast between them.
            let mut a16 = self.alloc_f16(n * proj_shape.k)?;
            let attend = (FLASH_WGMMA_KERNELS[1], &mut a16);
            self.rope_pack_attend_tiled(ROPE_PACK_F16[1], &qkv16, dims, rope, lens, attend)?;
            drop(qkv16);
            let out = self.unshared(x)?;
            return match proj.b {
                Some(b) => self.lt_gemm(&proj_shape, &a16, proj.w, &b.buf, out),
                None => self.gemm_f16(&a16, n, proj.w, out, true),
            };
        }
        let a = self.rope_pack_attend(ROPE_PACK_F16, &qkv16, dims, rope, lens)?;
        drop(qkv16);
        // Past the GEMVs' rows: a rounded to f16 and its projection added into x by the GEMM
        // (the bias in cuBLASLt's epilogue).
        self.add_linear_impl(x, &a, proj.w, proj.b)
    }

    /// Whether Hopper's wgmma kernel takes the ViT's attention of these sizes (where it was
    /// compiled and loaded).
    fn wgmma_attends(&self, dims: VitAttentionDims) -> bool {
        self.inner.wgmma_flash && dims.dp == FLASH_WGMMA_DP && dims.d <= FLASH_WGMMA_MAX_D
    }

    /// The sizes of the ViT's fused q/k/v rows (`n` of `cols = 3 * heads * d`) with `rope` and
    /// `lens`, where rope_qkv_pack and flash attention take them; `None` for anything else.
    fn vit_attention_dims(
        &self,
        n: usize,
        cols: usize,
        heads: usize,
        [cos, sin]: [&CudaTensor; 2],
        lens: &[usize],
    ) -> Option<VitAttentionDims> {
        if !self.inner.flash || n == 0 || heads == 0 || cols % (3 * heads) != 0 {
            return None;
        }
        let d = cols / (3 * heads);
        let dp = FLASH_DIMS.iter().copied().find(|&dp| dp >= d)?;
        let fits = d > 0
            && d % 2 == 0
            && cos.shape == [n, d]
            && sin.shape == [n, d]
            && lens.iter().sum::<usize>() == n;
        fits.then_some(VitAttentionDims { n, heads, d, dp })
    }

    /// The ViT's q/k/v rows `qkv` (`n` rows of `3 * heads * d`, f32 or f16 as the pack reads
    /// them: ROPE_PACK_F32 or ROPE_PACK_F16, each a row-layout and a tiled kernel) rotated and
    /// packed in one pass, then flash attention within each run of `lens` rows: on an
    /// H100/H200 the tiled pack and the wgmma kernel ([`Self::rope_pack_attend_tiled`]), else
    /// the row pack and the mma.sync kernels. Sizes as [`Self::vit_attention_dims`] found them.
    /// Returns `[n, heads * d]`.
    fn rope_pack_attend<T: DeviceRepr>(
        &self,
        [pack, pack_tiled]: [&'static str; 2],
        qkv: &CudaSlice<T>,
        dims: VitAttentionDims,
        [cos, sin]: [&CudaTensor; 2],
        lens: &[usize],
    ) -> Result<CudaTensor> {
        let VitAttentionDims { n, heads, d, dp } = dims;
        if self.wgmma_attends(dims) {
            let mut out = self.alloc(vec![n, heads * d])?;
            let out_buf = Arc::get_mut(&mut out.buf).expect("fresh");
            let attend = (FLASH_WGMMA_KERNELS[0], out_buf);
            self.rope_pack_attend_tiled(pack_tiled, qkv, dims, [cos, sin], lens, attend)?;
            return Ok(out);
        }
        let mut q = self.alloc(vec![n, heads, d])?;
        // rope_qkv_pack writes every element (padding dims as zeros).
        let (mut kp, mut vp) = (
            self.alloc_f16(n * heads * dp)?,
            self.alloc_f16(n * heads * dp)?,
        );
        let ints = [heads, d, dp].map(|v| v as i32);
        let mut l = self.inner.stream.launch_builder(self.kernel(pack));
        l.arg(qkv)
            .arg(&*cos.buf)
            .arg(&*sin.buf)
            .arg(Arc::get_mut(&mut q.buf).expect("fresh"))
            .arg(&mut kp)
            .arg(&mut vp);
        for v in &ints {
            l.arg(v);
        }
        // SAFETY: matches rope_qkv_pack_f16 (T = f32) or rope_qkv16_pack_f16 (T = f16), one
        // block per row: qkv holds n rows of 3 * heads * d, cos and sin n rows of d, q n *
        // heads * d floats, kp and vp n * heads * dp halves.
        self.launched(pack, unsafe { l.launch(Self::row_config(n)) }.map(|_| ()))?;

        // Each image's rows attend to each other only: one launch per run of rows, each on its
        // sub-range of every buffer (all of them are row-major).
        let mut out = self.alloc(vec![n, heads * d])?;
        let out_buf = Arc::get_mut(&mut out.buf).expect("fresh");
        let mut start = 0;
        for &len in lens.iter().filter(|&&len| len > 0) {
            let rows = |width: usize| start * heads * width..(start + len) * heads * width;
            let shape = FlashShape {
                nq: len,
                hq: heads,
                hkv: heads,
                d,
                dp,
                kv_len: len,
                causal: false,
                first: 0,
            };
            self.flash_packed(
                &q.buf.slice(rows(d)),
                [&kp.slice(rows(dp)), &vp.slice(rows(dp))],
                &mut out_buf.slice_mut(rows(d)),
                shape,
            )?;
            start += len;
        }
        Ok(out)
    }

    /// [`Self::rope_pack_attend`] on Hopper's wgmma kernel, every image on its own: its rows
    /// rotated and its keys and values packed into the kernel's tiles (`pack`:
    /// rope_qkv(16)_pack_tiled_f16), then attended by `attend` (one of FLASH_WGMMA_KERNELS,
    /// writing `out` [n, heads * d] as f32 or f16).
    fn rope_pack_attend_tiled<T: DeviceRepr, O: DeviceRepr>(
        &self,
        pack: &'static str,
        qkv: &CudaSlice<T>,
        dims: VitAttentionDims,
        [cos, sin]: [&CudaTensor; 2],
        lens: &[usize],
        (attend, out_buf): (&'static str, &mut CudaSlice<O>),
    ) -> Result<()> {
        let VitAttentionDims { n, heads, d, .. } = dims;
        let width = 3 * heads * d;
        // Halves of one KV head's tile of keys (and the same again of values).
        let tile = FLASH_WGMMA_KEYS * FLASH_WGMMA_DP;
        let tiles: usize = lens.iter().map(|len| len.div_ceil(FLASH_WGMMA_KEYS)).sum();
        // q as f16, scaled for the kernel's exp2 softmax by the pack.
        let mut q = self.alloc_f16(n * heads * d)?;
        let q_scale = std::f32::consts::LOG2_E / (d as f32).sqrt();
        // The pack writes every element of each image's tiles (keys past it as zeros).
        let (mut kt, mut vt) = (
            self.alloc_f16(tiles * heads * tile)?,
            self.alloc_f16(tiles * heads * tile)?,
        );

        let (mut start, mut at) = (0, 0);
        for &len in lens.iter().filter(|&&len| len > 0) {
            let image_tiles = len.div_ceil(FLASH_WGMMA_KEYS);
            let rows = |width: usize| start * width..(start + len) * width;
            let packed = at..at + image_tiles * heads * tile;
            {
                let (qkv_rows, cos_rows, sin_rows) = (
                    qkv.slice(rows(width)),
                    cos.buf.slice(rows(d)),
                    sin.buf.slice(rows(d)),
                );
                let mut q_rows = q.slice_mut(rows(heads * d));
                let (mut k_tiles, mut v_tiles) =
                    (kt.slice_mut(packed.clone()), vt.slice_mut(packed.clone()));
                let ints = [heads, d, len, image_tiles].map(|v| v as i32);
                // From f16 rows with d a multiple of 8, PACK_ROWS rows a block staged in shared
                // memory (within what a block gets without opting in).
                let rows = image_tiles * FLASH_WGMMA_KEYS;
                let smem = pack_rows_smem_bytes(width);
                let (pack, cfg) = if pack == ROPE_PACK_F16[1] && d % 8 == 0 && smem <= DEFAULT_SMEM
                {
                    let cfg = LaunchConfig {
                        grid_dim: ((rows / PACK_ROWS) as u32, 1, 1),
                        block_dim: (ROW_THREADS, 1, 1),
                        shared_mem_bytes: smem as u32,
                    };
                    (ROPE_PACK16_TILED_ROWS, cfg)
                } else {
                    (pack, Self::row_config(rows))
                };
                // SAFETY: matches rope_qkv_pack_tiled_f16 (T = f32), rope_qkv16_pack_tiled_f16
                // (T = f16) or rope_qkv16_pack_tiled_rows_f16 (T = f16, d % 8 == 0), one block
                // per row (or PACK_ROWS rows, with their shared memory) of the image's tiles:
                // qkv holds its len rows of 3 * heads * d, cos and sin len rows of d, q len *
                // heads * d halves, kt and vt image_tiles * heads tiles of FLASH_WGMMA_KEYS *
                // FLASH_WGMMA_DP halves.
                let mut l = self.inner.stream.launch_builder(self.kernel(pack));
                l.arg(&qkv_rows)
                    .arg(&cos_rows)
                    .arg(&sin_rows)
                    .arg(&mut q_rows)
                    .arg(&q_scale)
                    .arg(&mut k_tiles)
                    .arg(&mut v_tiles);
                for v in &ints {
                    l.arg(v);
                }
                self.launched(pack, unsafe { l.launch(cfg) }.map(|_| ()))?;
            }

            let (q_rows, k_tiles, v_tiles) = (
                q.slice(rows(heads * d)),
                kt.slice(packed.clone()),
                vt.slice(packed),
            );
            let mut out_rows = out_buf.slice_mut(rows(heads * d));
            // The blocks of the full waves a CTA each, the key tiles of the rest spread over
            // the SMs (FwRest).
            let blocks = len.div_ceil(FLASH_WGMMA_QUERIES) * heads;
            let (whole, ctas) = flash_wgmma_grid(blocks, image_tiles, self.inner.sm_count);
            if blocks - whole > COUNTERS {
                return Err(Error::shape(
                    "vit attention",
                    format!("{len} rows of {heads} heads: more than {COUNTERS} counters"),
                ));
            }
            // Written by the kernel, which leaves them at 0 again (Inner::counters).
            let (counters, _done) = self.inner.counters.device_ptr(&self.inner.stream);
            let mut partials =
                self.alloc_slice::<f32>(flash_wgmma_partial_floats(ctas - whole).max(1))?;
            let ints = [len, heads, heads, d, len, whole].map(|v| v as i32);
            let mut l = self.inner.stream.launch_builder(self.kernel(attend));
            l.arg(&q_rows)
                .arg(&k_tiles)
                .arg(&v_tiles)
                .arg(&mut out_rows);
            for v in &ints {
                l.arg(v);
            }
            l.arg(&counters).arg(&mut partials);
            let cfg = LaunchConfig {
                grid_dim: (ctas as u32, 1, 1),
                block_dim: (FLASH_WGMMA_THREADS, 1, 1),
                shared_mem_bytes: flash_wgmma_smem_bytes() as u32,
            };
            // SAFETY: matches flash_attention_wgmma_d80 (O = f32) or its _f16out build (O =
            // f16), the caller's pair: q len * heads * d halves, out len * heads * d of O, kt
            // and vt the image's tiles as packed above (d <= FLASH_WGMMA_MAX_D), a CTA for each
            // of the first `whole` blocks of FLASH_WGMMA_QUERIES queries of a head and at least
            // one for each other (flash_wgmma_grid), a counter (zero) for each of those and
            // two partial results for each CTA past `whole`; shared memory opted in at load.
            self.launched(attend, unsafe { l.launch(cfg) }.map(|_| ()))?;
            start += len;
            at += image_tiles * heads * tile;
        }
        Ok(())
    }

    pub(super) fn write_kv_impl(
        &self,
        cache: &mut CudaCache,
        slots: &CudaIds,
        rows: &CudaTensor,
    ) -> Result<()> {
        let [num_slots, heads, dim] = cache.shape;
        let width = heads * dim;
        if rows.len() != slots.len * width {
            return Err(Error::shape(
                "write_kv",
                format!(
                    "{} rows {:?} into a cache of {:?}",
                    slots.len, rows.shape, cache.shape
                ),
            ));
        }
        if slots.len == 0 {
            return Ok(());
        }
        let (w, ns) = (width as i32, num_slots as u32);
        let fp8 = cache.fp8();
        let inv = cache.format.inv_scale();
        let name = if fp8 { "write_kv_f8" } else { "write_kv_f16" };
        let mut l = self.inner.stream.launch_builder(self.kernel(name));
        l.arg(&mut cache.buf)
            .arg(&slots.buf)
            .arg(&*rows.buf)
            .arg(&w)
            .arg(&ns);
        if fp8 {
            l.arg(&inv);
        }
        // SAFETY: matches write_kv_f16 (an f16 cache) or write_kv_f8 (an FP8 cache, then its
        // reciprocal scale), one block per row; the kernel checks every slot.
        self.launched(
            name,
            unsafe { l.launch(Self::row_config(slots.len)) }.map(|_| ()),
        )
    }

    pub(super) fn paged_attention_impl(
        &self,
        q: &CudaTensor,
        k: &CudaCache,
        v: &CudaCache,
        batch: &PagedBatch<Self>,
    ) -> Result<CudaTensor> {
        let [rows, hq, d] = q.shape[..] else {
            return Err(Error::shape(
                "paged_attention",
                format!("q must be [rows, heads, d], got {:?}", q.shape),
            ));
        };
        let [_, hkv, dk] = k.shape;
        if v.shape != k.shape
            || v.fp8() != k.fp8()
            || dk != d
            || hkv == 0
            || hq % hkv != 0
            || d > MAX_HEAD_DIM
            || batch.block_size == 0
            || batch.seqs.len < batch.num_seqs * 4
            || batch.decode_seqs > batch.num_seqs
        {
            return Err(Error::shape(
                "paged_attention",
                format!(
                    "q {:?}, cache {:?}, {} sequences ({} decoding), block size {}",
                    q.shape, k.shape, batch.num_seqs, batch.decode_seqs, batch.block_size
                ),
            ));
        }
        let group = hq / hkv;
        // Rows of no sequence (none in practice) stay zero, as the reference says. A step of
        // decoding sequences only, one row each, writes every row: no memset then.
        let decode_name = decode_kernel(d, group, k.fp8(), DecodeAttention::current());
        let every_row_decodes =
            batch.decode_seqs == batch.num_seqs && rows == batch.num_seqs && decode_name.is_some();
        let mut out = if every_row_decodes {
            self.alloc(vec![rows, hq * d])?
        } else {
            self.alloc_zeroed(vec![rows, hq * d])?
        };
        let a = PagedArgs {
            q,
            k,
            v,
            batch,
            hq,
            hkv,
            d,
        };
        let mut first_rest = 0;
        // Decoding sequences: split-K over their keys, every KV row read once per head group.
        if let (true, Some(name)) = (batch.decode_seqs > 0, decode_name) {
            self.paged_decode(&a, name, &out)?;
            first_rest = batch.decode_seqs;
        }
        if batch.num_seqs == first_rest {
            return Ok(out);
        }
        self.paged_prefill(&a, first_rest, &mut out)?;
        Ok(out)
    }

    /// Paged attention's decoding sequences (the batch's first `decode_seqs`, one query each):
    /// the keys split over up to four blocks an SM, the splits merged by the kernel into `out`.
    fn paged_decode(&self, a: &PagedArgs, name: &'static str, out: &CudaTensor) -> Result<()> {
        let PagedArgs {
            q,
            k,
            v,
            batch,
            hq,
            hkv,
            d,
        } = *a;
        let scale = 1.0f32 / (d as f32).sqrt();
        let (hq_i, hkv_i, bs_i) = (hq as i32, hkv as i32, batch.block_size as i32);
        let stream = &self.inner.stream;
        let nd = batch.decode_seqs;
        let slots = self.inner.sm_count
            * self
                .inner
                .decode_blocks_per_sm
                .get(name)
                .copied()
                .unwrap_or(1);
        let splits = decode_splits(nd * hkv, slots, batch.max_keys).min(decode_max_splits());
        if nd * hkv > COUNTERS {
            return Err(Error::shape(
                "paged_attention",
                format!("{nd} decoding sequences of {hkv} KV heads: more than {COUNTERS} counters"),
            ));
        }
        let part_o = self.alloc(vec![nd * hq * splits, d])?;
        let part_ml = self.alloc(vec![nd * hq * splits, 2])?;
        let (q_p, _q) = q.buf.device_ptr(stream);
        let (k_p, _k) = k.buf.device_ptr(stream);
        let (v_p, _v) = v.buf.device_ptr(stream);
        let (seqs_p, _seqs) = batch.seqs.buf.device_ptr(stream);
        let (blocks_p, _blocks) = batch.blocks.buf.device_ptr(stream);
        let (po_p, _po) = part_o.buf.device_ptr(stream);
        let (pml_p, _pml) = part_ml.buf.device_ptr(stream);
        // Written by the kernel, which leaves them at 0 again (Inner::counters).
        let (done_p, _done) = self.inner.counters.device_ptr(stream);
        let (out_p, _out) = out.buf.device_ptr(stream);
        let (k_scale, v_scale) = (k.format.scale(), v.format.scale());
        let mut args = vec![
            arg(&q_p),
            arg(&k_p),
            arg(&v_p),
            arg(&seqs_p),
            arg(&blocks_p),
            arg(&po_p),
            arg(&pml_p),
            arg(&done_p),
            arg(&out_p),
            arg(&hq_i),
            arg(&hkv_i),
            arg(&bs_i),
            arg(&scale),
        ];
        if k.fp8() {
            args.extend([arg(&k_scale), arg(&v_scale)]);
        }
        let cfg = LaunchConfig {
            grid_dim: (nd as u32, hkv as u32, splits as u32),
            block_dim: (DECODE_WARPS * 32, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: the arguments are paged_decode_d{d}_g{gp}'s (or paged_decode_f8_d{d}_g{gp}'s,
        // over FP8 caches, then the caches' scales), in its order: d is the instantiated head dim, the group fits gp, the partials hold nd * hq * splits rows,
        // the counters nd * hkv; before its grid_wait the kernel reads only the step's
        // tables and keys older than the step's.
        let launched =
            unsafe { self.launch_args(name, cfg, &mut args, self.programmatic_launch()) };
        self.launched(name, launched)
    }

    /// Paged attention's prefill chunks, the sequences from `seq0` on: flash attention on
    /// tensor cores from 16 queries, else one warp per (query, head).
    fn paged_prefill(&self, a: &PagedArgs, seq0: usize, out: &mut CudaTensor) -> Result<()> {
        let PagedArgs {
            q,
            k,
            v,
            batch,
            hq,
            hkv,
            d,
        } = *a;
        let scale = 1.0f32 / (d as f32).sqrt();
        let (hq_i, hkv_i, d_i, bs_i) = (hq as i32, hkv as i32, d as i32, batch.block_size as i32);
        let stream = &self.inner.stream;
        let rest = batch.num_seqs - seq0;
        let seq0 = seq0 as i32;
        // Prefill chunks: flash attention on tensor cores from 16 queries, else one warp per
        // (query, head). Both take the same arguments.
        let flash_dim = FLASH_DIMS.iter().position(|&dp| dp >= d);
        let fp8 = k.fp8();
        let wgmma = self.inner.paged_wgmma_flash
            && PrefillAttention::current() == PrefillAttention::Wgmma
            && !fp8
            && d == PAGED_FLASH_WGMMA_D;
        let (name, cfg) = match flash_dim {
            Some(_) if wgmma && batch.max_queries >= FLASH_MIN_QUERIES => (
                PAGED_FLASH_WGMMA_KERNEL,
                LaunchConfig {
                    grid_dim: (
                        batch.max_queries.div_ceil(PAGED_FLASH_WGMMA_QUERIES) as u32,
                        hq as u32,
                        rest as u32,
                    ),
                    block_dim: (PAGED_FLASH_WGMMA_THREADS, 1, 1),
                    shared_mem_bytes: paged_flash_wgmma_smem_bytes() as u32,
                },
            ),
            Some(at) if self.inner.flash && batch.max_queries >= FLASH_MIN_QUERIES => (
                if fp8 {
                    PAGED_FLASH_F8_KERNELS[at]
                } else {
                    PAGED_FLASH_KERNELS[at]
                },
                LaunchConfig {
                    grid_dim: (
                        batch.max_queries.div_ceil(FLASH_QUERIES) as u32,
                        hq as u32,
                        rest as u32,
                    ),
                    block_dim: (128, 1, 1),
                    shared_mem_bytes: flash_smem_bytes(FLASH_DIMS[at], FLASH_QUERIES) as u32,
                },
            ),
            _ => (
                if fp8 {
                    "paged_attention_rows_f8"
                } else {
                    "paged_attention_rows_f16"
                },
                LaunchConfig {
                    grid_dim: (batch.max_queries.max(1) as u32, hq as u32, rest as u32),
                    block_dim: (32, 1, 1),
                    shared_mem_bytes: 0,
                },
            ),
        };
        let mut l = stream.launch_builder(self.kernel(name));
        l.arg(&*q.buf)
            .arg(&k.buf)
            .arg(&v.buf)
            .arg(&batch.seqs.buf)
            .arg(&batch.blocks.buf)
            .arg(Arc::get_mut(&mut out.buf).expect("fresh"))
            .arg(&seq0)
            .arg(&hq_i)
            .arg(&hkv_i)
            .arg(&d_i)
            .arg(&bs_i)
            .arg(&scale);
        let (k_scale, v_scale) = (k.format.scale(), v.format.scale());
        if fp8 {
            l.arg(&k_scale).arg(&v_scale);
        }
        // SAFETY: matches paged_flash_attention_d{dp} (64 queries of one head of one sequence
        // per 4-warp block, blocks past a sequence's queries return; d <= dp; shared memory
        // opted in at load), paged_flash_attention_wgmma_d128 (the same arguments,
        // PAGED_FLASH_WGMMA_QUERIES queries a block of PAGED_FLASH_WGMMA_THREADS, d == 128, an
        // f16 cache) or paged_attention_rows_f16 (one warp per query, head and sequence; d <=
        // MAX_HEAD_DIM); over FP8 caches their _f8 twins, which take the caches' scales after
        // the same arguments.
        self.launched(name, unsafe { l.launch(cfg) }.map(|_| ()))
    }
}
