//! Run-time kernel compilation: CUDA sources embedded in the binary, compiled by NVRTC for the
//! GPU that is present, cached on disk so a second start does not recompile.
//!
//! - Headers: NVRTC needs the CUDA include directory; it is found from `CUDA_HOME`, then
//!   `CUDA_PATH`, then `/usr/local/cuda`, and a missing one is an error naming those variables.
//! - Cache: `<dir>/<name>-sm<arch>-nvrtc<major>.<minor>-<source hash>.ptx`, where `<dir>` is
//!   `VLM_KERNEL_CACHE`, else `$XDG_CACHE_HOME/vlm/kernels`, else `~/.cache/vlm/kernels`.
//!   Writes go through a temporary file and a rename, so concurrent starts never read half a file.

use std::path::{Path, PathBuf};

use cudarc::nvrtc::CompileOptions;

use crate::{Error, Result};

/// The CUDA include directory NVRTC should search, or an error that says how to point at one.
pub fn cuda_include_dir() -> Result<PathBuf> {
    include_dir_from(
        std::env::var_os("CUDA_HOME").map(PathBuf::from),
        std::env::var_os("CUDA_PATH").map(PathBuf::from),
    )
}

fn include_dir_from(cuda_home: Option<PathBuf>, cuda_path: Option<PathBuf>) -> Result<PathBuf> {
    let candidates: Vec<PathBuf> = [cuda_home, cuda_path, Some(PathBuf::from("/usr/local/cuda"))]
        .into_iter()
        .flatten()
        .map(|root| root.join("include"))
        .collect();
    candidates
        .iter()
        .find(|dir| dir.join("cuda_runtime.h").is_file() || dir.join("cuda_fp16.h").is_file())
        .cloned()
        .ok_or_else(|| Error::Cuda {
            what: format!(
                "CUDA headers not found (looked in {}); NVRTC needs them: set CUDA_HOME or CUDA_PATH to the CUDA toolkit root",
                candidates
                    .iter()
                    .map(|p| p.display().to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        })
}

/// Where compiled kernels are kept between runs.
pub fn cache_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("VLM_KERNEL_CACHE") {
        return PathBuf::from(d);
    }
    let base = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
        .unwrap_or_else(std::env::temp_dir);
    base.join("vlm").join("kernels")
}

/// FNV-1a, 64 bits: stable across Rust versions and platforms (unlike `DefaultHasher`), which
/// a cache key on disk needs.
pub fn source_hash(source: &str) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in source.bytes() {
        h ^= b as u64;
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// The cache file for a kernel source compiled for compute capability `arch` by NVRTC
/// `nvrtc_version` (major, minor).
pub fn cache_path(
    dir: &Path,
    name: &str,
    source: &str,
    arch: (i32, i32),
    nvrtc_version: (i32, i32),
) -> PathBuf {
    dir.join(format!(
        "{name}-sm{}{}-nvrtc{}.{}-{:016x}.ptx",
        arch.0,
        arch.1,
        nvrtc_version.0,
        nvrtc_version.1,
        source_hash(source)
    ))
}

/// Returns the cached PTX at `path`, or runs `compile`, stores its result there and returns it.
/// A cache that cannot be written is not an error: the kernels still run, just compiled again
/// next time.
pub fn cached_or_compile(
    path: &Path,
    compile: impl FnOnce() -> Result<String>,
) -> Result<(String, bool)> {
    if let Ok(ptx) = std::fs::read_to_string(path) {
        if ptx.contains(".entry") {
            return Ok((ptx, true));
        }
    }
    let ptx = compile()?;
    if let Some(dir) = path.parent() {
        let tmp = path.with_extension(format!("tmp{}", std::process::id()));
        let written = std::fs::create_dir_all(dir)
            .and_then(|()| std::fs::write(&tmp, &ptx))
            .and_then(|()| std::fs::rename(&tmp, path));
        if let Err(e) = written {
            tracing::warn!(path = %path.display(), error = %e, "cannot write the kernel cache; kernels will be recompiled next start");
            let _ = std::fs::remove_file(&tmp);
        }
    }
    Ok((ptx, false))
}

/// Compiles one kernel file to PTX for compute capability `cc` with NVRTC, for that exact chip
/// when `arch_specific` (`compute_90a`: instructions such as wgmma that later GPUs need not
/// have). Files that include CUDA headers (`cuda_fp16.h`) need them found (see
/// [`cuda_include_dir`]).
pub(super) fn compile_ptx(
    file: &str,
    source: &str,
    cc: (i32, i32),
    arch_specific: bool,
) -> Result<String> {
    let suffix = if arch_specific { "a" } else { "" };
    let arch: &'static str =
        Box::leak(format!("compute_{}{}{suffix}", cc.0, cc.1).into_boxed_str());
    let include_paths = if source.contains("#include") {
        vec![cuda_include_dir()?.display().to_string()]
    } else {
        Vec::new()
    };
    let opts = CompileOptions {
        arch: Some(arch),
        include_paths,
        ..Default::default()
    };
    cudarc::nvrtc::compile_ptx_with_opts(source, opts)
        .map(|p| p.to_src())
        .map_err(|e| Error::KernelCompile {
            kernel: format!("{file} for {arch}"),
            log: match e {
                cudarc::nvrtc::CompileError::CompileError { log, .. } => {
                    log.to_string_lossy().into_owned()
                }
                other => other.to_string(),
            },
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tmp(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("vlm-kcache-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn header_discovery_prefers_cuda_home_and_names_the_variables_when_missing() {
        let root = tmp("headers");
        let err = include_dir_from(Some(root.clone()), None)
            .unwrap_err()
            .to_string();
        if !Path::new("/usr/local/cuda/include/cuda_runtime.h").is_file() {
            assert!(
                err.contains("CUDA_HOME") && err.contains("CUDA_PATH"),
                "{err}"
            );
            assert!(
                err.contains(&root.join("include").display().to_string()),
                "{err}"
            );
        }
        std::fs::create_dir_all(root.join("include")).unwrap();
        std::fs::write(root.join("include/cuda_runtime.h"), "").unwrap();
        assert_eq!(
            include_dir_from(None, Some(root.clone())).unwrap(),
            root.join("include")
        );
        assert_eq!(
            include_dir_from(Some(root.clone()), None).unwrap(),
            root.join("include")
        );
    }

    #[test]
    fn cache_key_changes_with_source_arch_and_nvrtc_version() {
        let d = Path::new("/c");
        let a = cache_path(d, "ops", "src", (9, 0), (12, 6));
        assert_ne!(a, cache_path(d, "ops", "src2", (9, 0), (12, 6)));
        assert_ne!(a, cache_path(d, "ops", "src", (8, 7), (12, 6)));
        assert_ne!(a, cache_path(d, "ops", "src", (9, 0), (13, 0)));
        assert_eq!(a, cache_path(d, "ops", "src", (9, 0), (12, 6)));
        // FNV-1a of "a" is a published constant: the key is stable across builds.
        assert_eq!(source_hash("a"), 0xaf63_dc4c_8601_ec8c);
    }

    #[test]
    fn second_call_reads_the_cache_instead_of_compiling() {
        let path = tmp("cache").join("sub/ops.ptx");
        let (ptx, hit) =
            cached_or_compile(&path, || Ok(".visible .entry add_f32()".into())).unwrap();
        assert!(!hit && ptx.contains("add_f32"));
        let (again, hit) = cached_or_compile(&path, || panic!("must not recompile")).unwrap();
        assert!(hit);
        assert_eq!(again, ptx);
        // A corrupt cache entry is recompiled, not trusted.
        std::fs::write(&path, "garbage").unwrap();
        let (_, hit) = cached_or_compile(&path, || Ok(".entry x".into())).unwrap();
        assert!(!hit);
    }
}
