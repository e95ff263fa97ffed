//! Reading the JSON files of a Hugging Face checkpoint directory.
//!
//! Every failure names the file and, where there is one, the key: "config.json: key
//! `text_config.hidden_size` missing field" tells a user what to fix, "invalid type" does not.
//!
//! `vlm_proto::checkpoint` reads the same way for the gateway and the image rule. The copy is
//! deliberate: vlm-compute and vlm-proto depend on no crate of ours (docs/architecture.md), so
//! neither can take the other's, and a crate of its own for three functions would cost more.

use std::path::Path;

use serde::de::DeserializeOwned;
use serde_json::Value;

use crate::{Error, Result};

/// Reads and parses a JSON file.
pub fn read_json(path: &Path) -> Result<Value> {
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
pub fn parse<T: DeserializeOwned>(path: &Path, key: &str, value: Value) -> Result<T> {
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

/// Reads `path` and deserializes the whole file into `T`.
pub fn read_json_as<T: DeserializeOwned>(path: &Path) -> Result<T> {
    parse(path, "", read_json(path)?)
}

/// The value under `key` of a JSON object, or an error naming the file and key.
pub fn require<'a>(path: &Path, value: &'a Value, key: &str) -> Result<&'a Value> {
    value.get(key).ok_or_else(|| Error::BadKey {
        path: path.to_path_buf(),
        key: key.to_string(),
        problem: "is missing".into(),
    })
}

/// Token ids given as a single integer or a list (`eos_token_id` comes both ways).
pub fn id_list(value: &Value) -> Vec<u32> {
    match value {
        Value::Number(n) => n.as_u64().map(|v| vec![v as u32]).unwrap_or_default(),
        Value::Array(a) => a
            .iter()
            .filter_map(|v| v.as_u64())
            .map(|v| v as u32)
            .collect(),
        _ => Vec::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(serde::Deserialize, Debug)]
    #[allow(dead_code)]
    struct Inner {
        hidden_size: usize,
    }

    #[test]
    fn errors_name_file_and_full_key() {
        let path = Path::new("config.json");
        let v: Value = serde_json::json!({"hidden_size": "big"});
        let err = parse::<Inner>(path, "text_config", v)
            .unwrap_err()
            .to_string();
        assert!(err.contains("config.json"), "{err}");
        assert!(err.contains("text_config.hidden_size"), "{err}");
        let err = parse::<Inner>(path, "text_config", serde_json::json!({}))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("`text_config`") && err.contains("hidden_size"),
            "{err}"
        );
    }

    #[test]
    fn id_lists_accept_int_or_list() {
        assert_eq!(id_list(&serde_json::json!(7)), vec![7]);
        assert_eq!(id_list(&serde_json::json!([1, 2])), vec![1, 2]);
        assert!(id_list(&Value::Null).is_empty());
    }
}
