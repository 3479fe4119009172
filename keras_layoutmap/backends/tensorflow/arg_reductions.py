"""`ops.argmax` and `ops.argmin` on DTensors.

DTensor's SPMD rule for `tf.ArgMax` (and `ArgMin`) keeps its operand's
rows as they are and does not slice them when the layout propagated onto
its output is split where the operand is whole. keras-hub's greedy sampler
takes the argmax of logits that `klm.fsdp` leaves split over the
vocabulary and whole over the batch, while the token it writes into the
prompt is split over the batch, and `generate()` failed with DTensor's
"SPMD expansion resulted in op output inconsistent with the provided
layout". On a mesh the index is computed from ops whose rules lay out
their outputs: the extreme along the axis (`reduce_max` / `reduce_min`),
then the first position holding it (`reduce_min` of the positions where
the input equals it). That is the index `tf.argmax` gives, the first on a
tie, with Keras' own treatment of -0.0 (below 0.0) kept, and NaN passed
over as TensorFlow's ArgMax does on one device.
"""

import functools

import numpy as np
import tensorflow as tf

from keras_layoutmap.backends.tensorflow.placement import runs_on_mesh


def _first_extreme(x, axis, keepdims, largest):
    # Masks are int32, never bool: DTensor moves a bool tensor between
    # layouts with an all-to-all that refuses bool ("must be tensor of
    # floating-point or 32/64-bit signed integer values").
    def ones_where(condition):
        return tf.cast(condition, tf.int32)

    if x.dtype.is_floating:
        x = tf.cast(x, tf.float32) if x.dtype.size < 4 else x
        tiny = np.finfo(x.dtype.as_numpy_dtype).tiny
        negative_zero = ones_where(tf.equal(x, 0.0)) * ones_where(
            tf.math.reciprocal(x) < 0.0)
        x = x - tf.cast(negative_zero, x.dtype) * tiny
        # TensorFlow's one-device ArgMax passes over NaN: a NaN becomes the
        # far end of the finite range (multiply_no_nan: 0 x NaN is 0).
        nans = tf.cast(tf.math.is_nan(x), x.dtype)
        far = -np.finfo(x.dtype.as_numpy_dtype).max if largest else (
            np.finfo(x.dtype.as_numpy_dtype).max)
        x = tf.math.multiply_no_nan(x, 1.0 - nans) + nans * far
    reduce = tf.reduce_max if largest else tf.reduce_min
    hits = ones_where(tf.equal(x, reduce(x, axis=axis, keepdims=True)))
    size = tf.shape(x)[axis]
    view = [1] * x.shape.rank
    view[axis] = -1
    positions = tf.reshape(tf.range(size, dtype=tf.int32), view)
    return tf.reduce_min(hits * positions + (1 - hits) * size, axis=axis,
                         keepdims=keepdims)


def _wrap(original, largest):
    @functools.wraps(original)
    def arg_reduction(x, axis=None, keepdims=False):
        if axis is None or not runs_on_mesh(x):
            return original(x, axis=axis, keepdims=keepdims)
        x = tf.convert_to_tensor(x)
        if x.shape.rank is None or x.shape.rank == 0 or x.dtype.is_complex:
            return original(x, axis=axis, keepdims=keepdims)
        return _first_extreme(x, axis % x.shape.rank, keepdims, largest)

    return arg_reduction


def wrap_argmax(original):
    """Keras' TensorFlow `numpy.argmax`, from reductions on a mesh."""
    return _wrap(original, largest=True)


def wrap_argmin(original):
    """Keras' TensorFlow `numpy.argmin`, from reductions on a mesh."""
    return _wrap(original, largest=False)
