//! [`PrefixStore`]: a namespace inside another store.

use std::sync::Arc;
use std::time::Duration;

use super::Store;
use crate::error::Result;

/// A view of `inner` in which every key is stored as `"{prefix}/{key}"`, so that independent
/// groups (a sub-communicator, a second job phase) can reuse key names without clashing.
///
/// [`Store::num_keys`] counts the keys of the whole underlying store, as PyTorch's
/// `PrefixStore` does: counting by prefix would need a scan no store offers.
#[derive(Clone)]
pub struct PrefixStore {
    prefix: String,
    inner: Arc<dyn Store>,
}

impl PrefixStore {
    /// A namespace `prefix` inside `inner`.
    pub fn new(prefix: impl Into<String>, inner: Arc<dyn Store>) -> Self {
        PrefixStore {
            prefix: prefix.into(),
            inner,
        }
    }

    /// The prefix (without the separating `/`).
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    fn key(&self, key: &str) -> String {
        format!("{}/{}", self.prefix, key)
    }
}

impl std::fmt::Debug for PrefixStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PrefixStore")
            .field("prefix", &self.prefix)
            .finish_non_exhaustive()
    }
}

impl Store for PrefixStore {
    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        self.inner.set(&self.key(key), value)
    }

    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        self.inner.get(&self.key(key), timeout)
    }

    fn wait(&self, keys: &[&str], timeout: Duration) -> Result<()> {
        let full: Vec<String> = keys.iter().map(|k| self.key(k)).collect();
        let refs: Vec<&str> = full.iter().map(String::as_str).collect();
        self.inner.wait(&refs, timeout)
    }

    fn check(&self, keys: &[&str]) -> Result<bool> {
        let full: Vec<String> = keys.iter().map(|k| self.key(k)).collect();
        let refs: Vec<&str> = full.iter().map(String::as_str).collect();
        self.inner.check(&refs)
    }

    fn add(&self, key: &str, delta: i64) -> Result<i64> {
        self.inner.add(&self.key(key), delta)
    }

    fn compare_set(&self, key: &str, expected: &[u8], desired: &[u8]) -> Result<Vec<u8>> {
        self.inner.compare_set(&self.key(key), expected, desired)
    }

    fn delete(&self, key: &str) -> Result<bool> {
        self.inner.delete(&self.key(key))
    }

    fn num_keys(&self) -> Result<usize> {
        self.inner.num_keys()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rendezvous::MemoryStore;

    #[test]
    fn keys_are_namespaced() {
        let base = Arc::new(MemoryStore::new());
        let a = PrefixStore::new("a", base.clone());
        let b = PrefixStore::new("b", base.clone());
        a.set("k", b"1").unwrap();
        b.set("k", b"2").unwrap();
        assert_eq!(a.get("k", Duration::from_secs(1)).unwrap(), b"1");
        assert_eq!(b.get("k", Duration::from_secs(1)).unwrap(), b"2");
        assert_eq!(base.get("a/k", Duration::from_secs(1)).unwrap(), b"1");
        assert_eq!(a.add("n", 5).unwrap(), 5);
        assert!(a.check(&["k", "n"]).unwrap());
        assert!(!b.check(&["n"]).unwrap());
        assert!(a.delete("k").unwrap());
        assert!(!a.delete("k").unwrap());
        assert_eq!(
            a.num_keys().unwrap(),
            2,
            "b/k and a/n remain in the base store"
        );
        assert_eq!(a.compare_set("c", b"", b"x").unwrap(), b"x");
        assert_eq!(base.get("a/c", Duration::from_secs(1)).unwrap(), b"x");
        a.wait(&["c"], Duration::from_millis(10)).unwrap();
    }
}
