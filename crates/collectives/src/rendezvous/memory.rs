//! [`MemoryStore`]: a store for ranks that are threads of one process.

use std::collections::HashMap;
use std::sync::{Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use super::Store;
use crate::error::{Error, Result};

/// An in-memory [`Store`]. Share it between threads behind an `Arc`; waiters sleep on a
/// condition variable that every write notifies.
#[derive(Debug, Default)]
pub struct MemoryStore {
    map: Mutex<HashMap<String, Vec<u8>>>,
    changed: Condvar,
}

impl MemoryStore {
    /// An empty store.
    pub fn new() -> Self {
        MemoryStore::default()
    }

    /// Locks the map. A poisoned lock only means another thread panicked mid-operation; every
    /// operation leaves the map consistent at each step, so the poison is ignored.
    fn lock(&self) -> MutexGuard<'_, HashMap<String, Vec<u8>>> {
        self.map.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Waits until every key is present, returning the locked map.
    fn wait_locked(
        &self,
        keys: &[&str],
        timeout: Duration,
    ) -> Result<MutexGuard<'_, HashMap<String, Vec<u8>>>> {
        let deadline = Instant::now() + timeout;
        let mut map = self.lock();
        loop {
            let missing: Vec<String> = keys
                .iter()
                .filter(|k| !map.contains_key(**k))
                .map(|k| k.to_string())
                .collect();
            if missing.is_empty() {
                return Ok(map);
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(Error::StoreTimeout {
                    keys: missing,
                    after: timeout,
                });
            }
            map = self
                .changed
                .wait_timeout(map, left)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
    }
}

/// Parses a counter value; `None` when it is not a decimal `i64`.
pub(crate) fn parse_counter(value: &[u8]) -> Option<i64> {
    std::str::from_utf8(value).ok()?.parse().ok()
}

impl Store for MemoryStore {
    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        self.lock().insert(key.to_string(), value.to_vec());
        self.changed.notify_all();
        Ok(())
    }

    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        let map = self.wait_locked(&[key], timeout)?;
        // invariant: wait_locked returned Ok, so the key is present under this same lock.
        Ok(map.get(key).cloned().unwrap_or_default())
    }

    fn wait(&self, keys: &[&str], timeout: Duration) -> Result<()> {
        self.wait_locked(keys, timeout).map(drop)
    }

    fn check(&self, keys: &[&str]) -> Result<bool> {
        let map = self.lock();
        Ok(keys.iter().all(|k| map.contains_key(*k)))
    }

    fn add(&self, key: &str, delta: i64) -> Result<i64> {
        let mut map = self.lock();
        let current = match map.get(key) {
            None => 0,
            Some(value) => parse_counter(value).ok_or_else(|| Error::StoreNotACounter {
                key: key.to_string(),
            })?,
        };
        let new = current.wrapping_add(delta);
        map.insert(key.to_string(), new.to_string().into_bytes());
        drop(map);
        self.changed.notify_all();
        Ok(new)
    }

    fn compare_set(&self, key: &str, expected: &[u8], desired: &[u8]) -> Result<Vec<u8>> {
        let mut map = self.lock();
        let swap = match map.get(key) {
            None => expected.is_empty(),
            Some(current) => current.as_slice() == expected,
        };
        if swap {
            map.insert(key.to_string(), desired.to_vec());
            drop(map);
            self.changed.notify_all();
            return Ok(desired.to_vec());
        }
        Ok(map.get(key).cloned().unwrap_or_default())
    }

    fn delete(&self, key: &str) -> Result<bool> {
        Ok(self.lock().remove(key).is_some())
    }

    fn num_keys(&self) -> Result<usize> {
        Ok(self.lock().len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::thread;

    #[test]
    fn set_get_delete_count() {
        let store = MemoryStore::new();
        store.set("a", b"hello").unwrap();
        assert_eq!(store.get("a", Duration::ZERO).unwrap(), b"hello");
        assert_eq!(store.num_keys().unwrap(), 1);
        assert!(store.delete("a").unwrap());
        assert!(!store.delete("a").unwrap());
        assert_eq!(store.num_keys().unwrap(), 0);
    }

    #[test]
    fn get_waits_for_a_writer_thread() {
        let store = Arc::new(MemoryStore::new());
        let writer = {
            let store = store.clone();
            thread::spawn(move || {
                thread::sleep(Duration::from_millis(20));
                store.set("late", b"v").unwrap();
            })
        };
        assert_eq!(store.get("late", Duration::from_secs(5)).unwrap(), b"v");
        writer.join().unwrap();
    }

    #[test]
    fn wait_times_out_naming_the_missing_keys() {
        let store = MemoryStore::new();
        store.set("here", b"").unwrap();
        match store.wait(&["here", "absent"], Duration::from_millis(20)) {
            Err(Error::StoreTimeout { keys, after }) => {
                assert_eq!(keys, vec!["absent".to_string()]);
                assert_eq!(after, Duration::from_millis(20));
            }
            other => panic!("expected StoreTimeout, got {other:?}"),
        }
    }

    #[test]
    fn add_counts_across_threads() {
        let store = Arc::new(MemoryStore::new());
        let handles: Vec<_> = (0..8)
            .map(|_| {
                let store = store.clone();
                thread::spawn(move || {
                    for _ in 0..100 {
                        store.add("n", 1).unwrap();
                    }
                })
            })
            .collect();
        for handle in handles {
            handle.join().unwrap();
        }
        assert_eq!(store.add("n", 0).unwrap(), 800);
        assert_eq!(store.get("n", Duration::ZERO).unwrap(), b"800");
        store.set("text", b"abc").unwrap();
        assert!(matches!(
            store.add("text", 1),
            Err(Error::StoreNotACounter { key }) if key == "text"
        ));
    }

    #[test]
    fn compare_set_follows_torch() {
        let store = MemoryStore::new();
        // Missing key and non-empty expectation: no swap, the (empty) current value comes back.
        assert_eq!(store.compare_set("k", b"x", b"y").unwrap(), b"");
        assert!(!store.check(&["k"]).unwrap());
        // Missing key and empty expectation: set.
        assert_eq!(store.compare_set("k", b"", b"first").unwrap(), b"first");
        // Wrong expectation: the current value comes back unchanged.
        assert_eq!(
            store.compare_set("k", b"other", b"second").unwrap(),
            b"first"
        );
        // Right expectation: swapped.
        assert_eq!(
            store.compare_set("k", b"first", b"second").unwrap(),
            b"second"
        );
    }
}
