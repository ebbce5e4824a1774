//! The scratch of the KDA chunked prefill: the prep's per-chunk products, which the scan reads.

use cudarc::driver::CudaSlice;

use super::kda::shape_err;
use super::kda_segmented::KdaSegmentedPrefill;
use super::model_ops::{base_ptr, Arg, DevPtr};
use super::{CudaDevice, CudaError};
use crate::gpu::{KdaShape, CHUNK};

/// Scratch of the chunked prefill: the prep's per-chunk products, `[head][chunk]`, for a number
/// of chunks and heads (reuse it across calls that fit).
pub struct KdaPrefillWorkspace {
    pub(super) chunks: usize,
    pub(super) heads: usize,
    pub(super) dk: usize,
    pub(super) dv: usize,
    pub(super) w: CudaSlice<u16>,
    pub(super) u: CudaSlice<u16>,
    pub(super) qg: CudaSlice<u16>,
    pub(super) kg: CudaSlice<u16>,
    pub(super) aqk: CudaSlice<u16>,
    pub(super) egl: CudaSlice<f32>,
    /// For a uniform batch ([`Self::new`]): its shape and sequence tables on the device.
    pub(super) batch: Option<(KdaShape, BatchTables)>,
    /// For a uniform batch of one long sequence: its segments, made at the first call.
    pub(super) segmented: Option<KdaSegmentedPrefill>,
}

/// A uniform batch's [`crate::gpu::KdaSequenceTables`] on the device.
pub(super) struct BatchTables {
    pub(super) seq_start: CudaSlice<i32>,
    pub(super) chunk_start: CudaSlice<i32>,
    pub(super) state_off: CudaSlice<i64>,
}

impl KdaPrefillWorkspace {
    /// A workspace for calls of one uniform batch shape ([`KdaKernels::prefill`]).
    pub fn new(dev: &CudaDevice, shape: KdaShape) -> Result<Self, CudaError> {
        let t = shape.tables();
        let mut ws = Self::packed(
            dev,
            shape.batch * shape.chunks(),
            shape.heads,
            shape.dk,
            shape.dv,
        )?;
        let tables = BatchTables {
            seq_start: dev.upload(&t.seq_start)?,
            chunk_start: dev.upload(&t.chunk_start)?,
            state_off: dev.upload(&t.state_off)?,
        };
        ws.batch = Some((shape, tables));
        Ok(ws)
    }

    /// A workspace for packed calls ([`KdaKernels::prefill_packed`]) of up to `chunks` chunks
    /// over `heads` heads. Uninitialised: the prep writes every product before the scan reads it.
    pub fn packed(
        dev: &CudaDevice,
        chunks: usize,
        heads: usize,
        dk: usize,
        dv: usize,
    ) -> Result<Self, CudaError> {
        let n = (chunks * heads).max(1);
        let s = dev.stream();
        // SAFETY: plain numbers; every element the scan reads was written by the prep first.
        unsafe {
            Ok(KdaPrefillWorkspace {
                chunks,
                heads,
                dk,
                dv,
                w: s.alloc(n * CHUNK * dk)?,
                u: s.alloc(n * CHUNK * dv)?,
                qg: s.alloc(n * CHUNK * dk)?,
                kg: s.alloc(n * CHUNK * dk)?,
                aqk: s.alloc(n * CHUNK * CHUNK)?,
                egl: s.alloc(n * dk)?,
                batch: None,
                segmented: None,
            })
        }
    }

    /// Device bytes this workspace holds.
    pub fn bytes(&self) -> usize {
        2 * (self.w.len() + self.u.len() + self.qg.len() + self.kg.len() + self.aqk.len())
            + 4 * self.egl.len()
    }

    /// The prep's outputs and the scan's inputs, in the kernels' parameter order.
    pub(super) fn products(&self, dev: &CudaDevice) -> [Arg; 6] {
        self.product_ptrs(dev).map(Arg::P)
    }

    /// The addresses of [`Self::products`]: w, u, q·exp(gc), k·exp(gc_last − gc), Aqk, exp(gc_last).
    pub(super) fn product_ptrs(&self, dev: &CudaDevice) -> [DevPtr; 6] {
        let s = dev.stream();
        [
            base_ptr(s, &self.w),
            base_ptr(s, &self.u),
            base_ptr(s, &self.qg),
            base_ptr(s, &self.kg),
            base_ptr(s, &self.aqk),
            base_ptr(s, &self.egl),
        ]
    }

    /// Token rows each product holds (chunks × heads × the chunk length).
    pub(super) fn rows(&self) -> usize {
        self.w.len() / self.dk
    }

    pub(super) fn dk(&self) -> usize {
        self.dk
    }

    pub(super) fn dv(&self) -> usize {
        self.dv
    }

    /// The uniform batch's shape and tables, checked against a call's shape.
    pub(super) fn batch_for(&self, shape: &KdaShape) -> Result<&BatchTables, CudaError> {
        match &self.batch {
            Some((s, t)) if s == shape => Ok(t),
            Some((s, _)) => Err(shape_err(format!(
                "workspace is for {s:?}, call is {shape:?}"
            ))),
            None => Err(shape_err(
                "a packed workspace was passed to a batch call".into(),
            )),
        }
    }
}
