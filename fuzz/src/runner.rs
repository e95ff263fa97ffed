//! A mutation fuzzer that runs on stable Rust, for CI: each target's committed corpus first (a
//! regression check), then mutants of it until the time budget is spent.
//!
//! No coverage instrumentation (that needs nightly: see `fuzz/libfuzzer/` for cargo-fuzz). As a
//! cheap stand-in for coverage, an input whose outcome is new (accepted, or refused with a
//! message not seen before) joins the pool that later mutants are drawn from, so mutants that
//! get one parser check further are kept and mutated again.
//!
//! Failures: a panic (including a failed property assertion in a target), an input that runs
//! longer than [`RunConfig::input_timeout`] (the worker thread is left behind; the run stops),
//! and an allocation over the cap (`alloc.rs`, which aborts). Each input is written to
//! `fuzz/artifacts/<target>/current` before it runs, so even an abort leaves it behind; a
//! panic or hang is also saved as `crash-<hash>` or `hang-<hash>`.

use std::collections::HashSet;
use std::hash::{Hash, Hasher};
use std::panic::AssertUnwindSafe;
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::alloc::CappedAlloc;
use crate::{Outcome, Target};

/// How long and how a target is fuzzed.
#[derive(Clone, Debug)]
pub struct RunConfig {
    /// Time spent on mutants after the corpus has run.
    pub duration: Duration,
    /// Seed of the mutation RNG; printed, so a run can be repeated.
    pub seed: u64,
    /// Longest one input may run before it counts as a hang.
    pub input_timeout: Duration,
}

impl RunConfig {
    /// From the environment: `FUZZ_SECONDS` (default `default_seconds`), `FUZZ_SEED` (default:
    /// from the clock), `FUZZ_INPUT_TIMEOUT_SECONDS` (default 10).
    pub fn from_env(default_seconds: u64) -> Self {
        let var = |k: &str| {
            std::env::var(k)
                .ok()
                .and_then(|v| v.trim().parse::<u64>().ok())
        };
        let seed = var("FUZZ_SEED").unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos() as u64)
        });
        Self {
            duration: Duration::from_secs(var("FUZZ_SECONDS").unwrap_or(default_seconds)),
            seed,
            input_timeout: Duration::from_secs(var("FUZZ_INPUT_TIMEOUT_SECONDS").unwrap_or(10)),
        }
    }
}

/// What a run did.
#[derive(Debug)]
pub struct Report {
    pub seeds: usize,
    pub execs: u64,
    /// Inputs the target accepted (as opposed to refused with an error).
    pub accepted: u64,
    /// Distinct outcomes seen (accepted, or each kind of refusal).
    pub outcomes: usize,
    /// Inputs in the pool at the end (seeds plus mutants with new outcomes).
    pub pool: usize,
    /// Slowest input, in seconds.
    pub slowest: f64,
    /// Most heap live at once, in bytes (every thread of the process counted).
    pub peak_heap: usize,
}

/// A crash or hang, with the input saved for replay.
#[derive(Debug)]
pub struct Failure {
    pub target: &'static str,
    /// "crash" (a panic) or "hang".
    pub kind: &'static str,
    pub message: String,
    pub input: PathBuf,
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "FUZZ FAILURE ({}) in target {}: {}\ninput saved as {}\nreplay: cargo run -p vlm-fuzz -- replay {} {}",
            self.kind,
            self.target,
            self.message,
            self.input.display(),
            self.target,
            self.input.display()
        )
    }
}

/// `fuzz/corpus/<target>/`, the committed seeds.
pub fn corpus_dir(target: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("corpus")
        .join(target)
}

/// `fuzz/artifacts/<target>/`, where failing inputs go (ignored by git).
pub fn artifacts_dir(target: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("artifacts")
        .join(target)
}

/// Every file of `dir`, in name order.
pub fn read_corpus(dir: &Path) -> std::io::Result<Vec<(PathBuf, Vec<u8>)>> {
    let mut paths: Vec<PathBuf> = std::fs::read_dir(dir)?
        .map(|e| e.map(|e| e.path()))
        .collect::<Result<_, _>>()?;
    paths.retain(|p| p.is_file());
    paths.sort();
    paths
        .into_iter()
        .map(|p| std::fs::read(&p).map(|b| (p, b)))
        .collect()
}

fn panic_message(p: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = p.downcast_ref::<&str>() {
        s.to_string()
    } else if let Some(s) = p.downcast_ref::<String>() {
        s.clone()
    } else {
        "a panic with a non-string payload".into()
    }
}

/// Runs one input in the calling thread: the outcome, or the panic's message.
pub fn run_one(target: &Target, input: &[u8]) -> Result<Outcome, String> {
    CappedAlloc::set_thread_target(target.name);
    std::panic::catch_unwind(AssertUnwindSafe(|| (target.run)(input)))
        .map_err(|p| panic_message(p.as_ref()))
}

/// A refusal's message with what varies between inputs (numbers, quoted values) cut away, so
/// that the same check failing on different values counts as one outcome.
fn outcome_class(o: &Outcome) -> String {
    match o {
        Ok(()) => "ok".into(),
        Err(m) => m
            .split(['"', '`', '\'', '{', '['])
            .next()
            .unwrap_or_default()
            .chars()
            .filter(|c| !c.is_ascii_digit())
            .take(60)
            .collect(),
    }
}

fn hash_hex(bytes: &[u8]) -> String {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    bytes.hash(&mut h);
    format!("{:016x}", h.finish())
}

fn save(dir: &Path, name: &str, bytes: &[u8]) -> PathBuf {
    let path = dir.join(name);
    if let Err(e) = std::fs::create_dir_all(dir).and_then(|_| std::fs::write(&path, bytes)) {
        eprintln!("cannot save the input as {}: {e}", path.display());
    }
    path
}

/// Fuzzes `target`: its corpus, then mutants until `cfg.duration` has passed.
pub fn fuzz(target: &'static Target, cfg: &RunConfig) -> Result<Report, Failure> {
    let artifacts = artifacts_dir(target.name);
    std::fs::create_dir_all(&artifacts).ok();
    let current = artifacts.join("current");
    let seeds = read_corpus(&corpus_dir(target.name)).unwrap_or_default();
    let mut pool: Vec<Vec<u8>> = seeds.iter().map(|(_, b)| b.clone()).collect();
    if pool.is_empty() {
        pool.push(Vec::new());
    }
    let n_seeds = pool.len();

    // One worker thread runs the inputs, so a hang can be noticed from here. Its stack is the
    // 2 MiB a request gets in the services (tokio's worker and blocking threads), so input
    // nested deep enough to overflow theirs overflows this one too.
    let (in_tx, in_rx) = mpsc::channel::<Vec<u8>>();
    let (out_tx, out_rx) = mpsc::channel::<Result<Outcome, String>>();
    std::thread::Builder::new()
        .name(format!("fuzz-{}", target.name))
        .stack_size(2 << 20)
        .spawn(move || {
            for input in in_rx {
                if out_tx.send(run_one(target, &input)).is_err() {
                    break;
                }
            }
        })
        .expect("spawn the fuzz worker");

    let mut rng = ChaCha8Rng::seed_from_u64(cfg.seed);
    let mut seen: HashSet<String> = HashSet::new();
    let mut report = Report {
        seeds: n_seeds,
        execs: 0,
        accepted: 0,
        outcomes: 0,
        pool: 0,
        slowest: 0.0,
        peak_heap: 0,
    };
    CappedAlloc::reset_peak();
    let mut mutants_until: Option<Instant> = None;
    let mut next_seed = 0;
    loop {
        let input = if next_seed < n_seeds {
            next_seed += 1;
            pool[next_seed - 1].clone()
        } else {
            let until = *mutants_until.get_or_insert_with(|| Instant::now() + cfg.duration);
            if Instant::now() >= until {
                break;
            }
            let mut m = pool[rng.random_range(0..pool.len())].clone();
            mutate(&mut rng, &mut m, &pool, target.dict, target.max_len);
            m
        };
        // Written before the run: an abort (allocation cap, stack overflow) leaves it here.
        std::fs::write(&current, &input).ok();
        let started = Instant::now();
        in_tx
            .send(input.clone())
            .expect("the fuzz worker stopped without a failure");
        let result = match out_rx.recv_timeout(cfg.input_timeout) {
            Ok(r) => r,
            Err(_) => {
                let path = save(&artifacts, &format!("hang-{}", hash_hex(&input)), &input);
                return Err(Failure {
                    target: target.name,
                    kind: "hang",
                    message: format!(
                        "one input ran for more than {:?} ({} bytes)",
                        cfg.input_timeout,
                        input.len()
                    ),
                    input: path,
                });
            }
        };
        report.execs += 1;
        report.slowest = report.slowest.max(started.elapsed().as_secs_f64());
        match result {
            Err(message) => {
                let path = save(&artifacts, &format!("crash-{}", hash_hex(&input)), &input);
                return Err(Failure {
                    target: target.name,
                    kind: "crash",
                    message,
                    input: path,
                });
            }
            Ok(outcome) => {
                if outcome.is_ok() {
                    report.accepted += 1;
                }
                if seen.insert(outcome_class(&outcome)) && next_seed >= n_seeds {
                    // Bounded pool: a new one replaces a random earlier mutant.
                    if pool.len() < 1024 {
                        pool.push(input);
                    } else {
                        let i = rng.random_range(n_seeds..pool.len());
                        pool[i] = input;
                    }
                }
            }
        }
    }
    std::fs::remove_file(&current).ok();
    report.outcomes = seen.len();
    report.pool = pool.len();
    report.peak_heap = CappedAlloc::peak();
    Ok(report)
}

const INTERESTING_8: &[u8] = &[0, 1, 0x20, 0x40, 0x7f, 0x80, 0xff];
const INTERESTING_32: &[u32] = &[
    0,
    1,
    0xff,
    0x100,
    0x7fff,
    0x8000,
    0xffff,
    0x1_0000,
    0x7fff_ffff,
    0x8000_0000,
    0xffff_ffff,
];
const INTERESTING_64: &[u64] = &[0, 1 << 32, 1 << 40, 1 << 62, 1 << 63, u64::MAX];
/// Numbers written as text, for JSON and other text formats.
const NUMBERS: &[&str] = &[
    "0",
    "-1",
    "1",
    "-0.0",
    "65536",
    "2147483648",
    "4294967295",
    "4294967296",
    "9223372036854775807",
    "18446744073709551615",
    "18446744073709551616",
    "1e308",
    "1e400",
    "-1e400",
    "3.4e38",
    "1e-45",
    "NaN",
    "Infinity",
];

/// Applies 1 to 8 random edits to `data`, keeping it at most `max_len` bytes.
pub fn mutate(
    rng: &mut impl Rng,
    data: &mut Vec<u8>,
    pool: &[Vec<u8>],
    dict: &[&[u8]],
    max_len: usize,
) {
    let edits = 1 << rng.random_range(0..4);
    for _ in 0..edits {
        let len = data.len();
        let pos = |rng: &mut dyn rand::RngCore| {
            if len == 0 {
                0
            } else {
                rng.random_range(0..len)
            }
        };
        match rng.random_range(0..13) {
            // Flip one bit.
            0 if len > 0 => {
                let i = pos(rng);
                data[i] ^= 1 << rng.random_range(0..8);
            }
            // A random byte, or an interesting one.
            1 if len > 0 => {
                let i = pos(rng);
                data[i] = rng.random();
            }
            2 if len > 0 => {
                let i = pos(rng);
                data[i] = INTERESTING_8[rng.random_range(0..INTERESTING_8.len())];
            }
            // An interesting 16-, 32- or 64-bit value, either byte order.
            3 if len >= 8 => {
                let i = rng.random_range(0..=len - 8);
                let bytes: Vec<u8> = match rng.random_range(0..3) {
                    0 => {
                        let v = INTERESTING_32[rng.random_range(0..INTERESTING_32.len())] as u16;
                        v.to_le_bytes().to_vec()
                    }
                    1 => {
                        let v = INTERESTING_32[rng.random_range(0..INTERESTING_32.len())];
                        v.to_le_bytes().to_vec()
                    }
                    _ => {
                        let v = INTERESTING_64[rng.random_range(0..INTERESTING_64.len())];
                        v.to_le_bytes().to_vec()
                    }
                };
                let mut bytes = bytes;
                if rng.random() {
                    bytes.reverse();
                }
                data[i..i + bytes.len()].copy_from_slice(&bytes);
            }
            // Delete a range.
            4 if len > 0 => {
                let i = pos(rng);
                let n = rng.random_range(1..=(len - i).min(64));
                data.drain(i..i + n);
            }
            // Insert random bytes, or a run of one byte.
            5 => {
                let i = pos(rng).min(len);
                let n = rng.random_range(1..=16);
                let bytes: Vec<u8> = if rng.random() {
                    (0..n).map(|_| rng.random()).collect()
                } else {
                    vec![rng.random(); 1 << rng.random_range(0..12)]
                };
                data.splice(i..i, bytes);
            }
            // Repeat a short chunk many times (deep nesting, long runs).
            6 if len > 0 => {
                let i = pos(rng);
                let n = rng.random_range(1..=(len - i).min(16));
                let chunk = data[i..i + n].to_vec();
                let times = 1 << rng.random_range(1..11);
                let rep: Vec<u8> = chunk.iter().copied().cycle().take(n * times).collect();
                data.splice(i..i, rep);
            }
            // Copy a range elsewhere.
            7 if len > 1 => {
                let src = pos(rng);
                let n = rng.random_range(1..=(len - src).min(256));
                let chunk = data[src..src + n].to_vec();
                let dst = pos(rng);
                data.splice(dst..dst, chunk);
            }
            // A dictionary token.
            8 if !dict.is_empty() => {
                let tok = dict[rng.random_range(0..dict.len())];
                let i = pos(rng).min(len);
                if rng.random() || len < tok.len() {
                    data.splice(i..i, tok.iter().copied());
                } else {
                    let i = i.min(len - tok.len());
                    data[i..i + tok.len()].copy_from_slice(tok);
                }
            }
            // Splice: this input's head, another's tail.
            9 if pool.len() > 1 => {
                let other = &pool[rng.random_range(0..pool.len())];
                if !other.is_empty() {
                    let cut = pos(rng).min(len);
                    let from = rng.random_range(0..other.len());
                    data.truncate(cut);
                    data.extend_from_slice(&other[from..]);
                }
            }
            // Replace a number written in text.
            10 if len > 0 => {
                let start = pos(rng);
                if let Some(off) = data[start..].iter().position(|b| b.is_ascii_digit()) {
                    let a = start + off;
                    let b = a + data[a..]
                        .iter()
                        .position(|c| !(c.is_ascii_digit() || matches!(c, b'.' | b'e' | b'-')))
                        .unwrap_or(len - a);
                    let num = NUMBERS[rng.random_range(0..NUMBERS.len())];
                    data.splice(a..b, num.bytes());
                }
            }
            // Truncate.
            11 if len > 0 => {
                let i = pos(rng);
                data.truncate(i);
            }
            // Overwrite with random bytes.
            _ if len > 0 => {
                let i = pos(rng);
                let n = rng.random_range(1..=(len - i).min(8));
                for b in &mut data[i..i + n] {
                    *b = rng.random();
                }
            }
            _ => data.push(rng.random()),
        }
    }
    data.truncate(max_len);
}
