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
"""

import contextvars
import functools

import tensorflow as tf
from tensorflow.experimental import dtensor

from keras_layoutmap.backends.tensorflow.placement import mesh_distribution

# The mesh axis to gather weights over while a model's call runs; None
# outside one (the optimizer's update, metrics) or with no FSDP axis.
_GATHER_AXIS = contextvars.ContextVar("klm_fsdp_gather_axis", default=None)


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


def gathered(variable, value):
    """`value` (what `variable.value` read) relayouted with the FSDP axis
    unsharded, while a model call gathers; else `value` itself."""
    axis = _GATHER_AXIS.get()
    if axis is None:
        return value
    layout = getattr(getattr(variable, "_value", None), "layout", None)
    if not isinstance(layout, dtensor.Layout):  # not a DVariable
        return value
    specs = list(layout.sharding_specs)
    if axis not in specs:
        return value
    whole = [dtensor.UNSHARDED if s == axis else s for s in specs]
    whole = dtensor.Layout(whole, layout.mesh)
    if not getattr(variable, "trainable", False) or len(specs) < 2:
        # no gradient, or no table of rows to look up: TF's own gradient
        return dtensor.relayout(value, whole)
    return _relayout(value, whole)


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
        return gathered(self, prop.fget(self))

    return value


def handle(self):
    """The variable's resource handle (Keras reads it through `value`,
    which may be a gathered tensor inside a model call)."""
    if isinstance(self._value, dtensor.DVariable):
        return self._value.handle
    return self.value.handle
