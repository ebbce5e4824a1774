//! Large host↔device transfers through one reusable page-locked buffer: the DMA engines read and
//! write it at full link speed (a pageable `Vec` goes through the driver's small bounce buffers
//! and fresh page faults), and the host side is split across threads.

use std::sync::Mutex;

use cudarc::driver::{result, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, PinnedHostSlice};
use rayon::prelude::*;

use super::{CudaDevice, CudaError};

/// Below this many floats a part is copied on the calling thread.
const PAR_MIN: usize = 1 << 16;

/// The page-locked buffer, grown to the largest transfer seen.
#[derive(Default)]
pub(super) struct Staging {
    buf: Mutex<Option<PinnedHostSlice<f32>>>,
}

impl CudaDevice {
    fn with_staging<R>(
        &self,
        len: usize,
        f: impl FnOnce(&mut [f32]) -> Result<R, CudaError>,
    ) -> Result<R, CudaError> {
        let mut guard = self.staging.buf.lock().unwrap_or_else(|e| e.into_inner());
        if guard.as_ref().is_none_or(|b| b.len() < len) {
            *guard = None;
            // Plain page-locked memory (not write-combined): the host reads it back.
            // SAFETY: the buffer is written before any of it is read (below).
            *guard = Some(unsafe { self.ctx.alloc_pinned_with_flags::<f32>(len.max(1), 0) }?);
        }
        let buf = guard.as_mut().expect("allocated above").as_mut_slice()?;
        f(&mut buf[..len])
    }

    /// Uploads the concatenation of `parts` (one device buffer of their total length).
    pub fn upload_parts(&self, parts: &[&[f32]]) -> Result<CudaSlice<f32>, CudaError> {
        let total: usize = parts.iter().map(|p| p.len()).sum();
        let mut dst = self.stream.alloc_zeros::<f32>(total.max(1))?;
        self.with_staging(total, |host| {
            scatter_parts(parts, host);
            let (ptr, _sync) = dst.device_ptr_mut(&self.stream);
            // SAFETY: `host` is page-locked and `total` floats long, `dst` holds at least as
            // many; the stream is synchronised before the staging buffer is released.
            unsafe { result::memcpy_htod_async(ptr, host, self.stream.cu_stream()) }?;
            self.stream.synchronize()?;
            Ok(())
        })?;
        Ok(dst)
    }

    /// Downloads `src` into `parts`, which cover its first elements in order.
    pub fn download_parts(
        &self,
        src: &CudaSlice<f32>,
        parts: &mut [&mut [f32]],
    ) -> Result<(), CudaError> {
        let total: usize = parts.iter().map(|p| p.len()).sum();
        if total > src.len() {
            return Err(CudaError::Shape(format!(
                "download_parts: {total} floats asked of a buffer of {}",
                src.len()
            )));
        }
        self.with_staging(total, |host| {
            let (ptr, _sync) = src.device_ptr(&self.stream);
            // SAFETY: `host` is page-locked and `total` floats long, within `src`; the stream is
            // synchronised before the host reads it.
            unsafe { result::memcpy_dtoh_async(host, ptr, self.stream.cu_stream()) }?;
            self.stream.synchronize()?;
            gather_parts(host, parts);
            Ok(())
        })
    }
}

fn scatter_parts(parts: &[&[f32]], host: &mut [f32]) {
    let mut chunks = Vec::with_capacity(parts.len());
    let mut rest = host;
    for p in parts {
        let (head, tail) = rest.split_at_mut(p.len());
        chunks.push((head, *p));
        rest = tail;
    }
    chunks.into_par_iter().for_each(|(dst, src)| copy(dst, src));
}

fn gather_parts(host: &[f32], parts: &mut [&mut [f32]]) {
    let mut pairs = Vec::with_capacity(parts.len());
    let mut rest = host;
    for p in parts.iter_mut() {
        let (head, tail) = rest.split_at(p.len());
        pairs.push((&mut **p, head));
        rest = tail;
    }
    pairs.into_par_iter().for_each(|(dst, src)| copy(dst, src));
}

/// A large copy split across threads.
fn copy(dst: &mut [f32], src: &[f32]) {
    if src.len() < PAR_MIN {
        dst.copy_from_slice(src);
    } else {
        dst.par_chunks_mut(PAR_MIN)
            .zip(src.par_chunks(PAR_MIN))
            .for_each(|(d, s)| d.copy_from_slice(s));
    }
}

/// Copies `len` bytes inside `buf` from byte `src` to byte `dst` (the ranges must not
/// overlap), in stream order.
pub fn copy_within(
    stream: &CudaStream,
    buf: &mut CudaSlice<u8>,
    src: usize,
    dst: usize,
    len: usize,
) -> Result<(), CudaError> {
    let end = src.max(dst) + len;
    if end > buf.len() || src.abs_diff(dst) < len {
        return Err(CudaError::Shape(format!(
            "copy_within: {len} B from {src} to {dst} in a buffer of {} B",
            buf.len()
        )));
    }
    let (base, _sync) = buf.device_ptr_mut(stream);
    // SAFETY: both ranges lie inside `buf` (checked above) and do not overlap; the copy is
    // queued on the stream that owns `buf`.
    unsafe {
        result::memcpy_dtod_async(
            base + dst as u64,
            base + src as u64,
            len,
            stream.cu_stream(),
        )
    }?;
    Ok(())
}
