//! What the gateway reads from a checkpoint directory besides its tokenizer and chat template
//! (`chat.rs`): that it is one, and the two ids of `config.json` it needs. The model services
//! read the rest; the gateway links none of their code.

use std::path::Path;

use serde_json::Value;
use vlm_proto::checkpoint;

use crate::{Error, Result};

/// Checks that `dir` looks like a checkpoint before anything else reads from it.
pub fn check_model_dir(dir: &Path) -> Result<()> {
    if !dir.is_dir() {
        return Err(Error::ModelDir(format!(
            "model directory {} does not exist",
            dir.display()
        )));
    }
    if !dir.join("config.json").is_file() {
        return Err(Error::ModelDir(format!(
            "{} has no config.json; point --model at a Hugging Face Qwen3-VL checkpoint directory",
            dir.display()
        )));
    }
    Ok(())
}

/// The ids of `config.json` the gateway needs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ModelIds {
    /// The image placeholder a prompt's images are expanded into; `None` for a text-only
    /// checkpoint, which names none and takes no images.
    pub image_token_id: Option<u32>,
    /// The vocabulary (`text_config.vocab_size`, or at the top for a text-only checkpoint), to
    /// refuse `logit_bias` ids outside it before any upstream call.
    pub vocab_size: usize,
}

impl ModelIds {
    /// Reads them from `dir/config.json`; an error names the file and the key.
    pub fn read(dir: &Path) -> Result<Self> {
        let path = dir.join("config.json");
        let v = checkpoint::read_json(&path).map_err(|e| Error::ModelDir(e.to_string()))?;
        let text = v.get("text_config").unwrap_or(&v);
        let key = if v.get("text_config").is_some() {
            "text_config.vocab_size"
        } else {
            "vocab_size"
        };
        let vocab_size = text
            .get("vocab_size")
            .and_then(Value::as_u64)
            .ok_or_else(|| {
                Error::ModelDir(format!(
                    "{}: key `{key}` is missing or not a count",
                    path.display()
                ))
            })?;
        let image_token_id = match v.get("image_token_id") {
            None | Some(Value::Null) => None,
            Some(id) => Some(
                id.as_u64()
                    .and_then(|id| u32::try_from(id).ok())
                    .ok_or_else(|| {
                        Error::ModelDir(format!(
                            "{}: key `image_token_id` is not a token id, got {id}",
                            path.display()
                        ))
                    })?,
            ),
        };
        Ok(Self {
            image_token_id,
            vocab_size: vocab_size as usize,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_fixture_names_its_image_token_and_vocabulary() {
        let ids = ModelIds::read(&crate::tiny_fixture()).unwrap();
        assert_eq!(ids.image_token_id, Some(412));
        assert!(ids.vocab_size > 412);
    }
}
