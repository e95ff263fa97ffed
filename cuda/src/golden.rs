//! Reading the golden fixtures that `tests/fixtures/make_fixtures.py` writes from HF
//! transformers: `golden/golden.safetensors` (f32 and i64 tensors) and `golden/golden.json`
//! (what was asked). Used by the tests of every stage.

use std::path::{Path, PathBuf};

use safetensors::{Dtype, SafeTensors};
use serde_json::Value;

use crate::{files, Error, HostTensor, Result};

/// The bundled tiny checkpoint, for the tests of a crate whose directory is `manifest_dir`
/// (`env!("CARGO_MANIFEST_DIR")`, fixed when the test was built). A test program carried to
/// another machine (the GPU one, which has no Rust) finds it relative to the directory it runs
/// in instead: run it from the crate's directory.
pub fn tiny_fixture(manifest_dir: &str) -> PathBuf {
    fixture(manifest_dir, "tiny-qwen3-vl")
}

/// `tests/fixtures/<name>` (`tiny-qwen3-vl`, `tiny-qwen3`, `tiny-qwen2`), found as
/// [`tiny_fixture`] finds its own.
pub fn fixture(manifest_dir: &str, name: &str) -> PathBuf {
    let rel = Path::new("../tests/fixtures").join(name);
    let built = Path::new(manifest_dir).join(&rel);
    if built.is_dir() {
        built
    } else {
        rel
    }
}

pub struct Golden {
    path: PathBuf,
    bytes: Vec<u8>,
    manifest: Value,
}

impl Golden {
    /// Opens `<model_dir>/golden/`.
    pub fn open(model_dir: &Path) -> Result<Self> {
        let dir = model_dir.join("golden");
        let path = dir.join("golden.safetensors");
        let bytes = std::fs::read(&path).map_err(|source| Error::Io {
            path: path.clone(),
            source,
        })?;
        let manifest = files::read_json(&dir.join("golden.json"))?;
        Ok(Self {
            path,
            bytes,
            manifest,
        })
    }

    /// What was asked of HF: `{"images": {...}, "cases": [...]}`.
    pub fn manifest(&self) -> &Value {
        &self.manifest
    }

    fn view(&self, name: &str) -> Result<(Dtype, Vec<usize>, &[u8])> {
        let st = SafeTensors::deserialize(&self.bytes).map_err(|e| Error::BadSafetensors {
            path: self.path.clone(),
            message: e.to_string(),
        })?;
        let t = st.tensor(name).map_err(|_| Error::MissingTensor {
            name: name.to_string(),
            dir: self.path.clone(),
        })?;
        let (start, len) = (
            t.data().as_ptr() as usize - self.bytes.as_ptr() as usize,
            t.data().len(),
        );
        Ok((
            t.dtype(),
            t.shape().to_vec(),
            &self.bytes[start..start + len],
        ))
    }

    /// An f32 tensor.
    pub fn tensor(&self, name: &str) -> Result<HostTensor> {
        let (dtype, shape, data) = self.view(name)?;
        if dtype != Dtype::F32 {
            return Err(Error::UnsupportedDtype {
                name: name.into(),
                dtype: format!("{dtype:?}"),
            });
        }
        let v = data
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        HostTensor::new(shape, v)
    }

    /// An i64 tensor, flattened, with its shape.
    pub fn ints(&self, name: &str) -> Result<(Vec<usize>, Vec<i64>)> {
        let (dtype, shape, data) = self.view(name)?;
        if dtype != Dtype::I64 {
            return Err(Error::UnsupportedDtype {
                name: name.into(),
                dtype: format!("{dtype:?}"),
            });
        }
        let v = data
            .chunks_exact(8)
            .map(|b| i64::from_le_bytes(b.try_into().expect("8 bytes")))
            .collect();
        Ok((shape, v))
    }
}
