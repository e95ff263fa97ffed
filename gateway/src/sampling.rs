//! A request's sampling fields as the engine takes them ([`SamplingParams`]): what the request
//! says; for a field it leaves out, the checkpoint's `generation_config.json` where that names
//! one (as vLLM's `--generation-config auto`); else greedy with every control off. Both APIs
//! (HTTP and gRPC) read their requests into [`RequestedSampling`] and resolve it here, so the
//! defaults are applied in one place.

use std::path::{Path, PathBuf};

use serde_json::Value;
use vlm_proto::sampling::SamplingParams;

use crate::{Error, Result};

/// The file of the checkpoint the defaults come from.
pub const GENERATION_CONFIG_FILE: &str = "generation_config.json";

/// Where the values of sampling fields a request leaves out come from (`--generation-config`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum GenerationConfig {
    /// The checkpoint's generation_config.json, for each field it names.
    #[default]
    Auto,
    /// Not the checkpoint's: greedy, with every control off.
    None,
}

/// The sampling fields as one request gives them: `None` where it says nothing.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RequestedSampling {
    pub temperature: Option<f32>,
    pub top_k: Option<usize>,
    pub top_p: Option<f32>,
    pub min_p: Option<f32>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    pub repetition_penalty: Option<f32>,
    /// No default: a checkpoint has none to give.
    pub logit_bias: Vec<(u32, f32)>,
    /// `Some(n)`: each token's logprob and the `n` most likely tokens'.
    pub logprobs: Option<usize>,
    pub seed: Option<u64>,
}

/// Values for the sampling fields a request leaves out, as the checkpoint recommends them.
/// Empty (every field `None`) is greedy with every control off.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SamplingDefaults {
    pub temperature: Option<f32>,
    pub top_k: Option<usize>,
    pub top_p: Option<f32>,
    pub min_p: Option<f32>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    pub repetition_penalty: Option<f32>,
}

impl SamplingDefaults {
    /// The defaults of checkpoint `dir` under `mode`: with [`GenerationConfig::Auto`], the
    /// keys its generation_config.json has (none when the file is missing); a key that is not
    /// a number, or a value the request checks would refuse, is an error naming the file and
    /// the key.
    pub fn load(dir: &Path, mode: GenerationConfig) -> Result<Self> {
        if mode == GenerationConfig::None {
            return Ok(Self::default());
        }
        let file = dir.join(GENERATION_CONFIG_FILE);
        let text = match std::fs::read_to_string(&file) {
            Ok(text) => text,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Self::default()),
            Err(e) => return Err(bad(&file, "", format!("cannot be read: {e}"))),
        };
        let json: Value = serde_json::from_str(&text)
            .map_err(|e| bad(&file, "", format!("not valid JSON: {e}")))?;
        Self::from_json(&json, &file)
    }

    /// The defaults in a parsed generation_config.json (`file` names it in errors). As vLLM,
    /// only the keys present count; unlike vLLM, which ignores it, `"do_sample": false`
    /// makes the default greedy whatever `temperature` says, as HF's `generate` reads it.
    pub fn from_json(json: &Value, file: &Path) -> Result<Self> {
        let Some(map) = json.as_object() else {
            return Err(bad(file, "", "not a JSON object".into()));
        };
        let number = |key: &str| -> Result<Option<f64>> {
            match map.get(key) {
                None | Some(Value::Null) => Ok(None),
                Some(v) => v
                    .as_f64()
                    .map(Some)
                    .ok_or_else(|| bad(file, key, format!("must be a number, got {v}"))),
            }
        };
        let float = |key: &str| number(key).map(|v| v.map(|v| v as f32));
        let mut d = Self {
            temperature: float("temperature")?,
            // HF and vLLM read 0 and below as off, which is our 0.
            top_k: number("top_k")?.map(|k| if k > 0.0 { k as usize } else { 0 }),
            top_p: float("top_p")?,
            min_p: float("min_p")?,
            presence_penalty: float("presence_penalty")?,
            frequency_penalty: float("frequency_penalty")?,
            repetition_penalty: float("repetition_penalty")?,
        };
        match map.get("do_sample") {
            None | Some(Value::Null) | Some(Value::Bool(true)) => {}
            Some(Value::Bool(false)) => d.temperature = Some(0.0),
            Some(v) => {
                return Err(bad(
                    file,
                    "do_sample",
                    format!("must be true or false, got {v}"),
                ))
            }
        }
        // A value no request could give would fail every request that leaves it out.
        d.apply(RequestedSampling::default())
            .validate()
            .map_err(|e| bad(file, "", e.to_string()))?;
        Ok(d)
    }

    /// Whether the checkpoint named any default (for the startup log).
    pub fn is_empty(&self) -> bool {
        *self == Self::default()
    }

    /// `r` with each field it leaves out taken from these defaults, else off (greedy).
    pub fn apply(&self, r: RequestedSampling) -> SamplingParams {
        let off = SamplingParams::default();
        SamplingParams {
            temperature: r
                .temperature
                .or(self.temperature)
                .unwrap_or(off.temperature),
            top_k: r.top_k.or(self.top_k).unwrap_or(off.top_k),
            top_p: r.top_p.or(self.top_p).unwrap_or(off.top_p),
            min_p: r.min_p.or(self.min_p).unwrap_or(off.min_p),
            presence_penalty: r
                .presence_penalty
                .or(self.presence_penalty)
                .unwrap_or(off.presence_penalty),
            frequency_penalty: r
                .frequency_penalty
                .or(self.frequency_penalty)
                .unwrap_or(off.frequency_penalty),
            repetition_penalty: r
                .repetition_penalty
                .or(self.repetition_penalty)
                .unwrap_or(off.repetition_penalty),
            logit_bias: r.logit_bias,
            logprobs: r.logprobs,
            seed: r.seed,
            // One request's choices are numbered by the orchestrator.
            choice: 0,
        }
    }
}

/// A problem with `key` of `file` (`""`: with the file as a whole).
fn bad(file: &Path, key: &str, message: String) -> Error {
    Error::GenerationConfig {
        file: PathBuf::from(file),
        message: if key.is_empty() {
            message
        } else {
            format!("`{key}` {message}")
        },
    }
}

/// Refuses `logit_bias` ids at or past `vocab` (the model's vocabulary), as llm-svc would,
/// before any upstream call.
pub fn check_logit_bias_ids(sampling: &SamplingParams, vocab: usize) -> Result<()> {
    match sampling.logit_bias.iter().find(|b| b.0 as usize >= vocab) {
        Some(&(id, _)) => Err(Error::InvalidRequest(format!(
            "`logit_bias` names token {id}, outside the vocabulary of {vocab}"
        ))),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn from(json: Value) -> Result<SamplingDefaults> {
        SamplingDefaults::from_json(&json, Path::new("m/generation_config.json"))
    }

    #[test]
    fn checkpoint_values_fill_only_the_fields_a_request_leaves_out() {
        let d = from(json!({
            "do_sample": true, "temperature": 0.7, "top_k": 20, "top_p": 0.8,
            "repetition_penalty": 1.05, "bos_token_id": 1, "eos_token_id": [2, 3],
        }))
        .unwrap();
        let p = d.apply(RequestedSampling {
            temperature: Some(0.0),
            top_p: Some(0.5),
            presence_penalty: Some(1.0),
            seed: Some(4),
            ..Default::default()
        });
        assert_eq!(
            (p.temperature, p.top_k, p.top_p, p.repetition_penalty),
            (0.0, 20, 0.5, 1.05),
            "the request's own values win, even 0"
        );
        assert_eq!((p.presence_penalty, p.min_p, p.seed), (1.0, 0.0, Some(4)));
        let all_left_out = d.apply(RequestedSampling::default());
        assert_eq!(
            (
                all_left_out.temperature,
                all_left_out.top_k,
                all_left_out.top_p
            ),
            (0.7, 20, 0.8)
        );
    }

    #[test]
    fn no_file_no_keys_or_none_mode_is_greedy() {
        let greedy = SamplingParams::default();
        // The bundled fixture says do_sample false and names no sampling key.
        let fixture = crate::tiny_fixture();
        let dir = std::env::temp_dir().join(format!("vlm-genconfig-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(
            dir.join(GENERATION_CONFIG_FILE),
            r#"{"temperature": 0.6, "top_k": -1, "top_p": 0.95}"#,
        )
        .unwrap();
        let missing = dir.join("nothing-here");
        for (d, mode, want_greedy) in [
            (&fixture, GenerationConfig::Auto, true),
            (&missing, GenerationConfig::Auto, true),
            (&dir, GenerationConfig::None, true),
            (&dir, GenerationConfig::Auto, false),
        ] {
            let defaults = SamplingDefaults::load(d, mode).unwrap();
            let p = defaults.apply(RequestedSampling::default());
            assert_eq!(p == greedy, want_greedy, "{} {mode:?}: {p:?}", d.display());
        }
        let d = SamplingDefaults::load(&dir, GenerationConfig::Auto).unwrap();
        assert_eq!(
            (d.temperature, d.top_k, d.top_p),
            (Some(0.6), Some(0), Some(0.95))
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn do_sample_false_makes_the_default_greedy() {
        let d = from(json!({"do_sample": false, "temperature": 0.7, "top_p": 0.8})).unwrap();
        let p = d.apply(RequestedSampling::default());
        assert_eq!((p.temperature, p.top_p), (0.0, 0.8));
        let asked = d.apply(RequestedSampling {
            temperature: Some(0.9),
            ..Default::default()
        });
        assert_eq!(asked.temperature, 0.9, "a request may still sample");
    }

    #[test]
    fn bad_values_name_the_file_and_the_key() {
        for (json, key) in [
            (json!({"temperature": "hot"}), "temperature"),
            (json!({"top_p": 0.0}), "top_p"),
            (json!({"repetition_penalty": 0}), "repetition_penalty"),
            (json!({"min_p": 2}), "min_p"),
            (json!({"do_sample": "yes"}), "do_sample"),
        ] {
            let e = from(json.clone()).unwrap_err().to_string();
            assert!(
                e.contains("m/generation_config.json") && e.contains(key),
                "{json}: {e}"
            );
            assert!(e.contains("--generation-config none"), "{e}");
        }
    }

    #[test]
    fn logit_bias_ids_past_the_vocabulary_are_refused() {
        let p = SamplingParams {
            logit_bias: vec![(3, 1.0), (400, 2.0)],
            ..Default::default()
        };
        assert!(check_logit_bias_ids(&p, 401).is_ok());
        let e = check_logit_bias_ids(&p, 400).unwrap_err().to_string();
        assert!(e.contains("`logit_bias` names token 400"), "{e}");
    }
}
