//! The prefix-cache block rule both sides of the LLM hop must agree on: how many tokens a KV
//! cache block holds and how a full block is named. llm-svc keys its prefix cache by these
//! hashes (`llm_svc::kv_cache`); the gateway hashes a prompt the same way to route it to the
//! replica that already holds its blocks. Defined once here so the two cannot drift.

use xxhash_rust::xxh3::Xxh3;

/// Identity of a block's contents, as a chain: equal hashes mean equal tokens, images and
/// prefix. 128 bits, so a collision between distinct prefixes is not a practical concern.
pub type BlockHash = u128;

/// Tokens per KV cache block: llm-svc's, and what the gateway hashes prompts in.
pub const KV_BLOCK_SIZE: usize = 16;

/// The hash of a full block: the previous block's hash, the block's token ids, and the
/// identities of the images whose tokens it holds (their placeholder ids are all alike).
pub fn block_hash(prev: Option<BlockHash>, tokens: &[u32], images: &[BlockHash]) -> BlockHash {
    let mut h = Xxh3::new();
    h.update(&prev.unwrap_or(0).to_le_bytes());
    h.update(&[prev.is_some() as u8]);
    for t in tokens {
        h.update(&t.to_le_bytes());
    }
    for i in images {
        h.update(&i.to_le_bytes());
    }
    h.digest128()
}

/// An image's identity as the gateway knows it before it is encoded: a hash of its bytes. It
/// names the image in the gateway's record of what each replica holds (llm-svc names it by its
/// embeddings, which follow from the bytes for one vision-svc configuration).
pub fn image_identity(bytes: &[u8]) -> BlockHash {
    xxhash_rust::xxh3::xxh3_128(bytes)
}

/// The hashes of every full block of `tokens`, in order, where `images` names each image by
/// the first token index it covers, its token count and its identity (images in prompt
/// order, not overlapping).
pub fn prompt_block_hashes(
    tokens: &[u32],
    images: &[(usize, usize, BlockHash)],
    block_size: usize,
) -> Vec<BlockHash> {
    let mut hashes: Vec<BlockHash> = Vec::with_capacity(tokens.len() / block_size.max(1));
    if block_size == 0 {
        return hashes;
    }
    for (b, block) in tokens.chunks_exact(block_size).enumerate() {
        let (start, end) = (b * block_size, (b + 1) * block_size);
        let in_block: Vec<BlockHash> = images
            .iter()
            .filter(|(s, len, _)| *s < end && start < s + len)
            .map(|&(_, _, id)| id)
            .collect();
        hashes.push(block_hash(hashes.last().copied(), block, &in_block));
    }
    hashes
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_prompt_hashes_its_full_blocks_as_a_chain_and_images_change_their_blocks() {
        let tokens: Vec<u32> = (0..40).collect();
        let h = prompt_block_hashes(&tokens, &[], 16);
        assert_eq!(h.len(), 2, "the last 8 tokens are no full block");
        assert_eq!(h[0], block_hash(None, &tokens[..16], &[]));
        assert_eq!(h[1], block_hash(Some(h[0]), &tokens[16..32], &[]));
        // An image over tokens 14..20 names both blocks it touches.
        let with = prompt_block_hashes(&tokens, &[(14, 6, 7)], 16);
        assert_eq!(with[0], block_hash(None, &tokens[..16], &[7]));
        assert_ne!(with[1], h[1]);
        let other = prompt_block_hashes(&tokens, &[(14, 6, 8)], 16);
        assert_ne!(with[0], other[0], "another image, another block");
    }
}
