//! Streaming detokenization and stop strings.
//!
//! [`IncrementalDecoder`] turns tokens into text as they arrive without ever emitting half a
//! UTF-8 character: byte-level BPE can split one character over several tokens, so text is
//! released only once the decoded tail no longer ends in U+FFFD (the approach of TGI's router).
//! [`StopStrings`] cuts the text at the first stop string and holds back any tail that could
//! still become one, so a client never sees part of a stop string. [`TokenBytes`] gives one
//! token's own bytes and text, as logprobs show each token.

use std::collections::HashMap;
use std::sync::LazyLock;

use tokenizers::{DecoderWrapper, Tokenizer};

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

/// One token on its own, as a response's logprobs show it: its bytes, which may be part of a
/// UTF-8 character (byte-level BPE splits characters over tokens), and its text, those bytes
/// with U+FFFD where a character is incomplete.
pub struct TokenBytes<'a> {
    tokenizer: &'a Tokenizer,
    /// GPT-2's byte-level vocabulary (Qwen's): each vocabulary character stands for a byte.
    byte_level: bool,
}

/// GPT-2's `bytes_to_unicode` backwards: the byte each character of a byte-level vocabulary
/// stands for. Printable bytes stand for themselves; the others (controls, space, 0x7F-0xA0,
/// 0xAD) for U+0100 onwards, in byte order.
static BYTE_LEVEL_CHARS: LazyLock<HashMap<char, u8>> = LazyLock::new(|| {
    let printable = |b: u8| matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
    let mut shifted = 0;
    (0..=255u8)
        .map(|b| {
            if printable(b) {
                (char::from(b), b)
            } else {
                shifted += 1;
                (char::from_u32(255 + shifted).unwrap_or('\0'), b)
            }
        })
        .collect()
});

impl<'a> TokenBytes<'a> {
    pub fn new(tokenizer: &'a Tokenizer) -> Self {
        Self {
            tokenizer,
            byte_level: matches!(tokenizer.get_decoder(), Some(DecoderWrapper::ByteLevel(_))),
        }
    }

    /// Token `id`'s bytes: from its vocabulary entry where the vocabulary spells bytes
    /// (byte-level characters, or SentencePiece's `<0xHH>` byte fallback), else the UTF-8 of
    /// its decoding alone (added tokens).
    pub fn bytes(&self, id: u32) -> Result<Vec<u8>> {
        if let Some(piece) = self.tokenizer.id_to_token(id) {
            if self.byte_level {
                let bytes: Option<Vec<u8>> = piece
                    .chars()
                    .map(|c| BYTE_LEVEL_CHARS.get(&c).copied())
                    .collect();
                if let Some(bytes) = bytes {
                    return Ok(bytes);
                }
            } else if let Some(hex) = piece.strip_prefix("<0x").and_then(|h| h.strip_suffix('>')) {
                if let (2, Ok(b)) = (hex.len(), u8::from_str_radix(hex, 16)) {
                    return Ok(vec![b]);
                }
            }
        }
        self.tokenizer
            .decode(&[id], false)
            .map(String::into_bytes)
            .map_err(|e| Error::Tokenizer(e.to_string()))
    }

    /// Token `id`'s text alone and its bytes.
    pub fn text_and_bytes(&self, id: u32) -> Result<(String, Vec<u8>)> {
        let bytes = self.bytes(id)?;
        Ok((String::from_utf8_lossy(&bytes).into_owned(), bytes))
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
    fn token_bytes_undo_the_byte_level_alphabet() {
        let dir = crate::tiny_fixture();
        let tokenizer = Tokenizer::from_file(dir.join("tokenizer.json")).unwrap();
        let tb = TokenBytes::new(&tokenizer);
        assert!(tb.byte_level);
        assert_eq!(BYTE_LEVEL_CHARS.len(), 256);
        assert_eq!(BYTE_LEVEL_CHARS[&'Ġ'], b' ');
        assert_eq!(BYTE_LEVEL_CHARS[&'Ċ'], b'\n');
        // Every token's bytes are what decoding it alone gives, where that is whole UTF-8.
        for id in 0..tokenizer.get_vocab_size(true) as u32 {
            let (text, bytes) = tb.text_and_bytes(id).unwrap();
            let decoded = tokenizer.decode(&[id], false).unwrap();
            if std::str::from_utf8(&bytes).is_ok() {
                assert_eq!(text, decoded, "token {id}");
            }
            assert!(!bytes.is_empty() || decoded.is_empty(), "token {id}");
        }
    }

    #[test]
    fn earliest_of_several_stop_strings_wins() {
        let mut s = StopStrings::new(vec!["bb".into(), "a".into()]);
        assert_eq!(s.push("xxbba"), ("xx".into(), true));
    }
}
