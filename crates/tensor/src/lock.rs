//! Taking the locks of two storages in one global order, so that no two operations can wait
//! on each other (lock-order deadlock).

use std::sync::{Arc, RwLockReadGuard, RwLockWriteGuard};

use crate::storage::{SharedStorage, Storage};

/// A read guard on `src` and a write guard on `dst`, which must be distinct storages.
pub(crate) struct ReadWrite<'a> {
    pub(crate) src: RwLockReadGuard<'a, Storage>,
    pub(crate) dst: RwLockWriteGuard<'a, Storage>,
}

/// Locks `src` for reading and `dst` for writing, lower address first.
///
/// Every place in this crate that holds two storage locks at once takes them in address order;
/// one thread taking A then B while another takes B then A is therefore impossible.
pub(crate) fn read_write<'a>(
    src: &'a Arc<SharedStorage>,
    dst: &'a Arc<SharedStorage>,
) -> ReadWrite<'a> {
    if Arc::as_ptr(src) < Arc::as_ptr(dst) {
        let src = src.read();
        let dst = dst.write();
        ReadWrite { src, dst }
    } else {
        let dst = dst.write();
        let src = src.read();
        ReadWrite { src, dst }
    }
}

/// Read guards on two storages, or one guard used twice when they are the same storage
/// (taking a read lock twice from one thread can deadlock behind a waiting writer).
pub(crate) enum ReadPair<'a> {
    /// Both tensors view one storage.
    Same(RwLockReadGuard<'a, Storage>),
    /// Two different storages.
    Distinct(RwLockReadGuard<'a, Storage>, RwLockReadGuard<'a, Storage>),
}

impl ReadPair<'_> {
    /// The first and second storage.
    pub(crate) fn get(&self) -> (&Storage, &Storage) {
        match self {
            ReadPair::Same(g) => (g, g),
            ReadPair::Distinct(a, b) => (a, b),
        }
    }
}

/// Locks two storages for reading, lower address first.
pub(crate) fn read_pair<'a>(a: &'a Arc<SharedStorage>, b: &'a Arc<SharedStorage>) -> ReadPair<'a> {
    if Arc::ptr_eq(a, b) {
        ReadPair::Same(a.read())
    } else if Arc::as_ptr(a) < Arc::as_ptr(b) {
        let ga = a.read();
        let gb = b.read();
        ReadPair::Distinct(ga, gb)
    } else {
        let gb = b.read();
        let ga = a.read();
        ReadPair::Distinct(ga, gb)
    }
}
