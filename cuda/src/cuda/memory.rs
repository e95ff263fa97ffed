//! Device memory in and out: uploads and downloads (large ones staged through pinned host
//! memory), copies and writes, weights (rounded to f16, filled at random, stacked), ids and
//! the KV cache's buffers, and the device-copy timing.

use std::sync::{Arc, Mutex};

use cudarc::driver::{CudaEvent, PushKernelArg};

use super::error::cuda_err;
use super::{CudaBackend, CudaCache, CudaIds, CudaTensor, CudaWeight};
use crate::handoff::DeviceRows;
use crate::{Embeddings, Error, HalfTensor, HostTensor, Result};

impl CudaBackend {
    pub(super) fn time_copy_impl(&self, bytes: usize) -> Result<std::time::Duration> {
        let stream = &self.inner.stream;
        let alloc = |what| {
            stream
                .alloc_zeros::<u8>(bytes.max(1))
                .map_err(|e| cuda_err(what)(&e))
        };
        let (src, mut dst) = (alloc("copy source")?, alloc("copy destination")?);
        self.synchronize()?;
        let t = std::time::Instant::now();
        stream
            .memcpy_dtod(&src, &mut dst)
            .map_err(|e| cuda_err("device copy")(&e))?;
        self.synchronize()?;
        Ok(t.elapsed())
    }

    pub(super) fn upload_impl(&self, t: &HostTensor) -> Result<CudaTensor> {
        let data = if t.is_empty() { &[0f32][..] } else { t.data() };
        let buf = self.inner.staging.upload(&self.inner.stream, data)?;
        Ok(CudaTensor {
            shape: t.shape().to_vec(),
            buf: Arc::new(buf),
        })
    }

    pub(super) fn download_impl(&self, t: &CudaTensor) -> Result<HostTensor> {
        let v = self
            .inner
            .staging
            .download(&self.inner.stream, &t.buf, t.len())?;
        HostTensor::new(t.shape.clone(), v)
    }

    /// Rounded to f16 on the device, so half the bytes cross the bus and the host converts
    /// nothing: the wire's element type, as downloaded.
    pub(super) fn download_embeddings_impl(&self, t: &CudaTensor) -> Result<Embeddings> {
        let halves = self.to_f16(t)?;
        let values = self
            .inner
            .staging
            .download(&self.inner.stream, &halves, t.len())?;
        Ok(Embeddings::F16(HalfTensor::from_values(
            t.shape.clone(),
            values,
        )?))
    }

    /// f16 rows go up as they are (from a message's buffer or a mapped segment: half the
    /// bytes of f32, and no pass over them on the host) and are widened on the device.
    pub(super) fn upload_embeddings_impl(&self, e: &Embeddings) -> Result<CudaTensor> {
        let h = match e {
            Embeddings::F16(h) if !h.is_empty() => h,
            Embeddings::Device(rows) => {
                return self.copy_handed_off(HandedOff::of(rows, "upload_embeddings")?)
            }
            host => return self.upload_impl(&*host.to_f32()?),
        };
        let stream = &self.inner.stream;
        let raw = self.inner.staging.upload(stream, &h.bytes()[..])?;
        let mut out = self.alloc(h.shape().to_vec())?;
        let n = h.len() as u64;
        let name = "cast_f16_to_f32";
        let mut l = stream.launch_builder(self.kernel(name));
        l.arg(&raw).arg(self.unshared(&mut out)?).arg(&n);
        // SAFETY: matches cast_f16_to_f32: raw holds the n halves' 2n bytes, out n floats.
        self.launched(name, unsafe { l.launch(Self::fill_config(n)) }.map(|_| ()))?;
        Ok(out)
    }

    /// Another stream reads `t` only once this stream has computed it: each reader waits for
    /// the event recorded here, on the device. The host goes on meanwhile (the language stage
    /// prepares its step while the tower still runs).
    pub(super) fn hand_off_impl(&self, t: CudaTensor, identity: Vec<u8>) -> Result<Embeddings> {
        let ready = self
            .inner
            .stream
            .record_event(None)
            .map_err(|e| cuda_err("recording an event")(&e))?;
        let shape = t.shape.clone();
        let handed = HandedOff {
            tensor: t,
            ready,
            last_read: Mutex::new(None),
        };
        Ok(Embeddings::Device(DeviceRows::new(shape, handed, identity)))
    }

    pub(super) fn embeddings_to_host_impl(&self, e: &Embeddings) -> Result<Embeddings> {
        match e {
            Embeddings::Device(rows) => {
                let handed = HandedOff::of(rows, "embeddings_to_host")?;
                self.wait_for(handed)?;
                self.download_embeddings_impl(&handed.tensor)
            }
            host => Ok(host.clone()),
        }
    }

    /// A copy of another backend's tensor on this stream (a device-to-device copy: some
    /// microseconds for an image), so the step that uses it owns what it reads; the copy's
    /// place in this stream is noted for the source's drop.
    fn copy_handed_off(&self, handed: &HandedOff) -> Result<CudaTensor> {
        let stream = &self.inner.stream;
        self.wait_for(handed)?;
        let mut out = self.alloc(handed.tensor.shape.clone())?;
        stream
            .memcpy_dtod(&*handed.tensor.buf, self.unshared(&mut out)?)
            .map_err(|e| cuda_err("copying handed-over embeddings")(&e))?;
        let read = stream
            .record_event(None)
            .map_err(|e| cuda_err("recording an event")(&e))?;
        *handed.last_read.lock().unwrap_or_else(|e| e.into_inner()) = Some(read);
        Ok(out)
    }

    /// This stream's work from here on waits (on the device) until `handed` is computed.
    fn wait_for(&self, handed: &HandedOff) -> Result<()> {
        self.inner
            .stream
            .wait(&handed.ready)
            .map_err(|e| cuda_err("waiting for handed-over embeddings")(&e))
    }

    pub(super) fn copy_impl(&self, dst: &mut CudaTensor, src: &CudaTensor) -> Result<()> {
        if dst.len() != src.len() {
            return Err(Error::shape(
                "copy",
                format!("{:?} into {:?}", src.shape, dst.shape),
            ));
        }
        let buf = self.unshared(dst)?;
        self.inner
            .stream
            .memcpy_dtod(&*src.buf, buf)
            .map_err(|e| cuda_err("copy")(&e))
    }

    pub(super) fn upload_weight_impl(&self, t: &HostTensor) -> Result<CudaWeight> {
        use rayon::prelude::*;
        let halves: Vec<half::f16> = t
            .data()
            .par_iter()
            .map(|&v| half::f16::from_f32(v))
            .collect();
        let buf = self
            .inner
            .stream
            .clone_htod(if halves.is_empty() {
                &[half::f16::ZERO][..]
            } else {
                &halves
            })
            .map_err(|e| cuda_err("uploading a weight")(&e))?;
        Ok(CudaWeight::f16(t.shape().to_vec(), buf))
    }

    pub(super) fn random_weight_impl(
        &self,
        shape: &[usize],
        key: u64,
        bound: f32,
    ) -> Result<CudaWeight> {
        let n: usize = shape.iter().product();
        let mut buf = self
            .inner
            .stream
            .alloc_zeros::<half::f16>(n.max(1))
            .map_err(|e| cuda_err("allocating device memory")(&e))?;
        let name = "fill_uniform_f16";
        let n = n as u64;
        let mut l = self.inner.stream.launch_builder(self.kernel(name));
        l.arg(&mut buf).arg(&n).arg(&key).arg(&bound);
        // SAFETY: argument types and count match fill_uniform_f16 in weights_f16.cu.
        self.launched(name, unsafe { l.launch(Self::fill_config(n)) }.map(|_| ()))?;
        Ok(CudaWeight::f16(shape.to_vec(), buf))
    }

    pub(super) fn random_uniform_impl(
        &self,
        shape: &[usize],
        key: u64,
        bound: f32,
    ) -> Result<CudaTensor> {
        let mut out = self.alloc(shape.to_vec())?;
        let n = out.len() as u64;
        let name = "fill_uniform_f32";
        let cfg = Self::fill_config(n);
        let buf = Arc::get_mut(&mut out.buf).expect("fresh buffer");
        let mut l = self.inner.stream.launch_builder(self.kernel(name));
        l.arg(buf).arg(&n).arg(&key).arg(&bound);
        // SAFETY: argument types and count match fill_uniform_f32 in ops_f32.cu.
        self.launched(name, unsafe { l.launch(cfg) }.map(|_| ()))?;
        Ok(out)
    }

    pub(super) fn write_impl(&self, dst: &mut CudaTensor, values: &[f32]) -> Result<()> {
        if values.len() != dst.len() {
            return Err(Error::shape(
                "write",
                format!("{} values into {:?}", values.len(), dst.shape),
            ));
        }
        if values.is_empty() {
            return Ok(());
        }
        let buf = self.unshared(dst)?;
        self.inner.staging.write(&self.inner.stream, values, buf)
    }

    pub(super) fn upload_ids_impl(&self, values: &[u32]) -> Result<CudaIds> {
        let buf = self
            .inner
            .stream
            .clone_htod(if values.is_empty() {
                &[0u32][..]
            } else {
                values
            })
            .map_err(|e| cuda_err("uploading ids")(&e))?;
        Ok(CudaIds {
            len: values.len(),
            buf,
        })
    }

    pub(super) fn write_ids_impl(
        &self,
        dst: &mut CudaIds,
        at: usize,
        values: &[u32],
    ) -> Result<()> {
        if at + values.len() > dst.len {
            return Err(Error::shape(
                "write_ids",
                format!("{} ids at {at} into a buffer of {}", values.len(), dst.len),
            ));
        }
        if values.is_empty() {
            return Ok(());
        }
        let mut target = dst.buf.slice_mut(at..at + values.len());
        self.inner
            .stream
            .memcpy_htod(values, &mut target)
            .map_err(|e| cuda_err("write_ids")(&e))
    }

    pub(super) fn download_ids_impl(&self, ids: &CudaIds, n: usize) -> Result<Vec<u32>> {
        if n > ids.len {
            return Err(Error::shape(
                "download_ids",
                format!("{n} ids from a buffer of {}", ids.len),
            ));
        }
        if n == 0 {
            return Ok(Vec::new());
        }
        self.inner
            .stream
            .clone_dtoh(&ids.buf.slice(..n))
            .map_err(|e| cuda_err("download_ids")(&e))
    }

    pub(super) fn zeros_cache_impl(
        &self,
        slots: usize,
        heads: usize,
        dim: usize,
        format: crate::KvFormat,
    ) -> Result<CudaCache> {
        self.check_kv_format_impl(format, heads, dim)?;
        let bytes =
            slots * heads * dim * format.element_bytes(<Self as crate::Backend>::CACHE_BYTES);
        let buf = self
            .inner
            .stream
            .alloc_zeros::<u8>(bytes.max(2))
            .map_err(|e| cuda_err("allocating the KV cache")(&e))?;
        Ok(CudaCache {
            shape: [slots, heads, dim],
            format,
            buf,
        })
    }

    pub(super) fn download_cache_impl(&self, cache: &CudaCache) -> Result<HostTensor> {
        let bytes = self
            .inner
            .stream
            .clone_dtoh(&cache.buf)
            .map_err(|e| cuda_err("download_cache")(&e))?;
        let n: usize = cache.shape.iter().product();
        let values = match cache.format {
            crate::KvFormat::Native => bytes[..2 * n]
                .chunks_exact(2)
                .map(|h| half::f16::from_le_bytes([h[0], h[1]]).to_f32())
                .collect(),
            crate::KvFormat::Fp8 { scale } => bytes[..n]
                .iter()
                .map(|&b| crate::kv::fp8_load(b, scale))
                .collect(),
        };
        HostTensor::new(cache.shape.to_vec(), values)
    }
}

/// A tensor handed to another backend of this process ([`crate::handoff`]). Its memory goes
/// back on the stream that made it, which knows nothing of the reader's stream: dropping it
/// first waits for the reader's last copy of it (in practice long done; a request cancelled
/// while its prefill chunk still runs is the case this covers).
struct HandedOff {
    tensor: CudaTensor,
    /// Recorded on the writer's stream after the ops that compute `tensor`.
    ready: CudaEvent,
    last_read: Mutex<Option<CudaEvent>>,
}

impl HandedOff {
    /// The handed-over tensor `rows` holds, for `op`; an error if another kind of backend
    /// (the CPU) made it.
    fn of<'a>(rows: &'a DeviceRows, op: &'static str) -> Result<&'a HandedOff> {
        rows.get::<HandedOff>().ok_or_else(|| {
            Error::shape(
                op,
                format!("embeddings {:?} handed over by a CPU backend", rows.shape()),
            )
        })
    }
}

impl Drop for HandedOff {
    fn drop(&mut self) {
        let read = self.last_read.get_mut().unwrap_or_else(|e| e.into_inner());
        if let Some(read) = read.take() {
            if let Err(e) = read.synchronize() {
                tracing::warn!(error = %e, "waiting for a read of handed-over embeddings");
            }
        }
    }
}
