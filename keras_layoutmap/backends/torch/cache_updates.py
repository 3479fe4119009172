"""`ops.slice_update` on DTensors (the KV cache of keras-hub's `generate`).

Keras' torch kernel clones the input and assigns the update into a slice of
it: an in-place copy into a view, for which torch 2.13's DTensor has no rule
when the two are laid out differently (it fails with a bare
`AssertionError` in its dispatcher: Gemma's cache split over the batch,
the new keys also over the heads). An update is independent per element,
so the input and the update are brought to one layout: the input's, except
that a dimension the update covers only in part (the cache's sequence) is
whole on every process. Each process then writes its piece of the update
into its piece of the input, and the result is its piece of the output.
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
        target = tuple(p if isinstance(p, Shard) and whole[p.dim]
                       else Replicate() for p in inputs.placements)
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
