//! Layers shared by both model stages, built on [`Backend`] ops and loaded by name.

use crate::{Backend, HostTensor, Projection, Result, WeightPrefix};

/// `nn.Linear`: `x · wᵀ (+ b)` with `w` stored `[out, in]`.
pub struct Linear<B: Backend> {
    w: B::Weight,
    b: Option<B::Tensor>,
}

impl<B: Backend> Linear<B> {
    /// Reads the matrix `[out, inp]` under `w` in whatever format the checkpoint stores it
    /// ([`WeightPrefix::load_matrix`]), and `bias` `[out]` when `bias`.
    pub fn load(be: &B, w: &WeightPrefix, out: usize, inp: usize, bias: bool) -> Result<Self> {
        Ok(Self {
            w: w.load_matrix(be, out, inp)?,
            b: if bias {
                Some(w.load(be, "bias", &[out])?)
            } else {
                None
            },
        })
    }

    /// Several projections of the same input stacked into one (`parts`: each prefix with its
    /// output size, in order), so one GEMM computes them all: q/k/v, gate/up. Outputs come in
    /// the parts' order along the last dim.
    pub fn load_stacked(
        be: &B,
        parts: &[(&WeightPrefix, usize)],
        inp: usize,
        bias: bool,
    ) -> Result<Self> {
        let weights = parts
            .iter()
            .map(|(w, out)| w.load_matrix(be, *out, inp))
            .collect::<Result<Vec<_>>>()?;
        let b = if bias {
            let mut all = Vec::new();
            for (w, out) in parts {
                all.extend(w.get("bias", &[*out])?.into_data());
            }
            let n = all.len();
            Some(be.upload(&HostTensor::new(vec![n], all)?)?)
        } else {
            None
        };
        Ok(Self {
            w: be.stack_weights(&weights.iter().collect::<Vec<_>>())?,
            b,
        })
    }

    /// From host tensors already in shape (for weights the checkpoint stores differently).
    pub fn from_host(be: &B, w: &HostTensor, b: Option<&HostTensor>) -> Result<Self> {
        Ok(Self {
            w: be.upload_weight(w)?,
            b: b.map(|b| be.upload(b)).transpose()?,
        })
    }

    pub fn forward(&self, be: &B, x: &B::Tensor) -> Result<B::Tensor> {
        be.linear(x, &self.w, self.b.as_ref())
    }

    /// `rms_norm(x, norm, eps)` through this layer ([`Backend::rms_norm_linear`]).
    pub fn forward_normed(
        &self,
        be: &B,
        x: &B::Tensor,
        norm: &B::Tensor,
        eps: f32,
    ) -> Result<B::Tensor> {
        be.rms_norm_linear(x, norm, eps, &self.w, self.b.as_ref())
    }

    /// `residual += forward(x)` ([`Backend::add_linear`]).
    pub fn forward_add(&self, be: &B, x: &B::Tensor, residual: &mut B::Tensor) -> Result<()> {
        be.add_linear(residual, x, &self.w, self.b.as_ref())
    }

    /// This layer as a fused op's operand ([`Backend::layer_norm_linears`], ...).
    pub fn projection(&self) -> Projection<'_, B> {
        Projection {
            w: &self.w,
            b: self.b.as_ref(),
        }
    }

    /// Bytes the matrix takes as `be` stores it.
    pub fn bytes(&self, be: &B) -> usize {
        be.weight_bytes(&self.w)
    }

    /// The weight matrix, for ops that take several (`Backend::swiglu`).
    pub fn weight(&self) -> &B::Weight {
        &self.w
    }
}
