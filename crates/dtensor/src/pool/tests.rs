use super::*;
use hypershard_tensor::DType;

use crate::bridge::staging_tensor;

/// (dtype, length) of every idle buffer, oldest first.
fn idle_sizes(pool: &BufferPool) -> Vec<(WireDType, usize)> {
    pool.lock()
        .idle
        .iter()
        .map(|b| (b.dtype(), b.len()))
        .collect()
}

fn address(buffer: &Buffer) -> usize {
    buffer
        .as_host()
        .map_or(0, |h| h.as_bytes().as_ptr() as usize)
}

#[test]
fn loans_are_recycled_by_exact_size_within_the_cap() {
    let pool = Arc::new(BufferPool::new());
    let a = pool.take(WireDType::F32, 100);
    assert_eq!(a.as_slice::<f32>().expect("host"), &[0.0; 100][..]);
    let first = address(&a);
    pool.give(a);
    // Same dtype and length: the same memory comes back.
    let b = pool.take(WireDType::F32, 100);
    assert_eq!(address(&b), first);
    // Another dtype of the same byte length is a miss.
    let c = pool.take(WireDType::I32, 100);
    let stats = pool.stats();
    assert_eq!((stats.hits, stats.misses), (1, 2));
    assert_eq!(stats.in_use_bytes, 800);
    pool.give(b);
    pool.give(c);
    assert_eq!(pool.stats().in_use_bytes, 0);
    assert_eq!(pool.stats().peak_in_use_bytes, 800);
    // A buffer larger than 4 x the largest request (and than the most lent at once) is never
    // kept.
    pool.give(Buffer::zeros(WireDType::F32, 401));
    let d = pool.take(WireDType::F32, 401);
    assert_eq!(pool.stats().misses, 3);
    // A buffer another handle still shares is not kept (writing it would copy).
    let shared = Buffer::zeros(WireDType::F32, 8);
    let other = shared.as_host().expect("host").share();
    pool.give(shared);
    drop(other);
    let _e = pool.take(WireDType::F32, 8);
    assert_eq!(pool.stats().misses, 4);
    // The byte cap (4 x 401 f32, above the most lent at once so far) drops the oldest buffers
    // first.
    for len in 395..400 {
        pool.give(Buffer::zeros(WireDType::F32, len));
        let stats = pool.stats();
        assert!(stats.cached_bytes <= 4 * 401 * 4, "{stats:?}");
        assert_eq!(stats.idle_cap_bytes, 4 * 401 * 4);
    }
    assert_eq!(
        idle_sizes(&pool),
        vec![
            (WireDType::F32, 396),
            (WireDType::F32, 397),
            (WireDType::F32, 398),
            (WireDType::F32, 399)
        ]
    );
    // Holding 10 buffers of 400 at once raises the cap to that peak and allows 10 idle of
    // that size: all 10 are kept when they come back (a step's gradients, handed back
    // together by zero_grad), and all 10 are hits the next time.
    let held: Vec<Buffer> = (0..10).map(|_| pool.take(WireDType::F32, 400)).collect();
    for buffer in held {
        pool.give(buffer);
    }
    let count = |pool: &BufferPool| {
        idle_sizes(pool)
            .iter()
            .filter(|&&size| size == (WireDType::F32, 400))
            .count()
    };
    assert_eq!(count(&pool), 10);
    let stats = pool.stats();
    assert!(stats.cached_bytes <= stats.idle_cap_bytes, "{stats:?}");
    let misses = stats.misses;
    let again: Vec<Buffer> = (0..10).map(|_| pool.take(WireDType::F32, 400)).collect();
    assert_eq!(pool.stats().misses, misses);
    drop(again);
    drop(d);
}

#[test]
fn pooled_tensors_return_their_storage_when_dropped() -> Result<()> {
    let pool = Arc::new(BufferPool::new());
    let t = pool.tensor(&[2, 3], DType::F32)?;
    assert_eq!(t.shape(), &[2, 3]);
    assert_eq!(pool.stats().in_use_bytes, 24);
    t.with_data_mut::<f32, _>(|v| v.copy_from_slice(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]))?;
    let view = t.narrow(0, 1, 1)?;
    drop(t);
    // A view keeps the storage alive; the values are intact.
    assert_eq!(view.to_vec::<f32>()?, vec![4.0, 5.0, 6.0]);
    drop(view);
    assert_eq!(pool.stats().in_use_bytes, 0);
    // Now the memory is back: the next request of 6 f32 is a hit with the old values.
    let again = pool.take(WireDType::F32, 6);
    assert_eq!((pool.stats().hits, pool.stats().misses), (1, 1));
    assert_eq!(
        again.as_slice::<f32>().expect("host"),
        &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    );
    // `adopt` makes a flat tensor over a loan, which comes back the same way.
    let flat = pool.adopt(again, DType::F32)?;
    assert_eq!(flat.shape(), &[6]);
    drop(flat);
    assert_eq!(pool.stats().cached_buffers, 1);
    // A buffer of another dtype is refused with a typed error (and kept).
    assert!(matches!(
        pool.adopt(pool.take(WireDType::I32, 6), DType::F32),
        Err(Error::BufferMismatch { .. })
    ));
    // With the pool gone the storage is simply freed.
    let orphan = pool.tensor(&[4], DType::F32)?;
    drop(pool);
    drop(orphan);
    Ok(())
}

#[test]
fn a_loan_moved_into_a_collective_leaves_the_accounting() -> Result<()> {
    let pool = Arc::new(BufferPool::new());
    let t = pool.tensor(&[4], DType::F32)?;
    let lent_at = t.with_data(|xs: &[f32]| xs.as_ptr() as usize)?;
    // Pool memory is collective memory: lent copy-on-write while the tensor lives...
    let share = crate::bridge::lend_buffer(&t).expect("pool memory is collective memory");
    assert_eq!(address(&share), lent_at);
    drop(share);
    // ...and moved out without a copy when the tensor is its sole owner. The loan ends then.
    let Ok(moved) = reclaim_buffer(t)? else {
        panic!("the sole owner gives its memory up");
    };
    assert_eq!(address(&moved), lent_at);
    assert_eq!(pool.stats().in_use_bytes, 0);
    // Handed back by a redistribute, it is kept as a buffer the pool did not lend.
    pool.keep(moved);
    assert_eq!(pool.stats().cached_buffers, 1);
    assert_eq!(pool.stats().in_use_bytes, 0);
    Ok(())
}

#[test]
fn release_cached_frees_everything_and_starts_a_new_window() {
    let pool = BufferPool::new();
    let held = pool.take(WireDType::U8, 1000);
    let big = pool.take(WireDType::U8, 4000);
    pool.give(big);
    pool.give(pool.take(WireDType::U8, 10));
    assert_eq!(pool.stats().cached_bytes, 4010);
    assert_eq!(pool.release_cached(), 4010);
    let stats = pool.stats();
    assert_eq!((stats.cached_bytes, stats.cached_buffers), (0, 0));
    // The new window starts from what is lent now: the 1000 bytes still held.
    assert_eq!(stats.idle_cap_bytes, 1000);
    assert_eq!(stats.peak_in_use_bytes, 5000, "the all-time peak stays");
    // A buffer of the old window's largest size is now over the cap.
    pool.give(Buffer::zeros(WireDType::U8, 4000));
    assert_eq!(pool.stats().cached_buffers, 0);
    // What is still lent comes back within the cap.
    pool.give(held);
    assert_eq!(pool.stats().cached_bytes, 1000);
}

#[test]
fn large_buffers_let_go_are_freed_off_thread_and_used_up_tensors_retired() -> Result<()> {
    let pool = BufferPool::new();
    let large = DEFERRED_FREE_BYTES * 3;
    // One request of `large` bytes: the cap is 4 x that. Five distinct sizes of it do not
    // fit; the oldest go to the background thread.
    drop(pool.output(WireDType::U8, large));
    for i in 0..5 {
        pool.keep(Buffer::zeros(WireDType::U8, large - 64 * i));
    }
    assert_eq!(pool.stats().cached_buffers, 4);
    assert!(
        pool.freer.lock().expect("freer").thread.is_some(),
        "the freeing thread started"
    );
    // A used-up tensor in collective memory is kept; a shared one or plain memory is not.
    let used = staging_tensor(&[16], DType::F32)?;
    let view = used.clone();
    pool.retire(used)?;
    assert_eq!(pool.stats().cached_buffers, 4);
    pool.retire(view)?;
    assert_eq!(pool.stats().cached_buffers, 5);
    pool.retire(crate::Tensor::zeros(&[16], DType::F32)?)?;
    assert_eq!(pool.stats().cached_buffers, 5);
    // Dropping the pool stops and joins the thread (the test would hang otherwise).
    drop(pool);
    Ok(())
}

#[test]
fn the_pool_keeps_at_most_its_buffer_count() {
    let pool = BufferPool::new();
    drop(pool.output(WireDType::U8, 1 << 20));
    // Six sizes more than the count allows, 8 bytes apart: the six oldest are evicted.
    let sizes = MAX_IDLE_BUFFERS + 6;
    for i in 1..=sizes {
        pool.keep(Buffer::from_vec(vec![0u8; 8 * i]));
    }
    let idle = idle_sizes(&pool);
    assert_eq!(idle.len(), MAX_IDLE_BUFFERS);
    assert_eq!(idle[0], (WireDType::U8, 8 * 7));
    assert_eq!(idle[MAX_IDLE_BUFFERS - 1], (WireDType::U8, 8 * sizes));
    let held: usize = (7..=sizes).map(|i| 8 * i).sum();
    assert_eq!(pool.release_cached(), held);
    assert_eq!(pool.stats().cached_buffers, 0);
}

#[test]
fn a_buffer_not_lent_is_not_kept_when_one_of_its_size_is_idle() -> Result<()> {
    let pool = BufferPool::new();
    // A redistribute's output of 6 f32 sets the cap (4 x 24 bytes).
    drop(pool.output(WireDType::F32, 6));
    // Two sizes idle: 4 f32 and 6 f32.
    let first = Buffer::from_vec(vec![1.0f32; 4]);
    let kept = address(&first);
    pool.keep(first);
    pool.keep(Buffer::from_vec(vec![2.0f32; 6]));
    assert_eq!(pool.stats().cached_buffers, 2);
    // A used-up source of 4 f32 (collective memory, sole owner) finds its size idle: it is
    // freed, and neither the idle buffer of its size nor the other size is pushed out.
    pool.retire(staging_tensor(&[2, 2], DType::F32)?)?;
    assert_eq!(
        idle_sizes(&pool),
        vec![(WireDType::F32, 4), (WireDType::F32, 6)]
    );
    // The same for a send buffer (or a moved source) a collective hands back.
    pool.keep(Buffer::from_vec(vec![3.0f32; 6]));
    assert_eq!(pool.stats().cached_buffers, 2);
    // The buffer that stayed is the first one: the next take of that size gets it.
    let taken = pool.output(WireDType::F32, 4);
    assert_eq!(address(&taken), kept);
    assert_eq!(taken.as_slice::<f32>()?, &[1.0; 4]);
    // Once it is taken, a consumed source of that size is kept again.
    pool.retire(staging_tensor(&[4], DType::F32)?)?;
    assert_eq!(
        idle_sizes(&pool),
        vec![(WireDType::F32, 6), (WireDType::F32, 4)]
    );
    // The same length in another dtype is another size.
    pool.keep(Buffer::zeros(WireDType::I32, 4));
    assert_eq!(pool.stats().cached_buffers, 3);
    Ok(())
}

#[test]
fn an_idle_pool_never_holds_more_than_its_cap() {
    let pool = Arc::new(BufferPool::new());
    // A fixed pseudo-random walk (a 64-bit LCG, so the test is the same on every run) of
    // loans, returns, passing buffers and releases over a few sizes, with a large one now
    // and then.
    let mut state: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut next = || {
        state = state
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        (state >> 33) as usize
    };
    let sizes = [16, 24, 40, 64, 100, 256, 1000];
    let mut lent: Vec<Buffer> = Vec::new();
    for step in 0..2000 {
        let len = if step % 97 == 13 {
            (1 << 20) + next() % 4096
        } else {
            sizes[next() % sizes.len()]
        };
        match next() % 7 {
            0 | 1 => lent.push(pool.take(WireDType::U8, len)),
            2 | 3 if !lent.is_empty() => {
                let index = next() % lent.len();
                pool.give(lent.swap_remove(index));
            }
            4 => drop(pool.output(WireDType::U8, len)),
            5 => pool.keep(Buffer::zeros(WireDType::U8, len)),
            _ if step % 50 == 0 => {
                pool.release_cached();
            }
            _ => {}
        }
        let stats = pool.stats();
        assert!(
            stats.cached_bytes <= stats.idle_cap_bytes,
            "step {step}: {stats:?}"
        );
        assert!(stats.cached_buffers <= MAX_IDLE_BUFFERS, "step {step}");
        let in_use: usize = lent.iter().map(Buffer::byte_len).sum();
        assert_eq!(stats.in_use_bytes, in_use, "step {step}");
        let state = pool.lock();
        for &(dtype, len) in &sizes.map(|len| (WireDType::U8, len)) {
            let idle = state
                .idle
                .iter()
                .filter(|b| (b.dtype(), b.len()) == (dtype, len))
                .count();
            assert!(idle <= state.allowed((dtype, len)), "step {step}: {len}");
        }
        let counted: usize = state.idle.iter().map(WireBuffer::byte_len).sum();
        assert_eq!(counted, state.idle_bytes, "step {step}");
    }
}

#[test]
fn a_repeated_step_allocates_nothing_after_the_first() -> Result<()> {
    // The traffic of an FSDP step over four like units (a transformer's blocks) at world 2,
    // as the pool sees it: per unit a gather input and output (the output adopted as the
    // unsharded parameters, freed on reshard), and in backward a reduce-scatter input and
    // output and a reduced shard that is accumulated and dropped.
    let pool = Arc::new(BufferPool::new());
    let step = |pool: &Arc<BufferPool>| -> Result<()> {
        for pass in 0..2 {
            for _unit in 0..4 {
                let input = pool.take(WireDType::F32, 300);
                let output = pool.take(WireDType::F32, 600);
                pool.give(input);
                let params = pool.adopt(output, DType::F32)?;
                if pass == 1 {
                    let reduce_input = pool.take(WireDType::F32, 600);
                    let reduce_output = pool.take(WireDType::F32, 300);
                    pool.give(reduce_input);
                    let shard = pool.adopt(reduce_output, DType::F32)?;
                    drop(shard);
                }
                drop(params);
            }
        }
        Ok(())
    };
    step(&pool)?;
    let warm = pool.stats();
    assert!(warm.misses > 0);
    for _ in 0..5 {
        step(&pool)?;
        let stats = pool.stats();
        assert_eq!(stats.misses, warm.misses, "{stats:?}");
        assert!(stats.cached_bytes <= stats.idle_cap_bytes, "{stats:?}");
    }
    Ok(())
}
