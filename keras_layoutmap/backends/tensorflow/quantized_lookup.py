"""Row lookups of int8 tables on DTensors: exact, in a dtype DTensor moves.

keras-nightly's int4 `Embedding` looks its packed table up first and unpacks
only the rows it gathered (`ops.take(int8 table, ids)`). Under a recipe that
splits the table's rows over one mesh axis and its columns over the batch
axis (keras-hub's Gemma: `("model", "batch")`), DTensor moves the gathered
rows to the ids' batch split with an all-to-all, and its collectives take
floats and 32/64-bit integers only ("'tf.CollectiveAllToAllV2' op operand #0
must be tensor of floating-point or 32/64-bit signed integer values").

On a mesh an int8 (or other narrow integer) table is widened to int32 for
the lookup and the rows narrowed back: the same integers, so the same
numbers as Keras' one-device path. Off the mesh Keras' own path runs.
"""

import functools

import tensorflow as tf
from keras.backend import standardize_dtype
from tensorflow.experimental import dtensor

from keras_layoutmap.backends.tensorflow.placement import mesh_of, runs_on_mesh

# The integer dtypes DTensor's collectives refuse.
NARROW_INTEGERS = ("int8", "uint8", "int16", "uint16")


def wrap_take(original):
    """Keras' TensorFlow `numpy.take`: a narrow-integer table on a mesh is
    looked up in int32."""

    @functools.wraps(original)
    def take(x, indices, axis=None):
        dtype = getattr(x, "dtype", None)  # a tensor's, or a Keras variable's
        if dtype is None or standardize_dtype(dtype) not in NARROW_INTEGERS:
            return original(x, indices, axis=axis)
        x = tf.convert_to_tensor(x)
        if not runs_on_mesh(x, indices):
            return original(x, indices, axis=axis)
        rows = original(tf.cast(x, tf.int32), indices, axis=axis)
        mesh = mesh_of(rows)
        if mesh is not None and rows.shape.rank:
            # Laid out as the ids are (their first dimension), the rest whole,
            # before narrowing: what follows then has nothing to move.
            rows = dtensor.relayout(rows, dtensor.Layout(
                [dtensor.MATCH] + [dtensor.UNSHARDED] * (rows.shape.rank - 1),
                mesh))
        return tf.cast(rows, x.dtype)

    return take

