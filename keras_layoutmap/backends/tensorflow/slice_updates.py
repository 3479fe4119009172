"""`ops.slice_update` on DTensors.

Keras' TensorFlow `slice_update` is XLA's dynamic-update-slice, an op
DTensor has no layout rule for ("'tf.XlaDynamicUpdateSlice' op does not
implement layout propagation"): keras-hub's `CausalLM.generate()` writes
each new key/value into its cache and each new token into the prompt with
it, so generation failed on any mesh. On a mesh the update is computed from
ops DTensor lays out: along each dimension, the positions the update covers
(`start <= i < start + size`) select `updates` gathered to the input's
shape, and `tf.where` keeps the input elsewhere. The result is exactly the
dynamic-update-slice's (indices clipped as XLA clips them), with the
input's layout. (Every dimension is gathered, also one the update covers
whole: with those gathers left out, `generate()` wrote wrong tokens on a
mesh, with no error.) Inside a
`tf.function` a symbolic tensor does not say whether it is a DTensor:
there every call under a mesh distribution takes this path (the same
numbers on any tensor). Eagerly, a plain input or update joins the other's
mesh, whole on every device.
"""

import functools

import tensorflow as tf
from tensorflow.experimental import dtensor

from keras_layoutmap.backends.tensorflow.placement import (
    copy_whole_to_mesh,
    mesh_of,
    runs_on_mesh,
)


def _by_mask(inputs, start_indices, updates):
    updates = tf.cast(updates, inputs.dtype)
    shape = tf.shape(inputs)
    size = tf.shape(updates)
    mask = None
    for axis in range(inputs.shape.rank):
        # XLA clips the start so that the update fits inside the input.
        start = tf.clip_by_value(tf.cast(start_indices[axis], tf.int32), 0,
                                 shape[axis] - size[axis])
        positions = tf.range(shape[axis]) - start
        inside = (positions >= 0) & (positions < size[axis])
        updates = tf.gather(updates, tf.clip_by_value(positions, 0, size[axis] - 1),
                            axis=axis)
        view = [1] * inputs.shape.rank
        view[axis] = -1
        inside = tf.reshape(inside, view)
        mask = inside if mask is None else mask & inside
    return tf.where(mask, updates, inputs)


def _like_inputs(updates, inputs):
    """`updates` laid out as `inputs` along the axes it covers whole, and
    whole along the others: DTensor gathers the update along an axis only
    if the other axes are split alike in it and in the result (which has
    the input's layout). Eagerly only (the layouts are known)."""
    layout = dtensor.fetch_layout(inputs)
    specs = [spec if updates.shape[axis] == n else dtensor.UNSHARDED
             for axis, (spec, n) in enumerate(
                 zip(layout.sharding_specs, inputs.shape))]
    target = dtensor.Layout(specs, layout.mesh)
    if dtensor.fetch_layout(updates) == target:
        return updates
    return dtensor.relayout(updates, target)


def wrap_slice_update(original):
    """Keras' `slice_update`, by mask and gather where a tensor is a DTensor."""

    @functools.wraps(original)
    def slice_update(inputs, start_indices, updates):
        if not runs_on_mesh(inputs, updates):
            return original(inputs, start_indices, updates)
        inputs = tf.convert_to_tensor(inputs)
        updates = tf.convert_to_tensor(updates)
        if tf.executing_eagerly():
            # One of the two may be a plain tensor: DTensor's ops refuse a
            # mix, so it joins the other's mesh, whole on every device.
            mesh = mesh_of(inputs) or mesh_of(updates)
            inputs, updates = (copy_whole_to_mesh(x, mesh)
                               for x in (inputs, updates))
            updates = _like_inputs(updates, inputs)
        if isinstance(start_indices, (list, tuple)):
            start_indices = [tf.convert_to_tensor(s) for s in start_indices]
        else:
            start_indices = tf.unstack(tf.convert_to_tensor(start_indices))
        return _by_mask(inputs, start_indices, updates)

    return slice_update
