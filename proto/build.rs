//! Generates the vlm.v1 stubs with a vendored protoc, so a build needs no system protoc.
fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protoc = protoc_bin_vendored::protoc_bin_path()?;
    // SAFETY (edition 2021: not unsafe): build scripts are single-threaded here.
    std::env::set_var("PROTOC", protoc);
    let out = std::path::PathBuf::from(std::env::var("OUT_DIR")?);
    tonic_prost_build::configure()
        // Embeddings and images as `bytes::Bytes`: decoding slices the received buffer instead
        // of copying it, and passing a payload on (gateway to llm-svc, a cache hit, a retry on
        // another replica) is a reference count, not a copy of megabytes.
        .bytes(".vlm.v1.Tensor.data")
        .bytes(".vlm.v1.EncodeRequest.image")
        // Ordered by token id, so a request's bias entries go on in one order every time.
        .btree_map(".vlm.v1.SamplingParams.logit_bias")
        .btree_map(".vlm.v1.ChatRequest.logit_bias")
        .file_descriptor_set_path(out.join("vlm_descriptor.bin"))
        .compile_protos(&["vlm/v1/vlm.proto"], &["."])?;
    println!("cargo:rerun-if-changed=vlm/v1/vlm.proto");
    Ok(())
}
