//! Grammar-constrained decoding (structured outputs, tool calls): a request's
//! [`Constraint`] (a JSON schema, a regular expression or a Lark grammar) compiled by
//! llguidance against the checkpoint's vocabulary, then, every step, the set of tokens the
//! grammar allows next as a bit mask that the device's sampler applies before it picks
//! (`vlm_compute::sampling`: disallowed tokens get -inf, so greedy and sampled requests alike
//! keep to the grammar).
//!
//! One [`Grammars`] per engine holds llguidance's parser factory, built once from
//! `tokenizer.json` (the token trie and its precomputed slices); each request gets its own
//! [`Grammar`] (a matcher), which follows the tokens as they are picked.
//!
//! The token trie is built from the vocabulary's bytes through toktrie's own API
//! (`token_bytes_from_tokenizer_json`), not through `toktrie_hf_tokenizers`, which pins an older
//! `tokenizers` than ours. Its greedy tokenization is used only for a grammar's literal
//! strings; masks never depend on it.

use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Instant;

use llguidance::api::TopLevelGrammar;
use llguidance::earley::SlicedBiasComputer;
use llguidance::toktrie::{ApproximateTokEnv, InferenceCapabilities, TokEnv, TokRxInfo, TokTrie};
use llguidance::{Matcher, ParserFactory};
use vlm_proto::pb::{constraint, Constraint};

use crate::{Error, Result};

/// The token sets llguidance precomputes (its "slices"): its JSON slices plus JSON-string runs of
/// at most 7 and 8 characters.
///
/// A slice is used only where every token in it is allowed, so inside a string with a
/// `maxLength` llguidance's own slices (runs of up to 10 and 30 characters) stop applying once
/// fewer than 10 characters are left, and the mask is then a walk of the whole token trie
/// (151,936 tokens). With the shorter slices, 7 to 9 characters left take the slice's mask and
/// walk only the longer tokens. Fewer left gain nothing: the walk is then mostly refusing the
/// longer tokens one byte each, which a slice cannot spare (shorter slices, measured down to one
/// character, made those masks slower).
///
/// Measured with `cli/examples/mask_times.rs` (`vlm bench`'s schema, 64 answers, 1,000 steps) on an
/// H100 host's 16 cores, with the stand-in tokenizer of `deploy/models/qwen3-vl-8b`: one step's 64
/// masks in parallel went from median 0.283 / p99 2.13 ms to 0.157 / 1.13 ms; a single mask with 8
/// or 9 characters left from 0.77 ms to 0.013-0.047 ms, with 7 left from 0.80 to 0.35 ms; every
/// mask identical to llguidance's default slices'. The factory takes 0.06 s and 23 MiB more to
/// build (0.25 s, 53 MiB). What is left of the tail is 5 and 6 characters left (0.24 and 0.6 ms, as
/// before). The stand-in's words (` t1234`) are all 8 characters or fewer, so there one slice
/// covers every word; a real vocabulary's longer tokens are still walked, and its numbers have not
/// been measured.
fn slices() -> Vec<String> {
    let mut slices = SlicedBiasComputer::json_slices();
    slices.extend([7, 8].map(|n| format!(r#"[^"\\\x00-\x1F\x7F]{{1,{n}}}"#)));
    slices
}

/// The parser factory of one vocabulary.
pub struct Grammars {
    factory: ParserFactory,
    /// Tokens the model scores (the logits' width; the tokenizer may have fewer).
    vocab: usize,
}

impl Grammars {
    /// The factory for the checkpoint in `dir` (its `tokenizer.json`), for a model scoring
    /// `vocab` tokens that ends a sequence at any of `eos`.
    pub fn load(dir: &Path, vocab: usize, eos: &[u32]) -> Result<Self> {
        let path = dir.join("tokenizer.json");
        let text = std::fs::read_to_string(&path)
            .map_err(|e| Error::Config(format!("{}: {e}", path.display())))?;
        let json: serde_json::Value = serde_json::from_str(&text)
            .map_err(|e| Error::Config(format!("{}: {e}", path.display())))?;
        let mut words = llguidance::token_bytes_from_tokenizer_json(&json)
            .map_err(|e| Error::Config(format!("{}: {e}", path.display())))?;
        if words.len() > vocab {
            return Err(Error::Config(format!(
                "{} has {} tokens, more than the model's vocab_size {vocab}",
                path.display(),
                words.len()
            )));
        }
        // Ids the model scores but the tokenizer never made: no bytes, never allowed.
        words.resize(vocab, Vec::new());
        let first_eos = eos.first().copied().unwrap_or(0);
        let trie = TokTrie::from(&TokRxInfo::new(vocab as u32, first_eos), &words);
        let trie = if eos.is_empty() {
            trie
        } else {
            trie.with_eos_tokens(eos)
        };
        let env: TokEnv = Arc::new(ApproximateTokEnv::new(trie));
        let mut factory = ParserFactory::new(&env, InferenceCapabilities::default(), &slices())
            .map_err(|e| Error::Config(format!("grammar support for {}: {e}", path.display())))?;
        // llguidance's own logging goes to stderr; its errors come back as values instead.
        factory.quiet();
        Ok(Self { factory, vocab })
    }

    /// Compiles a request's constraint; a grammar llguidance refuses is the request's error,
    /// with llguidance's reason.
    pub fn compile(&self, c: &Constraint) -> Result<Grammar> {
        let bad = |why: String| Error::InvalidParameter(format!("constraint: {why}"));
        let grammar = match &c.grammar {
            Some(constraint::Grammar::JsonSchema(text)) => {
                let schema: serde_json::Value = serde_json::from_str(text)
                    .map_err(|e| bad(format!("the JSON schema is not JSON: {e}")))?;
                if !schema.is_object() {
                    return Err(bad("a JSON schema must be an object".into()));
                }
                // One line, json.dumps's separators, unless the schema says otherwise: with
                // whitespace allowed anywhere a model can fill its budget with it.
                TopLevelGrammar::from_json_schema(vlm_proto::constraint::with_json_style(schema))
            }
            Some(constraint::Grammar::Regex(rx)) => TopLevelGrammar::from_regex(rx),
            Some(constraint::Grammar::Lark(lark)) => TopLevelGrammar::from_lark(lark.clone()),
            None => return Err(bad("no grammar given".into())),
        };
        // Checked before the (costly) compile.
        if let Some(t) = c.after_token.filter(|&t| t as usize >= self.vocab) {
            return Err(bad(format!(
                "after_token {t} is not in the vocabulary ({} tokens)",
                self.vocab
            )));
        }
        let parser = self
            .factory
            .create_parser(grammar)
            .map_err(|e| bad(e.to_string()))?;
        Ok(Grammar {
            matcher: Matcher::new(Ok(parser)),
            waiting_for: c.after_token,
            vocab: self.vocab,
            failure: None,
        })
    }
}

/// A sequence's grammar and the mask of its current state, which a pool thread computes
/// while the engine goes on. The step waits for a mask only until its deadline
/// ([`masks_by`]); a sequence whose mask is late takes no pick that step, and its mask,
/// still being computed, is there for the next one. So a slow grammar delays its own
/// sequence, never the batch.
pub struct SequenceGrammar {
    grammar: Mutex<Grammar>,
    mask: Mutex<MaskState>,
}

/// Where a sequence's next mask is.
enum MaskState {
    /// Not asked for since the grammar last moved.
    Idle,
    /// A pool thread is computing it.
    Computing,
    /// Computed ([`Grammar::mask`]'s answer), for the step that takes it.
    Ready(Option<Vec<u32>>),
}

/// What a step gets of a sequence's mask by its deadline.
#[derive(Debug, PartialEq)]
pub enum StepMask {
    /// The tokens the pick may be.
    Mask(Vec<u32>),
    /// Any token: the grammar has not started (or has failed, which ends the request).
    Free,
    /// Not computed yet: the sequence takes no pick this step.
    Late,
}

/// Extra time every mask takes: zero, except in the test that a slow grammar holds back its
/// own sequence only (`tests/slow_grammar.rs`, a process of its own).
static MASK_DELAY_MICROS: AtomicU64 = AtomicU64::new(0);

/// Makes every mask of this process take `by` longer (for tests).
#[doc(hidden)]
pub fn slow_every_mask_for_tests(by: std::time::Duration) {
    MASK_DELAY_MICROS.store(by.as_micros() as u64, Ordering::Relaxed);
}

/// Rung by a pool thread whenever a mask is ready: one for the process, since a mask computed
/// for one step may be taken by a later one.
static MASK_READY: (Mutex<()>, Condvar) = (Mutex::new(()), Condvar::new());

impl SequenceGrammar {
    pub fn new(grammar: Grammar) -> Arc<Self> {
        Arc::new(Self {
            grammar: Mutex::new(grammar),
            mask: Mutex::new(MaskState::Idle),
        })
    }

    /// The grammar, to advance or ask; never while its mask is being computed (a late
    /// sequence takes no pick, so nothing advances it meanwhile).
    pub fn lock(&self) -> std::sync::MutexGuard<'_, Grammar> {
        self.grammar.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Why the grammar cannot go on, without waiting for a mask being computed (then it has
    /// not failed yet, as far as anyone knows).
    pub fn failure(&self) -> Option<String> {
        match self.grammar.try_lock() {
            Ok(g) => g.failure().map(str::to_string),
            Err(std::sync::TryLockError::Poisoned(e)) => {
                e.into_inner().failure().map(str::to_string)
            }
            Err(std::sync::TryLockError::WouldBlock) => None,
        }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, MaskState> {
        self.mask.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Starts computing the mask on rayon's pool unless it is computed or under way.
    fn start(self: &Arc<Self>) {
        let mut state = self.state();
        if !matches!(*state, MaskState::Idle) {
            return;
        }
        *state = MaskState::Computing;
        drop(state);
        let me = Arc::clone(self);
        rayon::spawn(move || {
            let delay = MASK_DELAY_MICROS.load(Ordering::Relaxed);
            if delay > 0 {
                std::thread::sleep(std::time::Duration::from_micros(delay));
            }
            let mask = me.lock().mask();
            *me.state() = MaskState::Ready(mask);
            // Under the signal's lock, so a step checking the masks cannot miss it.
            let _signal = MASK_READY.0.lock().unwrap_or_else(|e| e.into_inner());
            MASK_READY.1.notify_all();
        });
    }

    /// The mask if it is ready (taken: the grammar then moves with the pick).
    fn take(&self) -> Option<StepMask> {
        let mut state = self.state();
        match std::mem::replace(&mut *state, MaskState::Idle) {
            MaskState::Ready(Some(mask)) => Some(StepMask::Mask(mask)),
            MaskState::Ready(None) => Some(StepMask::Free),
            other => {
                *state = other;
                None
            }
        }
    }
}

/// Each grammar's mask for this step, computed in parallel on rayon's pool (one task a
/// grammar, so a step's masks take about as long as its slowest one, not their sum), waiting
/// no later than `deadline`: a mask not ready by then is [`StepMask::Late`] and goes on being
/// computed for the next step.
pub fn masks_by(grammars: &[&Arc<SequenceGrammar>], deadline: Instant) -> Vec<StepMask> {
    for g in grammars {
        g.start();
    }
    let mut masks: Vec<Option<StepMask>> = grammars.iter().map(|_| None).collect();
    let mut signal = MASK_READY.0.lock().unwrap_or_else(|e| e.into_inner());
    loop {
        for (m, g) in masks.iter_mut().zip(grammars) {
            if m.is_none() {
                *m = g.take();
            }
        }
        let now = Instant::now();
        if masks.iter().all(Option::is_some) || now >= deadline {
            break;
        }
        signal = MASK_READY
            .1
            .wait_timeout(signal, deadline - now)
            .unwrap_or_else(|e| e.into_inner())
            .0;
    }
    masks
        .into_iter()
        .map(|m| m.unwrap_or(StepMask::Late))
        .collect()
}

/// One request's grammar as its tokens are picked.
pub struct Grammar {
    matcher: Matcher,
    /// The token after which the grammar applies, until it has been picked.
    waiting_for: Option<u32>,
    vocab: usize,
    /// Why the grammar can go no further, if it cannot (the request then fails).
    failure: Option<String>,
}

impl Grammar {
    /// The tokens the next pick may be ([`vlm_compute::sampling::mask_words`] words, one bit a
    /// token), or `None` while the grammar has not started (any token).
    pub fn mask(&mut self) -> Option<Vec<u32>> {
        if self.waiting_for.is_some() || self.failure.is_some() {
            return None;
        }
        match self.matcher.compute_mask_or_eos() {
            Ok(mask) if mask.num_set() > 0 => {
                let mut words: Vec<u32> = mask.into();
                words.resize(vlm_compute::sampling::mask_words(self.vocab), 0);
                Some(words)
            }
            Ok(_) => {
                self.failure = Some("the grammar allows no token here".into());
                None
            }
            Err(e) => {
                self.failure = Some(e.to_string());
                None
            }
        }
    }

    /// Whether the grammar would take `token` next, leaving it where it is: the check a
    /// sampler that picks before masking makes (`vlm bench` times it against the masks).
    pub fn allows(&mut self, token: u32) -> bool {
        if self.failure.is_some() || self.waiting_for.is_some() {
            return true;
        }
        self.matcher.validate_tokens(&[token]).is_ok_and(|n| n == 1)
    }

    /// Follows a picked token.
    pub fn accept(&mut self, token: u32) {
        if self.failure.is_some() {
            return;
        }
        if let Some(start) = self.waiting_for {
            if token == start {
                self.waiting_for = None;
            }
            return;
        }
        if let Err(e) = self.matcher.consume_token(token) {
            self.failure = Some(format!("token {token} breaks the grammar: {e}"));
        }
    }

    /// Whether the grammar is complete and allows nothing more (the answer ends here).
    pub fn is_complete(&self) -> bool {
        self.failure.is_none() && self.waiting_for.is_none() && self.matcher.is_stopped()
    }

    /// Why the grammar cannot go on, if it cannot.
    pub fn failure(&self) -> Option<&str> {
        self.failure.as_deref()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use vlm_compute::sampling::mask_allows;

    fn fixture() -> std::path::PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/tiny-qwen3-vl")
    }

    fn grammars() -> (Grammars, tokenizers::Tokenizer) {
        let cfg = crate::ModelConfig::from_dir(&fixture()).unwrap();
        let g = Grammars::load(&fixture(), cfg.text.vocab_size, &cfg.eos_token_ids).unwrap();
        let tok = tokenizers::Tokenizer::from_file(fixture().join("tokenizer.json")).unwrap();
        (g, tok)
    }

    fn schema(s: &str) -> Constraint {
        Constraint {
            grammar: Some(constraint::Grammar::JsonSchema(s.into())),
            after_token: None,
        }
    }

    /// Picks, at each step, the allowed token whose text comes first in `want` (the longest
    /// that fits), as a model that wants to write `want` would.
    fn write(g: &mut Grammar, tok: &tokenizers::Tokenizer, want: &str) -> String {
        let mut out = String::new();
        while let Some(mask) = g.mask() {
            let rest = &want[out.len()..];
            let best = (0..tok.get_vocab_size(true) as u32)
                .filter(|&t| mask_allows(&mask, t as usize))
                .filter_map(|t| tok.decode(&[t], false).ok().map(|s| (t, s)))
                .filter(|(_, s)| !s.is_empty() && rest.starts_with(s.as_str()))
                .max_by_key(|(_, s)| s.len());
            let Some((t, s)) = best else { break };
            g.accept(t);
            out.push_str(&s);
            if g.is_complete() {
                break;
            }
        }
        out
    }

    #[test]
    fn a_schema_allows_what_it_validates_and_nothing_else() {
        let (gs, tok) = grammars();
        let c = schema(
            r#"{"type":"object","properties":{"n":{"type":"integer"}},"required":["n"],"additionalProperties":false}"#,
        );
        let mut g = gs.compile(&c).unwrap();
        // The first token must open the object.
        let mask = g.mask().unwrap();
        let open = tok.token_to_id("{").unwrap() as usize;
        let letter = tok.token_to_id("a").unwrap() as usize;
        assert!(mask_allows(&mask, open) && !mask_allows(&mask, letter));
        // Laid out as json.dumps writes it (vlm_proto::constraint): no other whitespace.
        assert_eq!(write(&mut g, &tok, r#"{"n": 42}"#), r#"{"n": 42}"#);
        let mut g = gs.compile(&c).unwrap();
        assert_eq!(write(&mut g, &tok, r#"{"n":42}"#), r#"{"n":"#);
        // A key the schema does not have is refused partway.
        let mut g = gs.compile(&c).unwrap();
        assert_eq!(write(&mut g, &tok, r#"{"m":1}"#), r#"{""#);
    }

    #[test]
    fn the_short_string_slices_give_llguidances_own_masks() {
        let (gs, _) = grammars();
        let mut plain = ParserFactory::new_simple(gs.factory.tok_env()).unwrap();
        plain.quiet();
        let text = r#"{"type":"array","items":{"type":"string","maxLength":12},"minItems":3}"#;
        let json = || {
            let schema = serde_json::from_str(text).unwrap();
            TopLevelGrammar::from_json_schema(vlm_proto::constraint::with_json_style(schema))
        };
        let mut ours = gs.compile(&schema(text)).unwrap();
        let mut theirs = Matcher::new(Ok(plain.create_parser(json()).unwrap()));
        // Picks spread over the allowed tokens, so strings end at every length left.
        for step in 0..200 {
            let Some(mask) = ours.mask() else { break };
            let mut want: Vec<u32> = theirs.compute_mask_or_eos().unwrap().into();
            want.resize(mask.len(), 0);
            assert_eq!(mask, want, "step {step}");
            let allowed: Vec<u32> = (0..gs.vocab as u32)
                .filter(|&t| mask_allows(&mask, t as usize))
                .collect();
            let pick = allowed[(step * 7919) % allowed.len()];
            ours.accept(pick);
            theirs.consume_token(pick).unwrap();
            if ours.is_complete() {
                return;
            }
        }
        panic!("the answer never ended");
    }

    #[test]
    fn after_token_leaves_the_tokens_before_it_free() {
        let (gs, tok) = grammars();
        let start = tok.token_to_id("#").unwrap();
        let mut c = schema(r#"{"type":"boolean"}"#);
        c.after_token = Some(start);
        let mut g = gs.compile(&c).unwrap();
        assert!(g.mask().is_none());
        g.accept(tok.token_to_id("x").unwrap());
        assert!(g.mask().is_none());
        g.accept(start);
        assert_eq!(write(&mut g, &tok, "true"), "true");
    }

    #[test]
    fn bad_grammars_are_the_requests_error() {
        let (gs, _) = grammars();
        for (c, why) in [
            (schema("{not json"), "not JSON"),
            (schema("[1]"), "must be an object"),
            (schema(r#"{"type":"nonsense"}"#), "nonsense"),
            (
                Constraint {
                    grammar: Some(constraint::Grammar::Lark("start: (".into())),
                    after_token: None,
                },
                "",
            ),
        ] {
            let e = gs.compile(&c).err().expect("refused").to_string();
            assert!(e.contains("constraint") && e.contains(why), "{e}");
        }
    }
}
