//! A row-major f32 tensor in host memory.
//!
//! This is the currency between the host and a backend (`Backend::upload` / `download`) and the
//! CPU backend's own tensor type. It is deliberately plain: a shape and a `Vec<f32>`.

use crate::{Error, Result};

#[derive(Clone, Debug, PartialEq)]
pub struct HostTensor {
    shape: Vec<usize>,
    data: Vec<f32>,
}

impl HostTensor {
    /// Wraps `data` as a tensor of `shape`; the element count must match.
    pub fn new(shape: impl Into<Vec<usize>>, data: Vec<f32>) -> Result<Self> {
        let shape = shape.into();
        let n: usize = shape.iter().product();
        if n != data.len() {
            return Err(Error::shape(
                "HostTensor::new",
                format!("shape {shape:?} holds {n} elements, got {}", data.len()),
            ));
        }
        Ok(Self { shape, data })
    }

    pub fn zeros(shape: impl Into<Vec<usize>>) -> Self {
        let shape = shape.into();
        let n = shape.iter().product();
        Self {
            shape,
            data: vec![0.0; n],
        }
    }

    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    pub fn data(&self) -> &[f32] {
        &self.data
    }

    pub fn data_mut(&mut self) -> &mut [f32] {
        &mut self.data
    }

    pub fn into_data(self) -> Vec<f32> {
        self.data
    }

    pub fn len(&self) -> usize {
        self.data.len()
    }

    pub fn is_empty(&self) -> bool {
        self.data.is_empty()
    }

    /// Number of rows when viewed as a matrix `[rows, last_dim]`.
    pub fn rows(&self) -> usize {
        self.data.len().checked_div(self.cols()).unwrap_or(0)
    }

    /// Size of the last dimension (1 for a scalar).
    pub fn cols(&self) -> usize {
        self.shape.last().copied().unwrap_or(1)
    }

    /// Same data, another shape with the same element count.
    pub fn reshape(mut self, shape: impl Into<Vec<usize>>) -> Result<Self> {
        let shape = shape.into();
        let n: usize = shape.iter().product();
        if n != self.data.len() {
            return Err(Error::shape(
                "reshape",
                format!("cannot view {:?} as {shape:?}", self.shape),
            ));
        }
        self.shape = shape;
        Ok(self)
    }

    /// Row `i` of the matrix view `[rows, last_dim]`.
    pub fn row(&self, i: usize) -> &[f32] {
        let c = self.cols();
        &self.data[i * c..(i + 1) * c]
    }

    /// Rows `start..end` of the matrix view, as a new tensor `[end - start, last_dim]`.
    pub fn slice_rows(&self, start: usize, end: usize) -> Result<Self> {
        let c = self.cols();
        if start > end || end > self.rows() {
            return Err(Error::shape(
                "slice_rows",
                format!("rows {start}..{end} of a tensor with {} rows", self.rows()),
            ));
        }
        Self::new(vec![end - start, c], self.data[start * c..end * c].to_vec())
    }

    /// Stacks matrices with the same row width on top of each other.
    pub fn concat_rows(parts: &[HostTensor]) -> Result<Self> {
        let Some(first) = parts.first() else {
            return Err(Error::shape("concat_rows", "nothing to concatenate"));
        };
        let c = first.cols();
        let mut data = Vec::with_capacity(parts.iter().map(|p| p.len()).sum());
        for p in parts {
            if p.cols() != c {
                return Err(Error::shape(
                    "concat_rows",
                    format!("row widths differ: {c} and {}", p.cols()),
                ));
            }
            data.extend_from_slice(&p.data);
        }
        let rows = data.len() / c.max(1);
        Self::new(vec![rows, c], data)
    }

    /// Largest absolute elementwise difference; shapes must match.
    pub fn max_abs_diff(&self, other: &HostTensor) -> Result<f32> {
        if self.shape != other.shape {
            return Err(Error::shape(
                "max_abs_diff",
                format!("{:?} vs {:?}", self.shape, other.shape),
            ));
        }
        Ok(self
            .data
            .iter()
            .zip(&other.data)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f32::max))
    }
}
