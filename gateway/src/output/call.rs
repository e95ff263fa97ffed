//! One `<tool_call>` block read as its text streams in ([`super::OutputSplitter`] feeds it the
//! text between the tags), as vLLM's Hermes parser reads it: once the `"name"` string is
//! whole, the call's first delta (its index, a new id, the name, no arguments yet); then the
//! text of its `"arguments"` value as it comes, in fragments.
//!
//! The block's JSON is followed character by character: members, strings and their escapes,
//! and the nesting depth inside a value, so the reader knows where the arguments value ends
//! (its closing bracket) without waiting for the outer object to close. What a block reads as:
//! - `name` first, a string: streamed. An object or array of arguments goes out as the model
//!   writes it, fragment by fragment; a string of arguments (JSON text already, as some models
//!   write it) goes out decoded once it is whole; `null` is `{}`, another scalar its text.
//!   A block whose object closes without arguments has `{}`. From the first delta on the block
//!   is this call, whatever follows: a call cut by the token budget keeps the arguments that
//!   came (possibly none, or incomplete JSON, with `finish_reason: "length"`), and text that
//!   breaks the JSON after the name is dropped with the rest of the block. Arguments that are
//!   themselves invalid JSON are sent as written (OpenAI's arguments are the model's text too).
//! - Anything else (`arguments` before `name`, a name that is not a string, text that is not
//!   an object): held until the block ends, then one delta with the whole call if the block is
//!   a JSON object with a string `name`, else the block is content, tags and all.
//!
//! Either way the stream's deltas add up to what the whole block read at once gives.

use super::{call_id, CallHead, ToolCallDelta};

/// Where the reader is in the block's JSON object.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Scan {
    /// Before the object's `{`.
    Start,
    /// Where a key comes (`first`: or the `}` of an empty object).
    BeforeKey { first: bool },
    /// Inside a key string (its text so far, quotes included, in `key`).
    Key,
    /// After a key, before its `:`.
    AfterKey,
    /// After a `:`, before the value.
    BeforeValue,
    /// Inside a member's value (`value` follows it).
    Value,
    /// After a value, before `,` or `}`.
    AfterValue,
    /// After the object's `}`: only whitespace belongs here.
    Closed,
    /// Text that does not read as one JSON object: the rest is not read.
    Broken,
}

/// What a member's value is to the call.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Role {
    Name,
    Arguments,
    Other,
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Kind {
    /// An object or array: ends at the bracket that closes its first.
    Container,
    /// A string: ends at its closing quote.
    Str,
    /// A number, `true`, `false` or `null`: ends before the next delimiter.
    Scalar,
}

/// One value followed to its end: strings, escapes and depth.
#[derive(Clone, Copy, Debug)]
struct ValueScan {
    kind: Kind,
    depth: u32,
    in_string: bool,
    escaped: bool,
}

/// How a value goes on past one character.
#[derive(PartialEq)]
enum Step {
    More,
    /// The character was the value's last.
    EndsWith,
    /// The character is past the value (a scalar's delimiter).
    EndsBefore,
}

impl ValueScan {
    /// The value that `first` opens.
    fn open(first: char) -> Self {
        let kind = match first {
            '{' | '[' => Kind::Container,
            '"' => Kind::Str,
            _ => Kind::Scalar,
        };
        Self {
            kind,
            depth: u32::from(kind == Kind::Container),
            in_string: kind == Kind::Str,
            escaped: false,
        }
    }

    fn step(&mut self, c: char) -> Step {
        if self.in_string {
            if self.escaped {
                self.escaped = false;
            } else if c == '\\' {
                self.escaped = true;
            } else if c == '"' {
                self.in_string = false;
                if self.kind == Kind::Str {
                    return Step::EndsWith;
                }
            }
            return Step::More;
        }
        match self.kind {
            Kind::Scalar if is_ws(c) || matches!(c, ',' | '}' | ']') => Step::EndsBefore,
            Kind::Container => match c {
                '"' => {
                    self.in_string = true;
                    Step::More
                }
                '{' | '[' => {
                    self.depth += 1;
                    Step::More
                }
                '}' | ']' => {
                    self.depth -= 1;
                    if self.depth == 0 {
                        Step::EndsWith
                    } else {
                        Step::More
                    }
                }
                _ => Step::More,
            },
            _ => Step::More,
        }
    }
}

/// JSON's whitespace.
fn is_ws(c: char) -> bool {
    matches!(c, ' ' | '\t' | '\n' | '\r')
}

/// What a block that has ended was.
#[derive(Debug, PartialEq)]
pub(super) enum Ended {
    /// A call: its last deltas (none where all went out already).
    Call(Vec<ToolCallDelta>),
    /// Not a call: its text, to go back to content as it came.
    NotACall(String),
}

/// Reads one `<tool_call>` block as it streams (see the module's notes).
pub(super) struct CallReader {
    /// The call's place among the choice's calls.
    index: u32,
    /// The block's text so far (a block that is not a call goes back to content).
    raw: String,
    scan: Scan,
    key: String,
    /// Whether the member being read is the object's first.
    first_member: bool,
    role: Role,
    value: Option<ValueScan>,
    /// A name's or a scalar argument's text, quotes included, until it is whole.
    held: String,
    name: Option<String>,
    /// `name` was not the first member, or not a string: the block is read whole at its end.
    whole: bool,
    /// The call's first delta has gone out: the block is this call from now on.
    sent_head: bool,
    /// An `arguments` (or `parameters`) member has begun.
    args_seen: bool,
    /// The object's closing `}` has been read.
    object_closed: bool,
    /// The arguments text so far, and how much of it has gone out.
    arguments: String,
    sent_args: usize,
}

impl CallReader {
    pub(super) fn new(index: u32) -> Self {
        Self {
            index,
            raw: String::new(),
            scan: Scan::Start,
            key: String::new(),
            first_member: true,
            role: Role::Other,
            value: None,
            held: String::new(),
            name: None,
            whole: false,
            sent_head: false,
            args_seen: false,
            object_closed: false,
            arguments: String::new(),
            sent_args: 0,
        }
    }

    /// Reads the next text of the block; returns the deltas it completes.
    pub(super) fn push(&mut self, text: &str) -> Vec<ToolCallDelta> {
        self.raw.push_str(text);
        for c in text.chars() {
            self.read(c);
        }
        self.deltas()
    }

    /// The block has ended (`closed`: by its closing tag; else the answer ended inside it).
    pub(super) fn end(mut self, closed: bool) -> Ended {
        if self.sent_head {
            if self.object_closed && !self.args_seen {
                self.arguments = "{}".into();
            }
            return Ended::Call(self.deltas());
        }
        let name = match serde_json::from_str::<serde_json::Value>(self.raw.trim()) {
            Ok(serde_json::Value::Object(o)) => {
                o.get("name").and_then(|n| n.as_str()).map(str::to_string)
            }
            _ => None,
        };
        match name {
            Some(name) => {
                if !self.args_seen {
                    self.arguments = "{}".into();
                }
                self.name = Some(name);
                self.whole = false;
                Ended::Call(self.head_and_arguments())
            }
            None => {
                let mut text = String::from(crate::tools::TOOL_CALL_OPEN);
                text.push_str(&self.raw);
                if closed {
                    text.push_str(crate::tools::TOOL_CALL_CLOSE);
                }
                Ended::NotACall(text)
            }
        }
    }

    /// The deltas due: the first once the name is read, then arguments not yet sent.
    fn deltas(&mut self) -> Vec<ToolCallDelta> {
        if self.whole || self.name.is_none() {
            return Vec::new();
        }
        if !self.sent_head {
            return self.head_and_arguments();
        }
        if self.sent_args == self.arguments.len() {
            return Vec::new();
        }
        let fragment = self.arguments[self.sent_args..].to_string();
        self.sent_args = self.arguments.len();
        vec![ToolCallDelta {
            index: self.index,
            head: None,
            arguments: fragment,
        }]
    }

    /// The call's first delta, with whatever arguments have come.
    fn head_and_arguments(&mut self) -> Vec<ToolCallDelta> {
        self.sent_head = true;
        self.sent_args = self.arguments.len();
        vec![ToolCallDelta {
            index: self.index,
            head: Some(CallHead {
                id: call_id(),
                name: self.name.clone().unwrap_or_default(),
            }),
            arguments: self.arguments.clone(),
        }]
    }

    fn read(&mut self, c: char) {
        match self.scan {
            Scan::Start => match c {
                _ if is_ws(c) => {}
                '{' => self.scan = Scan::BeforeKey { first: true },
                _ => self.scan = Scan::Broken,
            },
            Scan::BeforeKey { first } => match c {
                _ if is_ws(c) => {}
                '"' => {
                    self.key.clear();
                    self.key.push(c);
                    self.first_member = first;
                    self.scan = Scan::Key;
                }
                '}' if first => self.close_object(),
                _ => self.scan = Scan::Broken,
            },
            Scan::Key => {
                self.key.push(c);
                if c == '"' && !ends_escaped(&self.key[..self.key.len() - 1]) {
                    match serde_json::from_str::<String>(&self.key) {
                        Ok(key) => self.member(&key),
                        Err(_) => self.scan = Scan::Broken,
                    }
                }
            }
            Scan::AfterKey => match c {
                _ if is_ws(c) => {}
                ':' => self.scan = Scan::BeforeValue,
                _ => self.scan = Scan::Broken,
            },
            Scan::BeforeValue => {
                if is_ws(c) {
                    return;
                }
                if matches!(c, ',' | '}' | ']' | ':') {
                    self.scan = Scan::Broken;
                    return;
                }
                let scan = ValueScan::open(c);
                self.value = Some(scan);
                self.scan = Scan::Value;
                self.value_began(scan.kind, c);
            }
            Scan::Value => {
                let Some(scan) = self.value.as_mut() else {
                    self.scan = Scan::Broken;
                    return;
                };
                match scan.step(c) {
                    Step::More => self.value_text(c),
                    Step::EndsWith => {
                        self.value_text(c);
                        self.value_ended();
                    }
                    Step::EndsBefore => {
                        self.value_ended();
                        self.read(c);
                    }
                }
            }
            Scan::AfterValue => match c {
                _ if is_ws(c) => {}
                ',' => self.scan = Scan::BeforeKey { first: false },
                '}' => self.close_object(),
                _ => self.scan = Scan::Broken,
            },
            Scan::Closed => {
                if !is_ws(c) {
                    self.scan = Scan::Broken;
                }
            }
            Scan::Broken => {}
        }
    }

    fn close_object(&mut self) {
        self.scan = Scan::Closed;
        self.object_closed = true;
    }

    /// A member's key has been read: what its value is to the call.
    fn member(&mut self, key: &str) {
        self.scan = Scan::AfterKey;
        if self.first_member && key != "name" && !self.sent_head {
            self.whole = true;
        }
        self.role = match key {
            "name" if self.name.is_none() => Role::Name,
            "arguments" | "parameters" if !self.args_seen => Role::Arguments,
            _ => Role::Other,
        };
    }

    fn value_began(&mut self, kind: Kind, c: char) {
        self.held.clear();
        match (self.role, kind) {
            (Role::Name, Kind::Str) => self.held.push(c),
            (Role::Name, _) => {
                // Not a string: not a call the stream can begin.
                if !self.sent_head {
                    self.whole = true;
                }
                self.role = Role::Other;
            }
            (Role::Arguments, Kind::Container) => {
                self.args_seen = true;
                self.arguments.push(c);
            }
            (Role::Arguments, _) => {
                self.args_seen = true;
                self.held.push(c);
            }
            (Role::Other, _) => {}
        }
    }

    fn value_text(&mut self, c: char) {
        let Some(kind) = self.value.map(|v| v.kind) else {
            return;
        };
        match (self.role, kind) {
            (Role::Arguments, Kind::Container) => self.arguments.push(c),
            (Role::Name | Role::Arguments, _) => self.held.push(c),
            (Role::Other, _) => {}
        }
    }

    fn value_ended(&mut self) {
        let kind = self.value.take().map(|v| v.kind);
        self.scan = Scan::AfterValue;
        match (self.role, kind) {
            (Role::Name, Some(Kind::Str)) => match serde_json::from_str::<String>(&self.held) {
                Ok(name) => self.name = Some(name),
                Err(_) => self.scan = Scan::Broken,
            },
            (Role::Arguments, Some(Kind::Str)) => {
                match serde_json::from_str::<String>(&self.held) {
                    Ok(text) => self.arguments = text,
                    Err(_) => self.scan = Scan::Broken,
                }
            }
            (Role::Arguments, Some(Kind::Scalar)) => {
                self.arguments = if self.held == "null" {
                    "{}".into()
                } else {
                    std::mem::take(&mut self.held)
                };
            }
            _ => {}
        }
        self.role = Role::Other;
    }
}

/// Whether `text` ends in an odd run of backslashes (the next character is escaped).
fn ends_escaped(text: &str) -> bool {
    text.bytes().rev().take_while(|&b| b == b'\\').count() % 2 == 1
}
