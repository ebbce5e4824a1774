//! Checks a batch before any byte moves, and spreads it over connections.

use std::sync::Arc;

use crate::region::{ExtentRef, Incarnation, RegionHandle, RegionId, RegionTable};
use crate::{RegionDescriptor, TransferError, WriteBatch};

/// The source side of one extent, ready to send.
pub(crate) struct Source<'a> {
    /// Position in the batch (reported back in `ChecksumMismatch`).
    pub index: u32,
    pub bytes: &'a [u8],
    pub dst_offset: u64,
}

/// The source side of one extent, ready to send, with a shared lease on its bytes: whoever
/// holds a clone of `bytes` (a part task, a UCX put) keeps them until it is done.
pub(crate) struct LeasedSource {
    /// Position in the batch (reported back in `ChecksumMismatch`).
    pub index: u32,
    /// The registered region the bytes lie in (`None` for a staged copy).
    #[cfg_attr(not(feature = "ucx"), allow(dead_code))]
    pub region: Option<RegionId>,
    pub bytes: Arc<ExtentRef>,
    pub dst_offset: u64,
}

/// Checks that every extent fits its destination, that destination extents do not overlap, and
/// takes shared leases on the source extents (held for the whole write, retries included).
pub(crate) fn lease_sources(
    regions: &RegionTable,
    batch: &WriteBatch,
) -> Result<Vec<LeasedSource>, TransferError> {
    if u32::try_from(batch.extents.len()).is_err() {
        return Err(TransferError::BadRegion(
            "too many extents in one batch".into(),
        ));
    }
    let mut dst: Vec<(u64, u64)> = Vec::with_capacity(batch.extents.len());
    let mut leases = Vec::with_capacity(batch.extents.len());
    for (i, e) in batch.extents.iter().enumerate() {
        check_dst(batch.dst_region.len, e.dst_offset, e.len, i)?;
        dst.push((e.dst_offset, e.dst_offset + e.len));
        let region = regions.get(e.src_region).ok_or_else(|| {
            TransferError::BadRegion(format!(
                "source region {:?} of extent {i} is not registered",
                e.src_region
            ))
        })?;
        let start = usize::try_from(e.src_offset).unwrap_or(usize::MAX);
        let end = start.saturating_add(usize::try_from(e.len).unwrap_or(usize::MAX));
        leases.push(LeasedSource {
            index: i as u32,
            region: Some(e.src_region),
            bytes: Arc::new(region.try_read(start..end)?),
            dst_offset: e.dst_offset,
        });
    }
    check_disjoint(&mut dst)?;
    Ok(leases)
}

/// Refuses a write into `dst` when the peer it goes to (of incarnation `peer`) is not the
/// incarnation that registered the region.
pub(crate) fn check_incarnation(
    dst: &RegionDescriptor,
    peer: Incarnation,
) -> Result<(), TransferError> {
    if dst.incarnation != peer {
        return Err(TransferError::IncarnationMismatch {
            expected: dst.incarnation,
            found: peer,
        });
    }
    Ok(())
}

/// Checks that `bytes` fit at `dst_offset` of `dst` and copies them once into a transient
/// region, for backends whose sending tasks must own their source: the one extent of a
/// `write_bytes`.
pub(crate) fn stage(
    dst: &RegionDescriptor,
    dst_offset: u64,
    bytes: &[u8],
) -> Result<LeasedSource, TransferError> {
    check_dst(dst.len, dst_offset, bytes.len() as u64, 0)?;
    Ok(LeasedSource {
        index: 0,
        region: None,
        bytes: Arc::new(RegionHandle::from_bytes(bytes).try_read(0..bytes.len())?),
        dst_offset,
    })
}

pub(crate) fn check_dst(
    region_len: u64,
    offset: u64,
    len: u64,
    index: usize,
) -> Result<(), TransferError> {
    match offset.checked_add(len) {
        Some(end) if end <= region_len => Ok(()),
        _ => Err(TransferError::BadRegion(format!(
            "extent {index} ({offset}+{len}) is outside the destination region of {region_len} bytes"
        ))),
    }
}

fn check_disjoint(ranges: &mut Vec<(u64, u64)>) -> Result<(), TransferError> {
    // Empty extents overlap nothing; among the rest, sorted by start, any overlap shows between
    // neighbours.
    ranges.retain(|r| r.0 < r.1);
    ranges.sort_unstable();
    for w in ranges.windows(2) {
        if w[0].1 > w[1].0 {
            return Err(TransferError::BadRegion(format!(
                "destination extents overlap at byte {}",
                w[1].0
            )));
        }
    }
    Ok(())
}

/// Spreads extents (given by their lengths) over at most `parts` groups of about equal bytes,
/// largest first; each group lists extent indices in increasing order. Never returns an empty
/// list of groups (an empty batch still needs one part to carry its completion).
pub(crate) fn split(lens: &[u64], parts: usize) -> Vec<Vec<usize>> {
    let n = parts.clamp(1, lens.len().max(1));
    let mut order: Vec<usize> = (0..lens.len()).collect();
    order.sort_by_key(|&i| std::cmp::Reverse(lens[i]));
    let mut groups: Vec<(u64, Vec<usize>)> = vec![(0, Vec::new()); n];
    for i in order {
        let g = groups
            .iter_mut()
            .min_by_key(|(bytes, _)| *bytes)
            .expect("at least one group");
        g.0 += lens[i];
        g.1.push(i);
    }
    let mut out: Vec<Vec<usize>> = groups
        .into_iter()
        .map(|(_, mut g)| {
            g.sort_unstable();
            g
        })
        .filter(|g| !g.is_empty())
        .collect();
    if out.is_empty() {
        out.push(Vec::new());
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_balances_bytes() {
        let g = split(&[10, 10, 10, 10, 10, 10, 10, 10], 4);
        assert_eq!(g.len(), 4);
        assert!(g.iter().all(|p| p.len() == 2));
        let g = split(&[100, 1, 1, 1], 2);
        assert_eq!(g, vec![vec![0], vec![1, 2, 3]]);
        assert_eq!(split(&[], 4), vec![Vec::<usize>::new()]);
        assert_eq!(split(&[5], 4), vec![vec![0]]);
    }

    #[test]
    fn overlapping_destinations_are_refused() {
        assert!(check_disjoint(&mut vec![(0, 10), (10, 20)]).is_ok());
        assert!(check_disjoint(&mut vec![(0, 10), (9, 20)]).is_err());
        assert!(check_disjoint(&mut vec![(5, 5), (0, 10)]).is_ok());
        assert!(check_disjoint(&mut vec![(0, 10), (5, 5), (6, 8)]).is_err());
    }
}
