//! The sampling rule (`vlm_compute::sampling`, whose GPU kernel is its bit-for-bit twin)
//! against HF transformers' logits processors and torch's log_softmax on recorded logits
//! (`tests/fixtures/make_sampling_fixtures.py` writes them).

use std::path::PathBuf;

use serde_json::Value;
use vlm_compute::golden::Golden;
use vlm_compute::sampling::{kept_tokens, process, sample_row, RowParams, CUTOFF, IN_PROMPT};

fn fixture() -> Golden {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/sampling");
    Golden::open(&dir).expect("tests/fixtures/sampling/golden (make_sampling_fixtures.py)")
}

/// A case's settings, bias and token counts (prompt flagged, generated counted) as the engine
/// gives them to the sampler.
fn settings(case: &Value, vocab: usize) -> (RowParams, Vec<(u32, f32)>, Vec<u32>) {
    let f = |k: &str, d: f64| case.get(k).and_then(Value::as_f64).unwrap_or(d) as f32;
    let p = RowParams {
        temperature: f("temperature", 0.0),
        top_k: f("top_k", 0.0) as u32,
        top_p: f("top_p", 1.0),
        min_p: f("min_p", 0.0),
        presence_penalty: f("presence_penalty", 0.0),
        frequency_penalty: f("frequency_penalty", 0.0),
        repetition_penalty: f("repetition_penalty", 1.0),
        slot: 0,
        logprobs: 1 + 20,
        ..Default::default()
    };
    let bias: Vec<(u32, f32)> = case
        .get("logit_bias")
        .and_then(Value::as_object)
        .map(|m| {
            m.iter()
                .map(|(t, b)| (t.parse().unwrap(), b.as_f64().unwrap() as f32))
                .collect()
        })
        .unwrap_or_default();
    let ids = |k: &str| -> Vec<usize> {
        case[k]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as usize)
            .collect()
    };
    let mut counts = vec![0u32; vocab];
    for t in ids("prompt") {
        counts[t] |= IN_PROMPT;
    }
    for t in ids("generated") {
        counts[t] += 1;
    }
    (p, bias, counts)
}

#[test]
fn bias_and_penalties_are_hfs_and_vllms() {
    let g = fixture();
    let vocab = g.manifest()["vocab"].as_u64().unwrap() as usize;
    let (logits, want) = (g.tensor("logits").unwrap(), g.tensor("processed").unwrap());
    for (i, case) in g.manifest()["cases"].as_array().unwrap().iter().enumerate() {
        let (p, bias, counts) = settings(case, vocab);
        for (t, &count) in counts.iter().enumerate() {
            let b = bias.iter().find(|e| e.0 as usize == t).map_or(0.0, |e| e.1);
            let got = process(logits.row(i)[t], b, count, &p);
            let w = want.row(i)[t];
            // torch subtracts the frequency and presence terms as one sum, we one by one:
            // a rounding apart (logits of a few units, 100 at most with a bias).
            assert!(
                (got - w).abs() <= 1e-5 * w.abs().max(1.0),
                "case {i} token {t}: {got} vs HF's {w}"
            );
        }
    }
}

#[test]
fn the_tokens_a_draw_can_give_are_those_hfs_warpers_keep() {
    let g = fixture();
    let vocab = g.manifest()["vocab"].as_u64().unwrap() as usize;
    let (logits, kept) = (g.tensor("logits").unwrap(), g.tensor("kept").unwrap());
    let processed = g.tensor("processed").unwrap();
    for (i, case) in g.manifest()["cases"].as_array().unwrap().iter().enumerate() {
        let (p, bias, counts) = settings(case, vocab);
        let ours = kept_tokens(logits.row(i), &p, &bias, &counts);
        // HF keeps tokens a draw can never reach (under e^-21 of the best): compare the rest.
        let y = processed.row(i);
        let best = y.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x));
        let t = if p.temperature > 0.0 {
            p.temperature
        } else {
            1.0
        };
        let hf: Vec<u32> = (0..vocab)
            .filter(|&j| kept.row(i)[j] == 1.0 && (y[j] - best) / t > CUTOFF)
            .map(|j| j as u32)
            .collect();
        assert_eq!(ours, hf, "case {i}: {case}");
        assert!(!ours.is_empty());
        // And every draw is one of them.
        for position in 0..50 {
            let row = RowParams { position, ..p };
            let mut c = counts.clone();
            let pick = sample_row(logits.row(i), &row, &bias, Some(&mut c)).token;
            assert!(ours.contains(&pick), "case {i}: drew {pick}");
        }
    }
}

#[test]
fn logprobs_are_torchs_log_softmax_of_the_raw_logits() {
    let g = fixture();
    let vocab = g.manifest()["vocab"].as_u64().unwrap() as usize;
    let (logits, want) = (g.tensor("logits").unwrap(), g.tensor("logprobs").unwrap());
    for (i, case) in g.manifest()["cases"].as_array().unwrap().iter().enumerate() {
        let (p, bias, mut counts) = settings(case, vocab);
        let pick = sample_row(logits.row(i), &p, &bias, Some(&mut counts));
        let w = want.row(i);
        assert!(
            (pick.logprob - w[pick.token as usize]).abs() < 1e-5,
            "case {i}"
        );
        let mut best: Vec<usize> = (0..vocab).collect();
        best.sort_by(|&a, &b| w[b].total_cmp(&w[a]));
        let ids: Vec<u32> = pick.top.iter().map(|t| t.0).collect();
        let want_ids: Vec<u32> = best[..20].iter().map(|&j| j as u32).collect();
        assert_eq!(ids, want_ids, "case {i}");
        for &(t, lp) in &pick.top {
            assert!((lp - w[t as usize]).abs() < 1e-5, "case {i} token {t}");
        }
    }
}
