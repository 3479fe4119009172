"""FSDP on DTensor: weights sharded over the data axis are gathered whole
while a model computes with them.

DTensor refuses, rather than reshards, a matmul whose contracting dimension
is sharded on different mesh axes (a batch-sharded input times a weight
sharded over the same batch axis on its input dimension). JAX's compiler
inserts the all-gather; here the backend does: while a model is called under
a distribution whose `LayoutMap` has an FSDP axis (`klm.fsdp`), each read of
a variable sharded over that axis (`Variable.value`, which every op's
conversion of a Keras variable goes through) is `dtensor.relayout` to the
same layout with that axis unsharded. The relayout's gradient relayouts the
gradient back to the variable's layout (a reduce-scatter), so the optimizer
updates the shards it stores; the variable itself never changes layout.

Without an FSDP axis, the same gather runs for the span of one `Dense` or
`EinsumDense` call whose kernel is sharded over the batch axis: keras-hub's
`get_layout_map` recipes store kernels that way (`wrap_dense_call`).
"""

import contextlib
import contextvars
import functools
import re

import keras
import tensorflow as tf
from tensorflow.experimental import dtensor

from keras_layoutmap.backends.tensorflow.placement import is_dtensor, mesh_distribution
from keras_layoutmap.backends.tensorflow.quantized_lookup import NARROW_INTEGERS

# The mesh axis to gather weights over while a model's call runs; None
# outside one (the optimizer's update, metrics) or with no FSDP axis.
_GATHER_AXIS = contextvars.ContextVar("klm_fsdp_gather_axis", default=None)
# Values to read in place of variables' own (keras-hub's decoding: its
# weights gathered once per call, `decoding.py`): {id(variable): value}.
_HELD = contextvars.ContextVar("klm_held_values", default=None)


@contextlib.contextmanager
def reading(values):
    """Reads of each variable `values` holds (`{id(variable): tensor}`,
    through `Variable.value`) give that tensor; assigns are left as they
    are (a variable assigned while this holds it must not be among them)."""
    token = _HELD.set(values)
    try:
        yield
    finally:
        _HELD.reset(token)


def _fsdp_axis():
    dist = mesh_distribution()
    layout_map = getattr(dist, "layout_map", None)
    return getattr(layout_map, "fsdp_axis", None)


def wrap_model_call(original):
    """Gather FSDP-sharded weights for the span of the outermost model call."""

    @functools.wraps(original)
    def __call__(self, *args, **kwargs):
        if _GATHER_AXIS.get() is not None:
            return original(self, *args, **kwargs)
        axis = _fsdp_axis()
        if axis is None:
            return original(self, *args, **kwargs)
        token = _GATHER_AXIS.set(axis)
        try:
            return original(self, *args, **kwargs)
        finally:
            _GATHER_AXIS.reset(token)

    return __call__


def stored_layout(variable):
    """The DTensor layout a Keras variable is stored with, or None."""
    layout = getattr(getattr(variable, "_value", None), "layout", None)
    return layout if isinstance(layout, dtensor.Layout) else None


def _input_specs(layer, rank, kernel_specs):
    """The layout, per dimension, to give the input of `layer` (a Dense or
    EinsumDense of `rank`-dimensional inputs) whose kernel is laid out as
    `kernel_specs`: a dimension the kernel contracts takes the kernel's
    sharding of it, the first (the batch rows) stays as it is
    (`dtensor.MATCH`, which DTensor allows on one dimension only), any
    other is unsharded. None where the equation is not understood."""
    if isinstance(layer, keras.layers.EinsumDense):
        match = re.fullmatch(r"([a-z.]*),([a-z.]*)->[a-z.]*",
                             layer.equation.replace(" ", ""))
        if match is None or "." in match.group(2):
            return None
        letters, kernel = match.groups()
        if "..." in letters:
            if letters.count("...") > 1 or "." in letters.replace("...", ""):
                return None
            fill = rank - (len(letters) - 3)
            if fill < 0:
                return None
            letters = letters.replace("...", "*" * fill)
    else:  # Dense: `...i,io->...o`
        letters, kernel = "*" * (rank - 1) + "i", "io"
    if len(letters) != rank or len(kernel) != len(kernel_specs):
        return None
    specs = []
    for i, letter in enumerate(letters):
        if letter in kernel:
            specs.append(kernel_specs[kernel.index(letter)])
        else:
            specs.append(dtensor.MATCH if i == 0 else dtensor.UNSHARDED)
    return specs


def _relayout_input(x, specs, mesh):
    """`x` laid out as `specs`. A move from one mesh axis to another goes
    through unsharded: DTensor's relayout shards or unshards, it does not
    move an axis. The gradient passes through as it is, its layout left to
    DTensor: forced back to `x`'s (the Relayout op's own gradient), it can
    contradict the layout DTensor propagates to it (a LoRA-tuned Llama)."""
    whole = [s if s == dtensor.MATCH else dtensor.UNSHARDED for s in specs]

    @tf.custom_gradient
    def relayout(x):
        y = dtensor.relayout(x, dtensor.Layout(whole, mesh))
        if whole != specs:
            y = dtensor.relayout(y, dtensor.Layout(specs, mesh))
        return y, lambda dy: dy

    return relayout(x)


def wrap_dense_call(original):
    """`Dense.call` / `EinsumDense.call` (and their `quantized_call`, which
    a quantized layer runs instead) under a kernel sharded over the batch
    axis, as keras-hub's `get_layout_map` recipes shard Llama's and
    Qwen's attention and MLP kernels (the hidden dimension over `batch`)
    for FSDP-style storage.

    DTensor's matmul refuses a contracting dimension sharded on different
    mesh axes in its operands, or an output needing the batch axis twice
    (the batch rows and a kernel dimension); JAX's compiler gathers
    instead. So does this: for the span of the call, each read of a weight
    sharded over the batch axis is gathered over it (as `klm.fsdp` does for
    a whole model; the gradient goes back to the stored shards), and the
    input's contracted dimensions are laid out as the gathered kernel's.
    The relayouts anchor the activations: DTensor propagates layouts
    through the whole step, gradients included, and would otherwise carry
    the kernel's batch sharding onto them."""

    @functools.wraps(original)
    def call(self, inputs, *args, **kwargs):
        dist = mesh_distribution()
        axis = getattr(dist, "batch_dim_name", None)
        layout = stored_layout(getattr(self, "_kernel", None))
        if (axis is None or layout is None or _GATHER_AXIS.get() is not None
                or axis not in layout.sharding_specs):
            return original(self, inputs, *args, **kwargs)
        kernel_specs = whole_over(layout, (axis,)).sharding_specs
        token = _GATHER_AXIS.set(axis)
        try:
            # Eagerly, only a DTensor has a layout to set; inside a
            # tf.function under a mesh distribution every input is one.
            on_mesh = tf.is_tensor(inputs) and (
                not tf.executing_eagerly() or is_dtensor(inputs))
            rank = inputs.shape.rank if on_mesh else None
            specs = _input_specs(self, rank, kernel_specs) if rank else None
            if specs is not None:
                inputs = _relayout_input(inputs, specs, layout.mesh)
            return original(self, inputs, *args, **kwargs)
        finally:
            _GATHER_AXIS.reset(token)

    return call


def gathered(variable, value):
    """`value` (what `variable.value` read) relayouted with the FSDP axis
    unsharded, while a model call gathers; else `value` itself."""
    axis = _GATHER_AXIS.get()
    if axis is None:
        return value
    layout = stored_layout(variable)
    if layout is None:  # not a DVariable
        return value
    specs = list(layout.sharding_specs)
    if axis not in specs:
        return value
    whole = whole_over(layout, (axis,))
    if value.dtype.name in NARROW_INTEGERS:  # a quantized kernel's codes
        return relayout(value, whole)
    if not getattr(variable, "trainable", False) or len(specs) < 2:
        # no gradient, or no table of rows to look up: TF's own gradient
        gathered_value = dtensor.relayout(value, whole)
    else:
        gathered_value = _relayout(value, whole)
    return marked(gathered_value, whole)


def marked(value, layout):
    """`value`, a gathered weight, marked with its `layout`
    (`quantized_float8` keeps it so; an eager tensor takes no mark)."""
    try:
        value._klm_layout = layout
    except AttributeError:
        pass
    return value


def whole_over(layout, axes):
    """`layout` (a `dtensor.Layout`) with the mesh axes `axes` unsharded."""
    return dtensor.Layout([dtensor.UNSHARDED if s in axes else s
                           for s in layout.sharding_specs], layout.mesh)


def relayout(value, layout):
    """`dtensor.relayout(value, layout)`, also of a quantized kernel's
    codes (int8; int4 packed two a byte): DTensor's collectives move floats
    and 32/64-bit integers only, so they move widened, exactly, and are
    narrowed again where they arrive."""
    if value.dtype.name in NARROW_INTEGERS:
        return tf.cast(dtensor.relayout(tf.cast(value, tf.int32), layout),
                       value.dtype)
    return dtensor.relayout(value, layout)


def _relayout(value, whole):
    """`dtensor.relayout(value, whole)`, whose gradient goes back to
    `value`'s layout, a sparse one kept sparse. An embedding's lookup gives
    a `tf.IndexedSlices` gradient (a row per id looked up, split over the
    batch axis), and Keras' TensorFlow optimizers treat it as such: Adam
    squares each looked-up row before the rows of an id are summed. The
    Relayout op's own gradient makes it dense, summing first: Adam's second
    moment then differs from one device's wherever an id repeats in a
    batch, silently (1e-2 after one step of Adam(1e-2) on a keras-hub
    Gemma with an untied head). So the slices stay slices, their rows and
    ids gathered whole, as one device holds them."""

    @tf.custom_gradient
    def relayout(x):
        def gradient(dy):
            if isinstance(dy, tf.IndexedSlices):
                mesh = whole.mesh
                return tf.IndexedSlices(
                    dtensor.relayout(dy.values, dtensor.Layout.replicated(
                        mesh, dy.values.shape.rank)),
                    dtensor.relayout(dy.indices, dtensor.Layout.replicated(
                        mesh, dy.indices.shape.rank)),
                    dy.dense_shape)
            return dtensor.relayout_like(dy, x)  # the Relayout op's own

        return dtensor.relayout(x, whole), gradient

    return relayout(value)


def wrap_value(prop):
    """`Variable.value`, gathered while a model call gathers (see above)."""

    @property
    @functools.wraps(prop.fget)
    def value(self):
        held = _HELD.get()
        if held is not None and id(self) in held:
            return self._maybe_autocast(held[id(self)])
        return gathered(self, prop.fget(self))

    return value


def handle(self):
    """The variable's resource handle (Keras reads it through `value`,
    which may be a gathered tensor inside a model call)."""
    if isinstance(self._value, dtensor.DVariable):
        return self._value.handle
    return self.value.handle
