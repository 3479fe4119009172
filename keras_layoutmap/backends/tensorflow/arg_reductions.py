"""`ops.argmax`, `ops.argmin` and `ops.top_k` on DTensors.

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

DTensor's TopKV2 has the same fault (a mixture of experts' router: "Expected
shape: <128,2> got shape: <32,2>"), so on a mesh `top_k` is k rounds of the
same: the largest value, its first position, then that position set to
the bottom of the finite range and left out of the positions to come.
Indices and order are `tf.math.top_k`'s (the lower index first on a tie),
and so are the values, but that an infinity comes back as the largest
finite value.
"""

import functools

import numpy as np
import tensorflow as tf

from keras_layoutmap.backends.tensorflow.placement import runs_on_mesh


def _widened(x):
    """`x` as a float of 32 bits or more (integers as float64), clipped to
    its finite range (inf - inf would be NaN in the gaps below); and the
    bound of that range."""
    floating = x.dtype.is_floating
    x = tf.cast(x, tf.float32 if floating and x.dtype.size < 4 else
                x.dtype if floating else tf.float64)
    big = np.finfo(x.dtype.as_numpy_dtype).max
    return tf.clip_by_value(x, -big, big), big


def _first_extreme(x, axis, keepdims, largest):
    # No bool tensor on the way: DTensor moves one between layouts with an
    # all-to-all that refuses bool ("must be tensor of floating-point or
    # 32/64-bit signed integer values"), so the masks are signs.
    floating = x.dtype.is_floating
    x, _ = _widened(x)
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


def _top_k(x, k):
    dtype = x.dtype
    x, big = _widened(x)
    size = tf.cast(tf.shape(x)[-1], x.dtype)
    positions = tf.range(size)
    values, indices, excluded = [], [], None
    for _ in range(k):
        top = tf.reduce_max(x, axis=-1, keepdims=True)
        elsewhere = tf.math.sign(top - x)  # 0 where the largest
        if excluded is not None:  # taken before (a -inf row ties with them)
            elsewhere = elsewhere + excluded
        first = tf.reduce_min(positions + elsewhere * size, axis=-1,
                              keepdims=True)
        values.append(top)
        indices.append(first)
        taken = 1.0 - tf.math.sign(tf.math.abs(positions - first))
        excluded = taken if excluded is None else excluded + taken
        x = x * (1.0 - taken) - taken * big
    values = tf.cast(tf.concat(values, axis=-1), dtype)
    return values, tf.cast(tf.concat(indices, axis=-1), tf.int32)


def wrap_top_k(original):
    """Keras' TensorFlow `math.top_k`, from reductions on a mesh."""

    @functools.wraps(original)
    def top_k(x, k, sorted=True, **kwargs):
        # kwargs: Keras 3.16's `is_stable`; these rounds are stable anyway.
        if not runs_on_mesh(x) or not isinstance(k, int):
            return original(x, k, sorted=sorted, **kwargs)
        x = tf.convert_to_tensor(x)
        if x.shape.rank is None or x.shape.rank == 0 or x.dtype.is_complex:
            return original(x, k, sorted=sorted, **kwargs)
        return _top_k(x, k)

    return top_k


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
