"""`fit` / `evaluate` / `predict` (and the `*_on_batch` methods) on a mesh.

Each batch becomes DTensors by the distribution's data layout for that
batch's shape (so a short last batch is split unevenly, exactly), Keras'
own step runs on them (DTensor inserts the collectives: gradients of
replicated weights are summed over the batch axis), gradients are laid out
like their weights before the optimizer applies them, and what a step
returns (metrics, predictions) comes back whole to every process.

Across processes, `auto_shard_dataset=True` means every process passes the
same global data (each keeps its own rows); with `False` each passes its
own slice and the slices are gathered into the global batch first.
"""

import functools

import torch
from keras import distribution as keras_distribution
from keras.src import tree
from torch.distributed.tensor import DTensor, Partial, Replicate

from keras_layoutmap.backends.torch import processes
from keras_layoutmap.backends.torch.placement import (
    describe_mesh,
    to_device_mesh,
    to_host,
    to_layout,
)


def check_mesh(x, device_mesh, whose):
    """A DTensor input must be on `device_mesh`."""
    if x.device_mesh != device_mesh:
        raise ValueError(
            f"An input is a DTensor on another mesh {describe_mesh(x.device_mesh)} "
            f"than {whose}, {describe_mesh(device_mesh)}. Place inputs with a "
            "layout on that mesh (klm.distribute(x, klm.Layout.batch_sharded("
            "mesh, 'batch', rank))), or pass host data and let the "
            "distribution place it."
        )


_IN_STEP = [False]  # set while a step made by wrap_make_function runs


def _summed(placements):
    """`placements` with every pending sum (`Partial`) taken."""
    return tuple(Replicate() if isinstance(p, Partial) else p for p in placements)


def _reduced(x):
    """A model's output with its pending sums taken (a row-sharded last
    layer leaves `Partial` placements): a value, as on JAX and TF."""
    if isinstance(x, DTensor) and any(isinstance(p, Partial) for p in x.placements):
        return x.redistribute(x.device_mesh, _summed(x.placements))
    return x


def wrap_model_call(original):
    """A model on a mesh called on a DTensor from another mesh: a clear
    error, not DTensor's cross-mesh failure deep inside a layer."""

    @functools.wraps(original)
    def __call__(self, *args, **kwargs):
        # Inside fit & co. the batches were placed (and checked) already.
        inputs = [] if _IN_STEP[0] else [
            x for x in tree.flatten((args, kwargs)) if isinstance(x, DTensor)]
        if inputs:
            mesh = next((v._value.device_mesh for v in self.variables
                         if isinstance(getattr(v, "_value", None), DTensor)), None)
            if mesh is not None:
                for x in inputs:
                    check_mesh(x, mesh, f"model {self.name!r}'s variables")
        return tree.map_structure(_reduced, original(self, *args, **kwargs))

    return __call__


def _mesh_distribution():
    dist = keras_distribution.distribution()
    if dist is None or dist.device_mesh is None or dist.device_mesh.size <= 1:
        return None
    return dist


def distribute_batch(data, dist):
    """Every tensor of a batch as a DTensor with the distribution's data
    layout for its shape."""
    from keras.src.backend.torch.core import convert_to_tensor

    gather = (processes.process_count() > 1
              and not getattr(dist, "auto_shard_dataset", True))

    def place(x):
        if x is None:
            return x
        if isinstance(x, DTensor):
            check_mesh(x, to_device_mesh(dist.device_mesh), "the distribution's")
            return x
        x = convert_to_tensor(x)
        if gather:
            x = processes.all_gather_rows(x)
        layout = dist.get_data_layout(tuple(x.shape))
        from keras_layoutmap.layout import as_layout

        return to_layout(x, as_layout(layout))

    return tree.map_structure(place, data)


def _host_outputs(outputs):
    return tree.map_structure(
        lambda x: to_host(x) if isinstance(x, DTensor) else x, outputs)


def wrap_make_function(original, attribute):
    """`make_train_function` & co.: the step they make takes DTensor
    batches on a mesh and returns host values."""

    @functools.wraps(original)
    def make_function(self, force=False):
        if getattr(self, attribute) is not None and not force:
            return getattr(self, attribute)
        original(self, force=force)
        step = getattr(self, attribute)
        if getattr(step, "_klm_wrapped", False):
            return step

        def function(data):
            dist = _mesh_distribution()
            if dist is None:
                return step(data)
            data = [distribute_batch(batch, dist) for batch in data]
            _IN_STEP[0] = True
            try:
                return _host_outputs(step(data))
            finally:
                _IN_STEP[0] = False

        function._klm_wrapped = True
        setattr(self, attribute, function)
        return function

    return make_function


def _summed_together(grads):
    """Partial-sum gradients (DTensor's gradient of a weight replicated over
    an axis that splits the batch) reduced with one all-reduce per mesh
    axis for all of them, as DDP buckets its gradients, instead of one
    each. `grads`: DTensors of one mesh, placements and dtype."""
    first = grads[0]
    mesh = first.device_mesh
    flat = torch.cat([g.to_local().reshape(-1) for g in grads])
    for mesh_dim, place in enumerate(first.placements):
        if isinstance(place, Partial):
            torch.distributed.all_reduce(flat, group=mesh.get_group(mesh_dim))
    target = _summed(first.placements)
    result, start = [], 0
    for g in grads:
        local = g.to_local()
        piece = flat[start:start + local.numel()].view(local.shape)
        start += local.numel()
        result.append(DTensor.from_local(piece, mesh, target, run_check=False,
                                         shape=g.shape, stride=g.stride()))
    return result


def _sum_partial_gradients(pairs):
    """Where a gradient differs from its weight's placements only by
    partial sums (sum), reduce those gradients in buckets."""
    buckets = {}
    for index, (grad, variable) in enumerate(pairs):
        value = getattr(variable, "_value", None)
        if not (isinstance(grad, DTensor) and isinstance(value, DTensor)):
            continue
        places = tuple(grad.placements)
        if places == tuple(value.placements):
            continue
        if _summed(places) != tuple(value.placements) or any(
                isinstance(p, Partial) and p.reduce_op != "sum" for p in places):
            continue
        key = (id(grad.device_mesh), places, grad.dtype)
        buckets.setdefault(key, []).append(index)
    pairs = list(pairs)
    for indices in buckets.values():
        reduced = _summed_together([pairs[i][0] for i in indices])
        for i, grad in zip(indices, reduced):
            pairs[i] = (grad, pairs[i][1])
    return pairs


def gradients_like_weights(grads_and_vars):
    """Gradients of DTensor weights laid out like their weight (DTensor
    leaves the gradient of a replicated weight as partial sums)."""
    result = []
    for grad, variable in _sum_partial_gradients(grads_and_vars):
        value = getattr(variable, "_value", None)
        if isinstance(grad, DTensor) and isinstance(value, DTensor):
            if tuple(grad.placements) != tuple(value.placements):
                grad = grad.redistribute(value.device_mesh, value.placements)
        elif isinstance(value, DTensor) and grad is not None:
            from keras_layoutmap.layout import as_layout

            layout = getattr(variable, "_layout", None)
            if layout is not None:
                grad = to_layout(grad, as_layout(layout))
        result.append((grad, variable))
    return result


def wrap_apply(original):
    @functools.wraps(original)
    def apply(self, grads, trainable_variables=None):
        variables = (trainable_variables if trainable_variables is not None
                     else getattr(self, "_trainable_variables", None))
        if variables is not None:
            grads = list(grads)
            pairs = gradients_like_weights(list(zip(grads, variables)))
            grads = [g for g, _ in pairs]
        return original(self, grads, trainable_variables)

    return apply


def retrack_parameters(model):
    """Keras torch layers list their variables' parameters for torch
    (`zero_grad`, `parameters()`); a moved variable holds a new parameter."""
    for layer in model._flatten_layers(include_self=True):
        if hasattr(layer, "_torch_params"):
            layer._track_variables()

