"""`klm.auto_layout_map`: a tensor-parallel plan derived from a model.

`weight_roles.describe` reads what each weight is from the model's layers
and shapes (column- or row-parallel, heads, embedding, experts, a bias that
follows its kernel, a norm); `rules.auto` turns those roles into layouts
(divisibility, fallbacks, the data axis when memory needs it). This module
checks the inputs, builds a builder's model with shapes only, and writes
the layouts as a `klm.LayoutMap`, one rule per weight.

See docs/rules.md, "Automatic plans".
"""

import collections
import contextlib
import re

import keras

from keras_layoutmap.keras_internals import BaseOptimizer, global_state
from keras_layoutmap.layout_map import LayoutMap
from keras_layoutmap.mesh import as_mesh
from keras_layoutmap.rules import auto
from keras_layoutmap.weight_roles import describe


def auto_layout_map(model_or_builder, mesh, *, model_axis="model",
                    data_axis="batch", device_memory=None):
    """A `klm.LayoutMap` derived from a model's layers and weight shapes.

    Dense and EinsumDense kernels become column-parallel then row-parallel
    pairs (one reduction per block), attention is split by heads (key/value
    heads the model axis does not divide are split on their input
    features instead), embeddings over the vocabulary, mixture of
    experts weights over experts, biases follow their kernel and norms are
    replicated. Every layout divides its weight's shape. Each rule is the
    escaped object path of one weight, so the plan can be printed, edited
    and saved (`to_json()`); `plan.explain(model)` says why each weight got
    its layout.

    Without `device_memory`, every weight of rank 2 or more is also split
    over `data_axis` where its shape allows (the least memory per device, as
    keras-hub's `get_layout_map` recipes do). With it, weights are split
    over `data_axis` (FSDP) only as far as needed for the weights to fit,
    largest first.

    On JAX, the outputs of attention's query, key and value projections
    also get a rule (`"<layer path>/output"`, see docs/rules.md): the batch
    over `data_axis`, the heads over `model_axis`. Training splits them so
    anyway; while a model decodes, XLA would keep the batch whole, and the
    cache of keys and values would be split over the model axis alone.
    (On TensorFlow and torch, measured, these relayouts cost the training
    step and did not speed decoding; torch's cache takes the split of the
    keys written into it.)

    Args:
        model_or_builder (keras.Model | callable): a built `keras.Model`,
            or a function of no arguments that returns one: it is then
            built with shapes only (no weight gets memory; it may compile
            the model), and Keras' automatic layer names are left as they
            were, so the model built next under the plan gets the paths the
            plan names.
        mesh (klm.Mesh): a `klm.Mesh` (or `keras.distribution.DeviceMesh`)
            with the axes `model_axis` and `data_axis`.
        model_axis (str): the mesh axis tensor parallelism splits over.
        data_axis (str | None): the mesh axis batches are split over (None:
            weights are never split over it).
        device_memory (int | str | None): bytes for weights per device (an
            int, or text such as `"16GiB"`), or None.

    Returns:
        plan (klm.LayoutMap): a map on `mesh`, one exact rule per weight
            (on JAX, and per output of an attention projection).

    Raises:
        ValueError: a mesh without the named axes, a model with no weights,
            or a `device_memory` that no plan meets (the message gives the
            bytes per device of the smallest plan).
        RuntimeError: the builder failed (the message says how).
        TypeError: `model_or_builder` is neither a model nor a builder.

    Example:

    >>> import keras, keras_layoutmap as klm
    >>> mesh = klm.Mesh.for_planning([("batch", 2), ("model", 2)])
    >>> def build():
    ...     inputs = keras.Input((8,))
    ...     x = keras.layers.Dense(16, name="up")(inputs)
    ...     return keras.Model(inputs, keras.layers.Dense(8, name="down")(x))
    >>> plan = klm.auto_layout_map(build, mesh)
    >>> plan[r"up\\.kernel"].sharding_specs
    ['batch', 'model']
    >>> plan[r"down\\.kernel"].sharding_specs
    ['model', 'batch']
    """
    mesh = _check_mesh(mesh, model_axis, data_axis)
    budget = _budget(device_memory)
    model = _model(model_or_builder)
    weights = describe(model, backend=keras.backend.backend())
    if not weights:
        raise ValueError(
            f"auto_layout_map: the model {model.name!r} has no weights to "
            "plan. Build it first (call it on an input, or give "
            "`keras.Input` shapes), or pass a function that builds it."
        )
    sizes = dict(zip(mesh.axis_names, (int(s) for s in mesh.shape)))
    placements = auto.plan(weights, sizes, model_axis=model_axis,
                           data_axis=data_axis, device_memory=budget)
    layout_map = LayoutMap(mesh)
    for p in placements:
        key = re.escape(p.path)
        layout_map[key] = p.specs
        layout_map.set_reason(key, p.reason)
    if keras.backend.backend() == "jax":
        for path, specs, reason in auto.output_layouts(
                weights, placements, model_axis=model_axis,
                data_axis=auto.splitting_axis(data_axis, sizes)):
            key = re.escape(path)
            layout_map[key] = specs
            layout_map.set_reason(key, reason)
    return layout_map


def _check_mesh(mesh, model_axis, data_axis):
    try:
        mesh = as_mesh(mesh)
    except (TypeError, ValueError) as e:
        raise TypeError(f"auto_layout_map: `mesh` must be a klm.Mesh: {e}") from None
    if mesh is None:
        raise TypeError("auto_layout_map: `mesh` must be a klm.Mesh. Received: None")
    names = list(mesh.axis_names)
    for what, axis in (("model_axis", model_axis), ("data_axis", data_axis)):
        if axis is None and what == "data_axis":
            continue
        if axis not in names:
            raise ValueError(
                f"auto_layout_map: {what}={axis!r} is not an axis of the mesh "
                f"{mesh!r} (axes {names}). Name one of its axes, e.g. "
                f"{what}={names[-1 if what == 'model_axis' else 0]!r}."
            )
    if model_axis == data_axis:
        raise ValueError(
            f"auto_layout_map: model_axis and data_axis are both {model_axis!r}; "
            "they must be two different axes of the mesh."
        )
    return mesh


def _budget(device_memory):
    if device_memory is None:
        return None
    from keras_layoutmap.memory import parse_bytes

    try:
        return parse_bytes(device_memory)
    except ValueError as e:
        raise ValueError(f"auto_layout_map: {e}") from None


def _model(model_or_builder):
    """The model to plan: itself, or what the builder returns, built with
    shapes only."""
    if isinstance(model_or_builder, keras.layers.Layer):
        return model_or_builder
    if not callable(model_or_builder):
        raise TypeError(
            "auto_layout_map expects a keras.Model or a function of no "
            f"arguments that returns one. Received: {model_or_builder!r} of "
            f"type {type(model_or_builder).__name__}"
        )
    name = getattr(model_or_builder, "__qualname__", repr(model_or_builder))
    try:
        model = build_shapes_only(model_or_builder)
    except Exception as e:
        hint = ""
        if "stateless scope" in str(e):
            hint = (" (the builder runs with shapes only, where variables "
                    "come from layers' `add_weight`: make other state after "
                    "it returns)")
        raise RuntimeError(
            f"auto_layout_map: the builder {name} failed while building the "
            f"model from shapes{hint}: {type(e).__name__}: {e}"
        ) from e
    if not isinstance(model, keras.layers.Layer):
        raise TypeError(
            f"auto_layout_map: the builder {name} returned "
            f"{type(model).__name__}, expected a keras.Model"
        )
    return model


def build_shapes_only(builder, keep_names=True):
    """`builder()` inside `keras.StatelessScope(initialize_variables=False)`:
    every weight gets its shape, dtype and path, none gets memory. With
    `keep_names`, Keras' automatic layer-name counters are put back after,
    so the next model built gets the names this one had.

    Example:

    >>> import keras
    >>> from keras_layoutmap.auto_plan import build_shapes_only
    >>> model = build_shapes_only(lambda: keras.Sequential(
    ...     [keras.Input((4,)), keras.layers.Dense(2)]))
    >>> tuple(model.weights[0].shape)
    (4, 2)
    """
    with contextlib.ExitStack() as stack:
        if keep_names:
            stack.enter_context(_names_kept())
        stack.enter_context(_optimizers_outside_the_scope())
        stack.enter_context(keras.StatelessScope(initialize_variables=False))
        return builder()


@contextlib.contextmanager
def _optimizers_outside_the_scope():
    """Let an optimizer made while a builder runs (`compile()`; keras-hub's
    task models compile as they are made) create its iteration counter, a
    scalar with a value, which a `StatelessScope` refuses."""
    original = BaseOptimizer.__init__

    def __init__(self, *args, **kwargs):
        scope = global_state.get_global_attribute("stateless_scope")
        global_state.set_global_attribute("stateless_scope", None)
        try:
            original(self, *args, **kwargs)
        finally:
            global_state.set_global_attribute("stateless_scope", scope)

    BaseOptimizer.__init__ = __init__
    try:
        yield
    finally:
        BaseOptimizer.__init__ = original


@contextlib.contextmanager
def _names_kept():
    """Put Keras' automatic-name counters back as they were on exit."""
    before = global_state.get_global_attribute("object_name_uids")
    saved = None if before is None else collections.defaultdict(int, before)
    try:
        yield
    finally:
        global_state.set_global_attribute(
            "object_name_uids",
            saved if saved is not None else collections.defaultdict(int))
