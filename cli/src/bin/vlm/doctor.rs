//! `vlm doctor`: whether this machine can run `--device cuda` (driver, NVRTC, cuBLAS, CUDA
//! headers, kernel cache), every kernel compiled for the target GPUs, and on a GPU the
//! self-check op by op. One line per check; exit 0 only if all is in order. With `--model`,
//! first what that model takes on the GPU, by kind.

use anyhow::bail;

#[derive(clap::Args)]
pub struct DoctorArgs {
    /// GPU architectures to compile every kernel for (no GPU needed), comma-separated: sm_87
    /// is Jetson Orin, sm_90 H100, sm_89 L4/L40, sm_80 A100.
    #[arg(long, value_delimiter = ',', default_value = "sm_87,sm_90")]
    arch: Vec<String>,
    /// Also say what this checkpoint takes on the GPU (from its config.json alone): weights by
    /// format, the KV cache for --kv-cache-tokens, and a quantized model's scratch.
    #[arg(long, value_name = "DIR")]
    model: Option<std::path::PathBuf>,
    /// Tokens of KV cache to count with --model.
    #[arg(long, default_value_t = 8192, requires = "model")]
    kv_cache_tokens: usize,
    /// How that KV cache stores keys and values with --model: auto (f16) or fp8 (e4m3, one
    /// byte an element).
    #[arg(
        long,
        default_value = "auto",
        value_name = "auto|fp8",
        requires = "model"
    )]
    kv_cache_dtype: llm_svc::KvCacheDtype,
    #[command(flatten)]
    weights: llm_svc::WeightArgs,
}

pub fn doctor(args: DoctorArgs) -> anyhow::Result<()> {
    if let Some(dir) = &args.model {
        print_footprint(dir, args.weights, args.kv_cache_tokens, args.kv_cache_dtype)?;
    }
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

/// What the model in `dir` takes on the GPU, a line per kind.
fn print_footprint(
    dir: &std::path::Path,
    weights: llm_svc::WeightArgs,
    kv_tokens: usize,
    kv_dtype: llm_svc::KvCacheDtype,
) -> anyhow::Result<()> {
    let f = vlm_cli::footprint::Footprint::of(dir, weights, kv_tokens, kv_dtype)?;
    let gb = |b: usize| format!("{:>7.2} GB", b as f64 / 1e9);
    println!("{} on the GPU:", dir.display());
    println!(
        "  {} text decoder matrices ({})",
        gb(f.decoder_matrices),
        f.decoder_format
    );
    if f.lm_head_int8 > 0 {
        println!("  {} embeddings (f16)", gb(f.embeddings));
        println!("  {} lm_head (8-bit)", gb(f.lm_head_int8));
    } else {
        println!("  {} embeddings and lm_head (f16)", gb(f.embeddings));
    }
    if f.vision > 0 {
        println!("  {} vision tower and mergers (f16)", gb(f.vision));
    }
    println!(
        "  {} KV cache, {} tokens ({})",
        gb(f.kv_cache),
        f.kv_tokens,
        match kv_dtype {
            llm_svc::KvCacheDtype::Auto => "f16",
            llm_svc::KvCacheDtype::Fp8 => "FP8 e4m3",
        }
    );
    if f.dequant_scratch > 0 {
        println!(
            "  {} dequantization scratch (prefill and batches)",
            gb(f.dequant_scratch)
        );
    }
    println!(
        "  {} in all, before activations, workspaces and recorded graphs (llm-svc keeps 1 GiB and a step's activations for them)",
        gb(f.total())
    );
    Ok(())
}
