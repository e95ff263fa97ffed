//! What the language stage reads from a checkpoint: `config.json` and the stop tokens from
//! `generation_config.json` (or, as in HF transformers, wherever else a checkpoint names them).
//! Both the transformers 4.x keys (`rope_scaling` + `rope_theta`) and the 5.x keys
//! (`rope_parameters`) are read.
//!
//! One text decoder serves three checkpoint families, told apart by `architectures`
//! ([`Architecture`]):
//! - `Qwen3VLForConditionalGeneration`: the decoder's keys under `text_config`, the special
//!   image tokens and the vision merge size at the top and in `vision_config`
//!   ([`VisionTokens`]); M-RoPE.
//! - `Qwen3ForCausalLM` and `Qwen2ForCausalLM`: the decoder's keys at the top, no vision
//!   ([`ModelConfig::vision`] is `None`), plain 1-D RoPE. Qwen2 has biases on q/k/v (never on
//!   o) and no q/k norm; Qwen3 has q/k norm and biases per `attention_bias`.

use std::path::Path;

use serde::Deserialize;
use serde_json::Value;
use vlm_compute::files;

use crate::{Error, Result};

#[derive(Clone, Debug)]
pub struct TextConfig {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub rms_norm_eps: f32,
    pub max_position_embeddings: usize,
    /// Biases on the q, k and v projections (Qwen2 always; Qwen3 and Qwen3-VL per
    /// `attention_bias`).
    pub qkv_bias: bool,
    /// A bias on the output projection (`attention_bias`; Qwen2 never).
    pub o_bias: bool,
    /// Per-head RMSNorm of q and k before RoPE (`q_norm`, `k_norm`): Qwen3 and Qwen3-VL, not
    /// Qwen2.
    pub qk_norm: bool,
    pub rope_theta: f64,
    /// Frequencies per M-RoPE stream (t, h, w), interleaved; sums to `head_dim / 2`. A text-only
    /// model has `[head_dim / 2, 0, 0]`: every frequency turns with stream t, which is plain 1-D
    /// RoPE (and its prompts have no images, so all three streams are equal anyway).
    pub mrope_section: [usize; 3],
}

/// The checkpoint families llm-svc serves, by `config.json`'s `architectures`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Architecture {
    /// `Qwen3VLForConditionalGeneration`: the decoder of Qwen3-VL, with M-RoPE and DeepStack.
    Qwen3Vl,
    /// `Qwen3ForCausalLM`: text only, q/k norm.
    Qwen3,
    /// `Qwen2ForCausalLM` (Qwen2, Qwen2.5): text only, q/k/v biases, no q/k norm.
    Qwen2,
}

impl Architecture {
    /// Every supported `architectures` entry, with the family it names.
    pub const SUPPORTED: [(&'static str, Architecture); 3] = [
        ("Qwen3VLForConditionalGeneration", Architecture::Qwen3Vl),
        ("Qwen3ForCausalLM", Architecture::Qwen3),
        ("Qwen2ForCausalLM", Architecture::Qwen2),
    ];

    /// The `architectures` entry that names this family.
    pub fn name(self) -> &'static str {
        Self::SUPPORTED
            .iter()
            .find(|(_, a)| *a == self)
            .map(|(n, _)| *n)
            .expect("every family is listed")
    }

    /// Where the text decoder's weights live: `model.language_model.*` in a Qwen3-VL
    /// checkpoint, `model.*` in a text-only one (`lm_head` is at the top in both).
    pub fn decoder_prefix(self) -> &'static str {
        match self {
            Architecture::Qwen3Vl => "model.language_model",
            Architecture::Qwen3 | Architecture::Qwen2 => "model",
        }
    }

    /// Which family `config.json`'s `architectures` list names.
    fn from_config(path: &Path, v: &Value) -> Result<Self> {
        let supported = Self::SUPPORTED.map(|(n, _)| n).join(", ");
        let Some(names) = v.get("architectures") else {
            return Err(Error::Config(format!(
                "{}: `architectures` is missing; supported are {supported}",
                path.display()
            )));
        };
        let found = names.as_array().into_iter().flatten().find_map(|n| {
            let n = n.as_str()?;
            Self::SUPPORTED
                .iter()
                .find(|(s, _)| *s == n)
                .map(|(_, a)| *a)
        });
        found.ok_or_else(|| {
            Error::Config(format!(
                "{}: `architectures` is {names}; supported are {supported}",
                path.display()
            ))
        })
    }
}

/// What the language stage needs of a multimodal checkpoint's vision side: the special tokens
/// around and in an image, and how patches merge into image tokens.
#[derive(Clone, Debug)]
pub struct VisionTokens {
    pub image_token_id: u32,
    pub vision_start_token_id: u32,
    pub vision_end_token_id: u32,
    /// Patches per merged image token along each side (2): turns a patch grid into LLM positions.
    pub spatial_merge_size: usize,
}

/// Everything the language stage needs from the checkpoint's config files.
#[derive(Clone, Debug)]
pub struct ModelConfig {
    pub architecture: Architecture,
    pub text: TextConfig,
    /// The image tokens of a vision-language checkpoint; `None` for a text-only one, which
    /// takes no images.
    pub vision: Option<VisionTokens>,
    pub tie_word_embeddings: bool,
    /// Generation stops at any of these (generation_config.json, else config.json, else
    /// tokenizer_config.json's `eos_token`); empty when no file names one, and then only the
    /// token budget ends a generation.
    pub eos_token_ids: Vec<u32>,
}

#[derive(Deserialize)]
struct RawText {
    vocab_size: usize,
    hidden_size: usize,
    intermediate_size: usize,
    num_hidden_layers: usize,
    num_attention_heads: usize,
    #[serde(default)]
    num_key_value_heads: Option<usize>,
    #[serde(default)]
    head_dim: Option<usize>,
    #[serde(default = "default_eps")]
    rms_norm_eps: f64,
    max_position_embeddings: usize,
    #[serde(default)]
    attention_bias: bool,
    #[serde(default = "default_act")]
    hidden_act: String,
    #[serde(default)]
    rope_theta: Option<f64>,
    /// transformers 4.x
    #[serde(default)]
    rope_scaling: Option<RawRope>,
    /// transformers 5.x
    #[serde(default)]
    rope_parameters: Option<RawRope>,
    #[serde(default)]
    eos_token_id: Value,
    #[serde(default)]
    tie_word_embeddings: Option<bool>,
    /// Qwen2 and Qwen3: sliding-window attention on some layers, which we do not implement.
    #[serde(default)]
    use_sliding_window: bool,
    /// transformers >= 4.53: each layer's attention kind (`full_attention` or
    /// `sliding_attention`).
    #[serde(default)]
    layer_types: Option<Vec<String>>,
}

#[derive(Deserialize)]
struct RawRope {
    #[serde(default)]
    rope_type: Option<String>,
    #[serde(default, alias = "type")]
    kind: Option<String>,
    #[serde(default)]
    rope_theta: Option<f64>,
    #[serde(default)]
    mrope_section: Option<Vec<usize>>,
}

/// The top of a Qwen3-VL `config.json`, around `text_config`.
#[derive(Deserialize)]
struct RawTop {
    image_token_id: u32,
    vision_start_token_id: u32,
    vision_end_token_id: u32,
    #[serde(default)]
    tie_word_embeddings: Option<bool>,
    #[serde(default)]
    eos_token_id: Value,
}

/// The stop tokens, from the first file that names any, in the order HF transformers
/// consults them: `generation_config.json`'s `eos_token_id`, `config.json`'s (in `text_config`,
/// then at the top), then the tokenizer's `eos_token` (`tokenizer_config.json`, a string or an
/// added-token object, looked up in `tokenizer.json`). A checkpoint that names none still loads,
/// as in transformers: generation then ends only at the token budget. Either fallback is
/// logged as a warning naming the files that lacked it.
fn eos_token_ids(dir: &Path, text_eos: &Value, top_eos: &Value) -> Result<Vec<u32>> {
    let gen_path = dir.join("generation_config.json");
    if gen_path.is_file() {
        let g = files::read_json(&gen_path)?;
        let ids = g
            .get("eos_token_id")
            .map(files::id_list)
            .unwrap_or_default();
        if !ids.is_empty() {
            return Ok(ids);
        }
    }
    let ids = files::id_list(text_eos);
    if !ids.is_empty() {
        return Ok(ids);
    }
    let ids = files::id_list(top_eos);
    if !ids.is_empty() {
        return Ok(ids);
    }
    let tok_cfg_path = dir.join("tokenizer_config.json");
    let token = if tok_cfg_path.is_file() {
        let t = files::read_json(&tok_cfg_path)?;
        match t.get("eos_token") {
            Some(Value::String(s)) => Some(s.clone()),
            Some(Value::Object(o)) => o.get("content").and_then(Value::as_str).map(str::to_string),
            _ => None,
        }
    } else {
        None
    };
    let Some(token) = token else {
        tracing::warn!(
            dir = %dir.display(),
            "no eos token in generation_config.json, config.json (eos_token_id) or \
             tokenizer_config.json (eos_token): generation stops only at the token budget"
        );
        return Ok(Vec::new());
    };
    let tok_path = dir.join("tokenizer.json");
    let id = token_id(&tok_path, &token)?.ok_or_else(|| {
        Error::Config(format!(
            "{} names eos_token `{token}`, which {} does not have",
            tok_cfg_path.display(),
            tok_path.display()
        ))
    })?;
    tracing::warn!(
        dir = %dir.display(),
        eos_token = %token,
        id,
        "no eos_token_id in generation_config.json or config.json; generation stops at \
         tokenizer_config.json's eos_token"
    );
    Ok(vec![id])
}

/// The id of `token` in a `tokenizer.json`: among its added tokens, else in its model's
/// vocabulary.
fn token_id(path: &Path, token: &str) -> Result<Option<u32>> {
    #[derive(Deserialize)]
    struct Added {
        id: u32,
        content: String,
    }
    #[derive(Deserialize)]
    struct Model {
        /// BPE and WordPiece: token -> id (Unigram's list of pairs has no ids by name).
        #[serde(default)]
        vocab: Value,
    }
    #[derive(Deserialize)]
    struct Tokenizer {
        #[serde(default)]
        added_tokens: Vec<Added>,
        model: Option<Model>,
    }
    let t: Tokenizer = files::read_json_as(path)?;
    if let Some(a) = t.added_tokens.iter().find(|a| a.content == token) {
        return Ok(Some(a.id));
    }
    Ok(t.model
        .and_then(|m| m.vocab.get(token).and_then(Value::as_u64))
        .map(|id| id as u32))
}

fn default_eps() -> f64 {
    1e-6
}
fn default_act() -> String {
    "silu".into()
}

impl ModelConfig {
    /// Why `--quantize-lm-head` cannot be taken by this model, if it cannot: the loader and
    /// `vlm doctor`'s footprint refuse it in these words, by the config alone.
    pub fn lm_head_quantize_refusal(&self) -> Option<&'static str> {
        self.tie_word_embeddings.then_some(
            "--quantize-lm-head asked of a checkpoint that ties lm_head to its embedding table \
             (tie_word_embeddings), which stays f16",
        )
    }

    pub fn from_dir(dir: &Path) -> Result<Self> {
        let path = dir.join("config.json");
        let v = files::read_json(&path)?;
        let architecture = Architecture::from_config(&path, &v)?;
        match architecture {
            Architecture::Qwen3Vl => Self::vision_language(dir, &path, v),
            Architecture::Qwen3 | Architecture::Qwen2 => {
                Self::text_only(dir, &path, v, architecture)
            }
        }
    }

    /// The image token id of a vision-language checkpoint; `None` for a text-only one.
    pub fn image_token_id(&self) -> Option<u32> {
        self.vision.as_ref().map(|v| v.image_token_id)
    }

    /// Qwen3-VL: the decoder's keys in `text_config`, the image tokens at the top.
    fn vision_language(dir: &Path, path: &Path, v: Value) -> Result<Self> {
        let top: RawTop = files::parse(path, "", v.clone())?;
        let raw: RawText = files::parse(
            path,
            "text_config",
            files::require(path, &v, "text_config")?.clone(),
        )?;
        let merge = files::require(path, &v, "vision_config")?
            .get("spatial_merge_size")
            .and_then(Value::as_u64)
            .unwrap_or(2) as usize;
        let text = TextConfig::from_raw(&raw, Architecture::Qwen3Vl, path, "text_config: ")?;

        let eos = eos_token_ids(dir, &raw.eos_token_id, &top.eos_token_id)?;
        let vision = VisionTokens {
            image_token_id: top.image_token_id,
            vision_start_token_id: top.vision_start_token_id,
            vision_end_token_id: top.vision_end_token_id,
            spatial_merge_size: merge,
        };
        for (key, id) in [
            ("image_token_id", vision.image_token_id),
            ("vision_start_token_id", vision.vision_start_token_id),
            ("vision_end_token_id", vision.vision_end_token_id),
        ] {
            if id as usize >= text.vocab_size {
                return Err(Error::Config(format!(
                    "{}: `{key}` {id} is outside the vocabulary of {}",
                    path.display(),
                    text.vocab_size
                )));
            }
        }
        Ok(Self {
            architecture: Architecture::Qwen3Vl,
            tie_word_embeddings: top
                .tie_word_embeddings
                .or(raw.tie_word_embeddings)
                .unwrap_or(false),
            vision: Some(vision),
            eos_token_ids: eos,
            text,
        })
    }

    /// Qwen3 and Qwen2: the decoder's keys at the top of `config.json`, no vision.
    fn text_only(dir: &Path, path: &Path, v: Value, architecture: Architecture) -> Result<Self> {
        let raw: RawText = files::parse(path, "", v)?;
        let text = TextConfig::from_raw(&raw, architecture, path, "")?;
        Ok(Self {
            architecture,
            tie_word_embeddings: raw.tie_word_embeddings.unwrap_or(false),
            vision: None,
            eos_token_ids: eos_token_ids(dir, &raw.eos_token_id, &Value::Null)?,
            text,
        })
    }
}

impl TextConfig {
    /// The decoder's settings from its keys (`where_` names where they sit in `config.json`,
    /// "text_config: " or "" for the top, in error messages).
    fn from_raw(raw: &RawText, arch: Architecture, path: &Path, where_: &str) -> Result<Self> {
        let bad = |m: String| Err(Error::Config(format!("{}: {where_}{m}", path.display())));
        if raw.hidden_act != "silu" {
            return bad(format!(
                "hidden_act `{}` is not supported (silu)",
                raw.hidden_act
            ));
        }
        if raw.use_sliding_window {
            return bad("use_sliding_window true is not supported (full attention only)".into());
        }
        if let Some(kind) = raw
            .layer_types
            .iter()
            .flatten()
            .find(|t| *t != "full_attention")
        {
            return bad(format!(
                "layer_types has `{kind}`, which is not supported (full_attention)"
            ));
        }
        let rope = raw.rope_parameters.as_ref().or(raw.rope_scaling.as_ref());
        let rope_type = rope
            .and_then(|r| r.rope_type.clone().or(r.kind.clone()))
            .unwrap_or_else(|| "default".into());
        if rope_type != "default" && rope_type != "mrope" {
            return bad(format!(
                "rope_type `{rope_type}` is not supported (default)"
            ));
        }
        let heads = raw.num_attention_heads;
        let head_dim = raw.head_dim.unwrap_or(raw.hidden_size / heads.max(1));
        let kv_heads = raw.num_key_value_heads.unwrap_or(heads);
        if heads == 0 || kv_heads == 0 || heads % kv_heads != 0 {
            return bad(format!(
                "num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}"
            ));
        }
        let mrope_section = if arch == Architecture::Qwen3Vl {
            let section = rope
                .and_then(|r| r.mrope_section.clone())
                .unwrap_or_else(|| vec![24, 20, 20]);
            let [t, h, w] = section[..] else {
                return bad(format!("mrope_section {section:?} must have 3 entries"));
            };
            if t.checked_add(h).and_then(|th| th.checked_add(w)) != Some(head_dim / 2) {
                return bad(format!(
                    "mrope_section {section:?} must sum to head_dim / 2 = {}",
                    head_dim / 2
                ));
            }
            [t, h, w]
        } else {
            // 1-D RoPE: every frequency on stream t.
            [head_dim / 2, 0, 0]
        };
        let theta = rope.and_then(|r| r.rope_theta).or(raw.rope_theta);
        let Some(rope_theta) = theta else {
            return bad(format!(
                "no rope_theta (in rope_parameters or at the top of {})",
                if where_.is_empty() {
                    "config.json"
                } else {
                    "text_config"
                }
            ));
        };
        let qwen2 = arch == Architecture::Qwen2;
        Ok(Self {
            vocab_size: raw.vocab_size,
            hidden_size: raw.hidden_size,
            intermediate_size: raw.intermediate_size,
            num_hidden_layers: raw.num_hidden_layers,
            num_attention_heads: heads,
            num_key_value_heads: kv_heads,
            head_dim,
            rms_norm_eps: raw.rms_norm_eps as f32,
            max_position_embeddings: raw.max_position_embeddings,
            // transformers' Qwen2Attention: q/k/v always biased, o never, whatever
            // `attention_bias` says (Qwen2 configs do not have it).
            qkv_bias: qwen2 || raw.attention_bias,
            o_bias: !qwen2 && raw.attention_bias,
            qk_norm: !qwen2,
            rope_theta,
            mrope_section,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn repo(p: &str) -> std::path::PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join(p)
    }

    #[test]
    fn reads_transformers_4x_keys_from_the_8b_config() {
        let cfg = ModelConfig::from_dir(&repo("deploy/models/qwen3-vl-8b")).unwrap();
        let t = &cfg.text;
        assert_eq!(
            (t.hidden_size, t.num_hidden_layers, t.head_dim),
            (4096, 36, 128)
        );
        assert_eq!((t.num_attention_heads, t.num_key_value_heads), (32, 8));
        assert_eq!(t.mrope_section, [24, 20, 20]);
        assert_eq!(t.rope_theta, 5_000_000.0);
        assert_eq!(cfg.image_token_id(), Some(151655));
        assert_eq!(cfg.architecture, Architecture::Qwen3Vl);
        assert!(t.qk_norm && !t.qkv_bias && !t.o_bias);
        // From generation_config.json (<|im_end|>, <|endoftext|>), over config.json's one.
        assert_eq!(cfg.eos_token_ids, vec![151645, 151643]);
        assert!(!cfg.tie_word_embeddings);
    }

    #[test]
    fn reads_transformers_5x_keys_and_generation_config_from_the_fixture() {
        let cfg = ModelConfig::from_dir(&repo("tests/fixtures/tiny-qwen3-vl")).unwrap();
        assert_eq!(cfg.text.mrope_section, [6, 5, 5]);
        assert_eq!(cfg.text.rope_theta, 5_000_000.0);
        assert_eq!(
            cfg.eos_token_ids.len(),
            2,
            "generation_config.json lists two"
        );
        assert_eq!(cfg.vision.as_ref().unwrap().spatial_merge_size, 2);
    }

    #[test]
    fn bad_sections_and_missing_keys_are_named() {
        let dir = std::env::temp_dir().join(format!("vlm-tcfg-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let text = std::fs::read_to_string(repo("deploy/models/qwen3-vl-8b/config.json")).unwrap();
        // Two entries, and a sum past usize (refused, not a panic).
        for section in ["[24, 20]", "[18446744073709551615, 20, 20]"] {
            std::fs::write(
                dir.join("config.json"),
                text.replace("[24, 20, 20]", section),
            )
            .unwrap();
            let err = ModelConfig::from_dir(&dir).unwrap_err().to_string();
            assert!(err.contains("mrope_section"), "{section}: {err}");
        }
        std::fs::write(
            dir.join("config.json"),
            text.replace("\"hidden_size\": 4096,", ""),
        )
        .unwrap();
        let err = ModelConfig::from_dir(&dir).unwrap_err().to_string();
        assert!(
            err.contains("config.json")
                && err.contains("text_config")
                && err.contains("hidden_size"),
            "{err}"
        );
    }

    /// Qwen2.5-7B-Instruct's `config.json` as published (transformers 4.43).
    const QWEN25_7B: &str = r#"{
      "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0,
      "bos_token_id": 151643, "eos_token_id": 151645, "hidden_act": "silu",
      "hidden_size": 3584, "initializer_range": 0.02, "intermediate_size": 18944,
      "max_position_embeddings": 32768, "max_window_layers": 28, "model_type": "qwen2",
      "num_attention_heads": 28, "num_hidden_layers": 28, "num_key_value_heads": 4,
      "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 131072,
      "tie_word_embeddings": false, "torch_dtype": "bfloat16", "use_cache": true,
      "use_sliding_window": false, "vocab_size": 152064
    }"#;

    /// Qwen3-8B's `config.json` as published (transformers 4.51).
    const QWEN3_8B: &str = r#"{
      "architectures": ["Qwen3ForCausalLM"], "attention_bias": false, "attention_dropout": 0.0,
      "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
      "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 12288,
      "max_position_embeddings": 40960, "max_window_layers": 36, "model_type": "qwen3",
      "num_attention_heads": 32, "num_hidden_layers": 36, "num_key_value_heads": 8,
      "rms_norm_eps": 1e-06, "rope_scaling": null, "rope_theta": 1000000,
      "sliding_window": null, "tie_word_embeddings": false, "torch_dtype": "bfloat16",
      "use_cache": true, "use_sliding_window": false, "vocab_size": 151936
    }"#;

    /// A directory holding only `config.json` = `json`.
    fn config_dir(name: &str, json: &str) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("vlm-arch-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("config.json"), json).unwrap();
        dir
    }

    #[test]
    fn qwen2_reads_at_the_top_with_qkv_bias_no_qk_norm_and_1d_rope() {
        let dir = config_dir("qwen2", QWEN25_7B);
        let cfg = ModelConfig::from_dir(&dir).unwrap();
        let t = &cfg.text;
        assert_eq!(cfg.architecture, Architecture::Qwen2);
        assert_eq!(cfg.architecture.decoder_prefix(), "model");
        assert!(cfg.vision.is_none() && cfg.image_token_id().is_none());
        assert_eq!(
            (t.hidden_size, t.head_dim, t.num_key_value_heads),
            (3584, 128, 4)
        );
        // transformers' Qwen2Attention: q/k/v biased, o not, no q/k norm.
        assert!(t.qkv_bias && !t.o_bias && !t.qk_norm);
        assert_eq!(t.mrope_section, [64, 0, 0]);
        assert_eq!(t.rope_theta, 1e6);
        assert_eq!(cfg.eos_token_ids, vec![151645]);
        // Sliding-window attention is refused, by name, not served wrong.
        let sliding = config_dir(
            "qwen2-sliding",
            &QWEN25_7B.replace(
                r#""use_sliding_window": false"#,
                r#""use_sliding_window": true"#,
            ),
        );
        let err = ModelConfig::from_dir(&sliding).unwrap_err().to_string();
        assert!(err.contains("use_sliding_window"), "{err}");
        // transformers 5.x: rope_parameters, and layer_types.
        let v5 = QWEN25_7B.replace(
            r#""rope_theta": 1000000.0"#,
            r#""rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
               "layer_types": ["full_attention", "sliding_attention"]"#,
        );
        let err = ModelConfig::from_dir(&config_dir("qwen2-v5", &v5))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("layer_types") && err.contains("sliding_attention"),
            "{err}"
        );
        let v5 = v5.replace("sliding_attention", "full_attention");
        let cfg = ModelConfig::from_dir(&config_dir("qwen2-v5", &v5)).unwrap();
        assert_eq!(cfg.text.rope_theta, 1e4);
        for d in [
            dir,
            sliding,
            std::env::temp_dir().join(format!("vlm-arch-qwen2-v5-{}", std::process::id())),
        ] {
            let _ = std::fs::remove_dir_all(d);
        }
    }

    #[test]
    fn qwen3_reads_at_the_top_with_qk_norm_and_no_bias() {
        let dir = config_dir("qwen3", QWEN3_8B);
        let cfg = ModelConfig::from_dir(&dir).unwrap();
        let t = &cfg.text;
        assert_eq!(cfg.architecture, Architecture::Qwen3);
        assert!(cfg.vision.is_none());
        assert_eq!(
            (t.hidden_size, t.head_dim, t.num_attention_heads),
            (4096, 128, 32)
        );
        assert!(t.qk_norm && !t.qkv_bias && !t.o_bias);
        assert_eq!(t.mrope_section, [64, 0, 0]);
        assert_eq!(t.rope_theta, 1e6);
        assert!(!cfg.tie_word_embeddings);
        let tied = config_dir(
            "qwen3-tied",
            &QWEN3_8B.replace(
                r#""tie_word_embeddings": false"#,
                r#""tie_word_embeddings": true"#,
            ),
        );
        assert!(ModelConfig::from_dir(&tied).unwrap().tie_word_embeddings);
        for d in [dir, tied] {
            let _ = std::fs::remove_dir_all(d);
        }
    }

    #[test]
    fn an_unsupported_architecture_is_named_with_what_is_supported() {
        let llama = config_dir(
            "llama",
            &QWEN3_8B.replace("Qwen3ForCausalLM", "LlamaForCausalLM"),
        );
        let err = ModelConfig::from_dir(&llama).unwrap_err().to_string();
        assert!(
            err.contains("`architectures`") && err.contains("LlamaForCausalLM"),
            "{err}"
        );
        for (name, _) in Architecture::SUPPORTED {
            assert!(err.contains(name), "{err}");
        }
        let none = config_dir(
            "none",
            &QWEN3_8B.replace(r#""architectures": ["Qwen3ForCausalLM"],"#, ""),
        );
        let err = ModelConfig::from_dir(&none).unwrap_err().to_string();
        assert!(
            err.contains("`architectures` is missing") && err.contains("Qwen2ForCausalLM"),
            "{err}"
        );
        for d in [llama, none] {
            let _ = std::fs::remove_dir_all(d);
        }
    }

    /// A copy of the tiny fixture's JSON files in a fresh directory, with `generation_config.json`
    /// dropped, `eos_token_id` taken out of `config.json` and `tokenizer_config.json`'s
    /// `eos_token` set to `eos_token` (removed when `None`).
    fn fixture_without_eos_ids(name: &str, eos_token: Option<Value>) -> std::path::PathBuf {
        let src = repo("tests/fixtures/tiny-qwen3-vl");
        let dir = std::env::temp_dir().join(format!("vlm-eos-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::copy(src.join("tokenizer.json"), dir.join("tokenizer.json")).unwrap();
        let read = |f: &str| -> Value {
            serde_json::from_str(&std::fs::read_to_string(src.join(f)).unwrap()).unwrap()
        };
        let mut config = read("config.json");
        config.as_object_mut().unwrap().remove("eos_token_id");
        config["text_config"]
            .as_object_mut()
            .unwrap()
            .remove("eos_token_id");
        std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
        let mut tok = read("tokenizer_config.json");
        match eos_token {
            Some(v) => tok["eos_token"] = v,
            None => {
                tok.as_object_mut().unwrap().remove("eos_token");
            }
        }
        std::fs::write(dir.join("tokenizer_config.json"), tok.to_string()).unwrap();
        dir
    }

    #[test]
    fn eos_named_only_in_tokenizer_config_is_looked_up_in_the_tokenizer() {
        // The fixture's <|im_end|> is id 402 (its generation_config.json lists it first).
        let want = ModelConfig::from_dir(&repo("tests/fixtures/tiny-qwen3-vl"))
            .unwrap()
            .eos_token_ids[0];
        let as_string = fixture_without_eos_ids("string", Some("<|im_end|>".into()));
        let cfg = ModelConfig::from_dir(&as_string).unwrap();
        assert_eq!(cfg.eos_token_ids, vec![want]);
        // transformers also writes it as an AddedToken object.
        let added =
            serde_json::json!({"__type": "AddedToken", "content": "<|im_end|>", "special": true});
        let as_object = fixture_without_eos_ids("object", Some(added));
        assert_eq!(
            ModelConfig::from_dir(&as_object).unwrap().eos_token_ids,
            vec![want]
        );
        // A token the tokenizer does not have is an inconsistent checkpoint, named as such.
        let unknown = fixture_without_eos_ids("unknown", Some("<|no such token|>".into()));
        let err = ModelConfig::from_dir(&unknown).unwrap_err().to_string();
        assert!(
            err.contains("tokenizer_config.json") && err.contains("<|no such token|>"),
            "{err}"
        );
        for d in [as_string, as_object, unknown] {
            let _ = std::fs::remove_dir_all(d);
        }
    }

    #[test]
    fn a_checkpoint_naming_no_eos_loads_and_stops_only_at_the_budget() {
        let dir = fixture_without_eos_ids("none", None);
        let cfg = ModelConfig::from_dir(&dir).unwrap();
        assert!(cfg.eos_token_ids.is_empty(), "{:?}", cfg.eos_token_ids);
        let _ = std::fs::remove_dir_all(dir);
    }
}
