//! cargo-fuzz wrapper of vlm-fuzz's `image_url` target (fuzz/src/targets/); refusals are fine, a
//! panic is a crash.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let _ = (vlm_fuzz::target("image_url").expect("a vlm-fuzz target").run)(data);
});
