//! Fuzzing the inputs the services take from outside: image bytes, OpenAI request bodies, gRPC
//! messages, chat content through the chat template, image URLs, and checkpoint files.
//!
//! Each target is a plain `fn(&[u8]) -> Outcome` over the same functions a service runs on a
//! request ([`targets`]); a refusal (`Err` with the message a client would get) is fine, a
//! panic, a hang or an unbounded allocation is a failure. Two ways to run them:
//!
//! - stable Rust, in CI: [`runner`] mutates the committed corpora (`fuzz/corpus/<target>/`) for
//!   `FUZZ_SECONDS` per target (`fuzz/tests/fuzz.rs`, part of `cargo test --workspace`), or
//!   longer with `cargo run --release -p vlm-fuzz -- run <target> --seconds N`;
//! - nightly, coverage-guided: `fuzz/libfuzzer/` wraps the same functions in cargo-fuzz's
//!   `fuzz_target!`.

pub mod alloc;
pub mod runner;
pub mod seeds;
pub mod targets;

/// What a target made of one input: accepted, or refused with the error a client would see.
pub type Outcome = Result<(), String>;

/// A fuzz target and what the mutator needs to know about its input.
pub struct Target {
    pub name: &'static str,
    pub run: fn(&[u8]) -> Outcome,
    /// Tokens the mutator inserts (syntax of the input format, values that reach edge cases).
    pub dict: &'static [&'static [u8]],
    /// Mutants are cut to this many bytes.
    pub max_len: usize,
}

const IMAGE_DICT: &[&[u8]] = &[
    b"IHDR",
    b"IDAT",
    b"IEND",
    b"PLTE",
    b"tRNS",
    b"acTL",
    b"fcTL",
    b"RIFF",
    b"WEBP",
    b"VP8 ",
    b"VP8L",
    b"VP8X",
    b"ALPH",
    b"GIF89a",
    b"NETSCAPE2.0",
    b"\xff\xd8\xff",
    b"\xff\xc0",
    b"\xff\xc2",
    b"\xff\xc4",
    b"\xff\xdb",
    b"\xff\xdd",
    b"\xff\xda",
    b"\xff\xd9",
    b"\x00\x00\x40\x00",
    b"\xff\xff\xff\x7f",
];

const JSON_DICT: &[&[u8]] = &[
    b"{",
    b"}",
    b"[",
    b"]",
    b"\"",
    b",",
    b":",
    b"null",
    b"true",
    b"false",
    b"\\u0000",
    b"\\ud800",
    b"\\udfff",
    b"\\\"",
    b"[[[[[[[[[[[[[[[[",
    b"{\"a\":{\"a\":{\"a\":",
    b"\"messages\"",
    b"\"content\"",
    b"\"role\"",
    b"\"user\"",
    b"\"system\"",
    b"\"assistant\"",
    b"\"developer\"",
    b"\"tool\"",
    b"\"type\"",
    b"\"text\"",
    b"\"image_url\"",
    b"\"url\"",
    b"\"data:image/png;base64,\"",
    b"data:image/png;base64,",
    b"\"max_tokens\"",
    b"\"max_completion_tokens\"",
    b"\"temperature\"",
    b"\"top_p\"",
    b"\"top_k\"",
    b"\"stop\"",
    b"\"seed\"",
    b"\"n\"",
    b"\"stream\"",
    b"\"stream_options\"",
    b"\"include_usage\"",
    b"\"ignore_eos\"",
    b"\"return_token_ids\"",
    b"<|image_pad|>",
    b"<|vision_start|>",
    b"<|vision_end|>",
    b"<|im_start|>",
    b"<|im_end|>",
    b"{{ messages }}",
    b"{% raw %}",
    "\u{202e}".as_bytes(),
    "\u{feff}".as_bytes(),
    "\u{10ffff}".as_bytes(),
];

const TEMPLATE_DICT: &[&[u8]] = &[
    b"{{",
    b"}}",
    b"{%",
    b"%}",
    b"{#",
    b"#}",
    b"{%-",
    b"-%}",
    b"{% raw %}",
    b"{% endraw %}",
    b"{{ raise_exception('x') }}",
    b"{% for m in messages %}",
    b"{% endfor %}",
    b"{% if true %}",
    b"{% endif %}",
    b"{{ messages }}",
    b"{{ bos_token }}",
    b"message.content",
    b"range(1000000)",
    b"<|im_start|>",
    b"<|im_end|>",
    b"<|image_pad|>",
    b"<|vision_start|>",
    b"<|vision_end|>",
    b"<|endoftext|>",
    b"<think>",
    b"</think>",
    b"<tool_call>",
    "\u{0}".as_bytes(),
    "\u{202e}".as_bytes(),
    "\u{feff}".as_bytes(),
    "\u{fffd}".as_bytes(),
    "\u{10ffff}".as_bytes(),
    "e\u{301}\u{301}\u{301}".as_bytes(),
    b"\r\n",
];

const PROTO_DICT: &[&[u8]] = &[
    b"\x0a\x04user",
    b"\x0a\x06system",
    b"\x0a\x09assistant",
    b"\x12\x07\x0a\x05hello",
    b"\x12\x02\x12\x00",
    b"\x0a\x00",
    b"\x08\x02",
    b"\x08\x03",
    b"\x12\x01\x01",
    b"\x1a\x03\x01\x04\x04",
    b"\xff\xff\xff\xff\x0f",
    b"\x80\x80\x80\x80\x80\x80\x80\x80\x80\x01",
    b"<|image_pad|>",
];

const URL_DICT: &[&[u8]] = &[
    b"http://",
    b"https://",
    b"file://",
    b"file:///srv/images/",
    b"data:",
    b"localhost",
    b"images.example.com",
    b"127.0.0.1",
    b"0x7f.1",
    b"2130706433",
    b"169.254.169.254",
    b"[::1]",
    b"[::ffff:127.0.0.1]",
    b"[64:ff9b::7f00:1]",
    b"[fd00::1]",
    b"%2e%2e/",
    b"../",
    b"/..",
    b"%00",
    b"@",
    b":80",
    b"#",
    b"?",
    b"\\",
];

const CHECKPOINT_DICT: &[&[u8]] = &[
    b"{",
    b"}",
    b"[",
    b"]",
    b"\"",
    b"null",
    b"0",
    b"-1",
    b"\"dtype\":\"BF16\"",
    b"\"dtype\":\"F16\"",
    b"\"dtype\":\"F32\"",
    b"\"dtype\":\"I64\"",
    b"\"shape\":[]",
    b"\"shape\":[0]",
    b"\"shape\":[4294967296,4294967296]",
    b"\"data_offsets\":[0,0]",
    b"\"__metadata__\":{}",
    b"\"hidden_size\"",
    b"\"num_heads\"",
    b"\"depth\"",
    b"\"deepstack_visual_indexes\"",
    b"\"patch_size\"",
    b"\"merge_size\"",
    b"\"num_position_embeddings\"",
    b"\"num_hidden_layers\"",
    b"\"num_key_value_heads\"",
    b"\"head_dim\"",
    b"\"mrope_section\"",
    b"\"vocab_size\"",
    b"\"image_token_id\"",
    b"\"weight_map\"",
    b"\"../config.json\"",
    b"\"/dev/zero\"",
    b"\"chat_template\"",
    b"\"eos_token\"",
    b"{{",
    b"}}",
    b"{%",
    b"%}",
];

/// Every target, in the order CI runs them.
pub static TARGETS: &[Target] = &[
    Target {
        name: "image",
        run: targets::image::encoded_image,
        dict: IMAGE_DICT,
        max_len: 256 * 1024,
    },
    Target {
        name: "resize",
        run: targets::image::raw_pixels,
        dict: &[],
        max_len: 64 * 1024,
    },
    Target {
        name: "openai_request",
        run: targets::gateway::openai_request,
        dict: JSON_DICT,
        max_len: 64 * 1024,
    },
    Target {
        name: "grpc",
        run: targets::grpc::message,
        dict: PROTO_DICT,
        max_len: 64 * 1024,
    },
    Target {
        name: "chat_template",
        run: targets::gateway::chat_messages,
        dict: TEMPLATE_DICT,
        max_len: 64 * 1024,
    },
    Target {
        name: "image_url",
        run: targets::media::image_url,
        dict: URL_DICT,
        max_len: 4096,
    },
    Target {
        name: "checkpoint",
        run: targets::checkpoint::checkpoint_file,
        dict: CHECKPOINT_DICT,
        max_len: 192 * 1024,
    },
];

/// The target called `name`.
pub fn target(name: &str) -> Option<&'static Target> {
    TARGETS.iter().find(|t| t.name == name)
}
