//! Timings of llguidance's token masks for `vlm bench`'s schema
//! ([`vlm_cli::bench::bench_schema`]: 64 answers, each pick an allowed token chosen by a hash,
//! as `time_masks`), under llguidance's own slices and under other sets of them, which
//! llm-svc's `grammar.rs`'s choice of slices was measured with.
//!
//!   cargo run --release -p vlm-cli --example mask_times -- [--configs "8;7,8;2,4,6,8"]
//!       [--steps 300] [--answers 64] [--workers 16] [--parallel] [--dir deploy/models/qwen3-vl-8b]
//!
//! Each config of `--configs` (';' between them) adds `[^"\\\x00-\x1F\x7F]{1,n}` slices for its
//! numbers to llguidance's JSON slices; the plain JSON slices always run first, and every
//! config's mask must equal theirs. All configs follow the same answers, step by step, so their
//! timings are paired. Single-threaded (the default) it reports each config's mask times, by the
//! characters a `label` has left, and a step's time on `--workers` threads estimated from them;
//! `--parallel` times each step's masks on rayon's pool instead (the engine's `masks_by`).
//! `MASK_DEBUG=1` prints the masks over 0.25 ms. Build time and memory of each factory come first.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use llguidance::api::TopLevelGrammar;
use llguidance::earley::SlicedBiasComputer;
use llguidance::toktrie::{ApproximateTokEnv, InferenceCapabilities, TokEnv, TokRxInfo, TokTrie};
use llguidance::{Matcher, ParserFactory};

fn rss_mib() -> f64 {
    let s = std::fs::read_to_string("/proc/self/statm").unwrap();
    let pages: f64 = s.split_whitespace().nth(1).unwrap().parse().unwrap();
    pages * 4096.0 / (1 << 20) as f64
}

fn env(dir: &std::path::Path, vocab: usize, eos: &[u32]) -> TokEnv {
    let text = std::fs::read_to_string(dir.join("tokenizer.json")).unwrap();
    let json: serde_json::Value = serde_json::from_str(&text).unwrap();
    let mut words = llguidance::token_bytes_from_tokenizer_json(&json).unwrap();
    words.resize(vocab, Vec::new());
    let trie = TokTrie::from(&TokRxInfo::new(vocab as u32, eos[0]), &words).with_eos_tokens(eos);
    Arc::new(ApproximateTokEnv::new(trie))
}

fn slices(bounds: &[usize]) -> Vec<String> {
    let mut s = SlicedBiasComputer::json_slices();
    for b in bounds {
        s.push(format!(r#"[^"\\\x00-\x1F\x7F]{{1,{b}}}"#));
    }
    s
}

/// Characters of the label written so far, if the text ends inside a label.
fn in_label(text: &[u8]) -> Option<usize> {
    let key = br#""label": ""#;
    let at = text.windows(key.len()).rposition(|w| w == key)? + key.len();
    let s = String::from_utf8_lossy(&text[at..]);
    let mut chars = 0;
    let mut it = s.chars();
    while let Some(c) = it.next() {
        match c {
            '"' => return None,
            '\\' if it.next() == Some('u') => {
                for _ in 0..4 {
                    it.next();
                }
            }
            _ => {}
        }
        chars += 1;
    }
    Some(chars)
}

fn pct(sorted: &[f64], p: f64) -> f64 {
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

fn summary(name: &str, v: &mut [f64]) {
    v.sort_by(f64::total_cmp);
    if v.is_empty() {
        return;
    }
    println!(
        "{name:>14}: n {:6}  median {:7.3}  p90 {:7.3}  p99 {:7.3}  max {:7.3}  mean {:7.3} ms",
        v.len(),
        pct(v, 0.5),
        pct(v, 0.9),
        pct(v, 0.99),
        v[v.len() - 1],
        v.iter().sum::<f64>() / v.len() as f64
    );
}

/// Makespan of masks taking `times` (in spawn order) on `workers` threads that each take the
/// next mask when free (rayon's pool, roughly).
fn makespan(times: &[f64], workers: usize) -> f64 {
    let mut free = vec![0.0f64; workers];
    for t in times {
        let w = (0..workers)
            .min_by(|&a, &b| free[a].total_cmp(&free[b]))
            .unwrap();
        free[w] += t;
    }
    free.into_iter().fold(0.0, f64::max)
}

fn main() {
    let mut configs: Vec<Vec<usize>> = vec![Vec::new()];
    let mut steps = 300;
    let mut answers = 64;
    let mut workers = 16;
    let mut parallel = false;
    let debug = std::env::var_os("MASK_DEBUG").is_some();
    let mut dir = PathBuf::from("deploy/models/qwen3-vl-8b");
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            // ';'-separated bound lists, e.g. "8;2,4,6,8"; the default slices always come first.
            "--configs" => configs.extend(args.next().unwrap().split(';').map(|c| {
                c.split(',')
                    .filter(|s| !s.is_empty())
                    .map(|s| s.parse().unwrap())
                    .collect()
            })),
            "--steps" => steps = args.next().unwrap().parse().unwrap(),
            "--answers" => answers = args.next().unwrap().parse().unwrap(),
            "--workers" => workers = args.next().unwrap().parse().unwrap(),
            "--parallel" => parallel = true,
            "--dir" => dir = args.next().unwrap().into(),
            _ => panic!("unknown argument {a}"),
        }
    }
    let env = env(&dir, 151_936, &[151_645, 151_643]);
    let factories: Vec<ParserFactory> = configs
        .iter()
        .map(|bounds| {
            let rss0 = rss_mib();
            let t = Instant::now();
            let mut f = ParserFactory::new(&env, InferenceCapabilities::default(), &slices(bounds))
                .unwrap();
            f.quiet();
            println!(
                "slices +{bounds:?}: factory {:.3} s, +{:.1} MiB RSS",
                t.elapsed().as_secs_f64(),
                rss_mib() - rss0
            );
            f
        })
        .collect();
    let grammar = || {
        TopLevelGrammar::from_json_schema(vlm_proto::constraint::with_json_style(
            vlm_cli::bench::bench_schema(),
        ))
    };
    let new = |f: &ParserFactory| Matcher::new(Ok(f.create_parser(grammar()).unwrap()));
    // ms[c][i]: config c's matcher of answer i.
    let mut ms: Vec<Vec<Matcher>> = factories
        .iter()
        .map(|f| (0..answers).map(|_| new(f)).collect())
        .collect();
    let mut texts: Vec<Vec<u8>> = vec![Vec::new(); answers];
    let trie = env.tok_trie();
    let nc = configs.len();
    let mut all = vec![Vec::new(); nc];
    let mut outside = vec![Vec::new(); nc];
    let mut by_left: Vec<Vec<Vec<f64>>> = vec![vec![Vec::new(); 33]; nc];
    let mut step_sim = vec![Vec::new(); nc];
    let mut step_wall = vec![Vec::new(); nc];
    let warmup = 5;
    for step in 0..warmup + steps {
        let labels: Vec<Option<usize>> = texts.iter().map(|t| in_label(t)).collect();
        let mut masks = Vec::new();
        for c in 0..nc {
            let mut times = Vec::with_capacity(answers);
            let mut cm = Vec::with_capacity(answers);
            if parallel {
                use rayon::prelude::*;
                let t = Instant::now();
                let got: Vec<_> = ms[c]
                    .par_iter_mut()
                    .map(|m| {
                        let mask = m.compute_mask_or_eos().unwrap();
                        let words: Vec<u32> = mask.clone().into();
                        std::hint::black_box(words);
                        mask
                    })
                    .collect();
                if step >= warmup {
                    step_wall[c].push(t.elapsed().as_secs_f64() * 1e3);
                }
                cm = got;
            } else {
                for i in 0..answers {
                    let t = Instant::now();
                    let mask = ms[c][i].compute_mask_or_eos().unwrap();
                    let words: Vec<u32> = mask.clone().into();
                    let took = t.elapsed().as_secs_f64() * 1e3;
                    std::hint::black_box(&words);
                    times.push(took);
                    if debug && took > 0.25 {
                        let tail = &texts[i][texts[i].len().saturating_sub(40)..];
                        println!(
                            "config {c}: slow {took:.3} ms, label {:?}: {:?} {:?}",
                            labels[i],
                            String::from_utf8_lossy(tail),
                            ms[c][i].last_step_stats().map(|s| s.slices_applied)
                        );
                    }
                    if step >= warmup {
                        all[c].push(took);
                        match labels[i] {
                            Some(n) => by_left[c][32 - n.min(32)].push(took),
                            None => outside[c].push(took),
                        }
                    }
                    cm.push(mask);
                }
                if step >= warmup {
                    step_sim[c].push(makespan(&times, workers));
                }
            }
            masks.push(cm);
        }
        for i in 0..answers {
            let mask = &masks[0][i];
            for (c, m) in masks.iter().enumerate().skip(1) {
                assert!(
                    m[i] == *mask,
                    "config {c}, answer {i}, step {step}: masks differ"
                );
            }
            let allowed: Vec<u32> = (0..mask.len() as u32)
                .filter(|&t| mask.is_allowed(t))
                .collect();
            let pick = allowed[(step * 7919 + i * 104_729) % allowed.len()];
            texts[i].extend_from_slice(trie.token(pick));
            for m in ms.iter_mut() {
                m[i].consume_token(pick).unwrap();
            }
            if ms[0][i].is_stopped() {
                for c in 0..nc {
                    assert!(ms[c][i].is_stopped());
                    ms[c][i] = new(&factories[c]);
                }
                texts[i].clear();
            }
        }
    }
    for c in 0..nc {
        println!("== slices +{:?}", configs[c]);
        if parallel {
            summary("step (wall)", &mut step_wall[c]);
            continue;
        }
        summary(&format!("step ({workers} thr sim)"), &mut step_sim[c]);
        summary("all masks", &mut all[c]);
        summary("outside label", &mut outside[c]);
        for (left, v) in by_left[c].iter_mut().enumerate() {
            if left <= 12 {
                summary(&format!("label, {left} left"), v);
            }
        }
    }
}
