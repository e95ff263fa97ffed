//! Which backend a process runs on: one [`Device`] flag, parsed once, and one dispatcher
//! ([`Device::run`]) that hands the matching backend to code written once over [`Backend`].
//!
//! Every binary (`vision-svc`, `llm-svc`, `vlm run/serve/bench/load`) states its work as an
//! [`OnDevice`] and lets the device pick the backend, so the choice between the CPU and CUDA
//! is made here and nowhere else.

use crate::{Backend, CpuBackend, CudaBackend, Result};

/// Where the models run (`--device`): `cpu`, or `cuda` / `cuda:N` for GPU N.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Device {
    /// The CPU reference path (any machine).
    Cpu,
    /// An NVIDIA GPU (by its CUDA ordinal; `cuda` is GPU 0) through CUDA: kernels compiled at
    /// run time by NVRTC, each checked against the CPU reference on this GPU before anything
    /// is served.
    Cuda(u8),
}

/// GPUs `--device cuda:N` can name (N below this).
pub const MAX_GPUS: usize = 16;

/// Every value of the flag, for clap.
const VARIANTS: [Device; MAX_GPUS + 1] = {
    let mut v = [Device::Cpu; MAX_GPUS + 1];
    let mut i = 0;
    while i < MAX_GPUS {
        v[i + 1] = Device::Cuda(i as u8);
        i += 1;
    }
    v
};

/// Each GPU's name as a flag value (GPU 0 is `cuda`, also `cuda:0`).
const CUDA_NAMES: [&str; MAX_GPUS] = [
    "cuda", "cuda:1", "cuda:2", "cuda:3", "cuda:4", "cuda:5", "cuda:6", "cuda:7", "cuda:8",
    "cuda:9", "cuda:10", "cuda:11", "cuda:12", "cuda:13", "cuda:14", "cuda:15",
];

/// Opens and verifies GPU `N`: a plain function per GPU, as [`OnDevice::run`] takes one.
fn open_cuda<const N: usize>() -> Result<CudaBackend> {
    CudaBackend::open_verified(N)
}

const OPEN_CUDA: [fn() -> Result<CudaBackend>; MAX_GPUS] = [
    open_cuda::<0>,
    open_cuda::<1>,
    open_cuda::<2>,
    open_cuda::<3>,
    open_cuda::<4>,
    open_cuda::<5>,
    open_cuda::<6>,
    open_cuda::<7>,
    open_cuda::<8>,
    open_cuda::<9>,
    open_cuda::<10>,
    open_cuda::<11>,
    open_cuda::<12>,
    open_cuda::<13>,
    open_cuda::<14>,
    open_cuda::<15>,
];

impl clap::ValueEnum for Device {
    fn value_variants<'a>() -> &'a [Self] {
        &VARIANTS
    }

    fn to_possible_value(&self) -> Option<clap::builder::PossibleValue> {
        use clap::builder::PossibleValue;
        Some(match *self {
            Device::Cpu => PossibleValue::new("cpu").help("the CPU reference path (any machine)"),
            Device::Cuda(0) => PossibleValue::new("cuda")
                .alias("cuda:0")
                .help("NVIDIA GPU 0 through CUDA (cuda:N: GPU N)"),
            Device::Cuda(n) => PossibleValue::new(CUDA_NAMES[n as usize]).hide(true),
        })
    }
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

/// Work over several devices of one kind (one replica each), run by [`Device::run_all`].
pub trait OnDevices {
    type Output;
    /// Runs the work with one opener per device, in the order given.
    fn run<B: Backend + Clone>(self, opens: Vec<fn() -> Result<B>>) -> Self::Output;
}

impl Device {
    /// Runs `work` once over every device of `devices`: all the CPU (replicas sharing it) or all
    /// GPUs (GPU N opened and verified by its own opener). `None` if the list mixes the two or
    /// is empty.
    pub fn run_all<W: OnDevices>(devices: &[Device], work: W) -> Option<W::Output> {
        if devices.is_empty() {
            return None;
        }
        if devices.iter().all(|d| *d == Device::Cpu) {
            let cpu: fn() -> Result<CpuBackend> = || Ok(CpuBackend::new());
            return Some(work.run(vec![cpu; devices.len()]));
        }
        let gpus: Option<Vec<_>> = devices
            .iter()
            .map(|d| match d {
                Device::Cuda(n) => Some(OPEN_CUDA[*n as usize]),
                Device::Cpu => None,
            })
            .collect();
        gpus.map(|opens| work.run(opens))
    }

    /// Short name for logs and reports, as the flag takes it ("cpu", "cuda", "cuda:1").
    pub fn name(self) -> &'static str {
        match self {
            Device::Cpu => "cpu",
            Device::Cuda(n) => CUDA_NAMES[n as usize],
        }
    }

    /// Whether the device has memory of its own (the KV cache is then sized from it).
    pub fn is_gpu(self) -> bool {
        matches!(self, Device::Cuda(_))
    }

    /// Runs `work` on this device's backend: the one place the backend is chosen.
    pub fn run<W: OnDevice>(self, work: W) -> W::Output {
        match self {
            Device::Cpu => work.run(|| Ok(CpuBackend::new())),
            // The GPU, once every kernel has matched the CPU reference on it. Without a GPU
            // or driver (or without GPU N) the open fails with what is missing (Error::Cuda).
            Device::Cuda(n) => work.run(OPEN_CUDA[n as usize]),
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
            Device::Cuda(n) => {
                let gpu = CudaBackend::new(n as usize)?;
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
        for d in VARIANTS {
            assert_eq!(Device::from_str(d.name(), false).unwrap(), d);
        }
        assert_eq!(Device::from_str("cuda:0", false).unwrap(), Device::Cuda(0));
        assert_eq!(Device::from_str("cuda:3", false).unwrap(), Device::Cuda(3));
        assert_eq!(Device::Cuda(3).name(), "cuda:3");
        assert!(Device::from_str("tpu", false).is_err());
        assert!(Device::from_str("cuda:16", false).is_err());
    }

    #[test]
    fn cuda_opens_the_cuda_backend_or_says_what_is_missing() {
        match Device::Cuda(0).run(BackendName) {
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
