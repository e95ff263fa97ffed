#!/usr/bin/env python3
"""Writes tokenizer.json: a byte-level stand-in for Qwen3-VL's tokenizer, for random-weight runs.

Qwen's real tokenizer (151,643 BPE tokens) is part of the checkpoint, which this repository does
not ship. This one has no merges, so every byte of text is one token (ids 0-255), but Qwen's
special tokens sit at their real ids (151643 <|endoftext|> ... 151655 <|image_pad|>), which is
what the chat template, the image placeholders and eos need. Every other id of the model's
vocabulary (151,936) decodes to a short word of its own (" t1234"), as a real vocabulary's ids
decode to text: a random-weight model's output then streams token by token, with the
detokenizing and streaming work a real checkpoint's does (no merge ever produces these, so
encoding is unchanged). With it and config.json, `vlm run --model deploy/models/qwen3-vl-8b
--random-weights` runs the real 8B shapes end to end. Needs only the Python standard library.
"""
import json
import pathlib

SPECIAL = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
    "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>",
    "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
    "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>", "<think>", "</think>",
]
FIRST_SPECIAL_ID = 151643
VOCAB_SIZE = 151936  # config.json's text_config.vocab_size


def byte_to_unicode():
    """GPT-2's reversible map from bytes to printable characters (ByteLevel's alphabet)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def main():
    alphabet = byte_to_unicode()
    vocab = {alphabet[b]: b for b in range(256)}
    # The specials are in the model's vocab too: `tokenizers` numbers added tokens that are not
    # in it from the vocab's size up, which would move them off Qwen's ids.
    vocab.update({t: FIRST_SPECIAL_ID + i for i, t in enumerate(SPECIAL)})
    # "Ġ" is the space in ByteLevel's alphabet.
    taken = set(vocab.values())
    vocab.update({f"\u0120t{i}": i for i in range(256, VOCAB_SIZE) if i not in taken})
    added = [
        {"id": FIRST_SPECIAL_ID + i, "content": t, "single_word": False, "lstrip": False,
         "rstrip": False, "normalized": False, "special": t.startswith("<|")}
        for i, t in enumerate(SPECIAL)
    ]
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": True}
    tok = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": byte_level,
        "post_processor": None,
        "decoder": byte_level,
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": "",
                  "end_of_word_suffix": "", "fuse_unk": False, "byte_fallback": False,
                  "ignore_merges": False, "vocab": vocab, "merges": []},
    }
    out = pathlib.Path(__file__).with_name("tokenizer.json")
    # Compact: 151,936 entries.
    out.write_text(json.dumps(tok, ensure_ascii=False, separators=(",", ":")) + "\n", encoding="utf-8")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
