//! Reading the JSON files of a Hugging Face checkpoint directory, for what the contract reads
//! from it ([`crate::image::PreprocessConfig`]) and the gateway's own reads (tokenizer and
//! template settings, the ids it needs from `config.json`).
//!
//! Every failure names the file and, where there is one, the key: "config.json: key
//! `text_config.vocab_size` missing field" tells a user what to fix, "invalid type" does not.
//! The model stages read their own configs with `vlm_compute::files`, which says it the same way.

use std::path::{Path, PathBuf};

use serde::de::DeserializeOwned;
use serde_json::Value;

/// A checkpoint file that cannot be read, or a key in it that is missing or malformed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("cannot read {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path} is not valid JSON: {message}")]
    BadJson { path: PathBuf, message: String },
    #[error("{path}: key `{key}` {problem}")]
    BadKey {
        path: PathBuf,
        key: String,
        problem: String,
    },
}

/// Reads and parses a JSON file.
pub fn read_json(path: &Path) -> Result<Value, Error> {
    let text = std::fs::read_to_string(path).map_err(|source| Error::Io {
        path: path.to_path_buf(),
        source,
    })?;
    serde_json::from_str(&text).map_err(|e| Error::BadJson {
        path: path.to_path_buf(),
        message: e.to_string(),
    })
}

/// Deserializes `value` (found under `key` in `path`; "" for the whole file) into `T`, reporting
/// the full key path of whatever is missing or malformed.
pub fn parse<T: DeserializeOwned>(path: &Path, key: &str, value: Value) -> Result<T, Error> {
    serde_path_to_error::deserialize(value).map_err(|e| {
        let inner = e.path().to_string();
        let full = match (key.is_empty(), inner == ".") {
            (true, _) => inner,
            (false, true) => key.to_string(),
            (false, false) => format!("{key}.{inner}"),
        };
        Error::BadKey {
            path: path.to_path_buf(),
            key: full,
            problem: e.into_inner().to_string(),
        }
    })
}

/// The value under `key` of a JSON object, or an error naming the file and key.
pub fn require<'a>(path: &Path, value: &'a Value, key: &str) -> Result<&'a Value, Error> {
    value.get(key).ok_or_else(|| Error::BadKey {
        path: path.to_path_buf(),
        key: key.to_string(),
        problem: "is missing".into(),
    })
}
