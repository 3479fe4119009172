"""float8 training on DTensors: the amax history's roll as a gather.

Keras' float8 `Dense` and `EinsumDense` keep, per tensor, a history of its
largest absolute values and update it each step with `ops.roll(history,
shift=-1)`: TensorFlow's `Roll` op, for which DTensor has no layout rule
("has no layout rule for the op 'tf.Roll'"), so a float8 model could not
train on a mesh.

On a mesh, a roll by a static shift of a tensor of static shape is a
`tf.gather` of the same elements in the rolled order: an op DTensor lays
out, and the same values (nothing is computed, only moved). Anything else
runs Keras' own roll.
"""

import functools

import numpy as np
import tensorflow as tf

from keras_layoutmap.backends.tensorflow.placement import runs_on_mesh


def wrap_roll(original):
    """Keras' TensorFlow `numpy.roll`: a gather on a mesh."""

    @functools.wraps(original)
    def roll(x, shift, axis=None):
        x = tf.convert_to_tensor(x)
        if (not isinstance(shift, (int, np.integer))
                or not isinstance(axis, (int, np.integer, type(None)))
                or not x.shape.is_fully_defined() or not runs_on_mesh(x)):
            return original(x, shift, axis=axis)
        if axis is None:
            flat = tf.reshape(x, [-1])
            return tf.reshape(roll(flat, shift, 0), x.shape)
        n = int(x.shape[axis])
        if n == 0:
            return x
        order = (np.arange(n) - int(shift)) % n
        return tf.gather(x, tf.constant(order, tf.int32), axis=axis)

    return roll
