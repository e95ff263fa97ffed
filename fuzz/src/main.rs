//! `vlm-fuzz`: run a fuzz target for longer than CI does, replay a saved input, or rewrite the
//! seed corpora.
//!
//! ```text
//! vlm-fuzz list
//! vlm-fuzz run <target>|all [--seconds N] [--seed S]
//! vlm-fuzz replay <target> <file>...
//! vlm-fuzz seed
//! ```

use std::path::Path;
use std::process::ExitCode;
use std::time::Duration;

use vlm_fuzz::alloc::CappedAlloc;
use vlm_fuzz::runner::{self, RunConfig};
use vlm_fuzz::{target, Target, TARGETS};

#[global_allocator]
static ALLOC: CappedAlloc = CappedAlloc;

const USAGE: &str = "usage: vlm-fuzz list | run <target>|all [--seconds N] [--seed S] | replay <target> <file>... | seed";

fn find(name: &str) -> Result<Vec<&'static Target>, String> {
    if name == "all" {
        return Ok(TARGETS.iter().collect());
    }
    target(name).map(|t| vec![t]).ok_or_else(|| {
        let names: Vec<&str> = TARGETS.iter().map(|t| t.name).collect();
        format!("no target {name:?}; the targets are {}", names.join(", "))
    })
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let result = match args.iter().map(String::as_str).collect::<Vec<_>>()[..] {
        ["list"] => {
            for t in TARGETS {
                println!("{}", t.name);
            }
            Ok(true)
        }
        ["run", name, ref rest @ ..] => run(name, rest),
        ["replay", name, ref files @ ..] if !files.is_empty() => replay(name, files),
        ["seed"] => {
            let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("corpus");
            vlm_fuzz::seeds::write_all(&root)
                .map(|n| {
                    println!("wrote {n} seeds under {}", root.display());
                    true
                })
                .map_err(|e| format!("cannot write the seeds: {e}"))
        }
        _ => Err(USAGE.into()),
    };
    match result {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("{e}");
            ExitCode::from(2)
        }
    }
}

fn run(name: &str, rest: &[&str]) -> Result<bool, String> {
    let mut cfg = RunConfig::from_env(60);
    let mut it = rest.iter();
    while let Some(&flag) = it.next() {
        let value = it
            .next()
            .and_then(|v| v.parse::<u64>().ok())
            .ok_or_else(|| format!("{flag} needs a number\n{USAGE}"))?;
        match flag {
            "--seconds" => cfg.duration = Duration::from_secs(value),
            "--seed" => cfg.seed = value,
            _ => return Err(format!("unknown flag {flag}\n{USAGE}")),
        }
    }
    let mut ok = true;
    for t in find(name)? {
        println!(
            "{}: fuzzing for {:?}, seed {}",
            t.name, cfg.duration, cfg.seed
        );
        match runner::fuzz(t, &cfg) {
            Ok(r) => println!("{}: {r:?}", t.name),
            Err(f) => {
                eprintln!("{f}");
                ok = false;
            }
        }
    }
    Ok(ok)
}

fn replay(name: &str, files: &[&str]) -> Result<bool, String> {
    let t = target(name).ok_or_else(|| find(name).err().unwrap_or_default())?;
    let mut ok = true;
    for file in files {
        let bytes = std::fs::read(file).map_err(|e| format!("cannot read {file}: {e}"))?;
        let started = std::time::Instant::now();
        match runner::run_one(t, &bytes) {
            Ok(outcome) => println!("{file}: {outcome:?} in {:?}", started.elapsed()),
            Err(panic) => {
                println!("{file}: PANIC: {panic}");
                ok = false;
            }
        }
    }
    Ok(ok)
}
