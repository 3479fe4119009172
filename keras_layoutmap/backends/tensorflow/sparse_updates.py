"""Sparse optimizer updates of variables on a mesh.

An `Embedding`'s gradient on TensorFlow is a `tf.IndexedSlices` (a row per
id looked up), and Keras' TensorFlow optimizers add such an update to a
variable with `scatter_add` / `scatter_sub`. DTensor has no layout rule for
those ops ("'tf.ResourceScatterSub' op does not implement layout
propagation"), so SGD, for one, failed on any mesh with an embedding.
Adding the slices is adding their sum for each row: on a mesh the update is
made dense first (the rows summed, as `tf.convert_to_tensor` does) and
added whole. The numbers are one device's, up to the order of the sums.
"""

import functools

import keras
import tensorflow as tf
from tensorflow.experimental import dtensor


def wrap_sparse_update(original):
    """`TFOptimizer.assign_add` / `assign_sub`: an `IndexedSlices` update of
    a variable on a mesh added dense."""

    @functools.wraps(original)
    def update(self, variable, value):
        if isinstance(value, tf.IndexedSlices):
            target = (variable.value if isinstance(variable, keras.Variable)
                      else variable)
            if isinstance(target, dtensor.DVariable):
                value = tf.convert_to_tensor(value)
        return original(self, variable, value)

    return update
