"""Embedding lookups (`ops.take(table, ids, axis=0)`) from a table sharded
over its rows (the vocabulary).

DTensor's own rule for this lookup leaves a masked partial result whose mask
has the local shape of the ids; torch 2.13 then reduces it after the ids'
batch layout changed and fails on shapes that no longer match (Gemma's
scaled embeddings). So the lookup is the classic vocabulary-parallel one
(columns split over other axes are gathered first):
each process looks up the ids that fall in its rows, zeros the others, and
the pieces are summed over the mesh axes that split the rows. The gradient
of that sum is the output's gradient on every process (an all-reduce
forward, the identity backward), as DTensor holds a replicated gradient.

Every other `ops.take` of a DTensor (along another axis, of another rank,
flattened with `axis=None`) runs on each process's piece too: the split
along the taken axis (all of it, flattened) is gathered, the other splits
are kept, the indices are whole, and each process takes from its piece;
the output is split as the piece's other dimensions were. torch 2.13's
DTensor got those wrong: `index_select` along a split dim gave a raw
shape error further on ("mat1 and mat2 shapes cannot be multiplied"), and
the gradient of an `index_select` of a weight, a pending sum over the
batch axis, came back as a sum over every axis (`index_add`'s rule: the
weight's gradient twice what it is, silently).
"""

import functools

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from keras_layoutmap.backends.torch.keras_internals import Variable, convert_to_tensor
from keras_layoutmap.backends.torch.placement import (
    as_dtensor,
    contiguous_stride,
    local_slices,
)
from keras_layoutmap.backends.torch.tensor_parallel import SumOverGroup


def _row_sharded_lookup(table, ids):
    mesh = table.device_mesh
    row_dims = [i for i, p in enumerate(table.placements)
                if isinstance(p, Shard) and p.dim == 0]
    if not row_dims:
        return None  # rows whole: DTensor's own lookup is fine
    whole_columns = [Shard(0) if i in row_dims else Replicate()
                     for i in range(mesh.ndim)]
    if tuple(table.placements) != tuple(whole_columns):
        # Columns split too (keras-hub's (model, batch) embeddings): gathered
        # for the lookup, as FSDP gathers a weight to compute with it.
        table = table.redistribute(mesh, whole_columns)
    ids = as_dtensor(ids, mesh)
    ids_places = [Replicate() if i in row_dims else p
                  for i, p in enumerate(ids.placements)]
    if tuple(ids.placements) != tuple(ids_places):
        ids = ids.redistribute(mesh, ids_places)
    rows = local_slices(tuple(table.shape), mesh, table.placements)[0]
    local_ids = ids.to_local()
    inside = (local_ids >= rows.start) & (local_ids < rows.stop)
    # Each process's gradient for its rows covers its own ids only: partial
    # sums over the axes that split the ids.
    grad_places = [Shard(0) if i in row_dims else
                   Partial() if isinstance(ids_places[i], Shard) else Replicate()
                   for i in range(mesh.ndim)]
    found = torch.nn.functional.embedding(
        torch.where(inside, local_ids - rows.start, 0),
        table.to_local(grad_placements=grad_places))
    found = found * inside.unsqueeze(-1).to(found.dtype)
    for mesh_dim in row_dims:
        found = SumOverGroup.apply(found, mesh.get_group(mesh_dim))
    shape = (*ids.shape, table.shape[1])
    return DTensor.from_local(found, mesh, ids_places, run_check=False,
                              shape=shape, stride=contiguous_stride(shape))


def _local_take(original, x, indices, axis):
    """`original(x, indices, axis)` on this process's piece of the DTensor
    `x`, split as it is except along `axis` (everywhere, for None)."""
    mesh = x.device_mesh
    if isinstance(indices, DTensor):
        indices = indices.full_tensor()
    indices = convert_to_tensor(indices)
    if axis is not None:
        axis = axis % x.ndim
    target = [p if type(p) is Shard and axis is not None and p.dim != axis
              else Replicate() for p in x.placements]
    if tuple(x.placements) != tuple(target):
        x = x.redistribute(mesh, target)
    out = original(x.to_local(grad_placements=target), indices, axis=axis)
    if axis is None:
        return DTensor.from_local(out, mesh, target, run_check=False)
    extra = indices.ndim - 1  # the indices' dims replace `axis`
    places = [Shard(p.dim + extra if p.dim > axis else p.dim)
              if type(p) is Shard else p for p in target]
    shape = (*x.shape[:axis], *indices.shape, *x.shape[axis + 1:])
    return DTensor.from_local(out.contiguous(), mesh, places, run_check=False,
                              shape=shape, stride=contiguous_stride(shape))


def wrap_take(original):
    @functools.wraps(original)
    def take(x, indices, axis=None):
        if isinstance(x, Variable):
            x = x.value
        if isinstance(x, DTensor) and x.ndim == 2 and axis == 0:
            ids = convert_to_tensor(indices).long()
            ids = torch.where(ids < 0, ids + x.shape[0], ids)
            out = _row_sharded_lookup(x, ids)
            if out is not None:
                return out
            # rows whole: DTensor's own lookup is right (and needs no
            # collective, so a data-parallel call stays on local rows)
            return original(x, indices, axis=axis)
        if isinstance(x, DTensor):
            return _local_take(original, x, indices, axis)
        return original(x, indices, axis=axis)

    return take
