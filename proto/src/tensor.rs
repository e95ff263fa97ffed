//! Tensors on the wire: raw little-endian bytes of f32, f16 or bf16 plus a shape, instead of
//! `repeated float` (4-8x smaller, and a memcpy to decode).
//!
//! Converting between f32 and the wire's element type is the one pass over the values each
//! side makes: whole slices at a time (F16C instructions where the CPU has them), split across
//! threads for large tensors, into a buffer that becomes the message's bytes without a copy.

use bytes::Bytes;
use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};
use rayon::prelude::*;

use crate::pb::{Dtype, Tensor};

// The wire is little-endian and values are cast to bytes in memory order.
#[cfg(target_endian = "big")]
compile_error!("vlm-proto's tensor encoding assumes a little-endian host");

/// Values per conversion task: large enough that a task costs more than its scheduling
/// (~64K values is ~20 µs of F16C conversion), small enough to spread a 448² image's ~0.8M
/// values over a dozen threads.
const CHUNK: usize = 1 << 16;

/// A vector owned by a [`Bytes`] and read as its raw bytes.
struct RawBytes<T>(Vec<T>);

impl<T: bytemuck::Pod> AsRef<[u8]> for RawBytes<T> {
    fn as_ref(&self) -> &[u8] {
        bytemuck::cast_slice(&self.0)
    }
}

fn into_bytes<T: bytemuck::Pod + Send>(v: Vec<T>) -> Bytes {
    Bytes::from_owner(RawBytes(v))
}

/// `values` converted element by element with `convert` (a slice conversion), in parallel
/// chunks.
fn convert<S: Sync, T: Clone + Default + Send>(
    values: &[S],
    convert: impl Fn(&[S], &mut [T]) + Sync,
) -> Vec<T> {
    let mut out = vec![T::default(); values.len()];
    if values.len() <= CHUNK {
        convert(values, &mut out);
    } else {
        out.par_chunks_mut(CHUNK)
            .zip(values.par_chunks(CHUNK))
            .for_each(|(o, v)| convert(v, o));
    }
    out
}

/// Packs row-major f32 values as `dtype` (unspecified means f32).
pub fn encode(shape: &[usize], values: &[f32], dtype: Dtype) -> Tensor {
    let (dtype, data) = match dtype {
        Dtype::F16 => (
            Dtype::F16,
            into_bytes(convert(values, |v, o: &mut [f16]| {
                o.convert_from_f32_slice(v)
            })),
        ),
        Dtype::Bf16 => (
            Dtype::Bf16,
            into_bytes(convert(values, |v, o: &mut [bf16]| {
                o.convert_from_f32_slice(v)
            })),
        ),
        Dtype::F32 | Dtype::Unspecified => (
            Dtype::F32,
            Bytes::copy_from_slice(bytemuck::cast_slice(values)),
        ),
    };
    Tensor {
        dtype: dtype as i32,
        shape: shape.iter().map(|&d| d as u64).collect(),
        data,
        shm_offset: None,
    }
}

/// A tensor of f16 values already in the wire's layout (little-endian, row-major), sent as
/// they are: no conversion and no copy.
pub fn from_f16_bytes(shape: &[usize], bytes: Bytes) -> Tensor {
    Tensor {
        dtype: Dtype::F16 as i32,
        shape: shape.iter().map(|&d| d as u64).collect(),
        data: bytes,
        shm_offset: None,
    }
}

/// The bytes a tensor of this shape and dtype has, checked: the shape comes off the wire, and
/// a product that wraps could match the data.
fn byte_len(t: &Tensor) -> Result<(Vec<usize>, Dtype, usize), String> {
    let shape: Vec<usize> = t.shape.iter().map(|&d| d as usize).collect();
    let dtype = Dtype::try_from(t.dtype).map_err(|_| format!("unknown dtype {}", t.dtype))?;
    let width = match dtype {
        Dtype::F32 => 4,
        Dtype::F16 | Dtype::Bf16 => 2,
        Dtype::Unspecified => return Err("tensor dtype is unspecified".into()),
    };
    let bytes = shape
        .iter()
        .try_fold(1usize, |n, &d| n.checked_mul(d))
        .and_then(|n| n.checked_mul(width))
        .ok_or_else(|| format!("tensor shape {shape:?} has more elements than can exist"))?;
    Ok((shape, dtype, bytes))
}

/// The bytes a tensor's values take, wherever they travel (0 if its shape or dtype is bad).
pub fn payload_bytes(t: &Tensor) -> usize {
    byte_len(t).map_or(0, |(_, _, bytes)| bytes)
}

/// Points a tensor that travelled through shared memory (`shm_offset`) at its bytes in
/// `segment`; a tensor that carries its bytes is left as it is.
pub fn attach(t: &mut Tensor, segment: &Bytes) -> Result<(), String> {
    let Some(offset) = t.shm_offset.take() else {
        return Ok(());
    };
    if !t.data.is_empty() {
        return Err("a tensor has both bytes and a shared-memory offset".into());
    }
    let (shape, _, len) = byte_len(t)?;
    let end = usize::try_from(offset)
        .ok()
        .and_then(|o| o.checked_add(len).map(|end| (o, end)))
        .filter(|&(_, end)| end <= segment.len())
        .ok_or_else(|| {
            format!(
                "tensor of shape {shape:?} at offset {offset} runs past the shared-memory \
                 segment of {} bytes",
                segment.len()
            )
        })?;
    t.data = segment.slice(end.0..end.1);
    Ok(())
}

/// The shape and dtype of a tensor whose bytes are here and fit them.
fn checked(t: &Tensor) -> Result<(Vec<usize>, Dtype), String> {
    if t.shm_offset.is_some() {
        return Err("the tensor's bytes are in shared memory that was not attached".into());
    }
    let (shape, dtype, n_bytes) = byte_len(t)?;
    if t.data.len() != n_bytes {
        return Err(format!(
            "tensor of shape {shape:?} and dtype {dtype:?} needs {n_bytes} bytes, got {}",
            t.data.len()
        ));
    }
    Ok((shape, dtype))
}

/// An f16 tensor's shape and bytes as they are (a slice of the received buffer, no
/// conversion), checked to fit; `Ok(None)` for other dtypes, which [`decode`] widens to f32.
pub fn f16_bytes(t: &Tensor) -> Result<Option<(Vec<usize>, Bytes)>, String> {
    let (shape, dtype) = checked(t)?;
    Ok((dtype == Dtype::F16).then(|| (shape, t.data.clone())))
}

/// Unpacks a tensor to (shape, f32 values), checking that the bytes fit the shape.
pub fn decode(t: &Tensor) -> Result<(Vec<usize>, Vec<f32>), String> {
    let (shape, dtype) = checked(t)?;
    // The received buffer need not be aligned for the element type: aligned slices are read
    // in place, others through one aligned copy.
    let values = match dtype {
        Dtype::F16 => convert(&elements::<f16>(&t.data), |v, o: &mut [f32]| {
            v.convert_to_f32_slice(o)
        }),
        Dtype::Bf16 => convert(&elements::<bf16>(&t.data), |v, o: &mut [f32]| {
            v.convert_to_f32_slice(o)
        }),
        _ => elements::<f32>(&t.data).into_owned(),
    };
    Ok((shape, values))
}

/// `data` as elements of `T`: borrowed when aligned, copied otherwise.
fn elements<T: bytemuck::Pod>(data: &[u8]) -> std::borrow::Cow<'_, [T]> {
    match bytemuck::try_cast_slice(data) {
        Ok(v) => std::borrow::Cow::Borrowed(v),
        Err(_) => std::borrow::Cow::Owned(bytemuck::pod_collect_to_vec(data)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_each_dtype_and_rejects_short_data() {
        let v = [1.0f32, -0.5, 3.25, 0.0, 2.0, -8.0];
        for dt in [Dtype::F32, Dtype::F16, Dtype::Bf16] {
            let t = encode(&[2, 3], &v, dt);
            let (shape, back) = decode(&t).unwrap();
            assert_eq!(shape, vec![2, 3]);
            assert_eq!(back, v, "{dt:?}: these values are exact in every dtype");
        }
        let mut t = encode(&[2, 3], &v, Dtype::F16);
        t.data.truncate(t.data.len() - 1);
        assert!(decode(&t).unwrap_err().contains("needs 12 bytes"));
    }

    /// Tensors past one conversion chunk take the parallel path; the bytes must be the same
    /// as converting value by value, little-endian, and read back from a buffer at an odd
    /// address (as a slice of a received message can be).
    #[test]
    fn large_tensors_convert_as_value_by_value_and_from_unaligned_bytes() {
        let n = 3 * CHUNK + 17;
        let v: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin() * 100.0).collect();
        let t = encode(&[n], &v, Dtype::F16);
        let expected: Vec<u8> = v
            .iter()
            .flat_map(|x| f16::from_f32(*x).to_le_bytes())
            .collect();
        assert_eq!(&t.data[..], &expected[..]);
        let t = encode(&[n], &v, Dtype::Bf16);
        let expected: Vec<u8> = v
            .iter()
            .flat_map(|x| bf16::from_f32(*x).to_le_bytes())
            .collect();
        assert_eq!(&t.data[..], &expected[..]);

        for dt in [Dtype::F32, Dtype::F16] {
            let t = encode(&[n], &v, dt);
            let mut shifted = vec![0u8; t.data.len() + 1];
            shifted[1..].copy_from_slice(&t.data);
            let unaligned = Tensor {
                data: Bytes::from(shifted).slice(1..),
                ..t.clone()
            };
            assert_eq!(decode(&unaligned).unwrap(), decode(&t).unwrap(), "{dt:?}");
        }
        let (_, back) = decode(&encode(&[n], &v, Dtype::F32)).unwrap();
        assert_eq!(back, v);
    }

    #[test]
    fn attached_tensors_read_their_slice_of_the_segment_and_bounds_are_checked() {
        let a = encode(&[2], &[1.0, 2.0], Dtype::F16);
        let b = encode(&[3], &[3.0, 4.0, 5.0], Dtype::F32);
        let segment: Bytes = [&a.data[..], &b.data[..]].concat().into();
        let shared = |t: &Tensor, offset: u64| Tensor {
            data: Bytes::new(),
            shm_offset: Some(offset),
            ..t.clone()
        };
        let (mut a2, mut b2) = (shared(&a, 0), shared(&b, a.data.len() as u64));
        assert!(decode(&a2).unwrap_err().contains("not attached"));
        attach(&mut a2, &segment).unwrap();
        attach(&mut b2, &segment).unwrap();
        assert_eq!(decode(&a2).unwrap(), decode(&a).unwrap());
        assert_eq!(decode(&b2).unwrap(), decode(&b).unwrap());
        // Past the end, or an offset that wraps.
        for offset in [a.data.len() as u64 + 1, u64::MAX - 2] {
            let err = attach(&mut shared(&b, offset), &segment).unwrap_err();
            assert!(err.contains("runs past"), "{err}");
        }
    }

    #[test]
    fn f16_tensors_are_passed_on_as_their_bytes() {
        let v = [1.0f32, -0.5, 3.25, 0.0, 2.0, -8.0];
        let t = encode(&[3, 2], &v, Dtype::F16);
        let again = from_f16_bytes(&[3, 2], t.data.clone());
        assert_eq!(again, t);
        let (shape, bytes) = f16_bytes(&t).unwrap().expect("an f16 tensor");
        assert_eq!(
            (shape, bytes.as_ptr()),
            (vec![3, 2], t.data.as_ptr()),
            "not copied"
        );
        assert_eq!(f16_bytes(&encode(&[3, 2], &v, Dtype::F32)).unwrap(), None);
        let short = Tensor {
            shape: vec![4, 2],
            ..t
        };
        assert!(f16_bytes(&short).unwrap_err().contains("needs 16 bytes"));
    }

    /// Found by the grpc fuzz target: the element count overflowed (a panic in debug builds).
    #[test]
    fn rejects_shapes_whose_size_overflows() {
        let t = Tensor {
            dtype: Dtype::F32 as i32,
            shape: vec![1 << 40, 1 << 40],
            ..Default::default()
        };
        assert!(decode(&t)
            .unwrap_err()
            .contains("more elements than can exist"));
        let t = Tensor {
            dtype: Dtype::F16 as i32,
            shape: vec![1 << 63],
            ..Default::default()
        };
        assert!(decode(&t).is_err());
    }
}
