//! MXFP4 codes as the device keeps them. A checkpoint packs eight E2M1 codes in a 32-bit word,
//! code k in bits 4k..4k+3 (mantissa bit, two exponent bits, then the sign). On the device the
//! bits of every word are permuted once, at upload, so that the kernels turn codes k and k + 4
//! into one bf16 pair with few instructions: code k's sign lands on bit 15 of the pair and its
//! three magnitude bits on bits 8..6 (the bf16's two lowest exponent bits and its first mantissa
//! bit), code k + 4's on bits 31 and 24..22, which makes each value 2^-126 of the code's (code 1,
//! 0.5, becomes the subnormal 2^-127). Pair 0 is then the word masked, pairs 1 and 2 the word
//! shifted left by 3 and 6 and masked, pair 3 three shifts and masks (`mxfp4_pairs` in
//! common.cuh); 11 operations per word instead of 15 from the checkpoint's order.

/// Bit positions of code k's [mantissa, low exponent, high exponent, sign] bits in a device word.
const PLACES: [[u32; 4]; 8] = [
    [6, 7, 8, 15],
    [3, 4, 5, 12],
    [0, 1, 2, 9],
    [10, 11, 13, 14],
    [22, 23, 24, 31],
    [19, 20, 21, 28],
    [16, 17, 18, 25],
    [26, 27, 29, 30],
];

/// One checkpoint word of eight codes in the device's bit order.
pub fn mxfp4_device_word(w: u32) -> u32 {
    let mut out = 0u32;
    for (k, places) in PLACES.iter().enumerate() {
        for (bit, &at) in places.iter().enumerate() {
            out |= ((w >> (4 * k + bit)) & 1) << at;
        }
    }
    out
}

/// Packed codes in the device's bit order, word by word (rows of `in_dim / 2` bytes are whole
/// words: the kernels take `in_dim` in multiples of 32). Bytes past the last whole word, which no
/// kernel reads, are copied as they are.
pub fn mxfp4_device_codes(packed: &[u8]) -> Vec<u8> {
    let words = packed.chunks_exact(4);
    let tail = words.remainder();
    let mut out: Vec<u8> = words
        .flat_map(|c| {
            let w = u32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            mxfp4_device_word(w).to_le_bytes()
        })
        .collect();
    out.extend_from_slice(tail);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The device's decode of one word (`mxfp4_pairs` in common.cuh), on the host.
    fn pairs(w: u32) -> [u32; 4] {
        let m = 0x81c0_81c0u32;
        [
            w & m,
            (w << 3) & m,
            (w << 6) & m,
            ((w << 1) & 0x8000_8000) | ((w >> 5) & 0x0100_0100) | ((w >> 4) & 0x00c0_00c0),
        ]
    }

    /// bf16 bits of 2^-126 times the E2M1 value of `code`.
    fn scaled_bf16(code: u32) -> u32 {
        let mag = [0.0f32, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0][(code & 7) as usize];
        let v = if code & 8 != 0 { -mag } else { mag } * 2f32.powi(-126);
        v.to_bits() >> 16
    }

    #[test]
    fn every_position_is_taken_once() {
        let mut seen = 0u64;
        for p in PLACES.iter().flatten() {
            assert_eq!(seen & (1 << p), 0, "bit {p} twice");
            seen |= 1 << p;
        }
        assert_eq!(seen, 0xffff_ffff);
    }

    #[test]
    fn the_device_decode_gives_codes_k_and_k_plus_4_at_2_to_the_minus_126() {
        // Every code in every place, then random words.
        let mut words: Vec<u32> = (0..16u32)
            .flat_map(|c| (0..8).map(move |k| c << (4 * k)))
            .collect();
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        for _ in 0..10_000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            words.push(x as u32);
        }
        for w in words {
            for (k, pair) in pairs(mxfp4_device_word(w)).into_iter().enumerate() {
                let (lo, hi) = ((w >> (4 * k)) & 15, (w >> (4 * k + 16)) & 15);
                assert_eq!(pair & 0xffff, scaled_bf16(lo), "word {w:#x} code {k}");
                assert_eq!(pair >> 16, scaled_bf16(hi), "word {w:#x} code {}", k + 4);
            }
        }
    }

    #[test]
    fn bytes_are_rearranged_word_by_word() {
        let packed: Vec<u8> = (0..32u8).map(|i| i.wrapping_mul(37)).collect();
        let dev = mxfp4_device_codes(&packed);
        assert_eq!(dev.len(), packed.len());
        for (c, d) in packed.chunks(4).zip(dev.chunks(4)) {
            let w = u32::from_le_bytes(c.try_into().unwrap());
            assert_eq!(
                u32::from_le_bytes(d.try_into().unwrap()),
                mxfp4_device_word(w)
            );
        }
    }
}
