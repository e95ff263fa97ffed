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
//! - Tool calls: when the request offered tools and `tool_choice` is not `none`. Whitespace
//!   between and after calls is dropped; text around them is content.
//!
//! Calls stream in OpenAI's delta shape ([`ToolCallDelta`]): a call's first delta carries its
//! `index`, `id` and `function.name` as soon as the block's `"name"` has been read, and the
//! deltas after it more of `function.arguments`, fragment by fragment as the model writes
//! them ([`call`] says how a block is read, and what becomes of one that is not a call).

mod call;

use call::{CallReader, Ended};

use crate::tools::{TOOL_CALL_CLOSE, TOOL_CALL_OPEN};

pub const THINK_OPEN: &str = "<think>";
pub const THINK_CLOSE: &str = "</think>";

/// One tool call of a unary answer, as OpenAI's `tool_calls` carry it: its deltas gathered
/// ([`ToolCall::gather`]).
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

impl ToolCall {
    /// Adds a streamed delta to the calls gathered so far: a first delta opens a call,
    /// a later one adds to its call's arguments.
    pub fn gather(calls: &mut Vec<ToolCall>, d: ToolCallDelta) {
        match d.head {
            Some(CallHead { id, name }) => calls.push(ToolCall {
                index: d.index,
                id,
                name,
                arguments: d.arguments,
            }),
            None => {
                if let Some(c) = calls.iter_mut().rev().find(|c| c.index == d.index) {
                    c.arguments.push_str(&d.arguments);
                }
            }
        }
    }
}

/// What a call's first delta alone carries.
#[derive(Clone, Debug, PartialEq)]
pub struct CallHead {
    /// `call_` and random characters.
    pub id: String,
    pub name: String,
}

/// A piece of one tool call as a stream carries it (OpenAI's delta shape): the first of a
/// call has its `head`, each piece adds `arguments` text; a call's pieces joined are the call.
#[derive(Clone, Debug, PartialEq)]
pub struct ToolCallDelta {
    /// The call's place among the choice's calls (0, 1, ...).
    pub index: u32,
    /// On the call's first delta only.
    pub head: Option<CallHead>,
    /// More of the arguments' JSON text (possibly none on a first delta).
    pub arguments: String,
}

/// Adds `d` to `calls`, joined with the last one where it continues the same call.
fn add_call_delta(calls: &mut Vec<ToolCallDelta>, d: ToolCallDelta) {
    if d.head.is_none() {
        if d.arguments.is_empty() {
            return;
        }
        if let Some(last) = calls.last_mut().filter(|l| l.index == d.index) {
            last.arguments.push_str(&d.arguments);
            return;
        }
    }
    calls.push(d);
}

/// What one piece of text adds to each part of the answer.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct OutputDelta {
    pub content: String,
    pub reasoning: String,
    pub tool_calls: Vec<ToolCallDelta>,
}

impl OutputDelta {
    pub fn is_empty(&self) -> bool {
        self.content.is_empty() && self.reasoning.is_empty() && self.tool_calls.is_empty()
    }

    /// Adds `later` after this delta (a unary answer is its deltas gathered); a call's
    /// pieces in a row are joined into one.
    pub fn extend(&mut self, later: OutputDelta) {
        self.content.push_str(&later.content);
        self.reasoning.push_str(&later.reasoning);
        for d in later.tool_calls {
            add_call_delta(&mut self.tool_calls, d);
        }
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
    /// Inside a `<tool_call>` block (`call` reads it).
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
    /// The block under way.
    call: Option<CallReader>,
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
            call: None,
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
                    let reader = self.call.get_or_insert_with(|| CallReader::new(self.calls));
                    let closed = self.pending.find(TOOL_CALL_CLOSE);
                    // Text that may be the start of the closing tag waits.
                    let take = match closed {
                        Some(at) => at,
                        None if end => self.pending.len(),
                        None => self.pending.len() - held_prefix(&self.pending, TOOL_CALL_CLOSE),
                    };
                    for d in reader.push(&self.pending[..take]) {
                        add_call_delta(&mut out.tool_calls, d);
                    }
                    self.pending.drain(..take);
                    if closed.is_none() && !end {
                        return;
                    }
                    if closed.is_some() {
                        self.pending.drain(..TOOL_CALL_CLOSE.len());
                    }
                    let reader = self.call.take().expect("a block under way");
                    match reader.end(closed.is_some()) {
                        Ended::Call(deltas) => {
                            for d in deltas {
                                add_call_delta(&mut out.tool_calls, d);
                            }
                            self.calls += 1;
                        }
                        Ended::NotACall(text) => out.content.push_str(&text),
                    }
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
        let chars: Vec<char> = text.chars().collect();
        let pieces: Vec<String> = chars.chunks(step).map(|c| c.iter().collect()).collect();
        streamed_in(&pieces, reasoning, tools)
    }

    /// The answer in these pieces, each piece's delta kept, then the finish's.
    fn streamed_in<S: AsRef<str>>(pieces: &[S], reasoning: bool, tools: bool) -> Vec<OutputDelta> {
        let mut s = OutputSplitter::new(reasoning, tools);
        let mut deltas: Vec<OutputDelta> = pieces.iter().map(|p| s.push(p.as_ref())).collect();
        deltas.push(s.finish());
        deltas
    }

    /// Calls compared without their random ids.
    fn without_ids(mut d: OutputDelta) -> OutputDelta {
        for c in &mut d.tool_calls {
            if let Some(head) = &mut c.head {
                assert!(
                    head.id.starts_with("call_") && head.id.len() == 29,
                    "{}",
                    head.id
                );
                head.id.clear();
            }
        }
        d
    }

    /// A call's first delta (or a whole call, gathered), without its id.
    fn call(index: u32, name: &str, arguments: &str) -> ToolCallDelta {
        ToolCallDelta {
            index,
            head: Some(CallHead {
                id: String::new(),
                name: name.into(),
            }),
            arguments: arguments.into(),
        }
    }

    /// A later delta of call `index`.
    fn more(index: u32, arguments: &str) -> ToolCallDelta {
        ToolCallDelta {
            index,
            head: None,
            arguments: arguments.into(),
        }
    }

    /// Every way of cutting `text` into pieces gives the unary answer, each call's pieces
    /// joined into one.
    fn check_streams(text: &str, reasoning: bool, tools: bool) -> OutputDelta {
        let whole = without_ids(unary(text, reasoning, tools));
        assert!(
            whole.tool_calls.iter().all(|c| c.head.is_some()),
            "{whole:?}"
        );
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
                call(0, "get_weather", r#"{"city": "Paris"}"#),
                call(1, "clock", "{}")
            ]
        );
        // Calls only: no content at all; text after the calls stays content.
        let only = "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": [1, 2]}}\n</tool_call>\n";
        let got = check_streams(only, false, true);
        assert_eq!((got.content.as_str(), got.tool_calls.len()), ("", 1));
        assert_eq!(got.tool_calls[0].arguments, r#"{"a": [1, 2]}"#);
        let got = check_streams(&format!("{only}Done."), false, true);
        assert_eq!(got.content, "\nDone.");
        // Without tools (or tool_choice none) the blocks are plain text.
        let got = check_streams(only, false, false);
        assert_eq!((got.content.as_str(), got.tool_calls.len()), (only, 0));
    }

    #[test]
    fn a_call_streams_its_name_once_then_its_arguments_as_they_come() {
        let pieces = [
            "<tool_call>\n{\"name\": \"get_",
            "weather\"",
            ", \"arguments\": {\"ci",
            "ty\": \"Par",
            "is\"}",
            "}\n</tool_call>\n<tool_call>\n{\"name\": \"clock\", \"arguments\": {\"tz\": [\"U",
            "TC\"]}}</tool",
            "_call>",
        ];
        let deltas: Vec<Vec<ToolCallDelta>> = streamed_in(&pieces, false, true)
            .into_iter()
            .map(|d| {
                assert_eq!(d.content, "");
                without_ids(d).tool_calls
            })
            .collect();
        assert_eq!(
            deltas,
            vec![
                vec![],
                // The name is whole: the first delta, no arguments yet.
                vec![call(0, "get_weather", "")],
                vec![more(0, "{\"ci")],
                vec![more(0, "ty\": \"Par")],
                // The arguments' closing brace ends them: nothing waits for the outer one.
                vec![more(0, "is\"}")],
                vec![call(1, "clock", "{\"tz\": [\"U")],
                vec![more(1, "TC\"]}")],
                vec![],
                vec![],
            ]
        );
        // Token by token: the name and id once per call, the arguments in many fragments.
        let text = pieces.concat();
        let deltas: Vec<ToolCallDelta> = streamed(&text, 1, false, true)
            .into_iter()
            .flat_map(|d| d.tool_calls)
            .collect();
        for index in [0, 1] {
            let of_call: Vec<&ToolCallDelta> = deltas.iter().filter(|d| d.index == index).collect();
            assert!(of_call[0].head.is_some(), "{of_call:?}");
            assert!(of_call[1..].iter().all(|d| d.head.is_none()), "{of_call:?}");
            assert!(of_call.len() > 5, "{of_call:?}");
        }
        check_streams(&text, false, true);
    }

    #[test]
    fn arguments_keep_their_text_whatever_brackets_and_escapes_their_strings_hold() {
        for (arguments, rest) in [
            (
                r#"{"s": "a}\"]{ </tool", "n": [{"m": "\\"}, []], "e": ""}"#,
                "",
            ),
            (r#"[1, {"x": "]"}]"#, r#", "id": {"k": "}"}"#),
            ("{\n  \"pretty\": true\n}", ""),
        ] {
            let text = format!(
                "<tool_call>\n{{\"name\": \"f\", \"arguments\": {arguments}{rest}}}\n</tool_call>"
            );
            let got = check_streams(&text, false, true);
            assert_eq!(got.tool_calls, vec![call(0, "f", arguments)], "{text}");
            assert_eq!(got.content, "");
        }
        // Arguments written as a JSON string go out decoded; null is {}; none is {}.
        for (block, arguments) in [
            (
                r#"{"name": "f", "arguments": "{\"x\": \"\\u00e9\"}"}"#,
                "{\"x\": \"\\u00e9\"}",
            ),
            (r#"{"name": "f", "arguments": null}"#, "{}"),
            (r#"{"name": "f", "parameters": {"x": 1}}"#, r#"{"x": 1}"#),
            (r#"{"name": "f"}"#, "{}"),
            (r#"{"n\u0061me": "f\"g", "arguments": 7}"#, "7"),
        ] {
            let got = check_streams(&format!("<tool_call>{block}</tool_call>"), false, true);
            let name = if block.contains("f\\\"g") {
                "f\"g"
            } else {
                "f"
            };
            assert_eq!(got.tool_calls, vec![call(0, name, arguments)], "{block}");
        }
    }

    #[test]
    fn a_block_that_does_not_start_with_its_name_is_read_whole_at_its_end() {
        // Arguments before the name: one delta with the whole call once the block closes.
        let text = "<tool_call>\n{\"arguments\": {\"x\": [1, 2]}, \"name\": \"f\"}\n</tool_call>";
        let got = check_streams(text, false, true);
        assert_eq!(got.tool_calls, vec![call(0, "f", r#"{"x": [1, 2]}"#)]);
        let deltas = streamed(text, 2, false, true);
        let with_calls: Vec<usize> = (0..deltas.len())
            .filter(|&i| !deltas[i].tool_calls.is_empty())
            .collect();
        let closing = text.find("</tool_call>").unwrap() + "</tool_call>".len();
        assert_eq!(with_calls, vec![closing.div_ceil(2) - 1]);
        // Not a JSON object with a string name: content, tags and all, as vLLM leaves it.
        for text in [
            "<tool_call>\n{\"arguments\": {}}\n</tool_call>",
            "<tool_call>\n{\"name\": 3, \"arguments\": {}}\n</tool_call>",
            "<tool_call>\n[1, 2]\n</tool_call>",
            "<tool_call>\n{\"id\": 1, \"name\": \"f\", }\n</tool_call>",
            "a <tool_call>\n{\"nam",
            "a <tool_cal",
        ] {
            let got = check_streams(text, false, true);
            assert_eq!(got.content, text);
            assert!(got.tool_calls.is_empty(), "{text}");
        }
        // A good call after a bad one is numbered 0.
        let text = "<tool_call>\nnope\n</tool_call><tool_call>{\"name\": \"g\", \"parameters\": {\"x\": 1}}</tool_call>";
        let got = check_streams(text, false, true);
        assert_eq!(got.content, "<tool_call>\nnope\n</tool_call>");
        assert_eq!(got.tool_calls, vec![call(0, "g", r#"{"x": 1}"#)]);
    }

    #[test]
    fn a_call_whose_name_went_out_stays_a_call_however_it_ends() {
        for (text, arguments, content) in [
            // Cut by the token budget: the arguments that came.
            ("a <tool_call>\n{\"name\": \"f\", \"argu", "", "a "),
            (
                "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"q\": \"par",
                "{\"q\": \"par",
                "",
            ),
            // The closing tag never came, but the call is whole.
            ("<tool_call>\n{\"name\": \"f\"}\n", "{}", ""),
            // Invalid JSON is sent as the model wrote it.
            (
                "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": }}\n</tool_call>",
                "{\"a\": }",
                "",
            ),
            // Text that breaks the object after the name is dropped with the block.
            (
                "<tool_call>{\"name\": \"f\" oops, \"arguments\": {}}</tool_call>x",
                "",
                "x",
            ),
            (
                "<tool_call>{\"name\": \"f\", \"arguments\": {\"a\": 1}} oops</tool_call>",
                "{\"a\": 1}",
                "",
            ),
        ] {
            let got = check_streams(text, false, true);
            assert_eq!(got.tool_calls, vec![call(0, "f", arguments)], "{text}");
            assert_eq!(got.content, content, "{text}");
        }
    }

    #[test]
    fn gathered_deltas_are_the_unary_calls() {
        let mut calls = Vec::new();
        let text = "<tool_call>{\"name\": \"f\", \"arguments\": {\"a\": 1}}</tool_call><tool_call>{\"name\": \"g\", \"arguments\": [2]}</tool_call>";
        let mut ids = Vec::new();
        for d in streamed(text, 3, false, true) {
            for c in d.tool_calls {
                if let Some(h) = &c.head {
                    ids.push(h.id.clone());
                }
                ToolCall::gather(&mut calls, c);
            }
        }
        let want = |index: u32, name: &str, arguments: &str| ToolCall {
            index,
            id: ids[index as usize].clone(),
            name: name.into(),
            arguments: arguments.into(),
        };
        assert_eq!(
            calls,
            vec![want(0, "f", r#"{"a": 1}"#), want(1, "g", "[2]")]
        );
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
}
