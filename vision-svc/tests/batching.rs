//! Several images in one ViT pass give exactly what each gives alone, on the tiny fixture:
//! the model's `forward_batch` against `forward`.
//!
//! Exact equality holds on the CPU: every op but attention computes each row on its own, and
//! attention stays within each image. (On a GPU, GEMMs over more rows may round differently.)

use std::path::PathBuf;

use vision_svc::{preprocess, Patches, VisionEncoder, VisionOutput};
use vlm_compute::{CpuBackend, HostTensor, Weights};

fn fixture() -> PathBuf {
    vlm_compute::golden::tiny_fixture(env!("CARGO_MANIFEST_DIR"))
}

/// The fixture's test images (PNG, RGBA PNG, WebP, JPEG; all of different sizes), as bytes.
fn images() -> Vec<(String, Vec<u8>)> {
    let dir = fixture().join("images");
    let mut names: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    names.sort();
    assert!(names.len() >= 3, "fixture images: {names:?}");
    names
        .into_iter()
        .map(|n| {
            let bytes = std::fs::read(dir.join(&n)).unwrap();
            (n, bytes)
        })
        .collect()
}

fn encoder() -> VisionEncoder<CpuBackend> {
    let dir = fixture();
    VisionEncoder::load(&dir, &Weights::open(&dir).unwrap(), CpuBackend::new()).unwrap()
}

fn patches(enc: &VisionEncoder<CpuBackend>, bytes: &[u8]) -> Patches {
    preprocess::preprocess(bytes, &enc.preprocess, &enc.limits).unwrap()
}

/// Same shape and the same f32 bits.
fn assert_identical(what: &str, got: &HostTensor, want: &HostTensor) {
    assert_eq!(got.shape(), want.shape(), "{what}: shape");
    let differ = got
        .data()
        .iter()
        .zip(want.data())
        .filter(|(a, b)| a.to_bits() != b.to_bits())
        .count();
    assert_eq!(differ, 0, "{what}: {differ} of {} values differ", got.len());
}

fn assert_same_output(what: &str, got: &VisionOutput, want: &VisionOutput) {
    assert_eq!(got.grid_thw, want.grid_thw, "{what}: grid");
    assert_identical(&format!("{what} embeddings"), &got.embeds, &want.embeds);
    assert_eq!(got.deepstack.len(), want.deepstack.len(), "{what}: taps");
    for (j, (g, w)) in got.deepstack.iter().zip(&want.deepstack).enumerate() {
        assert_identical(&format!("{what} deepstack {j}"), g, w);
    }
}

#[test]
fn a_batch_of_images_of_different_sizes_gives_each_image_its_own_output_exactly() {
    let enc = encoder();
    let images = images();
    let all: Vec<Patches> = images.iter().map(|(_, b)| patches(&enc, b)).collect();
    let alone: Vec<VisionOutput> = all.iter().map(|p| enc.model.forward(p).unwrap()).collect();
    let grids: Vec<_> = all.iter().map(|p| p.grid_thw).collect();
    assert!(
        grids.iter().any(|g| g != &grids[0]),
        "the images should differ in size: {grids:?}"
    );

    // All together, then in another order with one image twice.
    let batched = enc.model.forward_batch(&all).unwrap();
    assert_eq!(batched.len(), all.len());
    for (((name, _), got), want) in images.iter().zip(&batched).zip(&alone) {
        assert_same_output(name, got, want);
    }
    let order: Vec<usize> = (0..all.len()).rev().chain([0]).collect();
    let picked: Vec<Patches> = order.iter().map(|&i| all[i].clone()).collect();
    let batched = enc.model.forward_batch(&picked).unwrap();
    for (&i, got) in order.iter().zip(&batched) {
        assert_same_output(&format!("{} (reordered)", images[i].0), got, &alone[i]);
    }
    assert!(enc.model.forward_batch(&[]).unwrap().is_empty());
}
