//! Minimal NumPy `.npy` (format 1.0) for 2-D little-endian float32 arrays: what `vlm run
//! --logits-out` writes and what tests read back. `numpy.load` reads these files as they are.

use std::io::Write;
use std::path::Path;

use crate::{Error, HostTensor, Result};

const MAGIC: &[u8] = b"\x93NUMPY\x01\x00";

/// Writes `t` (any rank) as a C-order `<f4` array.
pub fn write_f32(path: &Path, t: &HostTensor) -> Result<()> {
    let shape = t
        .shape()
        .iter()
        .map(|d| d.to_string())
        .collect::<Vec<_>>()
        .join(", ");
    let shape = if t.shape().len() == 1 {
        format!("({shape},)")
    } else {
        format!("({shape})")
    };
    let mut header = format!("{{'descr': '<f4', 'fortran_order': False, 'shape': {shape}, }}");
    // The header (with magic, length and newline) is padded to a multiple of 64 bytes.
    let unpadded = MAGIC.len() + 2 + header.len() + 1;
    header.push_str(&" ".repeat((64 - unpadded % 64) % 64));
    header.push('\n');
    let io = |source| Error::Io {
        path: path.to_path_buf(),
        source,
    };
    let mut f = std::io::BufWriter::new(std::fs::File::create(path).map_err(io)?);
    f.write_all(MAGIC).map_err(io)?;
    f.write_all(&(header.len() as u16).to_le_bytes())
        .map_err(io)?;
    f.write_all(header.as_bytes()).map_err(io)?;
    for v in t.data() {
        f.write_all(&v.to_le_bytes()).map_err(io)?;
    }
    f.flush().map_err(io)
}

/// Reads a C-order `<f4` array written by [`write_f32`] (or NumPy).
pub fn read_f32(path: &Path) -> Result<HostTensor> {
    let bytes = std::fs::read(path).map_err(|source| Error::Io {
        path: path.to_path_buf(),
        source,
    })?;
    let bad = |m: &str| Error::BadJson {
        path: path.to_path_buf(),
        message: format!("not a float32 .npy file: {m}"),
    };
    if bytes.len() < 10 || &bytes[..8] != MAGIC {
        return Err(bad("bad magic"));
    }
    let hlen = u16::from_le_bytes([bytes[8], bytes[9]]) as usize;
    let header = std::str::from_utf8(
        bytes
            .get(10..10 + hlen)
            .ok_or_else(|| bad("short header"))?,
    )
    .map_err(|_| bad("header is not text"))?;
    if !header.contains("'descr': '<f4'") || header.contains("'fortran_order': True") {
        return Err(bad("only C-order <f4 is supported"));
    }
    let shape_text = header
        .split("'shape': (")
        .nth(1)
        .and_then(|s| s.split(')').next())
        .ok_or_else(|| bad("no shape"))?;
    let shape: Vec<usize> = shape_text
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|s| s.parse().map_err(|_| bad("bad shape")))
        .collect::<Result<_>>()?;
    let data: Vec<f32> = bytes[10 + hlen..]
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    HostTensor::new(shape, data)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_and_pads_header_to_64_bytes() {
        let path = std::env::temp_dir().join(format!("vlm-npy-{}.npy", std::process::id()));
        let t = HostTensor::new(vec![2, 3], vec![1., 2., 3., 4., 5., -6.5]).unwrap();
        write_f32(&path, &t).unwrap();
        let bytes = std::fs::read(&path).unwrap();
        assert_eq!(
            (bytes.len() - 24) % 64,
            0,
            "data starts on a 64-byte boundary"
        );
        assert_eq!(read_f32(&path).unwrap(), t);
    }
}
