//! `vlm doctor`: what `--device cuda` needs on this machine, checked one at a time, each with
//! what to do about it. Useful where a service refuses to start (a Jetson image missing its
//! headers, a host whose driver is too old) and before deploying an image at all: the kernels
//! can be compiled for a target GPU without one.

use super::context::nvrtc_version;
use super::{compile, compile_all_ptx, cuda_libraries, CudaBackend, CudaLibrary};

/// One finding: what was checked, whether it is in order, and the detail (a version, a path,
/// or what to do).
#[derive(Clone, Debug)]
pub struct Finding {
    pub what: String,
    pub ok: bool,
    pub detail: String,
}

/// Runs every check, handing each finding to `report` as it comes (some take seconds), and
/// returns whether `--device cuda` can work here. `archs` are compute capabilities to compile
/// the kernels for besides the GPU's own (e.g. (8, 7) for Jetson Orin).
pub fn run(archs: &[(i32, i32)], mut report: impl FnMut(&Finding)) -> bool {
    let mut all_ok = true;
    let mut note = |what: &str, ok: bool, detail: String| {
        all_ok &= ok;
        report(&Finding {
            what: what.to_string(),
            ok,
            detail,
        });
    };
    let libraries = cuda_libraries();
    for lib in &libraries {
        note(lib.name, lib.present, library_detail(lib));
    }
    let [driver, nvrtc, cublas, cublas_lt] = libraries.map(|l| l.present);
    let headers_ok = check_headers(&mut note);
    check_kernel_cache(&mut note);
    if nvrtc && headers_ok {
        for &arch in archs {
            check_compiles(arch, &mut note);
        }
    }
    if !(driver && nvrtc && cublas && cublas_lt && headers_ok) {
        return all_ok;
    }
    check_gpu(&mut note);
    all_ok
}

/// A library's detail: NVRTC's version, "loaded", or what to do where it is missing.
fn library_detail(lib: &CudaLibrary) -> String {
    match (lib.present, lib.name.starts_with("NVRTC")) {
        (true, true) => {
            let (major, minor) = nvrtc_version();
            format!("{major}.{minor}")
        }
        (true, false) => "loaded".into(),
        (false, _) => format!("not found: {}", lib.hint),
    }
}

/// Whether NVRTC finds the CUDA headers (and where).
fn check_headers(note: &mut impl FnMut(&str, bool, String)) -> bool {
    let headers = compile::cuda_include_dir();
    let headers_ok = headers.is_ok();
    note(
        "CUDA headers for NVRTC",
        headers_ok,
        match headers {
            Ok(dir) => dir.display().to_string(),
            Err(e) => e.to_string(),
        },
    );
    headers_ok
}

/// Whether compiled kernels can be kept (the cache directory is writable).
fn check_kernel_cache(note: &mut impl FnMut(&str, bool, String)) {
    let cache = compile::cache_dir();
    let writable = std::fs::create_dir_all(&cache).is_ok() && {
        let probe = cache.join(format!(".doctor-{}", std::process::id()));
        let ok = std::fs::write(&probe, b"ok").is_ok();
        let _ = std::fs::remove_file(&probe);
        ok
    };
    note(
        "kernel cache",
        writable,
        if writable {
            cache.display().to_string()
        } else {
            format!(
                "{} is not writable: kernels will be compiled at every start; set VLM_KERNEL_CACHE",
                cache.display()
            )
        },
    );
}

/// Whether every kernel compiles for compute capability `major.minor` (no GPU needed).
fn check_compiles((major, minor): (i32, i32), note: &mut impl FnMut(&str, bool, String)) {
    let spinner = indicatif::ProgressBar::new_spinner()
        .with_message(format!("compiling every kernel for sm_{major}{minor}"));
    spinner.enable_steady_tick(std::time::Duration::from_millis(120));
    let compiled = compile_all_ptx((major, minor));
    spinner.finish_and_clear();
    note(
        &format!("kernels compile for sm_{major}{minor}"),
        compiled.is_ok(),
        match compiled {
            Ok(files) => format!("{} files", files.len()),
            Err(e) => e.to_string(),
        },
    );
}

/// A GPU: opens it (compiling for it) and runs the serving self-check, op by op.
fn check_gpu(note: &mut impl FnMut(&str, bool, String)) {
    match CudaBackend::new(0) {
        Ok(gpu) => {
            let (major, minor) = gpu.compute_capability();
            note(
                "GPU 0",
                true,
                format!(
                    "{} (sm_{major}{minor}, driver supports CUDA {})",
                    gpu.device_name(),
                    gpu.driver_version()
                ),
            );
            let mut worst = String::new();
            let mut worst_ratio = 0.0f32;
            let checked = crate::twin::self_check(&gpu, |o| {
                if o.share_of_allowed() >= worst_ratio {
                    worst_ratio = o.share_of_allowed();
                    worst = o.to_string();
                }
            });
            note(
                "self-check against the CPU reference",
                checked.is_ok(),
                match checked {
                    Ok(()) => format!(
                        "{} ops pass; closest to its tolerance: {worst}",
                        crate::twin::self_check_cases().len()
                    ),
                    Err(e) => e.to_string(),
                },
            );
        }
        Err(e) => note("GPU 0", false, e.to_string()),
    }
}
