//! cargo-fuzz wrapper of vlm-fuzz's `chat_template` target (fuzz/src/targets/); refusals are fine, a
//! panic is a crash.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let _ = (vlm_fuzz::target("chat_template").expect("a vlm-fuzz target").run)(data);
});
