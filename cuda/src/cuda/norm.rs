//! The norms: LayerNorm and RMSNorm over rows, into f32 (the [`Backend`] ops) or into f16 (the
//! operand of the GEMM after them); kernels in `cuda/kernels/ops_f32.cu`.
//!
//! [`Backend`]: crate::Backend

use std::sync::Arc;

use cudarc::driver::{CudaSlice, DeviceRepr, PushKernelArg};

use super::launch::width_of;
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
        let cols = x.cols() as i32;
        let mut l = self
            .inner
            .stream
            .launch_builder(self.kernel("layer_norm_f32"));
        l.arg(&*x.buf)
            .arg(&*w.buf)
            .arg(&*b.buf)
            .arg(Arc::get_mut(&mut out.buf).expect("fresh"))
            .arg(&cols)
            .arg(&eps);
        // SAFETY: matches layer_norm_f32, one block per row.
        self.launched(
            "layer_norm_f32",
            unsafe { l.launch(Self::row_config(x.rows())) }.map(|_| ()),
        )?;
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
        let cols = x.cols() as i32;
        let name = "layer_norm_f16";
        let mut l = self.inner.stream.launch_builder(self.kernel(name));
        l.arg(&*x.buf)
            .arg(&*norm.w.buf)
            .arg(&*norm.b.buf)
            .arg(&mut out)
            .arg(&cols)
            .arg(&norm.eps);
        // SAFETY: matches layer_norm_f16, one block per row; out holds x.len() halves.
        self.launched(
            name,
            unsafe { l.launch(Self::row_config(x.rows())) }.map(|_| ()),
        )?;
        Ok(out)
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
        let mut l = self.inner.stream.launch_builder(self.kernel(name));
        l.arg(&*x.buf).arg(&*w.buf).arg(out).arg(&cols).arg(&eps);
        // SAFETY: matches rms_norm_f32 / rms_norm_f16 (one block per row) for O = f32 / f16;
        // out holds x.len() elements.
        self.launched(
            name,
            unsafe { l.launch(Self::row_config(x.rows())) }.map(|_| ()),
        )
    }
}
