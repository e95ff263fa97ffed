//! The norms: LayerNorm and RMSNorm over rows, into f32 (the [`Backend`] ops) or into f16 (the
//! operand of the GEMM after them); kernels in `cuda/kernels/ops_f32.cu`. LayerNorm takes a
//! warp a row where the row fits its registers (the ViT's), else a block a row, as RMSNorm does.
//!
//! [`Backend`]: crate::Backend

use std::sync::Arc;

use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut, DeviceRepr, LaunchConfig, PushKernelArg};

use super::kernels::{layer_norm_by_warp, ROW_THREADS};
use super::launch::{arg, width_of};
use super::{CudaBackend, CudaTensor};
use crate::{LayerNormParams, Result};

impl CudaBackend {
    pub(super) fn layer_norm_impl(
        &self,
        x: &CudaTensor,
        w: &CudaTensor,
        b: &CudaTensor,
        eps: f32,
    ) -> Result<CudaTensor> {
        width_of("layer_norm", x, w)?;
        width_of("layer_norm", x, b)?;
        let mut out = self.alloc(x.shape.clone())?;
        let buf = Arc::get_mut(&mut out.buf).expect("fresh");
        self.launch_layer_norm("layer_norm_f32", x, w, b, eps, buf)?;
        Ok(out)
    }

    /// `x`'s LayerNorm rounded to f16: the operand of the GEMMs after it.
    pub(super) fn layer_norm_f16(
        &self,
        x: &CudaTensor,
        norm: LayerNormParams<Self>,
    ) -> Result<CudaSlice<half::f16>> {
        width_of("layer_norm", x, norm.w)?;
        width_of("layer_norm", x, norm.b)?;
        let mut out = self.alloc_f16(x.len())?;
        self.launch_layer_norm("layer_norm_f16", x, norm.w, norm.b, norm.eps, &mut out)?;
        Ok(out)
    }

    /// Launches LayerNorm kernel `name` (layer_norm_f32 or layer_norm_f16, as `O` is) over the
    /// rows of `x` into `out`, which holds `x.len()` elements; widths checked by the caller.
    /// Rows that fit a warp's registers take a warp each, ROW_THREADS / 32 rows a block; wider
    /// ones a block each (the kernel decides the same way from the same constant).
    fn launch_layer_norm<O: DeviceRepr>(
        &self,
        name: &'static str,
        x: &CudaTensor,
        w: &CudaTensor,
        b: &CudaTensor,
        eps: f32,
        out: &mut CudaSlice<O>,
    ) -> Result<()> {
        let (rows, cols) = (x.rows(), x.cols());
        if rows == 0 {
            return Ok(());
        }
        let cfg = if layer_norm_by_warp(cols) {
            let per_block = (ROW_THREADS / 32) as usize;
            LaunchConfig {
                grid_dim: (rows.div_ceil(per_block) as u32, 1, 1),
                block_dim: (ROW_THREADS, 1, 1),
                shared_mem_bytes: 0,
            }
        } else {
            Self::row_config(rows)
        };
        let (rows_i, cols_i) = (rows as i32, cols as i32);
        let mut l = self.inner.stream.launch_builder(self.kernel(name));
        l.arg(&*x.buf)
            .arg(&*w.buf)
            .arg(&*b.buf)
            .arg(out)
            .arg(&rows_i)
            .arg(&cols_i)
            .arg(&eps);
        // SAFETY: matches layer_norm_f32 / layer_norm_f16 for O = f32 / f16: a warp per row
        // (warps past the last row return) or a block per row, as layer_norm_by_warp says on
        // both sides; x, w and b hold rows x cols and cols floats, out rows x cols elements.
        self.launched(name, unsafe { l.launch(cfg) }.map(|_| ()))
    }

    /// `x`'s RMSNorm rounded to f16: the operand of the GEMM after it.
    pub(super) fn rms_norm_f16(
        &self,
        x: &CudaTensor,
        w: &CudaTensor,
        eps: f32,
    ) -> Result<CudaSlice<half::f16>> {
        width_of("rms_norm", x, w)?;
        let mut out = self.alloc_f16(x.len())?;
        self.launch_rms_norm("rms_norm_f16", x, w, eps, &mut out)?;
        Ok(out)
    }

    /// Launches RMSNorm kernel `name` (rms_norm_f32 or rms_norm_f16, as `O` is) over the rows
    /// of `x` into `out`, which holds `x.len()` elements; `w`'s width checked by the caller.
    pub(super) fn launch_rms_norm<O: DeviceRepr>(
        &self,
        name: &'static str,
        x: &CudaTensor,
        w: &CudaTensor,
        eps: f32,
        out: &mut CudaSlice<O>,
    ) -> Result<()> {
        let cols = x.cols() as i32;
        let stream = &self.inner.stream;
        let (xp, _x) = x.buf.device_ptr(stream);
        let (wp, _w) = w.buf.device_ptr(stream);
        let (op, _o) = out.device_ptr_mut(stream);
        let mut args = [arg(&xp), arg(&wp), arg(&op), arg(&cols), arg(&eps)];
        // SAFETY: matches rms_norm_f32 / rms_norm_f16 (one block per row) for O = f32 / f16;
        // out holds x.len() elements. The kernel reads nothing before its grid_wait.
        let launched = unsafe {
            self.launch_args(
                name,
                Self::row_config(x.rows()),
                &mut args,
                self.programmatic_launch(),
            )
        };
        self.launched(name, launched)
    }
}
