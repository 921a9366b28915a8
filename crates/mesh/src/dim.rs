//! Naming a mesh dimension by index or by name.

use std::fmt;

/// A reference to one mesh dimension: by its index or by its name.
///
/// Every [`DeviceMesh`](crate::DeviceMesh) method that takes a dimension accepts
/// `impl Into<DimRef>`, so both `mesh.size(1)` and `mesh.size("dp_shard")` work.
///
/// ```
/// use hypershard_mesh::DimRef;
///
/// assert_eq!(DimRef::from(1), DimRef::Index(1));
/// assert_eq!(DimRef::from("dp_shard"), DimRef::Name("dp_shard"));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DimRef<'a> {
    /// The dimension at this index (0 is the outermost, slowest-varying dimension).
    Index(usize),
    /// The dimension with this name.
    Name(&'a str),
}

impl From<usize> for DimRef<'_> {
    fn from(index: usize) -> Self {
        DimRef::Index(index)
    }
}

impl<'a> From<&'a str> for DimRef<'a> {
    fn from(name: &'a str) -> Self {
        DimRef::Name(name)
    }
}

impl<'a> From<&'a String> for DimRef<'a> {
    fn from(name: &'a String) -> Self {
        DimRef::Name(name.as_str())
    }
}

impl<'a, 'b> From<&'b DimRef<'a>> for DimRef<'a> {
    fn from(dim: &'b DimRef<'a>) -> Self {
        *dim
    }
}

impl<'a, 'b> From<&'b &'a str> for DimRef<'a> {
    fn from(name: &'b &'a str) -> Self {
        DimRef::Name(name)
    }
}

impl From<&usize> for DimRef<'_> {
    fn from(index: &usize) -> Self {
        DimRef::Index(*index)
    }
}

impl fmt::Display for DimRef<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DimRef::Index(index) => write!(f, "{index}"),
            DimRef::Name(name) => write!(f, "{name:?}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn conversions_keep_index_and_name() {
        let owned = String::from("tp");
        assert_eq!(DimRef::from(3), DimRef::Index(3));
        assert_eq!(DimRef::from(&3), DimRef::Index(3));
        assert_eq!(DimRef::from("dp"), DimRef::Name("dp"));
        assert_eq!(DimRef::from(&"dp"), DimRef::Name("dp"));
        assert_eq!(DimRef::from(&owned), DimRef::Name("tp"));
        assert_eq!(DimRef::from(&DimRef::Index(2)), DimRef::Index(2));
    }

    #[test]
    fn display_quotes_names_only() {
        assert_eq!(DimRef::Index(2).to_string(), "2");
        assert_eq!(DimRef::Name("dp").to_string(), "\"dp\"");
    }
}
