//! Counter-based random numbers for random-weight models.
//!
//! Element `i` of a tensor is a pure function of `(key, i)` (a SplitMix64 hash), so the CPU and
//! the `fill_uniform_f32` kernel in `cuda/kernels/ops_f32.cu` produce the same bits, in any
//! order, on any number of threads. That is what lets the real 8B shapes be generated on the
//! GPU (seconds, no 16 GB host round trip) and still be checked against the CPU.

use rayon::prelude::*;

use crate::HostTensor;

/// SplitMix64's finalizer: a bijective mix of all 64 bits.
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The key of tensor `name` in a model generated from `seed`.
pub fn tensor_key(seed: u64, name: &str) -> u64 {
    mix(crate::cuda::compile::source_hash(name) ^ mix(seed))
}

/// Element `index` of the tensor with `key`: uniform in `[-bound, bound)`.
pub fn uniform(key: u64, index: u64, bound: f32) -> f32 {
    let h = bits(key, index);
    // 24 random bits: every value is exact in f32, and the same on the GPU.
    let u = (h >> 40) as f32 * (1.0 / 16_777_216.0);
    (2.0 * u - 1.0) * bound
}

/// 64 random bits for element `index` of the tensor with `key` ([`uniform`] takes its top 24).
pub fn bits(key: u64, index: u64) -> u64 {
    mix(key ^ index.wrapping_mul(0x9E37_79B9_7F4A_7C15))
}

/// A whole tensor of [`uniform`] values, generated in parallel.
pub fn uniform_tensor(shape: &[usize], key: u64, bound: f32) -> HostTensor {
    let n: usize = shape.iter().product();
    let data: Vec<f32> = (0..n as u64)
        .into_par_iter()
        .map(|i| uniform(key, i, bound))
        .collect();
    HostTensor::new(shape.to_vec(), data).expect("length matches shape")
}

/// How a random-weight model fills the tensor `name` of `shape`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum RandomInit {
    /// Norm weights: 1, so activations keep their scale through the layers.
    Ones,
    /// Biases.
    Zeros,
    /// Matrices: uniform with unit output variance for unit-variance inputs.
    Uniform { key: u64, bound: f32 },
}

impl RandomInit {
    pub fn for_tensor(seed: u64, name: &str, shape: &[usize]) -> Self {
        if shape.len() == 1 && name.contains("norm") {
            RandomInit::Ones
        } else if shape.len() == 1 {
            RandomInit::Zeros
        } else {
            let fan_in: usize = shape[1..].iter().product();
            RandomInit::Uniform {
                key: tensor_key(seed, name),
                bound: (3.0 / fan_in.max(1) as f32).sqrt(),
            }
        }
    }

    /// The tensor on the host.
    pub fn host(&self, shape: &[usize]) -> HostTensor {
        let n: usize = shape.iter().product();
        match *self {
            RandomInit::Ones => HostTensor::new(shape.to_vec(), vec![1.0; n]).expect("shape"),
            RandomInit::Zeros => HostTensor::zeros(shape.to_vec()),
            RandomInit::Uniform { key, bound } => uniform_tensor(shape, key, bound),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_are_fixed_functions_of_key_and_index() {
        // Pinned so a change to the generator (which the CUDA kernel must follow) is noticed.
        let key = tensor_key(0, "model.language_model.embed_tokens.weight");
        let first: Vec<f32> = (0..4).map(|i| uniform(key, i, 1.0)).collect();
        // Computed independently (Python, the same SplitMix64 and FNV-1a), as f32 literals.
        assert_eq!(first, [0.312_579_27, 0.340_080_98, 0.603_754_3, 0.657_235]);
        assert_ne!(
            uniform(tensor_key(1, "a"), 0, 1.0),
            uniform(tensor_key(0, "a"), 0, 1.0)
        );
        // Mean ~0, variance ~1/3 of bound²: a sanity check that the bits are spread.
        let t = uniform_tensor(&[1000, 1000], key, 1.0);
        let mean = t.data().iter().map(|&v| v as f64).sum::<f64>() / 1e6;
        let var = t
            .data()
            .iter()
            .map(|&v| (v as f64 - mean).powi(2))
            .sum::<f64>()
            / 1e6;
        assert!(mean.abs() < 3e-3, "mean {mean}");
        assert!((var - 1.0 / 3.0).abs() < 3e-3, "variance {var}");
        assert!(t.data().iter().all(|v| (-1.0..1.0).contains(v)));
    }
}
