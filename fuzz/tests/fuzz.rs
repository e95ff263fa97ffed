//! Each fuzz target for `FUZZ_SECONDS` under `cargo test`: its committed corpus, then mutants
//! (`fuzz/src/runner.rs`). 3 seconds by default, so `cargo test --workspace` stays quick (every
//! seed of the corpus still runs); `.ci/run`'s long tier gives each 30 (`FUZZ_SECONDS=30`). Fails on a panic, a hang (one input over
//! `FUZZ_INPUT_TIMEOUT_SECONDS`, default 10) or an allocation over 2 GiB (`FUZZ_MAX_ALLOC_MB`),
//! with the input saved under `fuzz/artifacts/<target>/` and the command that replays it.

use vlm_fuzz::alloc::CappedAlloc;
use vlm_fuzz::runner::{self, RunConfig};

#[global_allocator]
static ALLOC: CappedAlloc = CappedAlloc;

const DEFAULT_SECONDS: u64 = 3;

fn fuzz(name: &str) {
    if let Some(mb) = std::env::var("FUZZ_MAX_ALLOC_MB")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
    {
        CappedAlloc::set_cap(mb << 20);
    }
    let target = vlm_fuzz::target(name).expect("a target of that name");
    let cfg = RunConfig::from_env(DEFAULT_SECONDS);
    // Loaded outside the timed per-input runs: the first input would otherwise pay for it.
    vlm_fuzz::targets::fixture();
    match runner::fuzz(target, &cfg) {
        Ok(r) => {
            println!("{name} (seed {}): {r:?}", cfg.seed);
            assert!(r.execs as usize >= r.seeds, "every seed ran");
        }
        Err(f) => panic!(
            "{f}\n(rerun this run's mutants with FUZZ_SEED={})",
            cfg.seed
        ),
    }
}

#[test]
fn fuzz_image() {
    fuzz("image");
}

#[test]
fn fuzz_resize() {
    fuzz("resize");
}

#[test]
fn fuzz_openai_request() {
    fuzz("openai_request");
}

#[test]
fn fuzz_grpc() {
    fuzz("grpc");
}

#[test]
fn fuzz_chat_template() {
    fuzz("chat_template");
}

#[test]
fn fuzz_image_url() {
    fuzz("image_url");
}

#[test]
fn fuzz_checkpoint() {
    fuzz("checkpoint");
}

#[test]
fn every_target_has_a_test_and_a_corpus() {
    let here = include_str!("fuzz.rs");
    for t in vlm_fuzz::TARGETS {
        assert!(
            here.contains(&format!("fn fuzz_{}()", t.name)),
            "target {} has no test here",
            t.name
        );
        let seeds = runner::read_corpus(&runner::corpus_dir(t.name)).unwrap_or_default();
        assert!(
            !seeds.is_empty(),
            "target {} has no committed corpus",
            t.name
        );
    }
}
