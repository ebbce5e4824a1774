//! The page arena in device memory: the serving path's home for every sequence's state when the
//! model runs on a GPU. The pool's bookkeeping stays on the host; zeroing and copy-on-write copies
//! are queued on the model's stream (so they order with the forward passes), and byte reads and
//! writes (transfers between workers) copy through the host.

use std::sync::Arc;

use tessera_kernels::cuda::{base_ptr, copy_within, CudaDevice, CudaSlice, CudaStream};

use crate::kv::{KvArena, KvError};

pub(crate) struct DeviceArena {
    /// The model's stream: every arena operation is ordered with the forward passes.
    stream: Arc<CudaStream>,
    buf: CudaSlice<u8>,
    ordinal: usize,
}

fn device_err(what: &str, e: impl std::fmt::Display) -> KvError {
    KvError::Device(format!("{what}: {e}"))
}

impl DeviceArena {
    /// A zeroed arena of `bytes` on the model's device.
    pub(crate) fn new(dev: &CudaDevice, ordinal: usize, bytes: usize) -> Result<Self, KvError> {
        let stream = dev.stream().clone();
        let buf = stream
            .alloc_zeros::<u8>(bytes.max(4))
            .map_err(|e| device_err(&format!("allocating a {bytes} B page arena"), e))?;
        Ok(DeviceArena {
            stream,
            buf,
            ordinal,
        })
    }

    fn check(&self, offset: usize, len: usize) -> Result<(), KvError> {
        if offset + len > self.buf.len() {
            return Err(KvError::Device(format!(
                "{len} B at {offset} is outside the {} B arena",
                self.buf.len()
            )));
        }
        Ok(())
    }
}

impl KvArena for DeviceArena {
    fn len_bytes(&self) -> usize {
        self.buf.len()
    }

    fn zero(&mut self, offset: usize, len: usize) -> Result<(), KvError> {
        self.check(offset, len)?;
        let mut view = self.buf.slice_mut(offset..offset + len);
        self.stream
            .memset_zeros(&mut view)
            .map_err(|e| device_err("zeroing a page", e))
    }

    fn copy(&mut self, src: usize, dst: usize, len: usize) -> Result<(), KvError> {
        copy_within(&self.stream, &mut self.buf, src, dst, len)
            .map_err(|e| device_err("copying a page", e))
    }

    fn read(&self, offset: usize, out: &mut [u8]) -> Result<(), KvError> {
        self.check(offset, out.len())?;
        let view = self.buf.slice(offset..offset + out.len());
        self.stream
            .memcpy_dtoh(&view, out)
            .and_then(|_| self.stream.synchronize())
            .map_err(|e| device_err("reading pages", e))
    }

    fn write(&mut self, offset: usize, bytes: &[u8]) -> Result<(), KvError> {
        self.check(offset, bytes.len())?;
        let mut view = self.buf.slice_mut(offset..offset + bytes.len());
        self.stream
            .memcpy_htod(bytes, &mut view)
            .and_then(|_| self.stream.synchronize())
            .map_err(|e| device_err("writing pages", e))
    }

    fn device(&self) -> Option<(usize, u64)> {
        Some((self.ordinal, base_ptr(&self.stream, &self.buf)))
    }
}
