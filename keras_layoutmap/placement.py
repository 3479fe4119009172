"""Where a model's state lives: moved, whole, to the placement a
distribution asks for.

A model lives on one placement at a time: no distribution (every variable
on one device), or one mesh. Before `fit`, `evaluate`, `predict` and the
other trainer entry points run (see `trainer.py`), `place_model(model, dist)`
moves every variable of the model, its metrics and its optimizer that is not
where `dist` wants it:

- `dist` is None, or its mesh has one device: variables on a mesh of several
  devices come back to one device;
- otherwise: variables with no layout, or with a layout on another mesh,
  take the layout `dist` gives them (a `<weight>_layout=` kwarg, then the
  first matching rule, by object path, else replicated); an optimizer slot
  takes the layout of the weight it was made for. Variables already on the
  mesh keep their layout.

Every target layout is resolved before anything moves, so a layout that
does not fit (a dimension the mesh axis does not divide, a kwarg on another
mesh) raises with nothing half-moved. After a move, the model's traced
train / test / predict functions are dropped: they captured the old
placement.

Example:

>>> import keras, keras_layoutmap as klm
>>> from keras_layoutmap.placement import place_model
>>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
>>> mesh = klm.create_mesh([("batch", len(klm.list_devices()))])
>>> place_model(model, klm.DataParallel(mesh))
True
>>> klm.fetch_layout(model.layers[0].kernel).mesh == mesh
True
>>> place_model(model, None)  # back to one device
True
>>> klm.fetch_layout(model.layers[0].kernel).mesh.size
1
"""

import weakref

from keras_layoutmap import backends, paths
from keras_layoutmap.distributions import _Resolving
from keras_layoutmap.keras_internals import BaseOptimizer, compiled_metric_objects
from keras_layoutmap.layout import as_layout
from keras_layoutmap.paths import reference_of
from keras_layoutmap.rules.resolve import resolve_weight
from keras_layoutmap.zero import slot_layout_for


def _several(mesh):
    """`mesh` if it has several devices; None for one device (or none)."""
    return mesh if mesh is not None and mesh.devices.size > 1 else None


def _mesh_of(layout):
    """The mesh a variable with `layout` occupies; None for one device."""
    return None if layout is None else _several(layout.device_mesh)


def _same_mesh(a, b):
    return a is b or (a is not None and b is not None and a == b)


def model_state(model):
    """Every variable of `model`, its compiled metrics (built or not) and
    its optimizer, once each, in a stable order."""
    variables = list(model.variables) + list(model.metrics_variables)
    for metric in compiled_metric_objects(model):  # compiled, not yet built
        variables += list(metric.variables)
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None:
        variables += list(optimizer.variables)
    return list({id(v): v for v in variables}.values())


def _resolver(model, dist):
    """A function `variable -> layout` under `dist`, ignoring the layout the
    variable has now: what `dist` would give it if it were made now."""
    owners = paths.object_paths(model, with_owner=True)

    def resolve(variable):
        if not isinstance(dist, _Resolving):  # a plain keras distribution
            current = variable._layout
            variable._layout = None
            try:
                return as_layout(dist.get_variable_layout(variable))
            finally:
                variable._layout = current
        object_path, owner = owners.get(id(variable), (None, None))
        _, layout = resolve_weight(
            owner=owner, name=variable.name,
            shape=tuple(int(d) for d in variable.shape),
            object_path=object_path, path=variable.path,
            layout_map=getattr(dist, "layout_map", None),
            mesh=dist.device_mesh, dtype=variable.dtype,
        )
        return layout

    return resolve


def plan(model, dist):
    """`[(variable, layout_or_None), ...]`: the moves that put `model` where
    `dist` wants it (None: one device). Raises, moving nothing, when a
    target layout does not fit its variable."""
    target = None if dist is None else _several(dist.device_mesh)
    state = model_state(model)
    moving = [
        v for v in state
        if not _same_mesh(_mesh_of(getattr(v, "_layout", None)), target)
    ]
    if not moving:
        return []
    if target is None:
        return [(v, None) for v in moving]
    resolve = _resolver(model, dist)
    targets = {}
    slots = []
    for variable in moving:
        if reference_of(variable) is not None:
            slots.append(variable)
        else:
            targets[id(variable)] = resolve(variable)
    for slot in slots:
        reference = reference_of(slot)
        layout = targets.get(id(reference))
        if layout is None:
            current = getattr(reference, "_layout", None)
            layout = (as_layout(current) if _same_mesh(_mesh_of(current), target)
                      else resolve(reference))
        if tuple(slot.shape) != tuple(reference.shape):
            layout = resolve(slot)  # not a slot shaped like its weight
        else:
            layout = slot_layout_for(reference, layout)  # a ZeRO plan's split
        targets[id(slot)] = layout
    return [(v, targets[id(v)]) for v in moving]


def place_model(model, dist):
    """Move the state of `model` to where `dist` wants it (see the module
    docstring). Returns whether anything moved."""
    moves = plan(model, dist)
    if not moves:
        return False
    backend = backends.get()
    for variable, layout in moves:
        if layout is None:
            backend.unplace_variable(variable)
        else:
            backend.relayout_variable(variable, layout)
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None and getattr(optimizer, "built", False):
        # TensorFlow optimizers index weights by the backend variable, which
        # a move replaces.
        optimizer._trainable_variables_indices = {
            optimizer._var_key(v): i
            for i, v in enumerate(optimizer._trainable_variables)
        }
    after_place = getattr(backend, "after_place", None)
    if after_place is not None:  # e.g. torch's list of a module's parameters
        after_place(model)
    # The traced steps captured the old variables' placement.
    for name in ("train_function", "test_function", "predict_function"):
        if hasattr(model, name):
            setattr(model, name, None)
    return True


def _wrap_add_variable_from_reference(original):
    def add_variable_from_reference(self, reference_variable, *args, **kwargs):
        # Keras gives a slot its weight's `_layout`; a ZeRO plan splits it.
        layout = getattr(reference_variable, "_layout", None)
        slot = slot_layout_for(reference_variable, layout)
        if slot is not layout:
            reference_variable._layout = slot
        try:
            variable = original(self, reference_variable, *args, **kwargs)
        finally:
            if slot is not layout:
                reference_variable._layout = layout
        try:
            variable._klm_reference = weakref.ref(reference_variable)
        except TypeError:  # not weak-referenceable: no slot link
            pass
        return variable

    add_variable_from_reference.__wrapped__ = original
    return add_variable_from_reference


_INSTALLED = False


def install():
    """Record which weight each optimizer slot belongs to (idempotent)."""
    global _INSTALLED
    if _INSTALLED:
        return
    BaseOptimizer.add_variable_from_reference = (
        _wrap_add_variable_from_reference(
            BaseOptimizer.add_variable_from_reference))
    _INSTALLED = True
