"""Gradients of weights on a mesh, made ready for the optimizer.

DTensor leaves the gradient of a weight that is replicated over a mesh axis
splitting the batch as partial sums (`Partial`), one per process. They are
summed here for all weights at once, one all-reduce per mesh axis and dtype
(as DDP buckets its gradients), and each gradient is laid out like its
weight before the optimizer applies it. Where the weights and the
optimizer's slots are laid out as their weights, the optimizer then updates
each process's pieces (`local_updates`).
"""

import functools

from torch.distributed.tensor import DTensor, Partial

from keras_layoutmap.backends.torch import bucketed_sums, local_step, local_updates
from keras_layoutmap.backends.torch.placement import summed, to_layout
from keras_layoutmap.layout import as_layout


def _sum_in_one(grads):
    """The local pieces of `grads` (pending sums, DTensors of one mesh,
    placements and dtype) summed over the processes with one all-reduce
    per mesh axis for all of them."""
    first = grads[0]
    groups = bucketed_sums.groups_of(first.device_mesh, [
        mesh_dim for mesh_dim, place in enumerate(first.placements)
        if isinstance(place, Partial)])
    if not groups:
        return [g._local_tensor for g in grads]
    return bucketed_sums.sum_over([g._local_tensor for g in grads], groups)


def _is_pending_sum_of(grad, value):
    """`grad` differs from its weight's placements only by sums to take."""
    places = tuple(grad.placements)
    return (places != tuple(value.placements)
            and summed(places) == tuple(value.placements)
            and all(p.reduce_op == "sum" for p in places
                    if isinstance(p, Partial)))


def _sum_pending(pairs):
    """{index: summed local piece} for every gradient in `pairs` (gradient,
    variable) that is its weight's layout with sums to take; the sums are
    taken in buckets of one mesh, placements and dtype."""
    buckets = {}
    for index, (grad, variable) in enumerate(pairs):
        value = getattr(variable, "_value", None)
        if (isinstance(grad, DTensor) and isinstance(value, DTensor)
                and _is_pending_sum_of(grad, value)):
            key = (id(grad.device_mesh), tuple(grad.placements), grad.dtype)
            buckets.setdefault(key, []).append(index)
    found = {}
    for indices in buckets.values():
        pieces = _sum_in_one([pairs[i][0] for i in indices])
        found.update(zip(indices, pieces))
    return found


def gradients_like_weights(pairs):
    """(gradient, variable) pairs with each DTensor weight's gradient laid
    out like the weight."""
    sums = _sum_pending(pairs)
    result = []
    for index, (grad, variable) in enumerate(pairs):
        value = getattr(variable, "_value", None)
        if index in sums:
            grad = DTensor.from_local(
                sums[index], grad.device_mesh, summed(grad.placements),
                run_check=False, shape=grad.shape, stride=grad.stride())
        if isinstance(grad, DTensor) and isinstance(value, DTensor):
            if tuple(grad.placements) != tuple(value.placements):
                grad = grad.redistribute(value.device_mesh, value.placements)
        elif isinstance(value, DTensor) and grad is not None:
            layout = getattr(variable, "_layout", None)
            if layout is not None:
                grad = to_layout(grad, as_layout(layout))
        result.append((grad, variable))
    return result


def local_gradients(pairs, device_mesh):
    """Each gradient's local piece, summed over the batch axes, when every
    gradient is laid out as its weight on `device_mesh` (or is sums of it
    to take); else None, with nothing communicated."""
    for grad, variable in pairs:
        if grad is None:
            continue
        if not (isinstance(grad, DTensor) and grad.device_mesh == device_mesh):
            return None
        places = tuple(grad.placements)
        if places != tuple(variable._value.placements) and not _is_pending_sum_of(
                grad, variable._value):
            return None
    sums = _sum_pending(pairs)
    return [None if grad is None else sums.get(index, grad._local_tensor)
            for index, (grad, _) in enumerate(pairs)]


def _apply_summed(original, optimizer, grads, trainable_variables):
    """`original` apply on a local step's gradients summed over the
    processes; the applies it makes in turn take them as they are."""
    local_updates.APPLYING[0] = True
    try:
        return original(optimizer, local_step.reduce_gradients(grads),
                        trainable_variables)
    finally:
        local_updates.APPLYING[0] = False


def wrap_apply(original):
    """`optimizer.apply`: gradients laid out like their weights first; on
    each process's pieces where `local_updates` says it may."""

    @functools.wraps(original)
    def apply(self, grads, trainable_variables=None):
        variables = (trainable_variables if trainable_variables is not None
                     else getattr(self, "_trainable_variables", None))
        if variables is None or local_updates.APPLYING[0]:
            return original(self, grads, trainable_variables)
        if local_step.stepping():  # in a local step's scope: sum, then update
            return _apply_summed(original, self, grads, trainable_variables)
        pairs = list(zip(grads, variables))
        mesh = local_updates.local_update_mesh(self, variables)
        if mesh is not None:
            local = local_gradients(pairs, mesh)
            if local is not None:
                return local_updates.apply_locally(self, original, local,
                                                   variables)
        pairs = gradients_like_weights(pairs)
        return original(self, [g for g, _ in pairs], trainable_variables)

    return apply


def wrap_outer_apply(original):
    """`apply` of an optimizer that applies through others
    (`LossScaleOptimizer`, after its test that the gradients are finite;
    `MultiOptimizer`): in a local step the gradients are summed over the
    processes before it looks at them, so every process decides alike (a
    process skipping the step alone would skip the all-reduce that the
    others wait in), in one all-reduce for all the optimizers it holds."""

    @functools.wraps(original)
    def apply(self, grads, trainable_variables=None):
        if not local_step.stepping() or local_updates.APPLYING[0]:
            return original(self, grads, trainable_variables)
        return _apply_summed(original, self, grads, trainable_variables)

    return apply
