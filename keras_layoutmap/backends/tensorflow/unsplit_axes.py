"""Ops DTensor computes wrongly along a split axis: that axis gathered
first.

DTensor lays out a whole step at once, gradients included, and gives an
op's output the layout its consumers want. TensorFlow 2.21's rule for
`ConcatV2` then concatenates along a split axis without moving a value
when the axis is negative, as Keras passes it (`Concatenate(axis=-1)`):
each device concatenates its own pieces, so the output's columns are
interleaved (`[a0, b0 | a1, b1]` where one device holds `[a0, a1 | b0,
b1]`), silently. Given as positive, the same axis is refused ("Concat op
SPMD with concat dimension in sharded dimension is not supported"). A
`Concatenate` of two `Dense` whose kernels are split over `model` on their
output columns, read by a head whose rows are split over `model` (the auto
plan's column/row pair) trained to other weights than one device, its
loss wrong from the first step (1.82 for 2.65): the head's kernel gradient
wants the concatenated activations split along the concatenated axis.
Eagerly DTensor lays the output out from the operands alone and
concatenates right.

DTensor's `Pack` (`ops.stack`) refused a result its consumers want split
along the new axis ("SPMD expansion resulted in op output inconsistent
with the provided layout"): `TimeDistributed`'s steps stacked on the time
axis, flattened into a head split over its rows (the auto plan).

So while a step on a mesh is traced (`training.traced_mesh`), an op in
`RULES` sees its axis made non-negative (DTensor then computes it right or
refuses it clearly); in Keras' `Concatenate` layer and `TimeDistributed`'s
stack of its steps (`relayouted`), its operands and its result are also
relayouted with that axis unsplit (`unsplit`); the relayouts' own
gradients take the gradient back to each operand's layout. A relayout
needs a layout for every dimension: the first other than the axis (a
batch's rows) is split over the distribution's batch axis, any other is
gathered too (a spatial split of the images a `Concatenate` joins over
channels); DTensor moves the values to whatever layout comes next.
"""

import contextlib
import contextvars
import functools

import keras
import tensorflow as tf
from tensorflow.experimental import dtensor

from keras_layoutmap.backends.tensorflow.placement import mesh_distribution

# Whether the ops of `RULES` relayout their operands (`relayouted`): in
# Keras' `Concatenate` layer and `TimeDistributed`'s stack of its steps,
# a model's own joins of activations. Elsewhere (keras-hub's rotary
# embedding, the quantized layers' own concatenations) relayouting their
# other dimensions made DTensor refuse Gemma's step under its recipe and
# a LoRA int8 fit ("EmitAllScatter was passed a desired_layout", "input
# and output layout do not agree"): there `concatenate` only reads a
# non-negative axis, which DTensor computes right or refuses clearly.
_RELAYOUT = contextvars.ContextVar("klm_unsplit_relayout", default=False)


@contextlib.contextmanager
def relayouted():
    token = _RELAYOUT.set(True)
    try:
        yield
    finally:
        _RELAYOUT.reset(token)


def wrap_merge_function(original):
    """`Concatenate._merge_function`: its concatenate `relayouted`."""
    @functools.wraps(original)
    def merge(self, inputs):
        with relayouted():
            return original(self, inputs)
    return merge


# Dtypes DTensor's collectives do not move: moved as int32, exactly.
_WIDENED = (tf.bool, tf.int8, tf.uint8, tf.int16, tf.uint16)


# Ops DTensor has no layout rule for (`tf.reverse`, the loops of Keras'
# recurrent layers): next to them a relayout crashed DTensor's layout
# propagation (a segmentation fault, not its clear refusal of the op), in
# `Bidirectional(LSTM(4))`'s step under data parallel.
_NO_RULE = ("ReverseV2", "While", "StatelessWhile")


def _mesh():
    """The `dtensor.Mesh` of the step (or model call) being traced on a
    mesh, or None: eagerly, off a mesh, and where the graph traced so far
    holds an op of `_NO_RULE` (DTensor then refuses the step, clearly, as
    without the relayouts)."""
    from keras_layoutmap.backends.tensorflow.training import traced_mesh
    mesh = traced_mesh()
    if mesh is None:
        return None
    graph = tf.compat.v1.get_default_graph()
    if any(op.type in _NO_RULE or op.type.startswith("TensorList")
           for op in graph.get_operations()):
        return None
    return mesh


def _rows_spec(mesh, rows):
    """The mesh axis a tensor's first dimension (`rows` long), a batch's
    rows, keeps: the distribution's batch axis where it divides them, else
    none (a model called in a `tf.function` of one's own, off any
    distribution: the rows are gathered too)."""
    axis = getattr(mesh_distribution(), "batch_dim_name", None)
    if axis is None or axis not in mesh.dim_names or rows is None:
        return dtensor.UNSHARDED
    return axis if rows % mesh.dim_size(axis) == 0 else dtensor.UNSHARDED


def unsplit_specs(shape, axes, mesh):
    """The sharding specs of a relayout of a tensor of `shape` that leaves
    the dimensions `axes` unsplit: the first other dimension split over
    the batch axis (`_rows_spec`), every other unsplit. Not
    `dtensor.MATCH`: DTensor's layout propagation crashed the process
    (a segmentation fault) on it where the operand has no layout (the
    output of an op it has no rule for: a `Bidirectional` layer's
    `tf.reverse`, which is then refused with a clear error)."""
    keep = next((d for d in range(len(shape)) if d not in axes), None)
    return [_rows_spec(mesh, shape[d]) if d == keep else dtensor.UNSHARDED
            for d in range(len(shape))]


def unsplit(x, axes, mesh):
    """`x` relayouted on `mesh` with the dimensions `axes` unsplit (see
    `unsplit_specs`); a tensor of unknown rank, or a scalar, as it is."""
    rank = x.shape.rank
    if not rank:
        return x
    layout = dtensor.Layout(unsplit_specs(x.shape.as_list(), axes, mesh), mesh)
    if x.dtype in _WIDENED:
        return tf.cast(dtensor.relayout(tf.cast(x, tf.int32), layout), x.dtype)
    return dtensor.relayout(x, layout)


def _dense(xs):
    """The operands `xs` of a join as tensors, or None where they are not
    a non-empty list of dense ones (Keras' own op takes those)."""
    if not isinstance(xs, (list, tuple)) or not xs or any(
            isinstance(x, (tf.SparseTensor, tf.RaggedTensor)) for x in xs):
        return None
    return [keras.ops.convert_to_tensor(x) for x in xs]


def _axis(axis, rank):
    """`axis` (an int) as a non-negative dimension of rank `rank`, or None
    where it is not one."""
    if isinstance(axis, bool) or not isinstance(axis, int) or rank is None:
        return None
    return axis % rank if -rank <= axis < rank else None


def wrap_concatenate(original):
    """Keras' TensorFlow `numpy.concatenate(xs, axis=0)`: traced on a
    mesh, its operands and its result unsplit along a non-negative
    `axis`."""

    @functools.wraps(original)
    def concatenate(xs, axis=0):
        from keras_layoutmap.backends.tensorflow.training import traced_mesh
        dense = _dense(xs) if traced_mesh() is not None else None
        if dense is None:
            return original(xs, axis=axis)
        dim = _axis(axis, dense[0].shape.rank)
        if dim is None:
            return original(dense, axis=axis)
        mesh = _mesh() if _RELAYOUT.get() else None
        if mesh is None:
            # the axis as DTensor reads it right (or refuses, clearly)
            return original(dense, axis=dim)
        dense = [unsplit(x, (dim,), mesh) for x in dense]
        return unsplit(original(dense, axis=dim), (dim,), mesh)

    return concatenate


def wrap_stack(original):
    """Keras' TensorFlow `numpy.stack(x, axis=0)`: traced on a mesh, its
    result unsplit along the new `axis` (made non-negative), its operands
    laid out to match. DTensor's `Pack` refused a result its consumers
    want split along the new axis ("SPMD expansion resulted in op output
    inconsistent with the provided layout"): `TimeDistributed`'s steps,
    stacked on the time axis, flattened into a head split over its
    rows."""

    @functools.wraps(original)
    def stack(x, axis=0):
        mesh = _mesh() if _RELAYOUT.get() else None
        dense = _dense(x) if mesh is not None else None
        if dense is None:
            return original(x, axis=axis)
        rank = dense[0].shape.rank
        dim = _axis(axis, None if rank is None else rank + 1)
        if dim is None:
            return original(dense, axis=axis)
        # Each operand's first dimension keeps its layout, as the result's
        # first dimension other than the new one does.
        dense = [unsplit(a, (), mesh) for a in dense]
        return unsplit(original(dense, axis=dim), (dim,), mesh)

    return stack


# The Keras TensorFlow ops made to run unsplit along their axis:
# {name in keras_tf.numpy: wrapper}.
RULES = {"concatenate": wrap_concatenate, "stack": wrap_stack}


def install(numpy):
    """Wrap each op of `RULES` in Keras' TensorFlow `numpy` module, and
    Keras' `Concatenate` layer's merge."""
    for name, wrap in RULES.items():
        setattr(numpy, name, wrap(getattr(numpy, name)))
    layer = keras.layers.Concatenate
    layer._merge_function = wrap_merge_function(layer._merge_function)
