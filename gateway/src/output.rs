//! What a choice's generated text holds, split as it streams: the model's reasoning (a
//! Thinking checkpoint's text up to `</think>`), its content, and the tool calls of its
//! `<tool_call>` blocks (Qwen's Hermes format) in OpenAI's shape.
//!
//! The orchestrator feeds each choice's visible text (after detokenizing and stop strings)
//! through one [`OutputSplitter`], and the APIs show what comes out: `reasoning_content`,
//! `content` and `tool_calls`. A unary answer is the same splitter's output gathered, so a
//! stream's deltas always add up to the unary answer.
//!
//! When the split applies:
//! - Reasoning: when the rendered prompt ends by opening `<think>` (Qwen3-VL-*-Thinking's
//!   generation prompt), everything up to `</think>` is reasoning; otherwise, when the answer
//!   itself starts with `<think>` (a hybrid model that chose to think), from there to
//!   `</think>`. The newlines right after `</think>` are dropped, as Qwen's templates drop them
//!   when the turn is rendered again. An answer cut before `</think>` is all reasoning.
//! - Tool calls: when the request offered tools and `tool_choice` is not `none`. A block whose
//!   text is not a JSON object with a `name` stays content, as vLLM leaves it; so does one cut
//!   off by the token budget, unless what came is already a whole call. Whitespace between
//!   and after calls is dropped; text around them is content.
//!
//! A call is streamed whole once its block closes: one delta with its `index`, `id`, `type`,
//! `function.name` and all of `function.arguments` (OpenAI's delta shape, with the arguments
//! in one fragment).

use serde_json::Value;

use crate::tools::{TOOL_CALL_CLOSE, TOOL_CALL_OPEN};

pub const THINK_OPEN: &str = "<think>";
pub const THINK_CLOSE: &str = "</think>";

/// One tool call read from the answer, as OpenAI's `tool_calls` carry it.
#[derive(Clone, Debug, PartialEq)]
pub struct ToolCall {
    /// Its place among the choice's calls (0, 1, ...).
    pub index: u32,
    /// `call_` and random characters.
    pub id: String,
    pub name: String,
    /// The arguments as JSON text.
    pub arguments: String,
}

/// What one piece of text adds to each part of the answer.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct OutputDelta {
    pub content: String,
    pub reasoning: String,
    pub tool_calls: Vec<ToolCall>,
}

impl OutputDelta {
    pub fn is_empty(&self) -> bool {
        self.content.is_empty() && self.reasoning.is_empty() && self.tool_calls.is_empty()
    }

    /// Adds `later` after this delta (a unary answer is its deltas gathered).
    pub fn extend(&mut self, later: OutputDelta) {
        self.content.push_str(&later.content);
        self.reasoning.push_str(&later.reasoning);
        self.tool_calls.extend(later.tool_calls);
    }
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum State {
    /// At the start of an answer that may open `<think>` itself.
    MayThink,
    Reasoning,
    /// Just past `</think>`: its newlines are dropped.
    AfterReasoning,
    Content,
    /// Inside a `<tool_call>` block (its text so far is `pending`).
    InCall,
}

/// Splits one choice's text into reasoning, content and tool calls as it comes.
pub struct OutputSplitter {
    state: State,
    parse_calls: bool,
    /// Text not yet placed: the start of a tag still possible, a block not yet closed, or
    /// whitespace after a call that may turn out to be between calls.
    pending: String,
    calls: u32,
}

impl OutputSplitter {
    /// `prompt_opens_reasoning`: the prompt ends with `<think>`; `parse_calls`: the request's
    /// tools are read out of the answer.
    pub fn new(prompt_opens_reasoning: bool, parse_calls: bool) -> Self {
        Self {
            state: if prompt_opens_reasoning {
                State::Reasoning
            } else {
                State::MayThink
            },
            parse_calls,
            pending: String::new(),
            calls: 0,
        }
    }

    /// Whether any tool call was read (the choice finishes with `tool_calls`).
    pub fn called_tools(&self) -> bool {
        self.calls > 0
    }

    /// Adds the next piece of text; returns what it places.
    pub fn push(&mut self, text: &str) -> OutputDelta {
        self.pending.push_str(text);
        let mut out = OutputDelta::default();
        self.place(&mut out, false);
        out
    }

    /// Once the answer has ended: places whatever was held back.
    pub fn finish(&mut self) -> OutputDelta {
        let mut out = OutputDelta::default();
        self.place(&mut out, true);
        out
    }

    fn place(&mut self, out: &mut OutputDelta, end: bool) {
        loop {
            match self.state {
                State::MayThink => {
                    let start = self.pending.trim_start();
                    if let Some(rest) = start.strip_prefix(THINK_OPEN) {
                        self.pending = rest.to_string();
                        self.state = State::Reasoning;
                    } else if !end && THINK_OPEN.starts_with(start) {
                        return; // empty, or `<thi`: not known yet
                    } else {
                        self.state = State::Content;
                    }
                }
                State::Reasoning => match self.pending.find(THINK_CLOSE) {
                    Some(at) => {
                        out.reasoning.push_str(&self.pending[..at]);
                        self.pending.drain(..at + THINK_CLOSE.len());
                        self.state = State::AfterReasoning;
                    }
                    None => {
                        let keep = if end {
                            0
                        } else {
                            held_prefix(&self.pending, THINK_CLOSE)
                        };
                        let cut = self.pending.len() - keep;
                        out.reasoning.push_str(&self.pending[..cut]);
                        self.pending.drain(..cut);
                        return;
                    }
                },
                State::AfterReasoning => {
                    let trimmed = self.pending.trim_start_matches(['\n', '\r']);
                    if trimmed.is_empty() && !end {
                        self.pending.clear();
                        return;
                    }
                    self.pending = trimmed.to_string();
                    self.state = State::Content;
                }
                State::Content if !self.parse_calls => {
                    out.content.push_str(&self.pending);
                    self.pending.clear();
                    return;
                }
                State::Content => {
                    // After a call, whitespace waits: it is dropped if only calls follow.
                    let after_call = self.calls > 0;
                    if let Some(at) = self.pending.find(TOOL_CALL_OPEN) {
                        let before = &self.pending[..at];
                        if !(after_call && before.trim().is_empty()) {
                            out.content.push_str(before);
                        }
                        self.pending.drain(..at + TOOL_CALL_OPEN.len());
                        self.state = State::InCall;
                        continue;
                    }
                    if end {
                        if !(after_call && self.pending.trim().is_empty()) {
                            out.content.push_str(&self.pending);
                        }
                        self.pending.clear();
                        return;
                    }
                    let keep = held_prefix(&self.pending, TOOL_CALL_OPEN);
                    let cut = self.pending.len() - keep;
                    let free = &self.pending[..cut];
                    if after_call && free.trim().is_empty() {
                        return; // whitespace after a call: held
                    }
                    out.content.push_str(free);
                    self.pending.drain(..cut);
                    return;
                }
                State::InCall => {
                    let (block, rest, closed) = match self.pending.find(TOOL_CALL_CLOSE) {
                        Some(at) => (
                            self.pending[..at].to_string(),
                            self.pending[at + TOOL_CALL_CLOSE.len()..].to_string(),
                            true,
                        ),
                        None if end => (std::mem::take(&mut self.pending), String::new(), false),
                        None => return,
                    };
                    match parse_call(&block, self.calls) {
                        Some(call) => {
                            out.tool_calls.push(call);
                            self.calls += 1;
                        }
                        None => {
                            out.content.push_str(TOOL_CALL_OPEN);
                            out.content.push_str(&block);
                            if closed {
                                out.content.push_str(TOOL_CALL_CLOSE);
                            }
                        }
                    }
                    self.pending = rest;
                    self.state = State::Content;
                }
            }
        }
    }
}

/// The length of the longest tail of `text` that is a proper prefix of `tag` (it may still
/// become the tag).
fn held_prefix(text: &str, tag: &str) -> usize {
    (1..tag.len())
        .rev()
        .find(|&n| text.ends_with(&tag[..n]))
        .unwrap_or(0)
}

/// A block's call: a JSON object with a string `name` and `arguments` (vLLM also reads
/// `parameters`); `None` for anything else.
fn parse_call(block: &str, index: u32) -> Option<ToolCall> {
    let Ok(Value::Object(call)) = serde_json::from_str::<Value>(block.trim()) else {
        return None;
    };
    let name = call.get("name")?.as_str()?.to_string();
    let arguments = match call.get("arguments").or_else(|| call.get("parameters")) {
        None | Some(Value::Null) => "{}".to_string(),
        // Some models write the arguments as JSON text already.
        Some(Value::String(s)) => s.clone(),
        Some(v) => v.to_string(),
    };
    Some(ToolCall {
        index,
        id: call_id(),
        name,
        arguments,
    })
}

/// `call_` and 24 random letters and digits, as OpenAI's ids look.
fn call_id() -> String {
    use rand::distr::{Alphanumeric, SampleString};
    format!("call_{}", Alphanumeric.sample_string(&mut rand::rng(), 24))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The whole answer at once.
    fn unary(text: &str, reasoning: bool, tools: bool) -> OutputDelta {
        let mut s = OutputSplitter::new(reasoning, tools);
        let mut out = s.push(text);
        out.extend(s.finish());
        out
    }

    /// The answer in pieces of `step` characters, each piece's delta kept.
    fn streamed(text: &str, step: usize, reasoning: bool, tools: bool) -> Vec<OutputDelta> {
        let mut s = OutputSplitter::new(reasoning, tools);
        let chars: Vec<char> = text.chars().collect();
        let mut deltas: Vec<OutputDelta> = chars
            .chunks(step)
            .map(|c| s.push(&c.iter().collect::<String>()))
            .collect();
        deltas.push(s.finish());
        deltas
    }

    /// Calls compared without their random ids.
    fn without_ids(mut d: OutputDelta) -> OutputDelta {
        for c in &mut d.tool_calls {
            assert!(c.id.starts_with("call_") && c.id.len() == 29, "{}", c.id);
            c.id.clear();
        }
        d
    }

    fn call(index: u32, name: &str, arguments: &str) -> ToolCall {
        ToolCall {
            index,
            id: String::new(),
            name: name.into(),
            arguments: arguments.into(),
        }
    }

    /// Every way of cutting `text` into pieces gives the unary answer.
    fn check_streams(text: &str, reasoning: bool, tools: bool) -> OutputDelta {
        let whole = without_ids(unary(text, reasoning, tools));
        for step in 1..=text.chars().count().max(1) {
            let mut gathered = OutputDelta::default();
            for d in streamed(text, step, reasoning, tools) {
                gathered.extend(d);
            }
            assert_eq!(without_ids(gathered), whole, "{text:?} in pieces of {step}");
        }
        whole
    }

    #[test]
    fn tool_call_blocks_become_calls_and_text_around_them_content() {
        let text = "Let me look.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"clock\", \"arguments\": {}}\n</tool_call>";
        let got = check_streams(text, false, true);
        assert_eq!(got.content, "Let me look.\n");
        assert_eq!(
            got.tool_calls,
            vec![
                call(0, "get_weather", r#"{"city":"Paris"}"#),
                call(1, "clock", "{}")
            ]
        );
        // Calls only: no content at all; text after the calls stays content.
        let only = "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": [1, 2]}}\n</tool_call>\n";
        let got = check_streams(only, false, true);
        assert_eq!((got.content.as_str(), got.tool_calls.len()), ("", 1));
        assert_eq!(got.tool_calls[0].arguments, r#"{"a":[1,2]}"#);
        let got = check_streams(&format!("{only}Done."), false, true);
        assert_eq!(got.content, "\nDone.");
        // Without tools (or tool_choice none) the blocks are plain text.
        let got = check_streams(only, false, false);
        assert_eq!((got.content.as_str(), got.tool_calls.len()), (only, 0));
    }

    #[test]
    fn malformed_or_cut_blocks_stay_content() {
        for text in [
            "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": }\n</tool_call>",
            "<tool_call>\n[1, 2]\n</tool_call>",
            "<tool_call>\n{\"arguments\": {}}\n</tool_call>",
            "a <tool_call>\n{\"name\": \"f\", \"argu",
            "a <tool_cal",
        ] {
            let got = check_streams(text, false, true);
            assert_eq!(got.content, text);
            assert!(got.tool_calls.is_empty(), "{text}");
        }
        // A whole call whose closing tag never came (eos right after it) is still a call.
        let got = check_streams("<tool_call>\n{\"name\": \"f\"}\n", false, true);
        assert_eq!(got.tool_calls.len(), 1);
        assert_eq!(got.tool_calls[0].arguments, "{}");
        // A good call after a bad one is numbered 0.
        let text = "<tool_call>\nnope\n</tool_call><tool_call>{\"name\": \"g\", \"parameters\": {\"x\": 1}}</tool_call>";
        let got = check_streams(text, false, true);
        assert_eq!(got.content, "<tool_call>\nnope\n</tool_call>");
        assert_eq!(got.tool_calls, vec![call(0, "g", r#"{"x":1}"#)]);
    }

    #[test]
    fn reasoning_ends_at_the_closing_tag() {
        // The prompt opened <think>: everything up to </think> is reasoning.
        let got = check_streams("Hmm, 2+2.\n</think>\n\nIt is 4.", true, false);
        assert_eq!(
            (got.reasoning.as_str(), got.content.as_str()),
            ("Hmm, 2+2.\n", "It is 4.")
        );
        // Cut before </think>: all reasoning.
        let got = check_streams("Hmm, 2+2 is </thi", true, false);
        assert_eq!(
            (got.reasoning.as_str(), got.content.as_str()),
            ("Hmm, 2+2 is </thi", "")
        );
        // An answer that opens <think> itself.
        let got = check_streams("<think>\nplan\n</think>\n\nanswer", false, false);
        assert_eq!(
            (got.reasoning.as_str(), got.content.as_str()),
            ("\nplan\n", "answer")
        );
        // No <think> anywhere: all content, even text that starts like the tag.
        for text in ["<thin", "<b>bold</b>", "4", ""] {
            let got = check_streams(text, false, false);
            assert_eq!((got.reasoning.as_str(), got.content.as_str()), ("", text));
        }
        // Reasoning, then a call.
        let text = "need weather</think>\n\n<tool_call>\n{\"name\": \"w\", \"arguments\": {}}\n</tool_call>";
        let got = check_streams(text, true, true);
        assert_eq!(got.reasoning, "need weather");
        assert_eq!((got.content.as_str(), got.tool_calls.len()), ("", 1));
    }

    #[test]
    fn each_call_is_streamed_once_whole() {
        let text =
            "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"q\": \"long text\"}}\n</tool_call>";
        let deltas = streamed(text, 3, false, true);
        let with_calls: Vec<&OutputDelta> =
            deltas.iter().filter(|d| !d.tool_calls.is_empty()).collect();
        assert_eq!(with_calls.len(), 1);
        assert!(deltas.iter().all(|d| d.content.is_empty()));
    }
}
