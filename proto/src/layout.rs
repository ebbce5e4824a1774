//! Checks that two workers agree on the page layout before any page moves between them.

use crate::v1::{Dtype, PageLayoutDescriptor};

impl Dtype {
    /// Bytes per element; `None` for [`Dtype::Unspecified`].
    pub fn size_bytes(self) -> Option<usize> {
        match self {
            Dtype::Unspecified => None,
            Dtype::F32 => Some(4),
            Dtype::Bf16 | Dtype::F16 => Some(2),
            Dtype::Fp8E4m3 => Some(1),
        }
    }
}

impl PageLayoutDescriptor {
    /// The first field in which `self` (here) and `peer` (there) disagree, as
    /// `"field: <here> here, <peer> there"`; `None` when they are compatible. Every field but
    /// `parents` must be equal (`parents` follows each worker's memory budget).
    pub fn mismatch(&self, peer: &PageLayoutDescriptor) -> Option<String> {
        macro_rules! same {
            ($($field:ident).+) => {
                if self.$($field).+ != peer.$($field).+ {
                    return Some(format!(
                        "{}: {:?} here, {:?} there",
                        stringify!($($field).+),
                        self.$($field).+,
                        peer.$($field).+
                    ));
                }
            };
        }
        same!(layout_version);
        same!(page_tokens);
        same!(planes);
        same!(plane_bytes);
        same!(max_pages_per_parent);
        if self.groups.len() != peer.groups.len() {
            return Some(format!(
                "groups: {} here, {} there",
                self.groups.len(),
                peer.groups.len()
            ));
        }
        for (i, (a, b)) in self.groups.iter().zip(&peer.groups).enumerate() {
            if a != b {
                return Some(format!("groups[{i}]: {a:?} here, {b:?} there"));
            }
        }
        same!(dims);
        if self.latent_dtype() != peer.latent_dtype() {
            return Some(format!(
                "latent_dtype: {:?} here, {:?} there",
                self.latent_dtype(),
                peer.latent_dtype()
            ));
        }
        if self.conv_dtype() != peer.conv_dtype() {
            return Some(format!(
                "conv_dtype: {:?} here, {:?} there",
                self.conv_dtype(),
                peer.conv_dtype()
            ));
        }
        if self.recurrent_dtype() != peer.recurrent_dtype() {
            return Some(format!(
                "recurrent_dtype: {:?} here, {:?} there",
                self.recurrent_dtype(),
                peer.recurrent_dtype()
            ));
        }
        None
    }
}
