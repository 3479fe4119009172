"""A Python number read from a DTensor (`int(x)`, `x.item()`, `bool(x)`,
indexing with a 0-d tensor) is the whole value's, on every process.

torch 2.13's DTensor reads such a number from the process's own piece
(`aten._local_scalar_dense` is special-cased to skip sharding propagation).
A reduction over a split dimension leaves a pending one (`Partial`): the
piece holds this process's part, not the value. keras-hub's sampler does
`index = ops.min(row_lengths)` over the batch (split over `batch`) and then
`mask[:, index]`: each process indexed with its own rows' minimum, and rows
of prompts of different lengths came back with prompt tokens overwritten,
with no error. Likewise `while cond(...)` (Keras' torch `while_loop`) would
take each process's own answer, and a 1-element tensor split over an axis
has an empty piece on some processes.

So a scalar is read from the value laid out whole (`Replicate` on every
mesh axis), redistributed first where it is not: the collectives this takes
every process takes, as each reads the same number in the same program.
"""

import torch
from torch.distributed.tensor import DTensor, Replicate

_aten = torch.ops.aten


def _local_scalar_dense(op_call, args, kwargs):
    (x,) = args
    if not all(isinstance(p, Replicate) for p in x.placements):
        x = x.redistribute(x.device_mesh, [Replicate()] * x.device_mesh.ndim)
    return op_call(x.to_local(), **(kwargs or {}))


def install():
    """Register the handler with DTensor's dispatcher (its extension point
    for ops whose sharding rule is not enough, as `loss_parallel` uses)."""
    handlers = DTensor._op_dispatcher._custom_op_handlers
    handlers[_aten._local_scalar_dense.default] = _local_scalar_dense
