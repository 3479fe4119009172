"""`fit` / `evaluate` / `predict` on a mesh: each batch packed by the
distribution's data layout for its shape, Keras' own step run in a
`tf.function` that DTensor expands to every device, predictions gathered to
the host, and DTensor's layout errors made plain."""

import contextvars
import functools
import re

import numpy as np
import tensorflow as tf
from keras import tree
from tensorflow.experimental import dtensor

from keras_layoutmap.backends.tensorflow.placement import (
    is_dtensor,
    mesh_distribution,
    to_dmesh,
    to_host,
)
from keras_layoutmap.backends.tensorflow.processes import (
    gather_process_batches,
    process_count,
)
from keras_layoutmap.backends.tensorflow.random_draws import (
    _traced_mesh,
    mesh_step,
)
from keras_layoutmap.data import distribute as checked_distribute
from keras_layoutmap.layout import as_layout


def _check_inputs_on_mesh(model, inputs):
    """Refuse, before DTensor does, a plain tensor passed eagerly to a model
    whose variables live on a mesh: say what to do instead."""
    variables = model.variables
    # A variable of shapes only (made in a `keras.StatelessScope`, as
    # `klm explain` and `klm.auto_layout_map` build) holds no value.
    value = getattr(variables[0], "_value", None) if variables else None
    if value is None or not is_dtensor(value):
        return
    layout = dtensor.fetch_layout(value)
    if layout is None:
        return
    mesh = layout.mesh
    for index, x in enumerate(tree.flatten(inputs)):
        if not isinstance(x, (np.ndarray, tf.Tensor)) or len(x.shape) == 0:
            continue
        if tf.is_tensor(x) and is_dtensor(x):
            other = dtensor.fetch_layout(x).mesh
            if other != mesh:
                raise ValueError(
                    f"Model '{model.name}' has its variables on a mesh "
                    f"{dict(zip(mesh.dim_names, mesh.shape()))}, but input "
                    f"{index} is on another mesh "
                    f"{dict(zip(other.dim_names, other.shape()))}. Pack it "
                    "with a layout on the model's mesh."
                )
        else:
            raise ValueError(
                f"Model '{model.name}' has its variables on a mesh "
                f"{dict(zip(mesh.dim_names, mesh.shape()))}, but input {index} "
                f"is a plain {type(x).__name__} of shape {tuple(x.shape)}, "
                "not a tensor on that mesh. Place it first with "
                "klm.distribute(x, klm.Layout.batch_sharded(mesh, 'batch', "
                f"{len(x.shape)})) (or klm.pack one piece per device), or call "
                "model.predict(x), which packs batches for you."
            )


# The `dtensor.Mesh` of the model whose call a `tf.function` is tracing.
_MODEL_MESH = contextvars.ContextVar("klm_traced_model_mesh", default=None)


def _variables_mesh(model):
    """The `dtensor.Mesh` the variables of `model` live on, or None."""
    variables = model.variables
    layout = getattr(getattr(variables[0], "_value", None), "layout",
                     None) if variables else None
    return layout.mesh if isinstance(layout, dtensor.Layout) else None


def traced_mesh():
    """While a `tf.function` is traced: the mesh of the model on a mesh it
    calls, or of the distribution a `fit` / `evaluate` / `predict` step
    runs on; None eagerly and off a mesh."""
    if tf.executing_eagerly():
        return None
    mesh = _MODEL_MESH.get()
    return mesh if mesh is not None else _traced_mesh()


def wrap_model_call(original):
    """Eagerly, inputs checked against the mesh of the model's variables;
    traced, that mesh said (`traced_mesh`) for the span of the outermost
    call."""

    @functools.wraps(original)
    def __call__(self, *args, **kwargs):
        if tf.executing_eagerly():
            _check_inputs_on_mesh(self, args)
            return original(self, *args, **kwargs)
        mesh = None if _MODEL_MESH.get() is not None else _variables_mesh(self)
        if mesh is None:
            return original(self, *args, **kwargs)
        token = _MODEL_MESH.set(mesh)
        try:
            return original(self, *args, **kwargs)
        finally:
            _MODEL_MESH.reset(token)

    return __call__


def _pack_batch(data, dist):
    """`data` (a nest of host arrays or tensors) placed on the mesh: each
    leaf by the distribution's data layout for its shape. Leaves already on
    the distribution's mesh are left as they are."""
    dmesh = to_dmesh(dist.device_mesh)
    gather = process_count() > 1 and not dist.auto_shard_dataset

    def place(x):
        if x is None:
            return None
        if tf.is_tensor(x) and is_dtensor(x):
            mesh = dtensor.fetch_layout(x).mesh
            if mesh != dmesh:
                raise ValueError(
                    "An input is a DTensor on another mesh "
                    f"{dict(zip(mesh.dim_names, mesh.shape()))} than the "
                    f"model's, {dist.device_mesh!r}. Pack inputs with a layout on the "
                    "model's mesh (klm.Layout.batch_sharded(mesh, ...)), or "
                    "pass host arrays and let the distribution pack them."
                )
            return x
        if isinstance(x, tf.Tensor):
            x = x.numpy()
        array = np.asarray(x)
        if gather:
            array = gather_process_batches(array)
        layout = as_layout(dist.get_data_layout(array.shape))
        return checked_distribute(array, layout)

    return tree.map_structure(place, data)


class _PackedBatches:
    """The batches of `iterator` packed onto the mesh of `dist`."""

    def __init__(self, iterator, dist):
        self._iterator = iter(iterator)
        self._dist = dist

    def __iter__(self):
        return self

    def __next__(self):
        try:
            data = next(self._iterator)
        except tf.errors.OutOfRangeError:
            raise StopIteration from None
        return _pack_batch(data, self._dist)


_NO_LAYOUT_RULE = re.compile(r"'(tf\.\w+)' op does not implement layout propagation")
_LOOP = (" (a tf.while_loop over a TensorArray: Keras' recurrent layers loop "
         "this way on TensorFlow; build them with unroll=True)")
_WHERE_OPS_COME_FROM = {
    "tf.EmptyTensorList": _LOOP,
    "tf.TensorListReserve": _LOOP,
    "tf.TensorListFromTensor": _LOOP,
    "tf.ReverseV2": (" (tf.reverse: Keras' recurrent layers with "
                     "go_backwards=True, as the backward half of Bidirectional, "
                     "and ops.flip)"),
}


# The op DTensor's SPMD expansion failed on: `... see current operation:
# %5 = "tf.ConcatV2"(...)` (`%6:2 = ...` for several results).
_CURRENT_OP = re.compile(r'see current operation: %[\w#]+(?::\d+)? = "(tf\.\w+)"')
# DTensor's own ops, which no Keras layer emits.
_DTENSOR_OPS = ("tf.DTensorLayout", "tf.Relayout", "tf.RelayoutLike",
                "tf.CopyToMesh", "tf.CopyToMeshGrad")
_GRADIENT_SCOPES = ("gradient_tape", "gradients")


def _graph_nodes(graph_of):
    """`(op type, node name)` of each node of the step's traced graph and
    of the functions it calls; nothing where it cannot be had."""
    try:
        graph_def = graph_of().as_graph_def()
    except Exception:  # noqa: BLE001 (only a better message is at stake)
        return
    for node in graph_def.node:
        yield node.op, node.name
    for function in graph_def.library.function:
        for node in function.node_def:
            yield node.op, node.name


def _layer_named(scope, layers):
    """The layer a name scope of the traced step stands for: its name, or
    its name with the suffixes TensorFlow adds to a scope used again
    (`concatenate_1_1`), shortest last; None if none."""
    candidate = scope
    while True:
        if candidate in layers:
            return layers[candidate]
        stripped = re.sub(r"_\d+$", "", candidate)
        if stripped == candidate:
            return None
        candidate = stripped


def layers_emitting(model, op, graph_of):
    """`[(layer, in_gradient)]`: the Keras layers of `model` whose name
    scopes hold an op of type `op` (`"tf.ConcatV2"`) in the traced step
    (`graph_of()`: its graph), innermost layer of each op's scopes, in
    graph order, the outermost of layers found inside one another;
    `in_gradient` whether every such op is in the gradient. Read on the
    error path only."""
    op_type = op.removeprefix("tf.")
    layers = {layer.name: layer for layer in model._flatten_layers(
        include_self=False)}
    found = {}
    for node_op, name in _graph_nodes(graph_of):
        if node_op != op_type:
            continue
        scopes = name.split("/")[:-1]
        gradient = bool(scopes) and scopes[0] in _GRADIENT_SCOPES
        for scope in reversed(scopes):
            layer = _layer_named(scope, layers)
            if layer is not None:
                _, was = found.get(layer.name, (layer, True))
                found[layer.name] = (layer, was and gradient)
                break
    # A layer inside another found one (an LSTM's cell) is the outer's op.
    inner = {id(sub) for layer, _ in found.values()
             for sub in layer._flatten_layers(include_self=False)}
    return [(layer, gradient) for layer, gradient in found.values()
            if id(layer) not in inner]


def _emitted_by(model, op, graph_of):
    """The sentence naming the layers that emit `op`, or ''."""
    if graph_of is None or op is None or op in _DTENSOR_OPS:
        return ""
    found = layers_emitting(model, op, graph_of)
    if not found:
        return ""
    names = ", ".join(
        f"'{layer.name}' ({type(layer).__name__}"
        f"{', in its gradient' if gradient else ''})"
        for layer, gradient in found)
    return (f" The op '{op}' comes from layer{'s' if len(found) > 1 else ''} "
            f"{names}.")


def _run_step(model, step, data, graph_of=None):
    """`step(data)` on the mesh, with DTensor's layout errors made plain:
    the op, the Keras layers that emit it (`graph_of()`: the traced step's
    graph, read only then) and what to do."""
    try:
        with mesh_step():
            return step(data)
    except tf.errors.OpError as error:
        message = str(error)
        if graph_of is None and hasattr(step, "get_concrete_function"):
            def graph_of():
                with mesh_step():  # the trace `step(data)` made, cached
                    return step.get_concrete_function(data).graph
        missing = _NO_LAYOUT_RULE.search(message)
        if missing:
            op = missing.group(1)
            hint = _WHERE_OPS_COME_FROM.get(op, "")
            raise ValueError(
                f"DTensor cannot run a step of model '{model.name}' on a mesh: "
                f"it has no layout rule for the op '{op}'"
                f"{hint}.{_emitted_by(model, op, graph_of)} TensorFlow runs "
                "no plan that splits that op's operands (data parallel "
                f"included): {'change the layer as said, or ' if hint else ''}"
                "train on JAX or torch, which run such a model on a mesh."
            ) from error
        if "SPMD expansion" not in message and "spmd_expander" not in message:
            raise
        reason = message.split("error: ", 1)[-1].split("\n", 1)[0]
        current = _CURRENT_OP.search(message)
        op = current.group(1) if current else None
        emitted = _emitted_by(model, op, graph_of)
        if emitted:
            what = (" Give those layers' weights, or the weights of the "
                    "layers next to them, whole layouts (a LayoutMap rule "
                    "of None for each dimension), or train under "
                    "klm.DataParallel, which keeps every weight whole.")
        else:
            what = ""
        raise ValueError(
            f"DTensor cannot run a step of model '{model.name}' with the "
            f"layouts it was given: {reason}{emitted} TensorFlow runs only "
            "the combinations its SPMD expansion supports (JAX reshards "
            f"instead).{what} For a matmul, shard the contracting dimension "
            "of both operands on the same mesh axis, or on none. See the "
            "layouts with klm.explain(model)."
        ) from error


def _build_for_no_data(model, iterator):
    """Plain Keras traces its step even for empty data, which builds the
    compiled metrics and loss; build them from the data's spec instead, so
    `fit` / `evaluate` on empty data end as they do without a mesh."""
    spec = getattr(iterator, "element_spec", None)
    if spec is not None:
        model._symbolic_build(data_batch=spec)


def wrap_make_function(original):
    def _make_function(self, step_function):
        keras_function = original(self, step_function)
        compiled = {}

        def function(iterator):
            dist = mesh_distribution()
            if dist is None:
                return keras_function(iterator)
            if "step" not in compiled:
                # No XLA: DTensor expands the function to every device itself.
                # A trace per batch shape (the full one, the short last one),
                # not one relaxed to an unknown batch size: DTensor lays out
                # a step from its shapes, and with an unknown batch dimension
                # it chose layouts its own Transpose then refused (a
                # keras-hub Gemma under its recipe, on the short batch).
                compiled["step"] = (
                    step_function if self.run_eagerly
                    else tf.function(step_function, reduce_retracing=False))
            batches = _PackedBatches(iterator, dist)
            outputs = None
            for _ in range(self.steps_per_execution):
                try:
                    data = next(batches)
                except StopIteration:
                    if outputs is None:
                        _build_for_no_data(self, iterator)
                        raise
                    break
                outputs = _run_step(self, compiled["step"], data)
            return outputs

        return function

    return _make_function


def wrap_make_predict_function(original):
    def make_predict_function(self, force=False):
        if self.predict_function is not None and not force:
            return self.predict_function
        original(self, force=force)
        keras_function = self.predict_function

        def predict_function(data):
            dist = mesh_distribution()
            if dist is None:
                return keras_function(data)
            packed = [_pack_batch(d, dist) for d in data]

            def graph_of():  # the error path only: a trace of the step
                step = tf.function(self.predict_step, reduce_retracing=False)
                with mesh_step():
                    return step.get_concrete_function(packed[0]).graph

            outputs = _run_step(self, keras_function, packed, graph_of)
            return tree.map_structure(to_host, outputs)

        self.predict_function = predict_function
        return predict_function

    return make_predict_function


def wrap_takes_host_data(original):
    """`fit` / `evaluate` / `predict` pack host data themselves; Keras' data
    adapters cannot read a DTensor, so say what to pass instead."""

    @functools.wraps(original)
    def method(self, x=None, *args, **kwargs):
        if isinstance(x, (tf.Tensor, dict, list, tuple)):
            for leaf in tree.flatten(x):
                if isinstance(leaf, tf.Tensor) and is_dtensor(leaf):
                    raise ValueError(
                        f"model.{original.__name__} takes host data (numpy "
                        "arrays, tf.data, generators, PyDataset) and packs each "
                        "batch onto the mesh itself. Received a DTensor of "
                        f"shape {tuple(leaf.shape)}. Pass the host array, or "
                        "call the model (or your tf.function step) on the "
                        "packed tensor."
                    )
        return original(self, x, *args, **kwargs)

    return method
