"""`ops.slice_update` on DTensors (the KV cache of keras-hub's `generate`).

Keras' torch kernel clones the input and assigns the update into a slice of
it: an in-place copy into a view, for which torch 2.13's DTensor has no rule
when the two are laid out differently (it fails with a bare
`AssertionError` in its dispatcher: Gemma's cache split over the batch,
the new keys also over the heads). An update is independent per element,
so the input and the update are brought to one layout, mesh dim by mesh
dim: the input's split where it splits a dimension the update covers
whole; else the update's split of such a dimension (the input is then
sliced on each process, which needs no communication); else whole (a
dimension the update covers only in part, the cache's sequence). Each
process then writes its piece of the update into its piece of the input,
and the result is its piece of the output.

So a cache made whole (`ops.zeros`) takes the split of the keys written
into it (the batch and the heads) at its first update and keeps it: the
new keys of every later token are not gathered to every process, and the
cache each process holds is its piece, not the whole.
"""

import functools

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

from keras_layoutmap.backends.torch.keras_internals import convert_to_tensor
from keras_layoutmap.backends.torch.placement import (
    as_dtensor,
    contiguous_stride,
    local_piece,
)


def _start(index):
    if isinstance(index, DTensor):
        index = index.full_tensor()
    return int(index)


def _common_placements(inputs, updates, whole):
    """Per mesh dim: the input's split of a dimension the update covers
    whole, else the update's split of one (a dimension no other mesh dim
    splits), else `Replicate()`."""
    target = [p if isinstance(p, Shard) and whole[p.dim] else None
              for p in inputs]
    for mesh_dim, p in enumerate(updates):
        taken = {t.dim for t in target if isinstance(t, Shard)}
        if (target[mesh_dim] is None and isinstance(p, Shard)
                and whole[p.dim] and p.dim not in taken):
            target[mesh_dim] = p
    return tuple(Replicate() if t is None else t for t in target)


def wrap_slice_update(original):
    @functools.wraps(original)
    def slice_update(inputs, start_indices, updates):
        inputs = convert_to_tensor(inputs)
        updates = convert_to_tensor(updates)
        dtensors = [x for x in (inputs, updates) if isinstance(x, DTensor)]
        if not dtensors:
            return original(inputs, start_indices, updates)
        mesh = dtensors[0].device_mesh
        inputs, updates = as_dtensor(inputs, mesh), as_dtensor(updates, mesh)
        if isinstance(start_indices, DTensor):
            start_indices = start_indices.full_tensor()
        if torch.is_tensor(start_indices):
            start_indices = start_indices.tolist()
        starts = [_start(s) for s in start_indices]
        shape = tuple(inputs.shape)
        if len(starts) != len(shape) or updates.ndim != len(shape):
            raise ValueError(
                f"slice_update needs one start index per dimension of the "
                f"input and an update of the input's rank. Received an input "
                f"of shape {shape}, start indices {starts} and an update of "
                f"shape {tuple(updates.shape)}.")
        whole = [s == 0 and n == size for s, n, size
                 in zip(starts, updates.shape, shape)]
        target = _common_placements(inputs.placements, updates.placements,
                                    whole)
        local_in = local_piece(inputs, target)
        local_update = local_piece(updates, target).to(local_in.dtype)
        index = tuple(slice(None) if whole[d] else
                      slice(starts[d], starts[d] + updates.shape[d])
                      for d in range(len(shape)))
        out = torch.clone(local_in)
        out[index] = local_update
        return DTensor.from_local(out, mesh, target, run_check=False,
                                  shape=shape, stride=contiguous_stride(shape))

    return slice_update
