"""`model.export()` of a model on a mesh, serving plain tensors."""

import functools

import tensorflow as tf

from keras_layoutmap.backends.tensorflow.placement import (
    is_dtensor,
    to_host,
)


def wrap_export(original):
    """`model.export` of a model on a mesh: a SavedModel of plain variables
    holding the gathered weights, traced with no distribution, so that it
    serves plain tensors on any machine (DTensor is not in the graph)."""

    @functools.wraps(original)
    def export(self, *args, **kwargs):
        from keras import distribution as keras_distribution

        placed = [v for v in self.variables if is_dtensor(v._value)]
        dist = keras_distribution.distribution()
        if not placed:
            return original(self, *args, **kwargs)
        dvariables = {id(v): v._value for v in placed}
        try:
            keras_distribution.set_distribution(None)
            for v in placed:
                with tf.init_scope():
                    v._value = tf.Variable(
                        to_host(v._value.read_value()), trainable=v.trainable,
                        name=v.name)
            return original(self, *args, **kwargs)
        finally:
            for v in placed:
                v._value = dvariables[id(v)]
            keras_distribution.set_distribution(dist)

    return export
