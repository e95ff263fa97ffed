//! From chat messages to prompt token ids, as transformers' `apply_chat_template` + processor:
//! render the checkpoint's own Jinja chat template (from `chat_template.jinja`,
//! `chat_template.json` or `tokenizer_config.json`), tokenize with `tokenizer.json`, then
//! repeat each image placeholder once per image token (a text-only checkpoint has none, and
//! takes no images).

use std::path::Path;

use minijinja::{Environment, ErrorKind, Value as JinjaValue};
use serde_json::{json, Value};
use tokenizers::Tokenizer;
use vlm_proto::checkpoint;

use crate::{Error, Result};

/// One part of a message, in order.
#[derive(Clone, Debug)]
pub enum Part {
    Text(String),
    /// Encoded image bytes (PNG, JPEG, WebP, GIF).
    Image(Vec<u8>),
}

#[derive(Clone, Debug, Default)]
pub struct Message {
    /// "system", "user", "assistant" or "tool".
    pub role: String,
    pub parts: Vec<Part>,
    /// An assistant's earlier calls in OpenAI's shape (`{"id", "type": "function",
    /// "function": {"name", "arguments"}}`), which the template renders as `<tool_call>`
    /// blocks.
    pub tool_calls: Vec<Value>,
    /// The call a tool message answers.
    pub tool_call_id: Option<String>,
}

impl Message {
    pub fn new(role: &str, parts: Vec<Part>) -> Self {
        Self {
            role: role.into(),
            parts,
            ..Default::default()
        }
    }

    pub fn user(parts: Vec<Part>) -> Self {
        Self::new("user", parts)
    }

    /// The same message with each image's bytes left out (the template needs where images
    /// are, not what they hold).
    pub fn without_image_bytes(&self) -> Self {
        let parts = self
            .parts
            .iter()
            .map(|p| match p {
                Part::Text(t) => Part::Text(t.clone()),
                Part::Image(_) => Part::Image(Vec::new()),
            })
            .collect();
        Self {
            role: self.role.clone(),
            parts,
            tool_calls: self.tool_calls.clone(),
            tool_call_id: self.tool_call_id.clone(),
        }
    }
}

/// What a request gives the chat template besides its messages.
#[derive(Clone, Debug, Default)]
pub struct TemplateVars {
    /// The tools offered, as the request sent them (`{"type": "function", "function":
    /// {...}}`); the template lists them in its system turn (`tools`).
    pub tools: Vec<Value>,
    /// More variables (`chat_template_kwargs`, e.g. `enable_thinking: false`); they cannot
    /// replace the ones the server sets ([`RESERVED_TEMPLATE_VARS`]).
    pub kwargs: serde_json::Map<String, Value>,
}

/// The template variables the server sets itself.
pub const RESERVED_TEMPLATE_VARS: &[&str] = &[
    "messages",
    "tools",
    "add_generation_prompt",
    "bos_token",
    "eos_token",
];

/// The checkpoint's tokenizer and chat template.
pub struct ChatTokenizer {
    tokenizer: Tokenizer,
    env: Environment<'static>,
    bos_token: Option<String>,
    eos_token: Option<String>,
    /// The image placeholder, id and text; `None` for a text-only checkpoint.
    image_token: Option<(u32, String)>,
}

/// `tokenizer_config.json` writes special tokens as a string or as `{"content": "..."}`.
fn token_text(v: Option<&Value>) -> Option<String> {
    match v? {
        Value::String(s) => Some(s.clone()),
        Value::Object(o) => o.get("content")?.as_str().map(str::to_string),
        _ => None,
    }
}

/// Finds the chat template: `chat_template.jinja` (transformers 5.x), `chat_template.json`,
/// or the `chat_template` key of `tokenizer_config.json` (a string, or a list of named
/// templates of which "default" is used).
fn load_template(dir: &Path, tokenizer_config: &Value) -> Result<String> {
    let jinja = dir.join("chat_template.jinja");
    if jinja.is_file() {
        return std::fs::read_to_string(&jinja)
            .map_err(|e| Error::Template(format!("cannot read {}: {e}", jinja.display())));
    }
    let json_path = dir.join("chat_template.json");
    let (source, path) = if json_path.is_file() {
        (checkpoint::read_json(&json_path)?, json_path)
    } else {
        (tokenizer_config.clone(), dir.join("tokenizer_config.json"))
    };
    match source.get("chat_template") {
        Some(Value::String(s)) => Ok(s.clone()),
        Some(Value::Array(list)) => list
            .iter()
            .find(|t| t.get("name").and_then(Value::as_str) == Some("default"))
            .and_then(|t| t.get("template")?.as_str().map(str::to_string))
            .ok_or_else(|| Error::Template(format!("{}: `chat_template` has no entry named \"default\"", path.display()))),
        _ => Err(Error::Template(format!(
            "no chat template in {}: expected chat_template.jinja, chat_template.json or `chat_template` in tokenizer_config.json",
            dir.display()
        ))),
    }
}

impl ChatTokenizer {
    /// Loads `tokenizer.json`, the chat template and the special tokens of the checkpoint in
    /// `dir`; `image_token_id` comes from `config.json` (`None`: a text-only checkpoint).
    pub fn from_dir(dir: &Path, image_token_id: Option<u32>) -> Result<Self> {
        let tok_path = dir.join("tokenizer.json");
        if !tok_path.is_file() {
            return Err(Error::Tokenizer(format!(
                "{} is missing",
                tok_path.display()
            )));
        }
        let tokenizer = Tokenizer::from_file(&tok_path)
            .map_err(|e| Error::Tokenizer(format!("{}: {e}", tok_path.display())))?;
        let cfg_path = dir.join("tokenizer_config.json");
        let tokenizer_config = if cfg_path.is_file() {
            checkpoint::read_json(&cfg_path)?
        } else {
            Value::Null
        };
        let source = load_template(dir, &tokenizer_config)?;
        let image_token = image_token_id
            .map(|id| {
                let text = tokenizer.id_to_token(id).ok_or_else(|| {
                    Error::Tokenizer(format!(
                        "image_token_id {id} from config.json is not in {}",
                        tok_path.display()
                    ))
                })?;
                Ok::<_, Error>((id, text))
            })
            .transpose()?;

        // As transformers: trim_blocks + lstrip_blocks, loop controls, Python string methods,
        // and raise_exception for templates that validate their input.
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        minijinja_contrib::add_to_environment(&mut env);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function(
            "raise_exception",
            |msg: String| -> std::result::Result<JinjaValue, minijinja::Error> {
                Err(minijinja::Error::new(ErrorKind::InvalidOperation, msg))
            },
        );
        env.add_template_owned("chat", source)
            .map_err(|e| Error::Template(format!("cannot parse the chat template: {e:#}")))?;
        Ok(Self {
            tokenizer,
            env,
            bos_token: token_text(tokenizer_config.get("bos_token")),
            eos_token: token_text(tokenizer_config.get("eos_token")),
            image_token,
        })
    }

    /// The image placeholder's id (`None`: a text-only checkpoint).
    pub fn image_token_id(&self) -> Option<u32> {
        self.image_token.as_ref().map(|(id, _)| *id)
    }

    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    /// Renders `messages` with the generation prompt appended, images as placeholders.
    pub fn render(&self, messages: &[Message]) -> Result<String> {
        self.render_with(messages, &TemplateVars::default())
    }

    /// [`ChatTokenizer::render`] with the request's tools and template variables.
    pub fn render_with(&self, messages: &[Message], vars: &TemplateVars) -> Result<String> {
        let msgs: Vec<Value> = messages
            .iter()
            .map(|m| {
                let content: Vec<Value> = m
                    .parts
                    .iter()
                    .map(|p| match p {
                        Part::Text(t) => json!({"type": "text", "text": t}),
                        Part::Image(_) => json!({"type": "image"}),
                    })
                    .collect();
                let mut msg = json!({"role": m.role, "content": content});
                if !m.tool_calls.is_empty() {
                    msg["tool_calls"] = Value::Array(m.tool_calls.clone());
                }
                if let Some(id) = &m.tool_call_id {
                    msg["tool_call_id"] = id.clone().into();
                }
                msg
            })
            .collect();
        let mut ctx = vars.kwargs.clone();
        for (name, value) in [
            ("messages", Value::Array(msgs)),
            ("add_generation_prompt", true.into()),
            ("bos_token", self.bos_token.clone().into()),
            ("eos_token", self.eos_token.clone().into()),
        ] {
            ctx.insert(name.into(), value);
        }
        // No tools is no variable: templates test `tools` for being defined or truthy.
        if vars.tools.is_empty() {
            ctx.remove("tools");
        } else {
            ctx.insert("tools".into(), Value::Array(vars.tools.clone()));
        }
        let tmpl = self.env.get_template("chat").expect("added at load");
        tmpl.render(JinjaValue::from_serialize(&ctx))
            .map_err(|e| Error::Template(format!("cannot render the chat: {e:#}")))
    }

    /// The id of `text` where the vocabulary has it as one added token (`<tool_call>`,
    /// `</think>` in Qwen's), so a grammar can name it.
    pub fn added_token_id(&self, text: &str) -> Option<u32> {
        self.tokenizer
            .get_added_tokens_decoder()
            .iter()
            .find(|(_, t)| t.content == text)
            .map(|(&id, _)| id)
    }

    /// Token ids of rendered text; special tokens written in the text are recognized.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let enc = self
            .tokenizer
            .encode(text, false)
            .map_err(|e| Error::Tokenizer(e.to_string()))?;
        Ok(enc.get_ids().to_vec())
    }

    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String> {
        self.tokenizer
            .decode(ids, skip_special_tokens)
            .map_err(|e| Error::Tokenizer(e.to_string()))
    }

    /// Prompt token ids for `messages`: rendered, tokenized, and each image placeholder
    /// repeated `tokens_per_image[k]` times.
    pub fn prompt_ids(&self, messages: &[Message], tokens_per_image: &[usize]) -> Result<Vec<u32>> {
        self.prompt_ids_with(messages, &TemplateVars::default(), tokens_per_image)
    }

    /// [`ChatTokenizer::prompt_ids`] with the request's tools and template variables.
    pub fn prompt_ids_with(
        &self,
        messages: &[Message],
        vars: &TemplateVars,
        tokens_per_image: &[usize],
    ) -> Result<Vec<u32>> {
        let text = self.render_with(messages, vars)?;
        let ids = self.encode(&text)?;
        self.expand_image_tokens(&ids, tokens_per_image)
    }

    /// Repeats the k-th image placeholder `tokens_per_image[k]` times.
    pub fn expand_image_tokens(&self, ids: &[u32], tokens_per_image: &[usize]) -> Result<Vec<u32>> {
        let Some((image_token_id, image_token)) = &self.image_token else {
            if !tokens_per_image.is_empty() {
                return Err(Error::InvalidRequest(format!(
                    "the model is text-only and takes no images; the request has {}",
                    tokens_per_image.len()
                )));
            }
            return Ok(ids.to_vec());
        };
        let found = ids.iter().filter(|&t| t == image_token_id).count();
        // The chat decides both counts (the template places images of some roles only, and
        // text may spell the placeholder), so a mismatch is the request's fault: 400, not 500.
        if found != tokens_per_image.len() {
            return Err(Error::InvalidRequest(format!(
                "the chat template placed {found} image placeholder(s) `{}` for {} image(s): images are placed only where the template puts them (user messages for Qwen3-VL), and text may not contain the placeholder",
                image_token,
                tokens_per_image.len()
            )));
        }
        let mut out = Vec::with_capacity(ids.len() + tokens_per_image.iter().sum::<usize>());
        let mut k = 0;
        for &t in ids {
            if t == *image_token_id {
                out.extend(std::iter::repeat_n(t, tokens_per_image[k]));
                k += 1;
            } else {
                out.push(t);
            }
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tiny() -> ChatTokenizer {
        let dir = crate::tiny_fixture();
        ChatTokenizer::from_dir(&dir, Some(412)).unwrap()
    }

    /// A text-only checkpoint's chats as HF renders and tokenizes them, with the template read
    /// from `chat_template.jinja` and, as older checkpoints (Qwen2.5) ship it, from
    /// `tokenizer_config.json`'s `chat_template`; and an image sent to it is the request's fault.
    #[test]
    fn text_only_chats_match_hf_with_the_template_from_either_file() {
        let fixture = crate::fixture("tiny-qwen3");
        let in_config = std::env::temp_dir().join(format!("vlm-chat-tc-{}", std::process::id()));
        std::fs::create_dir_all(&in_config).unwrap();
        std::fs::copy(
            fixture.join("tokenizer.json"),
            in_config.join("tokenizer.json"),
        )
        .unwrap();
        let read = |f: &str| std::fs::read_to_string(fixture.join(f)).unwrap();
        let mut tok_cfg: Value = serde_json::from_str(&read("tokenizer_config.json")).unwrap();
        tok_cfg["chat_template"] = read("chat_template.jinja").into();
        std::fs::write(in_config.join("tokenizer_config.json"), tok_cfg.to_string()).unwrap();
        assert!(!in_config.join("chat_template.jinja").exists());

        let golden: Value = serde_json::from_str(&read("golden/golden.json")).unwrap();
        for dir in [&fixture, &in_config] {
            let chat = ChatTokenizer::from_dir(dir, None).unwrap();
            let mut chats = 0;
            for case in golden["cases"].as_array().unwrap() {
                let Some(messages) = case["messages"].as_array() else {
                    continue;
                };
                let messages: Vec<Message> = messages
                    .iter()
                    .map(|m| {
                        Message::new(
                            m["role"].as_str().unwrap(),
                            vec![Part::Text(m["content"].as_str().unwrap().into())],
                        )
                    })
                    .collect();
                assert_eq!(
                    chat.render(&messages).unwrap(),
                    case["chat_text"].as_str().unwrap(),
                    "{}: {}",
                    dir.display(),
                    case["name"]
                );
                let ids: Vec<u32> =
                    serde_json::from_value(case["prompt_token_ids"].clone()).unwrap();
                assert_eq!(chat.prompt_ids(&messages, &[]).unwrap(), ids);
                chats += 1;
            }
            assert!(chats >= 2, "the fixture's chat cases");
            let with_image = [Message::user(vec![
                Part::Image(Vec::new()),
                Part::Text("hi".into()),
            ])];
            let err = chat.prompt_ids(&with_image, &[4]).unwrap_err();
            assert!(matches!(err, Error::InvalidRequest(_)), "{err}");
            assert!(err.to_string().contains("text-only"), "{err}");
        }
        let _ = std::fs::remove_dir_all(in_config);
    }

    /// Found by the chat_template fuzz target: both were internal errors (500).
    #[test]
    fn images_the_template_drops_and_placeholders_in_text_are_invalid_requests() {
        let chat = tiny();
        let image_in_assistant = [
            Message::user(vec![Part::Text("Hi".into())]),
            Message::new("assistant", vec![Part::Image(Vec::new())]),
        ];
        let err = chat.prompt_ids(&image_in_assistant, &[4]).unwrap_err();
        assert!(matches!(err, Error::InvalidRequest(_)), "{err}");
        assert!(
            err.to_string().contains("placed 0 image placeholder(s)"),
            "{err}"
        );

        let placeholder_in_text = [Message::user(vec![Part::Text("<|image_pad|>".into())])];
        let err = chat.prompt_ids(&placeholder_in_text, &[]).unwrap_err();
        assert!(matches!(err, Error::InvalidRequest(_)), "{err}");
    }
}
