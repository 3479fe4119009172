"""`ops.dot_product_attention` on DTensors, computed per process.

torch 2.13's DTensor has no sharding rule of its own for the fused CPU
attention kernel: it derives one by tracing the kernel's decomposition,
which takes minutes on the first call, and with heads sharded in the query
but not in the key it hands the kernel pieces of different head counts.
Attention is independent per batch row and per head, so the three are
brought to one layout (the query's batch and head sharding when the head
counts agree, batch sharding only when they do not: grouped key/value
heads), each process computes attention on its own pieces with Keras' own
kernel, and the result is its piece of the output.
"""

import functools

from torch.distributed.tensor import DTensor, Replicate, Shard

from keras_layoutmap.backends.torch.placement import (
    as_dtensor,
    contiguous_stride,
    local_piece,
    local_slices,
    to_host,
)

# Keras' layout: (batch, sequence, heads, head size).
_BATCH, _HEADS = 0, 2


def _target(query, key):
    keep = (_BATCH, _HEADS) if query.shape[_HEADS] == key.shape[_HEADS] else (_BATCH,)
    return tuple(p if isinstance(p, Shard) and p.dim in keep else Replicate()
                 for p in query.placements)


def _local_mask(mask, rows, heads, shape):
    """This process's part of a mask or bias broadcastable to (batch, heads,
    query length, key length)."""
    if mask is None:
        return None
    mask = to_host(mask) if isinstance(mask, DTensor) else mask
    index = [slice(None)] * mask.ndim
    if mask.ndim == 4 and mask.shape[0] == shape[_BATCH]:
        index[0] = rows
    if mask.ndim == 4 and mask.shape[1] == shape[_HEADS]:
        index[1] = heads
    return mask[tuple(index)]


def wrap_dot_product_attention(original):
    @functools.wraps(original)
    def dot_product_attention(query, key, value, bias=None, mask=None, *args,
                              **kwargs):
        if not (isinstance(query, DTensor) and query.ndim == 4):
            return original(query, key, value, bias, mask, *args, **kwargs)
        mesh = query.device_mesh
        target = _target(query, key)

        def local(x):
            return local_piece(as_dtensor(x, mesh), target)

        shape = tuple(query.shape)
        index = local_slices(shape, mesh, target)
        rows, heads = index[_BATCH], index[_HEADS]
        out = original(
            local(query), local(key), local(value),
            _local_mask(bias, rows, heads, shape),
            _local_mask(mask, rows, heads, shape), *args, **kwargs)
        global_shape = (*shape[:3], value.shape[-1])
        # Keras' torch kernel returns a transposed view; the DTensor below
        # says its piece is laid out contiguously, so make it so (a view of
        # it would otherwise fail, or read the wrong elements).
        return DTensor.from_local(out.contiguous(), mesh, target, run_check=False,
                                  shape=global_shape,
                                  stride=contiguous_stride(global_shape))

    return dot_product_attention
