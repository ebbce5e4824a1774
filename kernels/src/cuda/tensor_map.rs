//! Tensor maps for the copy engine (TMA, `sm_90`): the descriptor a kernel receives by value
//! (`const __grid_constant__ TensorMap` in `tma.cuh`) and its encoding.

use cudarc::driver::sys::{
    cuTensorMapEncodeTiled, CUtensorMap, CUtensorMapDataType, CUtensorMapFloatOOBfill,
    CUtensorMapInterleave, CUtensorMapL2promotion, CUtensorMapSwizzle,
};

use super::CudaError;

/// A CUtensorMap passed by value to a kernel.
#[repr(transparent)]
pub(crate) struct TensorMapArg(CUtensorMap);

// SAFETY: a plain 128-byte descriptor the driver copies into the kernel's parameters.
unsafe impl cudarc::driver::DeviceRepr for TensorMapArg {}

/// The tiled map of a tensor at device address `ptr`: `dims` and `boxes` innermost first,
/// `strides` in bytes for every dimension but the innermost; elements are read one by one
/// (no element strides) and nothing is filled out of bounds but zeros.
pub(crate) fn tiled(
    data_type: CUtensorMapDataType,
    ptr: u64,
    dims: &[u64],
    strides: &[u64],
    boxes: &[u32],
    swizzle: CUtensorMapSwizzle,
) -> Result<TensorMapArg, CudaError> {
    let rank = dims.len();
    if !(1..=5).contains(&rank) || strides.len() + 1 != rank || boxes.len() != rank {
        return Err(CudaError::Shape(format!(
            "tensor map: {rank} dims, {} strides, {} boxes",
            strides.len(),
            boxes.len()
        )));
    }
    let steps = [1u32; 5];
    let mut map = std::mem::MaybeUninit::<CUtensorMap>::zeroed();
    // SAFETY: dims, boxes and steps hold `rank` values and strides `rank - 1` (checked above);
    // the map is written in place.
    unsafe {
        cuTensorMapEncodeTiled(
            map.as_mut_ptr(),
            data_type,
            rank as u32,
            ptr as *mut std::ffi::c_void,
            dims.as_ptr(),
            strides.as_ptr(),
            boxes.as_ptr(),
            steps.as_ptr(),
            CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
            swizzle,
            CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        )
        .result()?;
        Ok(TensorMapArg(map.assume_init()))
    }
}

#[cfg(test)]
mod tests {
    use super::tiled;
    use crate::cuda::CudaError;
    use cudarc::driver::sys::{CUtensorMapDataType, CUtensorMapSwizzle};

    #[test]
    fn mismatched_ranks_are_refused_before_the_driver_is_asked() {
        let t = CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_UINT16;
        let none = CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_NONE;
        let cases: [(&[u64], &[u64], &[u32]); 4] = [
            (&[8, 64, 72], &[1152], &[8, 32, 72]),
            (&[8, 64], &[1152], &[8, 32, 72]),
            (&[], &[], &[]),
            (&[1; 6], &[16; 5], &[1; 6]),
        ];
        for (dims, strides, boxes) in cases {
            match tiled(t, 0, dims, strides, boxes, none) {
                Err(CudaError::Shape(msg)) => assert!(msg.contains("tensor map"), "{msg}"),
                Err(e) => panic!("{dims:?}: {e}"),
                Ok(_) => panic!("{dims:?}: accepted"),
            }
        }
    }
}
