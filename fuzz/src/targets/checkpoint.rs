//! Loading a checkpoint directory as both services and the gateway do at start: config.json,
//! the image-processor settings, the safetensors index and headers, every weight read and
//! shape-checked into the vision tower and the text model, tokenizer_config.json and the chat
//! template (rendered once). A broken file must give an error that names it, never a panic, a
//! hang or an allocation sized by a number read from the file.
//!
//! The input's first byte picks the file ([`FILES`]) it replaces in a copy of the tiny
//! checkpoint; the rest is the file's content.

use std::cell::RefCell;
use std::path::{Path, PathBuf};

use ::gateway::chat::{ChatTokenizer, Message, Part};
use llm_svc::{ModelConfig, TextModel};
use vision_svc::VisionEncoder;
use vlm_compute::{CpuBackend, Weights};

use super::{fixture_dir, text};
use crate::Outcome;

/// The files an input can replace, by its first byte (modulo the count). The last one is the
/// single-file layout: `model.safetensors` with the index removed.
pub const FILES: &[&str] = &[
    "config.json",
    "preprocessor_config.json",
    "model.safetensors.index.json",
    "model-00005-of-00005.safetensors",
    "tokenizer_config.json",
    "chat_template.jinja",
    "model.safetensors",
];

const INDEX: &str = "model.safetensors.index.json";

/// A copy of the fixture in a temporary directory, removed when the thread ends.
struct Scratch {
    dir: PathBuf,
}

impl Scratch {
    fn new() -> Self {
        let id = format!("{:?}", std::thread::current().id());
        let id: String = id.chars().filter(char::is_ascii_digit).collect();
        let dir = std::env::temp_dir().join(format!("vlm-fuzz-{}-{id}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("create a scratch directory");
        for entry in std::fs::read_dir(fixture_dir()).expect("read the fixture") {
            let path = entry.expect("a fixture entry").path();
            if path.is_file() {
                std::fs::copy(&path, dir.join(path.file_name().unwrap())).expect("copy");
            }
        }
        Self { dir }
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        std::fs::remove_dir_all(&self.dir).ok();
    }
}

thread_local! {
    static SCRATCH: RefCell<Option<Scratch>> = const { RefCell::new(None) };
}

/// Puts the fixture's `name` back (or removes it, where the fixture has none).
fn restore(dir: &Path, name: &str) {
    let original = fixture_dir().join(name);
    if original.is_file() {
        std::fs::copy(&original, dir.join(name)).expect("restore a fixture file");
    } else {
        std::fs::remove_file(dir.join(name)).ok();
    }
}

pub fn checkpoint_file(data: &[u8]) -> Outcome {
    let Some((&which, content)) = data.split_first() else {
        return Err("empty input".into());
    };
    let name = FILES[which as usize % FILES.len()];
    SCRATCH.with(|s| {
        let mut s = s.borrow_mut();
        let dir = s.get_or_insert_with(Scratch::new).dir.clone();
        std::fs::write(dir.join(name), content).expect("write into the scratch directory");
        let single_file = name == "model.safetensors";
        if single_file {
            std::fs::remove_file(dir.join(INDEX)).ok();
        }
        let outcome = load(&dir);
        restore(&dir, name);
        if single_file {
            restore(&dir, INDEX);
        }
        outcome
    })
}

/// Everything the three services read from a checkpoint at start.
fn load(dir: &Path) -> Outcome {
    let weights = Weights::open(dir).map_err(text)?;
    let vision = VisionEncoder::load(dir, &weights, CpuBackend::new()).map_err(text)?;
    let model = ModelConfig::from_dir(dir).map_err(text)?;
    let image_token_id = model.image_token_id();
    TextModel::new(model, &weights, CpuBackend::new()).map_err(text)?;
    drop(vision);
    let chat = ChatTokenizer::from_dir(dir, image_token_id).map_err(text)?;
    let messages = [Message::user(vec![
        Part::Image(Vec::new()),
        Part::Text("Describe this image.".into()),
    ])];
    chat.prompt_ids(&messages, &[4]).map_err(text)?;
    Ok(())
}
