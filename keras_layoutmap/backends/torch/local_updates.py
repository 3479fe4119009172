"""An optimizer's update on each process's own pieces: the torch fast path.

Keras' optimizer updates every weight from its gradient and its slots (the
optimizer's variables made from it: Adam's moments, ...). On DTensors that
is decided op by op, in Python, at many times the cost of a small op. Where
what each process holds is all that its part of the update reads, the
update runs on the local tensors instead, with the same arithmetic:

- **everything replicated** (data parallel): every process holds the same
  weights, gradients (once summed) and slots, and makes the same update;
- **weights split** (FSDP, or any plan that splits a weight): where the
  optimizer's update is elementwise (`ELEMENTWISE`: each number of a
  weight is updated from the same position of its gradient and slots, and
  from scalars), and each trainable weight, its gradient and each of its
  slots are laid out alike, each process updates the numbers it holds,
  which are the numbers DTensor's ops would update there. Clipping by a
  norm (`clipnorm`, `global_clipnorm`) reads the whole gradient: it keeps
  the DTensor path, as does any optimizer not in `ELEMENTWISE` (Lamb,
  Adafactor, Muon, a subclass's own update). A `LossScaleOptimizer` tests
  the gradients on DTensors, then its inner optimizer updates as above.

Anything else updates on DTensors (`gradients.wrap_apply`).
"""

import torch
from torch.distributed.tensor import DTensor

from keras_layoutmap.backends.torch import local_pieces
from keras_layoutmap.backends.torch.gathered_weights import is_replicated
from keras_layoutmap.keras_internals import StatelessScope, in_stateless_scope
from keras_layoutmap.paths import reference_of

# Keras' own optimizers whose update of each weight is elementwise in the
# weight, its gradient and its slots (and scalars: the learning rate, the
# step count, Nadam's running product).
ELEMENTWISE = ("SGD", "Adam", "AdamW", "Adamax", "Nadam", "RMSprop",
               "Adagrad", "Adadelta", "Ftrl", "Lion")
APPLYING = [False]  # set while `apply_locally` runs


def elementwise(optimizer):
    """Whether `optimizer` is one of Keras' `ELEMENTWISE` optimizers (not a
    subclass of one: its update may read more), clipping no norm."""
    cls = type(optimizer)
    return (cls.__module__.startswith("keras.src.") and cls.__name__ in ELEMENTWISE
            and getattr(optimizer, "clipnorm", None) is None
            and getattr(optimizer, "global_clipnorm", None) is None)


def _laid_out_alike(optimizer, variables):
    """Each slot laid out as the weight it was made for (its mesh dims'
    placements and its shape), that weight one of `variables`; every other
    optimizer variable (the step count, the learning rate) replicated."""
    updated = {id(v) for v in variables}
    for slot in optimizer.variables:
        value = slot._value
        weight = reference_of(slot)
        if weight is None:
            if not is_replicated(value):
                return False
            continue
        if (id(weight) not in updated
                or tuple(weight._value.placements) != tuple(value.placements)
                or weight._value.shape != value.shape):
            return False
    return True


def local_update_mesh(optimizer, variables):
    """The `DeviceMesh` on which the optimizer may update `variables` on
    each process's own pieces (see above), or None (then it updates them
    on DTensors, as in a scope of the caller's own: `stateless_apply`)."""
    if not local_pieces.ENABLED or not optimizer.built or in_stateless_scope():
        return None
    values = [getattr(v, "_value", None)
              for v in (*variables, *optimizer.variables)]
    if not values or not all(isinstance(x, DTensor) for x in values):
        return None
    mesh = values[0].device_mesh
    if not all(x.device_mesh == mesh for x in values):
        return None
    if all(is_replicated(x) for x in values):
        return mesh
    if elementwise(optimizer) and _laid_out_alike(optimizer, variables):
        return mesh
    return None


def apply_locally(optimizer, original, grads, variables):
    """`original(optimizer, grads, variables)` on each process's local
    pieces: `grads` are the local pieces of gradients laid out as their
    weights, where `local_update_mesh` said the update may run so."""
    state = [*variables, *optimizer.variables]
    mapping = {id(v): v._value._local_tensor for v in state}
    scope = StatelessScope()
    scope.state_mapping = dict(mapping)
    APPLYING[0] = True  # an inner optimizer's apply (loss scaling) as it is
    try:
        with scope:
            result = original(optimizer, grads, variables)
    finally:
        APPLYING[0] = False
    # What was updated in place is in the local tensors already; what was
    # assigned, the scope kept.
    with torch.no_grad():
        for key, local in mapping.items():
            new = scope.state_mapping[key]
            if new is not local:
                local.copy_(new)
    return result
