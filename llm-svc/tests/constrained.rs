//! Grammar-constrained decoding end to end in the engine, on the tiny fixture, whose random
//! weights write garbage unless a grammar holds them: every answer to a JSON schema that ends
//! with `stop` parses and validates against its schema, greedy or sampled, alone or in a batch
//! (where each gives the tokens it gives alone); an answer cut by its token budget says so;
//! regular expressions and Lark grammars hold too; bad grammars are refused at the door.
//!
//! With a GPU (`on_cuda_*`) the same answers must validate: there the mask is applied by the
//! device's sampler (`sampling_f32.cu`).

mod common;

use common::{fixture, together_finished};
use llm_svc::{Engine, EngineConfig, FinishReason, GenerateRequest, KvCacheSize, SamplingParams};
use vlm_compute::{Backend, CpuBackend, Weights};
use vlm_proto::pb::{constraint::Grammar, Constraint};

fn engine_on<B: Backend>(backend: B) -> Engine {
    let dir = fixture();
    let weights = Weights::open(&dir).unwrap();
    let cfg = EngineConfig {
        kv_cache: KvCacheSize::Tokens(8192),
        ..EngineConfig::default()
    };
    Engine::load(&dir, &weights, backend, cfg, &prometheus::Registry::new()).unwrap()
}

fn tokenizer() -> tokenizers::Tokenizer {
    tokenizers::Tokenizer::from_file(fixture().join("tokenizer.json")).unwrap()
}

/// The schemas of `tests/fixtures/json_schemas.json` (what they cover is said there), which
/// the stack's test answers to as well.
fn schemas() -> Vec<serde_json::Value> {
    let path = fixture().join("../json_schemas.json");
    let doc: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    doc["schemas"].as_array().unwrap().clone()
}

fn request(
    constraint: Constraint,
    sampling: SamplingParams,
    max_new_tokens: usize,
) -> GenerateRequest {
    GenerateRequest {
        // "user: ..." in the tiny vocabulary: any ids will do, the weights are random.
        prompt: (40..72).collect(),
        images: Vec::new(),
        sampling,
        max_new_tokens,
        ignore_eos: false,
        return_logits: false,
        constraint: Some(constraint),
    }
}

fn json_schema(s: &serde_json::Value) -> Constraint {
    Constraint {
        grammar: Some(Grammar::JsonSchema(s.to_string())),
        after_token: None,
    }
}

fn samplings() -> Vec<SamplingParams> {
    vec![
        SamplingParams::greedy(),
        SamplingParams {
            temperature: 1.0,
            seed: Some(7),
            ..SamplingParams::greedy()
        },
        SamplingParams {
            temperature: 0.8,
            top_p: 0.9,
            seed: Some(11),
            ..SamplingParams::greedy()
        },
    ]
}

/// Every answer that stopped (not cut) validates; returns how many stopped.
fn check_answers(e: &Engine, max_new_tokens: usize) -> usize {
    let tok = tokenizer();
    let mut reqs = Vec::new();
    for s in schemas() {
        for sampling in samplings() {
            reqs.push((
                s.clone(),
                request(json_schema(&s), sampling, max_new_tokens),
            ));
        }
    }
    let only: Vec<GenerateRequest> = reqs.iter().map(|r| r.1.clone()).collect();
    let answers = together_finished(e, &only);
    let mut stopped = 0;
    for ((schema, _), (tokens, finish)) in reqs.iter().zip(&answers) {
        // The eos token closes a complete answer; it is not part of the JSON.
        let text = tok.decode(tokens, true).unwrap();
        if *finish == FinishReason::Eos {
            stopped += 1;
            let value: serde_json::Value = serde_json::from_str(&text)
                .unwrap_or_else(|err| panic!("{text:?} for {schema}: {err}"));
            let validator = jsonschema::validator_for(schema).unwrap();
            assert!(
                validator.is_valid(&value),
                "{text} does not validate against {schema}"
            );
        } else {
            assert_eq!(*finish, FinishReason::Length);
            assert_eq!(tokens.len(), max_new_tokens, "cut by the budget: {text:?}");
        }
    }
    stopped
}

#[test]
fn json_schema_answers_validate_greedy_or_sampled() {
    let e = engine_on(CpuBackend::new());
    let stopped = check_answers(&e, 64);
    // Random weights still finish most small schemas within 64 tokens.
    assert!(
        stopped >= schemas().len(),
        "only {stopped} answers finished"
    );
}

#[test]
fn a_batch_gives_each_request_its_tokens_alone() {
    let e = engine_on(CpuBackend::new());
    let reqs: Vec<GenerateRequest> = schemas()
        .iter()
        .zip(samplings().into_iter().cycle())
        .map(|(s, sampling)| request(json_schema(s), sampling, 40))
        .collect();
    let alone: Vec<_> = reqs
        .iter()
        .map(|r| together_finished(&e, std::slice::from_ref(r)).remove(0))
        .collect();
    assert_eq!(together_finished(&e, &reqs), alone);
}

#[test]
fn an_answer_cut_by_its_budget_ends_with_length() {
    let e = engine_on(CpuBackend::new());
    // A string of at least 50 characters cannot end in 5 tokens.
    let s = serde_json::json!({"type": "string", "minLength": 50});
    let out = together_finished(&e, &[request(json_schema(&s), SamplingParams::greedy(), 5)]);
    assert_eq!(out[0].1, FinishReason::Length);
    assert_eq!(out[0].0.len(), 5);
}

#[test]
fn regexes_and_lark_grammars_hold() {
    let e = engine_on(CpuBackend::new());
    let tok = tokenizer();
    let regex = Constraint {
        grammar: Some(Grammar::Regex("(yes|no), [0-9]{2}".into())),
        after_token: None,
    };
    let lark = Constraint {
        grammar: Some(Grammar::Lark(
            r#"start: "move " DIR " " NUM
DIR: "left" | "right"
NUM: /[1-9]/"#
                .into(),
        )),
        after_token: None,
    };
    let digits = |s: &str, n: usize| s.len() == n && s.bytes().all(|b| b.is_ascii_digit());
    let re_answer = |t: &str| {
        let rest = t.strip_prefix("yes, ").or_else(|| t.strip_prefix("no, "));
        rest.is_some_and(|r| digits(r, 2))
    };
    let lark_answer = |t: &str| {
        let rest = t
            .strip_prefix("move left ")
            .or_else(|| t.strip_prefix("move right "));
        rest.is_some_and(|r| digits(r, 1) && r != "0")
    };
    let answers: [&dyn Fn(&str) -> bool; 2] = [&re_answer, &lark_answer];
    for sampling in samplings() {
        let out = together_finished(
            &e,
            &[
                request(regex.clone(), sampling.clone(), 32),
                request(lark.clone(), sampling, 32),
            ],
        );
        for ((tokens, finish), valid) in out.iter().zip(answers) {
            let text = tok.decode(tokens, true).unwrap();
            assert_eq!(*finish, FinishReason::Eos, "{text:?}");
            assert!(valid(&text), "{text:?}");
        }
    }
}

#[test]
fn after_token_frees_what_comes_before_it() {
    let e = engine_on(CpuBackend::new());
    let tok = tokenizer();
    // The grammar applies once "#" has been generated. A logit bias makes the model write "#"
    // first and would make it write "#" forever: after it, the mask overrules the bias.
    let hash = tok.token_to_id("#").unwrap();
    let sampling = SamplingParams {
        logit_bias: vec![(hash, 100.0)],
        ..SamplingParams::greedy()
    };
    let constraint = Constraint {
        grammar: Some(Grammar::Regex("[0-9]{3}".into())),
        after_token: Some(hash),
    };
    let out = together_finished(&e, &[request(constraint, sampling, 8)]);
    let text = tok.decode(&out[0].0, true).unwrap();
    assert_eq!(out[0].1, FinishReason::Eos, "{text:?}");
    let digits = text.strip_prefix('#').unwrap_or_default();
    assert!(
        digits.len() == 3 && digits.bytes().all(|b| b.is_ascii_digit()),
        "{text:?}"
    );
}

#[test]
fn bad_grammars_are_refused_before_they_run() {
    let e = engine_on(CpuBackend::new());
    for (grammar, why) in [
        (Grammar::JsonSchema("{oops".into()), "not JSON"),
        (Grammar::JsonSchema(r#"{"type": 7}"#.into()), "constraint"),
        (Grammar::Lark("start: undefined_rule".into()), "constraint"),
    ] {
        let r = request(
            Constraint {
                grammar: Some(grammar),
                after_token: None,
            },
            SamplingParams::greedy(),
            8,
        );
        let err = e.validate(&r).unwrap_err();
        assert!(err.is_invalid_input(), "{err}");
        assert!(err.to_string().contains(why), "{err}");
        assert!(e.submit(r, None, tracing::Span::none()).is_err());
    }
}

/// The same answers on the GPU, where the device's sampler applies the masks (in recorded
/// decode steps and eager ones).
#[test]
fn on_cuda_json_schema_answers_validate() {
    let Some(gpu) = vlm_compute::cuda::test_gpu() else {
        return;
    };
    let e = engine_on(gpu);
    let stopped = check_answers(&e, 64);
    assert!(
        stopped >= schemas().len(),
        "only {stopped} answers finished"
    );
}
