"""Which tensor each Dense / EinsumDense layer reads and which it writes,
found by tracing the layers that hold them, with shapes only.

Inside a subclassed layer (a transformer block) Keras records no graph, and
a square kernel's shape does not say whether it reads the residual stream
or writes it: a gated MLP whose hidden size equals its intermediate size
has three (64, 64) kernels. The tensors they read do say. The gate and the
up projection read one tensor, so both are the column side of a pair; the
down projection reads their product. This module calls each layer that
holds projections once on the input specs of its call in the model's graph
(the backend's `compute_output_spec`: no memory is allocated), with every
projection's `call` wrapped to note the tensor objects it reads and writes.
A layer whose trace fails is left out (the walk then falls back on the
order the projections were made in).

Example:

>>> import keras
>>> from keras_layoutmap.projection_inputs import projection_reads
>>> class Gated(keras.layers.Layer):
...     def __init__(self, **kwargs):
...         super().__init__(**kwargs)
...         self.gate = keras.layers.Dense(8, name="gate")
...         self.up = keras.layers.Dense(8, name="up")
...         self.down = keras.layers.Dense(8, name="down")
...     def call(self, x):
...         return self.down(keras.ops.relu(self.gate(x)) * self.up(x))
>>> inputs = keras.Input((8,))
>>> model = keras.Model(inputs, Gated()(inputs))
>>> block = model.layers[1]
>>> reads = projection_reads(model, [block.gate, block.up, block.down])
>>> reads[id(block.gate)][0] == reads[id(block.up)][0]
True
>>> reads[id(block.down)][0] == reads[id(block.up)][0]
False
"""

import contextlib

import keras

from keras_layoutmap.keras_internals import Functional, compute_output_spec, tree


def projection_reads(model, projection_layers):
    """`{id(layer): (read, wrote)}` for each of `projection_layers` that a
    trace of `model`'s subclassed layers called: keys of the tensor it read
    and of the tensor it wrote. Two equal keys are one tensor object of one
    trace. A layer called twice in a trace keeps its first call.

    Args:
        model (keras.Model): a built model (its weights may be shapes only).
        projection_layers (list): the Dense / EinsumDense layers to watch.

    Returns:
        dict: `{id(layer): (read_key, wrote_key)}`, possibly empty.
    """
    watched = {id(layer): layer for layer in projection_layers}
    if not watched:
        return {}
    found = {}
    for number, (holder, args, kwargs) in enumerate(
            _holders(model, watched)):
        kept = []  # the traced tensors stay alive: their ids stay unique
        with _watching(watched, found, number, kept):
            try:
                with keras.StatelessScope(initialize_variables=False):
                    compute_output_spec(holder.call, *args, **kwargs)
            except Exception:  # noqa: BLE001 - a trace is a hint, not a need
                for key in [k for k, v in found.items() if v[0][0] == number]:
                    del found[key]
    return found


def _holders(model, watched):
    """`(layer, args, kwargs)` to trace: each layer of a Functional graph
    (the model's, or a nested one's) that is not itself a projection but
    holds one, with the symbolic arguments of its first call there. A model
    without a graph is traced itself, on the shape it was built with."""
    seen = set()
    stack = [model]
    while stack:
        graph = stack.pop()
        if id(graph) in seen:
            continue
        seen.add(id(graph))
        if not isinstance(graph, Functional):
            call = _built_call(graph)
            if call is not None and _holds(graph, watched):
                yield (graph, *call)
            continue
        for layer in graph.layers:
            if isinstance(layer, Functional):
                stack.append(layer)
            elif id(layer) not in watched and _holds(layer, watched):
                nodes = getattr(layer, "_inbound_nodes", None) or []
                if nodes:
                    arguments = nodes[0].arguments
                    yield layer, *_dense((arguments.args, arguments.kwargs))


def _dense(structure):
    """Fresh dense specs of the same shapes and dtypes: Keras marks some
    symbolic outputs sparse (an embedding scaled by a constant), which JAX's
    tracing then runs as BCOO arrays and refuses at the next addition."""
    return tree.map_structure(
        lambda x: keras.KerasTensor(x.shape, dtype=x.dtype)
        if isinstance(x, keras.KerasTensor) else x, structure)


def _holds(layer, watched):
    return any(id(sub) in watched
               for sub in layer._flatten_layers(include_self=False))


def _built_call(model):
    """`(args, kwargs)` for a model without a graph: one input spec of the
    shape it was built with, or None where that is not known."""
    shapes = getattr(model, "_build_shapes_dict", None)
    if not isinstance(shapes, dict) or len(shapes) != 1:
        return None
    shape = next(iter(shapes.values()))
    if not isinstance(shape, (tuple, list)) or not all(
            d is None or isinstance(d, int) for d in shape):
        return None
    return (keras.KerasTensor(tuple(shape), dtype=model.input_dtype),), {}


@contextlib.contextmanager
def _watching(watched, found, number, kept):
    """Wrap each watched layer's `call` (on the instance) to record what it
    reads and writes in `found`; on exit put back what the instance had (its
    class's method, or a `call` of its own)."""

    def wrap(layer, original):
        def call(*args, **kwargs):
            outputs = original(*args, **kwargs)
            if args and id(layer) not in found:
                kept.extend((args[0], outputs))
                found[id(layer)] = ((number, id(args[0])),
                                    (number, id(outputs)))
            return outputs

        return call

    wrapped = []  # (layer, its own `call` attribute or None)
    try:
        for layer in watched.values():
            own = vars(layer).get("call")
            object.__setattr__(layer, "call", wrap(layer, layer.call))
            wrapped.append((layer, own))
        yield
    finally:
        for layer, own in wrapped:
            if own is None:
                object.__delattr__(layer, "call")
            else:
                object.__setattr__(layer, "call", own)
