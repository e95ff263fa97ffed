//! Streaming detokenization and stop strings.
//!
//! [`IncrementalDecoder`] turns tokens into text as they arrive without ever emitting half a
//! UTF-8 character: byte-level BPE can split one character over several tokens, so text is
//! released only once the decoded tail no longer ends in U+FFFD (the approach of TGI's router).
//! [`StopStrings`] cuts the text at the first stop string and holds back any tail that could
//! still become one, so a client never sees part of a stop string.

use tokenizers::Tokenizer;

use crate::{Error, Result};

pub struct IncrementalDecoder<'a> {
    tokenizer: &'a Tokenizer,
    ids: Vec<u32>,
    /// Start of the window decoded for context (a few tokens before `read`).
    prefix: usize,
    /// Tokens before this index have been emitted as text.
    read: usize,
}

impl<'a> IncrementalDecoder<'a> {
    pub fn new(tokenizer: &'a Tokenizer) -> Self {
        Self {
            tokenizer,
            ids: Vec::new(),
            prefix: 0,
            read: 0,
        }
    }

    fn decode(&self, ids: &[u32]) -> Result<String> {
        self.tokenizer
            .decode(ids, true)
            .map_err(|e| Error::Tokenizer(e.to_string()))
    }

    /// Adds a token; returns the new text it completes (possibly empty).
    pub fn push(&mut self, id: u32) -> Result<String> {
        self.ids.push(id);
        let before = self.decode(&self.ids[self.prefix..self.read])?;
        let after = self.decode(&self.ids[self.prefix..])?;
        if after.len() > before.len() && !after.ends_with('\u{FFFD}') {
            let delta = after.get(before.len()..).unwrap_or_default().to_string();
            self.prefix = self.read;
            self.read = self.ids.len();
            Ok(delta)
        } else {
            Ok(String::new())
        }
    }

    /// Text of tokens still held back (an incomplete character at the very end), once no more
    /// tokens will come.
    pub fn finish(&mut self) -> Result<String> {
        let before = self.decode(&self.ids[self.prefix..self.read])?;
        let after = self.decode(&self.ids[self.prefix..])?;
        self.prefix = self.ids.len();
        self.read = self.ids.len();
        Ok(after.get(before.len()..).unwrap_or_default().to_string())
    }
}

pub struct StopStrings {
    stops: Vec<String>,
    /// Text received but not yet released (it may be the start of a stop string).
    pending: String,
    stopped: bool,
}

impl StopStrings {
    pub fn new(stops: Vec<String>) -> Self {
        Self {
            stops: stops.into_iter().filter(|s| !s.is_empty()).collect(),
            pending: String::new(),
            stopped: false,
        }
    }

    /// Adds text; returns what may be shown now, and whether a stop string was reached.
    pub fn push(&mut self, text: &str) -> (String, bool) {
        if self.stopped {
            return (String::new(), true);
        }
        self.pending.push_str(text);
        if let Some(at) = self
            .stops
            .iter()
            .filter_map(|s| self.pending.find(s.as_str()))
            .min()
        {
            self.stopped = true;
            let out = self.pending[..at].to_string();
            self.pending.clear();
            return (out, true);
        }
        // Hold back the longest tail that is a proper prefix of some stop string.
        let mut keep = 0;
        for s in &self.stops {
            for (i, _) in s.char_indices().skip(1) {
                if self.pending.ends_with(&s[..i]) {
                    keep = keep.max(i);
                }
            }
        }
        let cut = self.pending.len() - keep;
        let out = self.pending[..cut].to_string();
        self.pending.drain(..cut);
        (out, false)
    }

    /// Releases held-back text once generation has ended for another reason.
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.pending)
    }
}

/// Tokens in, text a client may see out: incremental decoding followed by stop strings.
pub struct TextStream<'a> {
    decoder: IncrementalDecoder<'a>,
    stops: StopStrings,
    stopped: bool,
}

impl<'a> TextStream<'a> {
    pub fn new(tokenizer: &'a Tokenizer, stop: Vec<String>) -> Self {
        Self {
            decoder: IncrementalDecoder::new(tokenizer),
            stops: StopStrings::new(stop),
            stopped: false,
        }
    }

    /// Adds a token; returns the text now visible and whether a stop string was reached
    /// (generation should end; the stop string itself is never returned).
    pub fn push(&mut self, token: u32) -> Result<(String, bool)> {
        let delta = self.decoder.push(token)?;
        let (visible, hit) = self.stops.push(&delta);
        self.stopped |= hit;
        Ok((visible, hit))
    }

    /// Once generation has ended: the text still held back (an incomplete character, the
    /// start of a stop string that never completed). Empty after a stop string.
    pub fn finish(&mut self) -> Result<String> {
        if self.stopped {
            return Ok(String::new());
        }
        let (mut tail, hit) = self.stops.push(&self.decoder.finish()?);
        if !hit {
            tail.push_str(&self.stops.finish());
        }
        Ok(tail)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stop_strings_cut_and_hold_back_partial_matches() {
        let mut s = StopStrings::new(vec!["END".into()]);
        assert_eq!(s.push("hello E"), ("hello ".into(), false));
        assert_eq!(s.push("N"), ("".into(), false));
        assert_eq!(s.push("Dgame"), ("".into(), true));
        let mut s = StopStrings::new(vec!["END".into()]);
        assert_eq!(s.push("hello E"), ("hello ".into(), false));
        assert_eq!(s.push("x"), ("Ex".into(), false));
        assert_eq!(s.push(" E"), (" ".into(), false));
        assert_eq!(s.finish(), "E");
    }

    #[test]
    fn earliest_of_several_stop_strings_wins() {
        let mut s = StopStrings::new(vec!["bb".into(), "a".into()]);
        assert_eq!(s.push("xxbba"), ("xx".into(), true));
    }
}
