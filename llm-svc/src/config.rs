//! What the language stage reads from a checkpoint: `config.json` (`text_config`, the special
//! token ids, `tie_word_embeddings`, the vision merge size) and the stop tokens from
//! `generation_config.json`. Both the transformers 4.x keys (`rope_scaling` + `rope_theta`) and
//! the 5.x keys (`rope_parameters`) are read.

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
    pub attention_bias: bool,
    pub rope_theta: f64,
    /// Frequencies per M-RoPE stream (t, h, w), interleaved; sums to `head_dim / 2`.
    pub mrope_section: [usize; 3],
}

/// Everything the language stage needs from the checkpoint's config files.
#[derive(Clone, Debug)]
pub struct ModelConfig {
    pub text: TextConfig,
    pub image_token_id: u32,
    pub vision_start_token_id: u32,
    pub vision_end_token_id: u32,
    pub tie_word_embeddings: bool,
    /// Patches per merged image token along each side (2): turns a patch grid into LLM positions.
    pub spatial_merge_size: usize,
    /// Generation stops at any of these (generation_config.json, else text_config).
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

fn default_eps() -> f64 {
    1e-6
}
fn default_act() -> String {
    "silu".into()
}

impl ModelConfig {
    pub fn from_dir(dir: &Path) -> Result<Self> {
        let path = dir.join("config.json");
        let v = files::read_json(&path)?;
        let top: RawTop = files::parse(&path, "", v.clone())?;
        let raw: RawText = files::parse(
            &path,
            "text_config",
            files::require(&path, &v, "text_config")?.clone(),
        )?;
        let merge = files::require(&path, &v, "vision_config")?
            .get("spatial_merge_size")
            .and_then(Value::as_u64)
            .unwrap_or(2) as usize;
        let text = TextConfig::from_raw(&raw, &path)?;

        // Stop tokens: generation_config.json decides when present, as in HF's generate().
        let gen_path = dir.join("generation_config.json");
        let mut eos = Vec::new();
        if gen_path.is_file() {
            let g = files::read_json(&gen_path)?;
            eos = g
                .get("eos_token_id")
                .map(files::id_list)
                .unwrap_or_default();
        }
        if eos.is_empty() {
            eos = files::id_list(&raw.eos_token_id);
        }
        if eos.is_empty() {
            eos = files::id_list(&top.eos_token_id);
        }
        if eos.is_empty() {
            return Err(Error::Config(format!(
                "no eos_token_id in {} or {}",
                gen_path.display(),
                path.display()
            )));
        }
        let cfg = Self {
            image_token_id: top.image_token_id,
            vision_start_token_id: top.vision_start_token_id,
            vision_end_token_id: top.vision_end_token_id,
            tie_word_embeddings: top
                .tie_word_embeddings
                .or(raw.tie_word_embeddings)
                .unwrap_or(false),
            spatial_merge_size: merge,
            eos_token_ids: eos,
            text,
        };
        for (key, id) in [
            ("image_token_id", cfg.image_token_id),
            ("vision_start_token_id", cfg.vision_start_token_id),
            ("vision_end_token_id", cfg.vision_end_token_id),
        ] {
            if id as usize >= cfg.text.vocab_size {
                return Err(Error::Config(format!(
                    "{}: `{key}` {id} is outside the vocabulary of {}",
                    path.display(),
                    cfg.text.vocab_size
                )));
            }
        }
        Ok(cfg)
    }
}

impl TextConfig {
    fn from_raw(raw: &RawText, path: &Path) -> Result<Self> {
        let bad = |m: String| {
            Err(Error::Config(format!(
                "{}: text_config: {m}",
                path.display()
            )))
        };
        if raw.hidden_act != "silu" {
            return bad(format!(
                "hidden_act `{}` is not supported (silu)",
                raw.hidden_act
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
        let section = rope
            .and_then(|r| r.mrope_section.clone())
            .unwrap_or_else(|| vec![24, 20, 20]);
        let [t, h, w] = section[..] else {
            return bad(format!("mrope_section {section:?} must have 3 entries"));
        };
        if t + h + w != head_dim / 2 {
            return bad(format!(
                "mrope_section {section:?} must sum to head_dim / 2 = {}",
                head_dim / 2
            ));
        }
        let theta = rope.and_then(|r| r.rope_theta).or(raw.rope_theta);
        let Some(rope_theta) = theta else {
            return bad("no rope_theta (in rope_parameters or at the top of text_config)".into());
        };
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
            attention_bias: raw.attention_bias,
            rope_theta,
            mrope_section: [t, h, w],
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
        assert_eq!(cfg.image_token_id, 151655);
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
        assert_eq!(cfg.spatial_merge_size, 2);
    }

    #[test]
    fn bad_sections_and_missing_keys_are_named() {
        let dir = std::env::temp_dir().join(format!("vlm-tcfg-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let text = std::fs::read_to_string(repo("deploy/models/qwen3-vl-8b/config.json")).unwrap();
        std::fs::write(
            dir.join("config.json"),
            text.replace("[24, 20, 20]", "[24, 20]"),
        )
        .unwrap();
        let err = ModelConfig::from_dir(&dir).unwrap_err().to_string();
        assert!(err.contains("mrope_section"), "{err}");
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
}
