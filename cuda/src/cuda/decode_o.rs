//! Batch-1 decode's attention and o projection in one kernel (`paged_decode_o` in
//! `cuda/kernels/paged_f16.cu`): one block an SM, all resident at once (a cooperative launch),
//! each streaming its rows of the o projection's weights into shared memory from its first
//! instruction while the kernels before it drain and attention runs; two grid barriers hand
//! attention's splits to their merge and the merged output to every block. Every other step
//! takes the two ops one after the other (attention.rs's split-K decode, linear.rs's GEMV).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};

use cudarc::driver::{CudaFunction, DevicePtr, LaunchConfig};

use super::kernels::{fused_o_kernel, FUSED_O_KERNELS, FUSED_O_MAX_SPLITS, FUSED_O_WARPS};
use super::launch::arg;
use super::{CudaBackend, CudaCache, CudaTensor, CudaWeight};
use crate::backend::PagedBatch;
use crate::Result;

/// The fused kernels this GPU may run.
pub(super) struct FusedO {
    /// The kernels ready, each with the dynamic shared memory it may take (bytes).
    kernels: HashMap<&'static str, usize>,
    /// Cleared if a launch fails (a driver that refuses the cooperative launch under
    /// programmatic dependent launch): attention and o then run apart.
    on: AtomicBool,
}

impl FusedO {
    /// The kernels this GPU runs (sm_90 and later, where programmatic dependent launch lets the
    /// weight loads start early; `VLM_FUSED_O=0` turns them off, to compare), each given all
    /// the shared memory a block may opt in to, where one block then still fits an SM.
    pub(super) fn setup(
        kernels: &HashMap<&'static str, CudaFunction>,
        cc: (i32, i32),
        optin: usize,
    ) -> Self {
        let mut ready = HashMap::new();
        if cc.0 >= 9 && std::env::var("VLM_FUSED_O").map_or(true, |v| v != "0") {
            for name in FUSED_O_KERNELS {
                let Some(k) = kernels.get(name) else { continue };
                match ready_kernel(k, optin) {
                    Ok(smem) => {
                        tracing::debug!(kernel = name, smem, "fused decode attention + o ready");
                        ready.insert(name, smem);
                    }
                    Err(e) => {
                        tracing::warn!(kernel = name, error = %e, "fused decode attention + o unavailable; attention and o run apart")
                    }
                }
            }
        }
        Self {
            on: AtomicBool::new(!ready.is_empty()),
            kernels: ready,
        }
    }
}

fn ready_kernel(k: &CudaFunction, optin: usize) -> std::result::Result<usize, String> {
    use cudarc::driver::sys::CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES as MAX_SMEM;
    let fixed = k
        .shared_size_bytes()
        .map_err(|e| format!("static shared memory: {e}"))?;
    let smem = optin.saturating_sub(fixed as usize);
    k.set_attribute(MAX_SMEM, smem as i32)
        .map_err(|e| format!("opting in to {smem} bytes of shared memory: {e}"))?;
    let fits = k
        .occupancy_max_active_blocks_per_multiprocessor(FUSED_O_WARPS * 32, smem, None)
        .map_err(|e| format!("occupancy: {e}"))?;
    if fits == 0 {
        return Err("a block does not fit an SM".into());
    }
    Ok(smem)
}

impl CudaBackend {
    /// Whether batch-1 decode takes the fused attention + o projection kernel on this GPU.
    pub fn fused_attention_o(&self) -> bool {
        self.inner.fused_o.on.load(Ordering::Relaxed)
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn paged_attention_add_linear_impl(
        &self,
        x: &mut CudaTensor,
        q: &CudaTensor,
        k: &CudaCache,
        v: &CudaCache,
        batch: &PagedBatch<Self>,
        w: &CudaWeight,
        b: Option<&CudaTensor>,
    ) -> Result<()> {
        if let Some(plan) = self.fused_o_plan(x, q, k, v, batch, w, b) {
            match self.fused_o(&plan, x, q, k, v, batch, w, b) {
                Ok(()) => return Ok(()),
                Err(e) => {
                    tracing::warn!(kernel = plan.name, error = %e, "fused decode attention + o failed to launch; attention and o run apart from now on");
                    self.inner.fused_o.on.store(false, Ordering::Relaxed);
                }
            }
        }
        let a = self.paged_attention_impl(q, k, v, batch)?;
        self.add_linear_impl(x, &a, w, b)
    }

    /// The fused kernel's launch for this op, where it applies: one decoding sequence of one
    /// query, an instantiated head dim and group, o's weight `[x's width, hq d]`.
    #[allow(clippy::too_many_arguments)]
    fn fused_o_plan(
        &self,
        x: &CudaTensor,
        q: &CudaTensor,
        k: &CudaCache,
        v: &CudaCache,
        batch: &PagedBatch<Self>,
        w: &CudaWeight,
        b: Option<&CudaTensor>,
    ) -> Option<FusedPlan> {
        if !self.fused_attention_o() {
            return None;
        }
        let [1, hq, d] = q.shape[..] else { return None };
        let [_, hkv, dk] = k.shape;
        let m = x.cols();
        let blocks = self.inner.sm_count;
        let one_decode = batch.num_seqs == 1 && batch.decode_seqs == 1 && x.rows() == 1;
        let shapes = v.shape == k.shape
            && dk == d
            && hkv > 0
            && hkv <= blocks
            && hq % hkv == 0
            && batch.block_size > 0
            && batch.seqs.len >= 4
            && w.shape == [m, hq * d]
            && b.is_none_or(|b| b.len() == m)
            && m > 0;
        if !one_decode || !shapes {
            return None;
        }
        let name = fused_o_kernel(d, hq / hkv)?;
        let smem = *self.inner.fused_o.kernels.get(name)?;
        // The merged attention output takes hq d floats of shared memory; the rest holds
        // whole rows of o.
        let cols = hq * d;
        let rows = m.div_ceil(blocks);
        let staged_rows = rows.min(smem.checked_sub(cols * 4)? / (cols * 2));
        Some(FusedPlan {
            name,
            blocks,
            splits: (blocks / hkv).min(FUSED_O_MAX_SPLITS),
            hkv,
            staged_rows,
            smem: cols * 4 + staged_rows * cols * 2,
        })
    }

    #[allow(clippy::too_many_arguments)]
    fn fused_o(
        &self,
        plan: &FusedPlan,
        x: &mut CudaTensor,
        q: &CudaTensor,
        k: &CudaCache,
        v: &CudaCache,
        batch: &PagedBatch<Self>,
        w: &CudaWeight,
        b: Option<&CudaTensor>,
    ) -> Result<()> {
        let [_, hq, d] = q.shape[..] else {
            unreachable!("checked by fused_o_plan")
        };
        let m = x.cols();
        // Attention's splits (output, then max and sum) and their merge.
        let part_o = self.alloc(vec![hq * plan.splits, d])?;
        let part_ml = self.alloc(vec![hq * plan.splits, 2])?;
        let att = self.alloc(vec![hq * d])?;
        let stream = &self.inner.stream;
        let bias = b.unwrap_or(&att);
        let (q_p, _q) = q.buf.device_ptr(stream);
        let (k_p, _k) = k.buf.device_ptr(stream);
        let (v_p, _v) = v.buf.device_ptr(stream);
        let (seqs_p, _seqs) = batch.seqs.buf.device_ptr(stream);
        let (blocks_p, _blocks) = batch.blocks.buf.device_ptr(stream);
        let (w_p, _w) = w.buf.device_ptr(stream);
        let (b_p, _b) = bias.buf.device_ptr(stream);
        let (po_p, _po) = part_o.buf.device_ptr(stream);
        let (pml_p, _pml) = part_ml.buf.device_ptr(stream);
        let (att_p, _att) = att.buf.device_ptr(stream);
        // The grid barrier's counter: the kernel leaves it at 0 (Inner::counters).
        let (bar_p, _bar) = self.inner.counters.device_ptr(stream);
        let x_buf = self.unshared(x)?;
        let (x_p, _x) = x_buf.device_ptr(stream);
        let has_bias = b.is_some() as i32;
        let (hq_i, hkv_i, splits_i) = (hq as i32, plan.hkv as i32, plan.splits as i32);
        let bs_i = batch.block_size as i32;
        let scale = 1.0f32 / (d as f32).sqrt();
        let (m_i, staged_i) = (m as i32, plan.staged_rows as i32);
        let mut args = [
            arg(&q_p),
            arg(&k_p),
            arg(&v_p),
            arg(&seqs_p),
            arg(&blocks_p),
            arg(&w_p),
            arg(&b_p),
            arg(&has_bias),
            arg(&x_p),
            arg(&po_p),
            arg(&pml_p),
            arg(&att_p),
            arg(&bar_p),
            arg(&hq_i),
            arg(&hkv_i),
            arg(&splits_i),
            arg(&bs_i),
            arg(&scale),
            arg(&m_i),
            arg(&staged_i),
        ];
        let cfg = LaunchConfig {
            grid_dim: (plan.blocks as u32, 1, 1),
            block_dim: (FUSED_O_WARPS * 32, 1, 1),
            shared_mem_bytes: plan.smem as u32,
        };
        // SAFETY: the arguments are paged_decode_o_d{d}_g{gp}'s, in its order: d is the
        // instantiated head dim and the group fits gp (fused_o_kernel), w is [m, hq d], the
        // bias m floats where has_bias, the partials hq * splits rows, hkv * splits <= blocks;
        // one block an SM fits (FusedO::setup) and the launch is cooperative, so every block
        // reaches the grid barriers. Before its grid_wait it reads only weights, the step's
        // tables and older keys.
        let launched = unsafe {
            self.launch_with(plan.name, cfg, &mut args, self.programmatic_launch(), true)
        };
        self.launched(plan.name, launched)
    }
}

/// [`CudaBackend::fused_o_plan`]'s answer.
struct FusedPlan {
    name: &'static str,
    /// One an SM.
    blocks: usize,
    /// Of each KV head's keys, one block each.
    splits: usize,
    hkv: usize,
    staged_rows: usize,
    /// Dynamic shared memory: the merged attention output and the staged rows.
    smem: usize,
}
