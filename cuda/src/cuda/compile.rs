//! Run-time kernel compilation: CUDA sources embedded in the binary, compiled by NVRTC to machine
//! code (CUBIN) for the GPU that is present, cached on disk so a second start does not recompile.
//!
//! - Why CUBIN and not PTX: the driver compiles PTX again at every start unless its own cache
//!   (`~/.nv/ComputeCache`) kept the result, and that cache is not ours: it is lost with a fresh
//!   container or machine, and the compose files' kernel-cache volume does not hold it. On an
//!   H200 (2026-11-29) `vlm run` with the PTX cached and the driver's cache off took 63 s, from
//!   cached CUBINs 3 s; an Orin's CPU compiles slower still. A cached CUBIN loads as is.
//! - Headers: NVRTC needs the CUDA include directory; it is found from `CUDA_HOME`, then
//!   `CUDA_PATH`, then `/usr/local/cuda`, and a missing one is an error naming those variables.
//! - Cache: `<dir>/<name>-sm<arch>-nvrtc<major>.<minor>-<source hash>.cubin`, where `<dir>` is
//!   `VLM_KERNEL_CACHE`, else `$XDG_CACHE_HOME/vlm/kernels`, else `~/.cache/vlm/kernels`.
//!   Writes go through a temporary file and a rename, so concurrent starts never read half a file.
//! - PTX is still what CI checks without a GPU ([`compile_ptx`], assembled by ptxas for spills).

use std::ffi::CString;
use std::path::{Path, PathBuf};

use cudarc::nvrtc::{result as nvrtc, sys as nvrtc_sys};

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
        "{name}-sm{}{}-nvrtc{}.{}-{:016x}.cubin",
        arch.0,
        arch.1,
        nvrtc_version.0,
        nvrtc_version.1,
        source_hash(source)
    ))
}

/// Whether `bytes` can be a CUBIN: an ELF file (a cache entry cut short or overwritten is
/// compiled again, not handed to the driver).
fn is_cubin(bytes: &[u8]) -> bool {
    bytes.len() > 64 && bytes.starts_with(b"\x7fELF")
}

/// Returns the cached CUBIN at `path`, or runs `compile`, stores its result there and returns
/// it, with whether it came from the cache. A cache that cannot be written is not an error: the
/// kernels still run, just compiled again next time.
pub fn cached_or_compile(
    path: &Path,
    compile: impl FnOnce() -> Result<Vec<u8>>,
) -> Result<(Vec<u8>, bool)> {
    if let Ok(cubin) = std::fs::read(path) {
        if is_cubin(&cubin) {
            return Ok((cubin, true));
        }
    }
    let cubin = compile()?;
    if let Some(dir) = path.parent() {
        let tmp = path.with_extension(format!("tmp{}", std::process::id()));
        let written = std::fs::create_dir_all(dir)
            .and_then(|()| std::fs::write(&tmp, &cubin))
            .and_then(|()| std::fs::rename(&tmp, path));
        if let Err(e) = written {
            tracing::warn!(path = %path.display(), error = %e, "cannot write the kernel cache; kernels will be recompiled next start");
            let _ = std::fs::remove_file(&tmp);
        }
    }
    Ok((cubin, false))
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
    let ptx = nvrtc_compile(file, source, "compute", cc, arch_specific, Emit::Ptx)?;
    Ok(String::from_utf8_lossy(&ptx).into_owned())
}

/// Compiles one kernel file to a CUBIN for `sm_{cc}` with NVRTC (`sm_90a` when `arch_specific`,
/// as [`compile_ptx`]'s `compute_90a`): NVRTC runs ptxas itself, so the driver loads the result
/// without compiling it again.
pub(super) fn compile_cubin(
    file: &str,
    source: &str,
    cc: (i32, i32),
    arch_specific: bool,
) -> Result<Vec<u8>> {
    nvrtc_compile(file, source, "sm", cc, arch_specific, Emit::Cubin)
}

/// What [`nvrtc_compile`] hands back.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Emit {
    Ptx,
    Cubin,
}

/// One kernel file through NVRTC for `{kind}_{cc}` (`compute_90`, `sm_87`; an `a` after it
/// when `arch_specific`), the CUDA headers on the include path where the file includes any;
/// an error names the file and the architecture and carries NVRTC's log.
fn nvrtc_compile(
    file: &str,
    source: &str,
    kind: &str,
    cc: (i32, i32),
    arch_specific: bool,
    emit: Emit,
) -> Result<Vec<u8>> {
    let arch = format!(
        "{kind}_{}{}{}",
        cc.0,
        cc.1,
        if arch_specific { "a" } else { "" }
    );
    let failed = |log: String| Error::KernelCompile {
        kernel: format!("{file} for {arch}"),
        log,
    };
    let mut opts = vec![format!("--gpu-architecture={arch}")];
    if source.contains("#include") {
        opts.push(format!("--include-path={}", cuda_include_dir()?.display()));
    }
    let (src, name) = match (CString::new(source), CString::new(file)) {
        (Ok(src), Ok(name)) => (src, name),
        _ => return Err(failed("the source or its name holds a NUL byte".into())),
    };
    let prog = nvrtc::create_program(&src, Some(&name)).map_err(|e| failed(e.to_string()))?;
    // Destroys the program on every path out.
    struct Program(nvrtc_sys::nvrtcProgram);
    impl Drop for Program {
        fn drop(&mut self) {
            // SAFETY: created by create_program above and destroyed only here.
            let _ = unsafe { nvrtc::destroy_program(self.0) };
        }
    }
    let prog = Program(prog);
    // NVRTC's text (the log, PTX) ends at its NUL.
    let text = |chars: Vec<std::ffi::c_char>| -> Vec<u8> {
        chars
            .into_iter()
            .take_while(|&c| c != 0)
            .map(|c| c as u8)
            .collect()
    };
    // SAFETY: `prog` is a live program (above); `src` and `name` outlive it.
    unsafe {
        if let Err(e) = nvrtc::compile_program(prog.0, &opts) {
            let log = nvrtc::get_program_log(prog.0).map(text).unwrap_or_default();
            return Err(failed(format!("{e}: {}", String::from_utf8_lossy(&log))));
        }
        if emit == Emit::Ptx {
            return nvrtc::get_ptx(prog.0)
                .map(text)
                .map_err(|e| failed(e.to_string()));
        }
        let mut size = 0usize;
        nvrtc_sys::nvrtcGetCUBINSize(prog.0, &mut size)
            .result()
            .map_err(|e| failed(e.to_string()))?;
        let mut cubin = vec![0u8; size];
        nvrtc_sys::nvrtcGetCUBIN(prog.0, cubin.as_mut_ptr().cast())
            .result()
            .map_err(|e| failed(e.to_string()))?;
        Ok(cubin)
    }
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
    fn nvrtc_writes_cubins_and_ptx_for_h100_and_orin_and_names_the_file_it_cannot_compile() {
        if !super::super::nvrtc_available() {
            super::super::skip_test(&"libnvrtc not found");
            return;
        }
        let src = r#"extern "C" __global__ void add_one(float* x) { x[threadIdx.x] += 1.0f; }"#;
        for (cc, exact) in [((9, 0), false), ((9, 0), true), ((8, 7), false)] {
            let cubin = compile_cubin("add.cu", src, cc, exact).unwrap();
            assert!(is_cubin(&cubin), "{cc:?}");
            // The kernel's name is in the ELF's symbol table, where the driver looks it up.
            assert!(cubin.windows(7).any(|w| w == b"add_one"), "{cc:?}");
        }
        // The PTX of the same file, through the same NVRTC call.
        let ptx = compile_ptx("add.cu", src, (9, 0), false).unwrap();
        assert!(
            ptx.contains(".entry add_one") && ptx.contains(".target sm_90"),
            "{ptx}"
        );
        let err = compile_cubin("broken.cu", "not CUDA at all", (9, 0), false)
            .unwrap_err()
            .to_string();
        assert!(err.contains("broken.cu for sm_90"), "{err}");
        let err = compile_ptx("broken.cu", "not CUDA at all", (8, 7), false)
            .unwrap_err()
            .to_string();
        assert!(err.contains("broken.cu for compute_87"), "{err}");
    }

    #[test]
    fn second_call_reads_the_cache_instead_of_compiling() {
        let path = tmp("cache").join("sub/ops.cubin");
        let elf = |tag: u8| [b"\x7fELF".as_slice(), &[tag; 96]].concat();
        let (cubin, hit) = cached_or_compile(&path, || Ok(elf(1))).unwrap();
        assert!(!hit && cubin == elf(1));
        let (again, hit) = cached_or_compile(&path, || panic!("must not recompile")).unwrap();
        assert!(hit);
        assert_eq!(again, cubin);
        // A corrupt or cut-short cache entry is recompiled, not trusted.
        for bad in [b"garbage".to_vec(), elf(1)[..32].to_vec()] {
            std::fs::write(&path, bad).unwrap();
            let (fresh, hit) = cached_or_compile(&path, || Ok(elf(2))).unwrap();
            assert!(!hit && fresh == elf(2));
        }
    }
}
