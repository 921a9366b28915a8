//! Binomial-tree broadcast for small messages: `ceil(log2 p)` rounds instead of the chain's
//! `p - 1` hops. With `v` a rank's distance from the root (`(rank - root) mod p`), rank `v`
//! receives from `v - 2^k` (`2^k` the lowest set bit of `v`) and forwards to `v + 2^j` for
//! every `2^j < 2^k` with `v + 2^j < p`, largest subtree first. Segments are forwarded as
//! they arrive, so a large message also streams down the tree.

use super::link::Link;
use crate::dtype::DType;
use crate::error::Result;

/// This rank's parent (none for the root) and children in the tree, as group ranks.
struct TreePlace {
    parent: Option<usize>,
    children: Vec<usize>,
}

fn place(rank: usize, size: usize, root: usize) -> TreePlace {
    let distance = (rank + size - root) % size;
    let actual = |v: usize| (v + root) % size;
    // The lowest set bit of the distance; the root's subtree spans every bit.
    let span = if distance == 0 {
        size.next_power_of_two()
    } else {
        1 << distance.trailing_zeros()
    };
    let parent = (distance != 0).then(|| actual(distance - span));
    let mut children = Vec::new();
    let mut step = span / 2;
    while step >= 1 {
        if distance + step < size {
            children.push(actual(distance + step));
        }
        step /= 2;
    }
    TreePlace { parent, children }
}

/// The root's children, largest subtree first (the order [`broadcast`] sends in).
pub(crate) fn children_of_root(size: usize, root: usize) -> Vec<usize> {
    place(root, size, root).children
}

/// Broadcasts `data` (the root's input, every other rank's destination) from `root`. On the
/// root, `sent[i]` leading bytes already went to its `i`-th child (the eager prefix; a
/// missing entry is zero); other ranks ignore it.
pub(crate) fn broadcast(
    link: &Link<'_>,
    dtype: DType,
    data: &mut [u8],
    root: usize,
    sent: &[usize],
) -> Result<()> {
    let TreePlace { parent, children } = place(link.rank(), link.size(), root);
    let Some(parent) = parent else {
        for (i, &child) in children.iter().enumerate() {
            let from = sent.get(i).copied().unwrap_or(0).min(data.len());
            link.send_data(child, dtype, 0, &data[from..])?;
        }
        return Ok(());
    };
    if children.is_empty() {
        // A leaf forwards nothing, so it sleeps until the whole buffer is in.
        return link.recv_into(parent, dtype, 0, data);
    }
    link.recv_copy(parent, dtype, 0, data, |arrived| {
        for &child in &children {
            link.send_data(child, dtype, 0, arrived)?;
        }
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_rank_but_the_root_has_one_parent_and_the_tree_reaches_everyone() {
        for size in 1..=9 {
            for root in 0..size {
                let mut received = vec![0usize; size];
                for rank in 0..size {
                    let here = place(rank, size, root);
                    assert_eq!(
                        here.parent.is_none(),
                        rank == root,
                        "size {size} root {root}"
                    );
                    for child in here.children {
                        assert_eq!(place(child, size, root).parent, Some(rank));
                        received[child] += 1;
                    }
                }
                let expected: Vec<usize> = (0..size).map(|r| usize::from(r != root)).collect();
                assert_eq!(received, expected, "size {size} root {root}");
            }
        }
        // Size 5 from root 0: 0 -> 4, 2, 1; 2 -> 3.
        assert_eq!(place(0, 5, 0).children, vec![4, 2, 1]);
        assert_eq!(children_of_root(5, 0), vec![4, 2, 1]);
        assert_eq!(children_of_root(4, 3), vec![1, 0]);
        assert_eq!(place(2, 5, 0).children, vec![3]);
        assert_eq!(place(3, 5, 0).parent, Some(2));
    }
}
