//! Checkpoints across world sizes: every rank saves the box of each global parameter it holds
//! ([`SavedShard`]); a job of any world size or mesh shape loads by copying, for its own
//! local box, the overlap with every saved box. This is what a distributed checkpoint
//! reader does (torch DCP's resharding on load), minus the file format, which belongs to the
//! caller (the training CLI writes safetensors shards plus a metadata file).

use std::collections::BTreeMap;

use hypershard_mesh::{Placement, shard_span};
use hypershard_nn::Module;
use hypershard_tensor::Tensor;

use crate::error::{FsdpError, Result};
use crate::module::FsdpModule;
use crate::param::ParamRole;
use crate::schedule::lock;
use crate::tp::tp_layouts;

/// One rank's piece of one global parameter: the box `offset .. offset + tensor.shape()` of a
/// tensor of `global_shape`.
#[derive(Debug, Clone)]
pub struct SavedShard {
    /// The parameter's global (unsharded) shape.
    pub global_shape: Vec<usize>,
    /// Where the piece starts in the global tensor, one entry per dim.
    pub offset: Vec<usize>,
    /// The values of the box (the piece's shape is the box's extent).
    pub tensor: Tensor,
}

/// The box of the local tensor in global coordinates.
struct LocalBox {
    global_shape: Vec<usize>,
    offset: Vec<usize>,
    shape: Vec<usize>,
}

/// The overlap of `[a0, a0 + alen)` and `[b0, b0 + blen)`: its start and length.
fn overlap(a0: usize, alen: usize, b0: usize, blen: usize) -> Option<(usize, usize)> {
    let start = a0.max(b0);
    let end = (a0 + alen).min(b0 + blen);
    (end > start).then(|| (start, end - start))
}

impl FsdpModule {
    /// The global box of this rank's local tensor of every parameter (sharded ones at their
    /// `torch.chunk` span along the shard dim; replicated, ignored and unmanaged ones whole).
    /// With TP, the box sits inside the global parameter at this rank's TP span (for a
    /// TP-sharded parameter), and a data-parallel span counts from the start of that.
    fn local_boxes(&mut self) -> Result<BTreeMap<String, LocalBox>> {
        let managed = self.managed_params()?;
        let tp = self.tp_group()?;
        let mut layouts = BTreeMap::new();
        if tp.is_some() {
            tp_layouts(self, "", &mut layouts)?;
        }
        let tp_box = |placement: Placement, global: &[usize]| -> Result<Vec<usize>> {
            let mut offset = vec![0; global.len()];
            if let (Placement::Shard(dim), Some(tp)) = (placement, &tp)
                && dim < global.len()
            {
                offset[dim] = shard_span(global[dim], tp.world(), tp.rank())?.offset;
            }
            Ok(offset)
        };
        let mut out = BTreeMap::new();
        let mut failure: Option<FsdpError> = None;
        self.visit_params("", &mut |name, param| {
            if failure.is_some() {
                return Ok(());
            }
            let entry = match managed.get(name) {
                Some(entry) => {
                    let group = lock(&entry.group);
                    let p = &group.params[entry.index];
                    let shape = p.sharded.shape().to_vec();
                    let (global_shape, placement) = match (&p.tp, p.role) {
                        (Some(info), _) => (info.global_shape.clone(), info.placement),
                        (None, ParamRole::Sharded) => {
                            (p.layout.shape.clone(), Placement::Replicate)
                        }
                        (None, ParamRole::Replicated) => (shape.clone(), Placement::Replicate),
                    };
                    let mut offset = match tp_box(placement, &global_shape) {
                        Ok(offset) => offset,
                        Err(error) => {
                            failure = Some(error);
                            return Ok(());
                        }
                    };
                    if p.role == ParamRole::Sharded {
                        match p.layout.span(group.mesh.shard_rank()) {
                            Ok(span) => offset[p.layout.dim] += span.offset,
                            Err(error) => {
                                failure = Some(error);
                                return Ok(());
                            }
                        }
                    }
                    LocalBox {
                        global_shape,
                        offset,
                        shape,
                    }
                }
                None => {
                    let shape = param.data()?.shape().to_vec();
                    let (global_shape, placement) = match layouts.get(name) {
                        Some((layout, _)) => (layout.global_shape.clone(), layout.placement),
                        None => (shape.clone(), Placement::Replicate),
                    };
                    match tp_box(placement, &global_shape) {
                        Ok(offset) => LocalBox {
                            global_shape,
                            offset,
                            shape,
                        },
                        Err(error) => {
                            failure = Some(error);
                            return Ok(());
                        }
                    }
                }
            };
            out.insert(name.to_string(), entry);
            Ok(())
        })?;
        match failure {
            Some(error) => Err(error),
            None => Ok(out),
        }
    }

    /// This rank's piece of every parameter, to be saved (one file per rank, say) and loaded
    /// later by [`load_saved_shards`](Self::load_saved_shards) at any world size. The tensors
    /// are copies in host memory, whatever the module's device (what a checkpoint writes). No
    /// communication.
    pub fn saved_shards(&mut self) -> Result<BTreeMap<String, SavedShard>> {
        let boxes = self.local_boxes()?;
        let locals = self.local_state_dict()?;
        let mut out = BTreeMap::new();
        for (name, tensor) in locals {
            if let Some(b) = boxes.get(&name) {
                out.insert(
                    name,
                    SavedShard {
                        global_shape: b.global_shape.clone(),
                        offset: b.offset.clone(),
                        // A copy already on the host: this is the tensor itself.
                        tensor: tensor.to_host()?,
                    },
                );
            }
        }
        Ok(out)
    }

    /// Loads parameters from the pieces every rank of an earlier job saved (any world size,
    /// FSDP or HSDP, any shard dims): for each parameter, this rank's local box is filled
    /// from its overlap with every saved piece (pieces with equal boxes, such as HSDP
    /// replicas, count once). A parameter with no pieces gives
    /// [`FsdpError::StateDictMissing`], a different global shape or a box outside it
    /// [`FsdpError::StateDictShape`], and pieces that leave part of the local box uncovered
    /// [`FsdpError::SavedShardsIncomplete`] (distinct pieces must not overlap); all are checked before anything is written.
    /// No communication; units must be resharded.
    pub fn load_saved_shards(&mut self, saved: &BTreeMap<String, Vec<SavedShard>>) -> Result<()> {
        let boxes = self.local_boxes()?;
        let mut locals = BTreeMap::new();
        for (name, local) in &boxes {
            let Some(pieces) = saved.get(name) else {
                return Err(FsdpError::StateDictMissing { name: name.clone() });
            };
            let mut seen: Vec<(&[usize], &[usize])> = Vec::new();
            let mut value: Option<Tensor> = None;
            let mut covered = 0usize;
            for piece in pieces {
                let shape_error = || FsdpError::StateDictShape {
                    name: name.clone(),
                    expected: local.global_shape.clone(),
                    local: local.shape.clone(),
                    actual: piece.global_shape.clone(),
                };
                let ndim = local.global_shape.len();
                if piece.global_shape != local.global_shape
                    || piece.offset.len() != ndim
                    || piece.tensor.ndim() != ndim
                {
                    return Err(shape_error());
                }
                let inside = (0..ndim)
                    .all(|d| piece.offset[d] + piece.tensor.shape()[d] <= local.global_shape[d]);
                if !inside {
                    return Err(shape_error());
                }
                let key = (piece.offset.as_slice(), piece.tensor.shape());
                if seen.contains(&key) {
                    continue;
                }
                seen.push(key);
                let mut dst_ranges = Vec::with_capacity(ndim);
                let mut src_ranges = Vec::with_capacity(ndim);
                let mut numel = 1usize;
                let mut empty = false;
                for d in 0..ndim {
                    match overlap(
                        local.offset[d],
                        local.shape[d],
                        piece.offset[d],
                        piece.tensor.shape()[d],
                    ) {
                        Some((start, len)) => {
                            dst_ranges.push((start - local.offset[d], len));
                            src_ranges.push((start - piece.offset[d], len));
                            numel *= len;
                        }
                        None => {
                            empty = true;
                            break;
                        }
                    }
                }
                if empty {
                    continue;
                }
                let target = match &value {
                    Some(t) => t.clone(),
                    None => {
                        let t = Tensor::zeros(&local.shape, piece.tensor.dtype())?;
                        value = Some(t.clone());
                        t
                    }
                };
                let mut dst = target;
                // Pieces are assembled on the host (no copy for host pieces); the load moves
                // the result to the module's device.
                let mut src = piece.tensor.to_host()?;
                for d in 0..ndim {
                    dst = dst.narrow(d, dst_ranges[d].0, dst_ranges[d].1)?;
                    src = src.narrow(d, src_ranges[d].0, src_ranges[d].1)?;
                }
                dst.copy_from(&src)?;
                covered += numel;
            }
            let needed: usize = local.shape.iter().product();
            if covered != needed {
                return Err(FsdpError::SavedShardsIncomplete {
                    name: name.clone(),
                    covered,
                    needed,
                });
            }
            let value = match value {
                Some(v) => v,
                // An empty local box (a trailing empty shard) needs no piece.
                None => Tensor::zeros(&local.shape, hypershard_tensor::DType::F32)?,
            };
            locals.insert(name.clone(), value);
        }
        self.load_state_dict(&locals)
    }
}

#[cfg(test)]
mod tests {
    use super::overlap;

    #[test]
    fn overlap_of_half_open_ranges() {
        assert_eq!(overlap(0, 3, 2, 4), Some((2, 1)));
        assert_eq!(overlap(2, 4, 0, 3), Some((2, 1)));
        assert_eq!(overlap(0, 3, 3, 2), None);
        assert_eq!(overlap(1, 0, 0, 5), None);
        assert_eq!(overlap(0, 10, 4, 2), Some((4, 2)));
    }
}
