//! `vlm doctor`: whether this machine can run `--device cuda` (driver, NVRTC, cuBLAS, CUDA
//! headers, kernel cache), every kernel compiled for the target GPUs, and on a GPU the
//! self-check op by op. One line per check; exit 0 only if all is in order.

use anyhow::bail;

#[derive(clap::Args)]
pub struct DoctorArgs {
    /// GPU architectures to compile every kernel for (no GPU needed), comma-separated: sm_87
    /// is Jetson Orin, sm_90 H100, sm_89 L4/L40, sm_80 A100.
    #[arg(long, value_delimiter = ',', default_value = "sm_87,sm_90")]
    arch: Vec<String>,
}

pub fn doctor(args: DoctorArgs) -> anyhow::Result<()> {
    let archs = args
        .arch
        .iter()
        .map(|a| {
            let digits = a.trim_start_matches("sm_");
            match (digits.len(), digits.parse::<i32>()) {
                (2..=3, Ok(n)) => Ok((n / 10, n % 10)),
                _ => bail!("--arch {a}: expected sm_XY, e.g. sm_87 (Orin) or sm_90 (H100)"),
            }
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    let ok = vlm_compute::cuda::doctor::run(&archs, |f| {
        println!(
            "{:<8} {:<38} {}",
            if f.ok { "ok" } else { "PROBLEM" },
            f.what,
            f.detail
        );
    });
    if !ok {
        bail!("--device cuda cannot run here until the problems above are fixed");
    }
    println!("--device cuda can run here.");
    Ok(())
}
