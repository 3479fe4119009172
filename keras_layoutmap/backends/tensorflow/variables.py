"""Keras variables as `dtensor.DVariable`s: made with their layout, moved,
assigned, read back to the host."""

import functools

import numpy as np
import tensorflow as tf
from tensorflow.experimental import dtensor

from keras_layoutmap import same_value
from keras_layoutmap.backends.tensorflow import decoding, processes
from keras_layoutmap.backends.tensorflow.initialization import born_sharded
from keras_layoutmap.backends.tensorflow.placement import (
    distribute,
    fetch_layout,
    is_dtensor,
    to_dmesh,
    to_host,
)
from keras_layoutmap.layout import Layout, as_layout


def _make_dvariable(variable, value, layout):
    # Every placed variable comes here: once keras-hub is loaded, install
    # its decoding wrap (a dict lookup until then).
    decoding.install_if_loaded()
    with tf.init_scope():
        value = distribute(value, layout)
        return dtensor.DVariable(
            value, trainable=variable.trainable, name=variable.name,
            aggregation=variable._map_aggregation(variable.aggregation),
            synchronization=variable._map_synchronization(
                variable.synchronization),
        )


def relayout_variable(variable, layout):
    value = variable.value.read_value()
    if is_dtensor(value) and dtensor.fetch_layout(value).mesh != to_dmesh(
            layout.mesh):
        value = to_host(value)  # from another mesh: through the host
    variable._layout = layout
    variable._value = _make_dvariable(variable, value, layout)


def unplace_variable(variable):
    """Bring a variable back to one device: a plain `tf.Variable` holding the
    gathered value, as if made with no distribution."""
    value = to_host(variable.value.read_value())
    with tf.init_scope():
        variable._value = tf.Variable(
            value, dtype=variable._dtype, trainable=variable.trainable,
            name=variable.name,
            aggregation=variable._map_aggregation(variable.aggregation),
            synchronization=variable._map_synchronization(
                variable.synchronization),
        )
    variable._layout = None


def wrap_initialize(original):
    def _initialize(self, value):
        if self._shape is None and not callable(value):
            # Keras sets the shape of a variable made from a value only
            # after `_initialize`; the layout needs it now.
            self._shape = self._validate_shape(tf.convert_to_tensor(value).shape)
        if getattr(self, "_layout", None) is None:
            from keras import distribution as keras_distribution

            dist = keras_distribution.distribution()
            if dist is not None:
                self._layout = dist.get_variable_layout(self)
        if self._layout is None or isinstance(value, tf.Variable):
            return original(self, value)
        layout = as_layout(self._layout)
        if layout.mesh.size == 1:
            return original(self, value)  # one device: nothing to place
        if callable(value):  # Keras' initializer call
            nbytes = int(np.prod(self._shape)) * tf.as_dtype(self._dtype).size
            made = born_sharded(value, layout, nbytes)
            if made is None:
                with tf.init_scope():
                    made = value()
            value = made
        self._value = _make_dvariable(self, value, layout)

    return _initialize


def wrap_direct_assign(original):
    def _direct_assign(self, value):
        if getattr(self, "_layout", None) is None or not is_dtensor(self._value):
            return original(self, value)
        value = tf.cast(value, self._value.dtype)
        if not is_dtensor(value):
            layout = as_layout(self._layout)
            _check_same_everywhere(self, value, layout)
            value = distribute(value, layout)
        self._value.assign(value)

    return _direct_assign


def _check_same_everywhere(variable, value, layout):
    """A host value assigned to a variable on a mesh that spans processes:
    the same on each (each keeps its own pieces of it), else an error on
    every process naming the variable. (Training's own assignments are
    DTensors; a variable made from a value makes no check, nor one on a
    mesh over some of the processes: the gather is over all of them.)"""
    if processes.process_count() == 1:
        return
    owners = {int(i) // processes.local_device_count()
              for i in np.ravel(to_dmesh(layout.mesh).global_device_ids())}
    if len(owners) != processes.process_count():
        return
    with same_value.naming(variable.path):
        processes.check_same_everywhere(value)


def wrap_numpy(original):
    def numpy(self):
        if getattr(self, "_layout", None) is None or not is_dtensor(self._value):
            return original(self)
        # A sharded DVariable has no single value on the host: gather it
        # (a one-file save: to process 0 alone, as numpy already).
        host = to_host(self._value.read_value())
        return host if isinstance(host, np.ndarray) else host.numpy()

    return numpy


def wrap_convert_to_numpy(original):
    @functools.wraps(original)
    def convert_to_numpy(x):
        if isinstance(x, tf.Tensor) and is_dtensor(x):
            x = to_host(x)  # a sharded DTensor has no single host value
            if isinstance(x, np.ndarray):
                return x  # a one-file save's: Keras' copy would be a second
        return original(x)

    return convert_to_numpy


def variable_array(self, dtype=None, copy=None):
    array = np.asarray(self.numpy())
    return array if dtype is None else array.astype(dtype)


# Set while Keras' train / test / predict step runs on a mesh: random draws


def wrap_initialize_keeps_value_layout(original):
    """`keras.Variable(value)` with `value` already a DTensor on a mesh and
    no distribution active keeps `value`'s layout (as JAX keeps a sharded
    array's), instead of becoming a one-device variable that DTensor later
    refuses to update."""

    def _initialize(self, value):
        from keras import distribution as keras_distribution

        if (getattr(self, "_layout", None) is None
                and keras_distribution.distribution() is None
                and tf.is_tensor(value) and not isinstance(value, tf.Variable)
                and is_dtensor(value)):
            axes, mesh = fetch_layout(value)
            self._layout = Layout(axes, mesh)
        return original(self, value)

    return _initialize
