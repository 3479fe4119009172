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
then the first position holding it (`reduce_min` of the positions, plus
the axis' size where the input is not the extreme). That is the index
`tf.argmax` gives, the first on a tie, with Keras' own treatment of -0.0
(below 0.0) kept; infinities count as the largest finite values. One
difference: a row holding NaN gives index 0 (TensorFlow's ArgMax passes
over NaN on one device).
"""

import functools

import numpy as np
import tensorflow as tf

from keras_layoutmap.backends.tensorflow.placement import runs_on_mesh


def _first_extreme(x, axis, keepdims, largest):
    # No bool tensor on the way: DTensor moves one between layouts with an
    # all-to-all that refuses bool ("must be tensor of floating-point or
    # 32/64-bit signed integer values"), so the masks are signs.
    floating = x.dtype.is_floating
    x = tf.cast(x, tf.float32 if floating and x.dtype.size < 4 else
                x.dtype if floating else tf.float64)
    big = np.finfo(x.dtype.as_numpy_dtype).max
    x = tf.clip_by_value(x, -big, big)  # inf - inf would be NaN below
    if floating:  # Keras: -0.0 below 0.0 (its flush-to-zero fix)
        negative_zero = tf.nn.relu(-tf.math.sign(tf.math.reciprocal(x))) * (
            1.0 - tf.math.abs(tf.math.sign(x)))
        x = x - negative_zero * np.finfo(x.dtype.as_numpy_dtype).tiny
    reduce = tf.reduce_max if largest else tf.reduce_min
    gap = reduce(x, axis=axis, keepdims=True) - x
    elsewhere = tf.math.sign(gap if largest else -gap)  # 0 where extreme
    size = tf.shape(x)[axis]
    view = [1] * x.shape.rank
    view[axis] = -1
    positions = tf.reshape(tf.range(tf.cast(size, x.dtype)), view)
    first = tf.reduce_min(positions + elsewhere * tf.cast(size, x.dtype),
                          axis=axis, keepdims=keepdims)
    # A row holding NaN gives NaN here: index 0.
    return tf.clip_by_value(tf.cast(first, tf.int32), 0, size - 1)


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
