//! cargo-fuzz wrapper of vlm-fuzz's `openai_request` target (fuzz/src/targets/); refusals are fine, a
//! panic is a crash.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let _ = (vlm_fuzz::target("openai_request").expect("a vlm-fuzz target").run)(data);
});
