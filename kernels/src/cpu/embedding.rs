//! Embedding lookup (row gather).

use super::KernelError;

/// out[i, :] = table[ids[i], :] for a table [vocab, dim]; out [ids.len(), dim].
/// Fails without writing anything if any id is out of range.
pub fn embedding(
    table: &[f32],
    dim: usize,
    ids: &[u32],
    out: &mut [f32],
) -> Result<(), KernelError> {
    assert!(dim > 0, "embedding: dim must be > 0");
    assert_eq!(
        table.len() % dim,
        0,
        "embedding: table not a multiple of dim"
    );
    assert_eq!(out.len(), ids.len() * dim, "embedding: out shape");
    let vocab = table.len() / dim;
    if let Some(&id) = ids.iter().find(|&&id| id as usize >= vocab) {
        return Err(KernelError::TokenOutOfRange { id, vocab });
    }
    for (o, &id) in out.chunks_exact_mut(dim).zip(ids) {
        o.copy_from_slice(&table[id as usize * dim..(id as usize + 1) * dim]);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gathers_rows_and_rejects_bad_ids() {
        let table: Vec<f32> = (0..12).map(|v| v as f32).collect(); // vocab 4, dim 3
        let mut out = vec![0.0; 6];
        embedding(&table, 3, &[3, 1], &mut out).unwrap();
        assert_eq!(out, vec![9.0, 10.0, 11.0, 3.0, 4.0, 5.0]);
        let err = embedding(&table, 3, &[0, 4], &mut out).unwrap_err();
        assert_eq!(err, KernelError::TokenOutOfRange { id: 4, vocab: 4 });
        assert_eq!(
            err.to_string(),
            "token id 4 out of range for vocabulary of 4"
        );
    }
}
