"""Tensors summed over process groups in one all-reduce per group for all
of them, in a flat buffer, as `DistributedDataParallel`'s buckets: the
local step's gradients and metric increments, and the pending sums of
DTensor gradients (`gradients`).
"""

import torch


def groups_of(device_mesh, mesh_dims):
    """The process groups of `device_mesh`'s dims `mesh_dims` to sum over,
    those of one process left out (a sum over one process is its value:
    no all-reduce)."""
    return [device_mesh.get_group(d) for d in mesh_dims
            if device_mesh.size(d) > 1]



def _flat_views(tensors, buffers, purpose):
    """(flat, views): a flat buffer for `tensors` (plain, one dtype and
    device) and its pieces shaped as they are. Kept in `buffers` (a dict),
    by `purpose` and the tensors' shapes, for the next step; new each call
    where `buffers` is None."""
    first = tensors[0]
    key = (purpose, first.dtype, first.device, *(t.shape for t in tensors))
    found = buffers.get(key) if buffers is not None else None
    if found is None:
        sizes = [t.numel() for t in tensors]
        flat = torch.empty(sum(sizes), dtype=first.dtype, device=first.device)
        found = (flat, tuple(piece.view(t.shape) for piece, t in
                             zip(torch.split(flat, sizes), tensors)))
        if buffers is not None:
            buffers[key] = found
    return found


def sum_over(tensors, groups, scale=1.0, scaled=None, buffers=None,
             purpose=None):
    """`tensors` (plain, one dtype) summed over `groups` in one all-reduce
    per group for all of them, the first `scaled` of them (all by default)
    multiplied by `scale` first.

    The sums are views of one flat buffer: a new one, or, with `buffers`
    (a dict), the one kept there for `purpose` and these shapes, which the
    next such sum overwrites (as `DistributedDataParallel`'s gradients are
    views of its buckets)."""
    flat, views = _flat_views(tensors, buffers, purpose)
    # the first `scaled` are multiplied into the buffer, the rest copied
    scaled = 0 if scale == 1.0 else len(tensors) if scaled is None else scaled
    for view, t in zip(views[:scaled], tensors[:scaled]):
        torch.mul(t, scale, out=view)
    if scaled < len(tensors):
        torch._foreach_copy_(views[scaled:], tensors[scaled:])
    for group in groups:
        torch.distributed.all_reduce(flat, group=group)
    return views
