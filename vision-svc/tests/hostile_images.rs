//! Decompression bombs in every supported format: small files that declare a huge image
//! (60000x60000, 3.6 Gpx, ~10 GB as RGB), refused as the caller's fault (INVALID_ARGUMENT /
//! HTTP 400) before anything is allocated for their pixels. A counting allocator records the
//! largest single allocation made on the decoding thread, so "before the big allocation" is
//! measured, not assumed. Milliseconds in all.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::io::Cursor;

use image::ImageFormat;
use vision_svc::preprocess::{check_header, decode, DecodeLimits};
use vision_svc::Error;

/// The system allocator, noting the largest allocation each thread asks for.
struct Counting;

thread_local! {
    static LARGEST: Cell<usize> = const { Cell::new(0) };
}

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let _ = LARGEST.try_with(|l| l.set(l.get().max(layout.size())));
        System.alloc(layout)
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        System.dealloc(ptr, layout)
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let _ = LARGEST.try_with(|l| l.set(l.get().max(new_size)));
        System.realloc(ptr, layout, new_size)
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// `decode(bytes)` under the default limits, and the largest allocation it made.
fn decode_measured(bytes: &[u8]) -> (vision_svc::Result<()>, usize) {
    LARGEST.with(|l| l.set(0));
    let result = decode(bytes, &DecodeLimits::default()).map(|_| ());
    (result, LARGEST.with(Cell::get))
}

/// A small valid image of `format`.
fn small(format: ImageFormat) -> Vec<u8> {
    let mut out = Vec::new();
    image::RgbImage::from_fn(16, 16, |x, y| image::Rgb([x as u8 * 16, y as u8 * 16, 128]))
        .write_to(&mut Cursor::new(&mut out), format)
        .unwrap();
    out
}

const HUGE: u32 = 60_000;

/// A real PNG whose IHDR says 60000x60000 (CRC fixed, so the header is valid).
fn png_bomb() -> Vec<u8> {
    let mut png = small(ImageFormat::Png);
    // Signature (8), IHDR length (4), "IHDR" (4), then width and height, big-endian.
    png[16..20].copy_from_slice(&HUGE.to_be_bytes());
    png[20..24].copy_from_slice(&HUGE.to_be_bytes());
    let crc = crc32fast::hash(&png[12..29]);
    png[29..33].copy_from_slice(&crc.to_be_bytes());
    png
}

/// A real JPEG whose frame header (SOF0) says 60000x60000.
fn jpeg_bomb() -> Vec<u8> {
    let mut jpeg = small(ImageFormat::Jpeg);
    let sof = jpeg
        .windows(2)
        .position(|w| w == [0xFF, 0xC0])
        .expect("a baseline JPEG has an SOF0 marker");
    // Marker (2), length (2), precision (1), then height and width, big-endian.
    jpeg[sof + 5..sof + 7].copy_from_slice(&(HUGE as u16).to_be_bytes());
    jpeg[sof + 7..sof + 9].copy_from_slice(&(HUGE as u16).to_be_bytes());
    jpeg
}

/// A real GIF whose logical screen says 60000x60000.
fn gif_screen_bomb() -> Vec<u8> {
    let mut gif = small(ImageFormat::Gif);
    gif[6..8].copy_from_slice(&(HUGE as u16).to_le_bytes());
    gif[8..10].copy_from_slice(&(HUGE as u16).to_le_bytes());
    gif
}

/// A GIF with a small screen whose first frame says 60000x60000.
fn gif_frame_bomb() -> Vec<u8> {
    let mut gif = small(ImageFormat::Gif);
    let frame = gif
        .iter()
        .position(|&b| b == 0x2C)
        .expect("an image descriptor");
    // Separator (1), left (2), top (2), then width and height, little-endian.
    gif[frame + 5..frame + 7].copy_from_slice(&(HUGE as u16).to_le_bytes());
    gif[frame + 7..frame + 9].copy_from_slice(&(HUGE as u16).to_le_bytes());
    gif
}

/// An extended WebP (VP8X) whose canvas says 60000x60000, around a small lossless image.
fn webp_canvas_bomb() -> Vec<u8> {
    let small = small(ImageFormat::WebP);
    // The small file's chunks after "RIFF" size "WEBP".
    let inner = &small[12..];
    let mut vp8x = b"VP8X".to_vec();
    vp8x.extend_from_slice(&10u32.to_le_bytes());
    vp8x.extend_from_slice(&[0, 0, 0, 0]);
    vp8x.extend_from_slice(&(HUGE - 1).to_le_bytes()[..3]);
    vp8x.extend_from_slice(&(HUGE - 1).to_le_bytes()[..3]);
    let mut webp = b"RIFF".to_vec();
    webp.extend_from_slice(&((4 + vp8x.len() + inner.len()) as u32).to_le_bytes());
    webp.extend_from_slice(b"WEBP");
    webp.extend_from_slice(&vp8x);
    webp.extend_from_slice(inner);
    webp
}

/// A simple lossless WebP (VP8L) at 16383x16383 (268 Mpx; the format's 14-bit fields allow
/// 16384, which image-webp reads as 0).
fn webp_lossless_bomb() -> Vec<u8> {
    let mut webp = small(ImageFormat::WebP);
    assert_eq!(&webp[12..16], b"VP8L", "image encodes WebP lossless");
    // Chunk header (8), signature 0x2f (1), then 14 bits width - 1, 14 bits height - 1.
    let bits = u32::from_le_bytes(webp[21..25].try_into().unwrap());
    let bits = (bits & !((1 << 28) - 1)) | (16382 << 14) | 16382;
    webp[21..25].copy_from_slice(&bits.to_le_bytes());
    webp
}

#[test]
fn the_small_originals_decode() {
    for format in [
        ImageFormat::Png,
        ImageFormat::Jpeg,
        ImageFormat::Gif,
        ImageFormat::WebP,
    ] {
        let img = decode(&small(format), &DecodeLimits::default()).unwrap();
        assert_eq!((img.width, img.height), (16, 16), "{format:?}");
    }
    // The counter sees a real image's pixel buffer: the bounds below measure something.
    let mut png = Vec::new();
    image::RgbImage::from_pixel(1024, 1024, image::Rgb([9, 9, 9]))
        .write_to(&mut Cursor::new(&mut png), ImageFormat::Png)
        .unwrap();
    let (result, largest) = decode_measured(&png);
    result.unwrap();
    assert!(largest >= 1024 * 1024 * 3, "largest allocation {largest}");
}

#[test]
fn bombs_declaring_a_huge_image_are_refused_from_the_header_alone() {
    for (name, bomb, size) in [
        ("PNG", png_bomb(), "60000x60000"),
        ("JPEG", jpeg_bomb(), "60000x60000"),
        ("GIF", gif_screen_bomb(), "60000x60000"),
        ("WebP VP8X", webp_canvas_bomb(), "60000x60000"),
        ("WebP VP8L", webp_lossless_bomb(), "16383x16383"),
    ] {
        let err = check_header(&bomb, &DecodeLimits::default()).unwrap_err();
        assert!(matches!(err, Error::ImageTooLarge(_)), "{name}: {err}");
        assert!(err.to_string().contains(size), "{name}: {err}");
        let (result, largest) = decode_measured(&bomb);
        let err = result.unwrap_err();
        assert!(matches!(err, Error::ImageTooLarge(_)), "{name}: {err}");
        assert!(err.is_invalid_input(), "{name}: the caller's fault");
        assert!(
            largest < 1 << 20,
            "{name}: largest allocation {largest} bytes for a {} byte file",
            bomb.len()
        );
    }
}

#[test]
fn a_gif_frame_larger_than_its_screen_is_refused_without_a_big_allocation() {
    let bomb = gif_frame_bomb();
    let (result, largest) = decode_measured(&bomb);
    let err = result.unwrap_err();
    assert!(err.is_invalid_input(), "{err}");
    assert!(
        largest < 1 << 20,
        "largest allocation {largest} bytes for a {} byte file: {err}",
        bomb.len()
    );
}
