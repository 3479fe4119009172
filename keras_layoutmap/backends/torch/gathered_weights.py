"""FSDP's weights gathered whole for a call on each process's own rows.

A weight split only over the mesh dims that split a call's rows (what
`klm.fsdp` makes) is gathered whole on every process for the call (one
all-gather), which then runs on plain tensors (`local_pieces`); the
gather's backward sums each process's gradient into the pieces (one
reduce-scatter), as FSDP does. A weight split over a dim whose processes
hold the same rows (tensor parallelism) is not gathered: the call stays on
DTensors.
"""

import contextlib

from torch.distributed.tensor import DTensor, Replicate, Shard


def is_replicated(value):
    """`value` is a DTensor held whole on every process of its mesh."""
    return isinstance(value, DTensor) and all(
        isinstance(p, Replicate) for p in value.placements)


def gathered(value, mesh, places):
    """For a weight in a call on inputs split by `places` over `mesh`:
    False where it is replicated, True where it is split only over mesh
    dims that split the rows (gathered whole for the call, its gradient
    summed back into pieces), None where it cannot be used locally
    (another mesh, or split over a dim whose processes hold the same
    rows)."""
    if not isinstance(value, DTensor) or value.device_mesh != mesh:
        return None
    if is_replicated(value):
        return False
    if all(isinstance(p, Replicate) or isinstance(places[dim], Shard)
           for dim, p in enumerate(value.placements)):
        return True
    return None


def whole(value, mesh):
    """A split weight gathered whole on every process (one all-gather; its
    gradient's backward sums the processes' gradients into the pieces:
    one reduce-scatter)."""
    return value.redistribute(mesh, [Replicate()] * mesh.ndim)


class GatheredWhereRead(dict):
    """A `StatelessScope`'s mapping in which each weight of `split` ({id:
    its DTensor}) is gathered whole where the call reads it, and not kept:
    a call without gradients holds one whole weight at a time, as DTensor's
    own ops do (a call with gradients keeps them anyway, for the backward).
    `local`: a read gives the whole weight's local tensor (a local call),
    else its replicated DTensor (the trial); `aside`: the context each
    gather runs in."""

    def __init__(self, mapping, split, local, aside=contextlib.nullcontext):
        super().__init__(mapping)
        self.split, self.local, self.aside = split, local, aside

    def get(self, key, default=None):  # what `get_current_value` reads
        if key in self:
            return self[key]
        value = self.split.get(key)
        if value is None:
            return default
        with self.aside():
            gathered_whole = whole(value, value.device_mesh)
        return gathered_whole._local_tensor if self.local else gathered_whole
