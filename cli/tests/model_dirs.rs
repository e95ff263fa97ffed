//! The committed 8B model directory (`deploy/models/qwen3-vl-8b`: the real config, a byte-level
//! stand-in tokenizer with Qwen's special-token ids, the chat template, the image-processor
//! settings) holds together, so `--random-weights` runs of the real shapes build the same prompt
//! structure a real checkpoint would. Its weights (36 GB in f32) are not built here.

use std::path::PathBuf;

use gateway::chat::{ChatTokenizer, Message, Part};

fn dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../deploy/models/qwen3-vl-8b")
}

#[test]
fn the_8b_directory_reads_as_a_qwen3_vl_model() {
    let dir = dir();
    let text = llm_svc::ModelConfig::from_dir(&dir).unwrap();
    assert_eq!(
        (
            text.text.hidden_size,
            text.text.num_hidden_layers,
            text.text.vocab_size
        ),
        (4096, 36, 151936)
    );
    assert_eq!(text.eos_token_ids, vec![151645, 151643]);
    let vision = vision_svc::VisionConfig::from_dir(&dir).unwrap();
    assert_eq!((vision.depth, vision.hidden_size), (27, 1152));
    let pre = vision_svc::PreprocessConfig::from_dir(&dir).unwrap();
    assert_eq!((pre.patch_size, pre.merge_size), (16, 2));

    let chat = ChatTokenizer::from_dir(&dir, text.image_token_id()).unwrap();
    let v = text.vision.as_ref().expect("a vision-language checkpoint");
    let ids = chat
        .prompt_ids(
            &[Message::user(vec![
                Part::Image(Vec::new()),
                Part::Text("hi".into()),
            ])],
            &[4],
        )
        .unwrap();
    let at = |t: u32| ids.iter().position(|&i| i == t);
    let start = at(v.vision_start_token_id).expect("vision start in the prompt");
    assert_eq!(&ids[start + 1..start + 5], &[v.image_token_id; 4]);
    assert_eq!(ids[start + 5], v.vision_end_token_id);
    // Plain text is one token per byte, and decodes back.
    assert_eq!(chat.encode("hi").unwrap().len(), 2);
    assert_eq!(
        chat.decode(&chat.encode("héllo").unwrap(), true).unwrap(),
        "héllo"
    );
    // Every other id decodes to a word of its own, so random weights' output streams as text.
    assert_eq!(chat.decode(&[123_456], true).unwrap(), " t123456");
    assert_eq!(chat.decode(&[151_935], true).unwrap(), " t151935");
    // <|im_end|> is eos, as in the real tokenizer.
    assert_eq!(chat.tokenizer().token_to_id("<|im_end|>"), Some(151645));
}
