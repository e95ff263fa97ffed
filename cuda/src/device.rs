//! Which backend a process runs on: one [`Device`] flag, parsed once, and one dispatcher
//! ([`Device::run`]) that hands the matching backend to code written once over [`Backend`].
//!
//! Every binary (`vision-svc`, `llm-svc`, `vlm run/serve/bench/load`) states its work as an
//! [`OnDevice`] and lets the device pick the backend, so the choice between the CPU and CUDA
//! is made here and nowhere else.

use crate::{Backend, CpuBackend, CudaBackend, Result};

/// Where the models run (`--device`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Device {
    /// The CPU reference path (any machine).
    Cpu,
    /// An NVIDIA GPU (GPU 0) through CUDA: kernels compiled at run time by NVRTC, each
    /// checked against the CPU reference on this GPU before anything is served.
    Cuda,
}

/// Work written once for any backend, run by [`Device::run`].
pub trait OnDevice {
    type Output;
    /// Runs the work with `open`, which opens the chosen backend (the CUDA one verified by
    /// its self-check). It is a plain function so the work may call it where and when it
    /// needs: a service opens the device on its model-loading thread, `vlm serve` once per
    /// service.
    fn run<B: Backend + Clone>(self, open: fn() -> Result<B>) -> Self::Output;
}

impl Device {
    /// Short name for logs and reports ("cpu", "cuda").
    pub fn name(self) -> &'static str {
        match self {
            Device::Cpu => "cpu",
            Device::Cuda => "cuda",
        }
    }

    /// Whether the device has memory of its own (the KV cache is then sized from it).
    pub fn is_gpu(self) -> bool {
        self == Device::Cuda
    }

    /// Runs `work` on this device's backend: the one place the backend is chosen.
    pub fn run<W: OnDevice>(self, work: W) -> W::Output {
        match self {
            Device::Cpu => work.run(|| Ok(CpuBackend::new())),
            // GPU 0, once every kernel has matched the CPU reference on it. Without a GPU
            // or driver the open fails with what is missing (Error::Cuda).
            Device::Cuda => work.run(|| CudaBackend::open_verified(0)),
        }
    }

    /// What the work runs on, for reports: the CPU's threads, or the GPU's name, compute
    /// capability and driver.
    pub fn describe(self) -> Result<String> {
        Ok(match self {
            Device::Cpu => format!(
                "cpu ({} threads)",
                std::thread::available_parallelism().map_or(1, |n| n.get())
            ),
            Device::Cuda => {
                let gpu = CudaBackend::new(0)?;
                let (major, minor) = gpu.compute_capability();
                format!(
                    "{} (sm_{major}{minor}, driver CUDA {})",
                    gpu.device_name(),
                    gpu.driver_version()
                )
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Reports which backend the dispatcher opened.
    struct BackendName;

    impl OnDevice for BackendName {
        type Output = Result<&'static str>;
        fn run<B: Backend + Clone>(self, open: fn() -> Result<B>) -> Self::Output {
            Ok(open()?.name())
        }
    }

    #[test]
    fn cpu_dispatches_to_the_cpu_backend_and_names_parse_as_flags() {
        assert_eq!(Device::Cpu.run(BackendName).unwrap(), "cpu");
        use clap::ValueEnum;
        for d in [Device::Cpu, Device::Cuda] {
            assert_eq!(Device::from_str(d.name(), false).unwrap(), d);
        }
        assert!(Device::from_str("tpu", false).is_err());
    }

    #[test]
    fn cuda_opens_the_cuda_backend_or_says_what_is_missing() {
        match Device::Cuda.run(BackendName) {
            Ok(name) => assert_eq!(name, "cuda"),
            Err(e) => assert!(
                matches!(
                    e,
                    crate::Error::Cuda { .. }
                        | crate::Error::SelfCheck { .. }
                        | crate::Error::KernelCompile { .. }
                ),
                "{e}"
            ),
        }
    }
}
