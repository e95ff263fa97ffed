//! The one way a failed driver, cuBLAS or NVRTC call becomes this crate's error: named by what
//! was being done. The bottom of the CUDA backend: every file uses it, it uses none of them.

use crate::Error;

pub(super) fn cuda_err(op: &str) -> impl Fn(&dyn std::fmt::Display) -> Error + '_ {
    move |e| Error::Cuda {
        what: format!("{op}: {e}"),
    }
}
