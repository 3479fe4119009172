"""The TensorFlow backend: `tf.experimental.dtensor` places tensors and
variables on the mesh.

Built so far: meshes and layouts as `dtensor.Mesh` / `dtensor.Layout`, every
Keras variable created under a distribution (or with a layout) as a
`dtensor.DVariable` with its layout, `distribute` / `pack` / `unpack` /
`copy_to_mesh` / `fetch_layout`, and custom training loops on them. Not yet:
`model.fit` / `evaluate` / `predict` on a multi-device mesh (TRAINING).
"""

import os

import numpy as np
import tensorflow as tf
from keras.src.backend.tensorflow import core as keras_tf_core
from tensorflow.experimental import dtensor

SHARDING = True
TRAINING = False
NOT_BUILT = (
    "model.fit / evaluate / predict on a multi-device mesh are not built yet "
    "for the tensorflow backend (the TensorFlow DTensor issue). Variables, "
    "optimizers, metrics and klm.pack / unpack / distribute work: train with "
    "a custom loop (docs/porting.md), or use KERAS_BACKEND=jax."
)


def configure_virtual_devices(n):
    cpus = tf.config.list_physical_devices("CPU")
    try:
        tf.config.set_logical_device_configuration(
            cpus[0], [tf.config.LogicalDeviceConfiguration()] * n
        )
    except RuntimeError:
        have = len(tf.config.list_logical_devices("CPU"))
        if have != n:
            raise RuntimeError(
                f"configure_virtual_devices({n}) must run before TensorFlow "
                f"initialises its devices; it already has {have} logical CPU "
                "device(s). Call it right after `import keras_layoutmap`."
            ) from None


def list_devices():
    return [f"cpu:{i}" for i, _ in enumerate(tf.config.list_logical_devices("CPU"))]


def num_local_devices(mesh):
    return mesh.size


_DMESHES = {}


def _tf_device(name):
    kind, index = str(name).split(":")
    return f"{kind.upper()}:{index}"


def _dmesh(mesh):
    """The one `dtensor.Mesh` for meshes equal to `mesh` (same axes, sizes
    and devices), with a name of its own: DTensor keys compiled functions
    by mesh name, so meshes of other shapes must not share one."""
    from keras_layoutmap.mesh import _mesh_key

    key = _mesh_key(mesh)
    if key not in _DMESHES:
        _DMESHES[key] = dtensor.create_mesh(
            list(zip(mesh.axis_names, mesh.shape)),
            devices=[_tf_device(d) for d in np.ravel(mesh.devices)],
            mesh_name=f"klm_{len(_DMESHES)}",
        )
    return _DMESHES[key]


def _dlayout(layout):
    specs = [dtensor.UNSHARDED if a is None else a for a in layout.axes]
    return dtensor.Layout(specs, _dmesh(layout.mesh))


def _value(x):
    """A tensor for `x`: a Keras or tf variable's current value."""
    if isinstance(x, keras_tf_core.Variable):
        x = x.value
    if isinstance(x, tf.Variable):
        x = x.read_value()
    return x


def _is_dtensor(x):
    try:
        dtensor.fetch_layout(x)
        return True
    except Exception:
        return False


def fetch_layout(x):
    from keras_layoutmap.mesh import Mesh

    value = _value(x)
    if not tf.is_tensor(value):
        raise TypeError(
            "Expected a tf.Tensor, DTensor or keras.Variable. Received: "
            f"{type(x).__name__}"
        )
    if not _is_dtensor(value):
        device = tf.convert_to_tensor(value).device.split("device:")[-1].lower()
        rank = len(value.shape)
        return [None] * rank, Mesh((1,), ["device"], [device or "cpu:0"])
    layout = dtensor.fetch_layout(value)
    dmesh = layout.mesh
    devices = [d.split("device:")[-1].lower() for d in dmesh.local_devices()]
    mesh = Mesh(dmesh.shape(), dmesh.dim_names, devices)
    axes = [None if s == dtensor.UNSHARDED else s for s in layout.sharding_specs]
    return axes, mesh


def host_shards(array, layout):
    """The piece of host `array` each device of `layout.mesh` holds, in mesh
    device order (row-major over the mesh axes)."""
    mesh = layout.mesh
    shards = []
    for index in range(mesh.size):
        coords = dict(zip(mesh.axis_names, np.unravel_index(index, mesh.shape)))
        region = []
        for axis, size in zip(layout.axes, array.shape):
            if axis is None:
                region.append(slice(None))
            else:
                step = size // mesh.dim_size(axis)
                region.append(slice(coords[axis] * step, (coords[axis] + 1) * step))
        shards.append(array[tuple(region)])
    return shards


def distribute(x, layout):
    value = _value(x)
    if tf.is_tensor(value) and _is_dtensor(value):
        source = dtensor.fetch_layout(value)
        if source.mesh == _dmesh(layout.mesh):
            return dtensor.relayout(value, _dlayout(layout))
        if not source.is_fully_replicated():
            raise ValueError(
                f"Cannot move a tensor sharded as {source.sharding_specs} on "
                f"another mesh ({source.mesh.dim_names}, "
                f"{source.mesh.shape()}) onto {layout.mesh!r}; relayout it to "
                "replicated on its own mesh first."
            )
        # Replicated on another mesh (TensorFlow even caches small constants
        # such as zeros on the last mesh used): any one copy is the value.
        value = dtensor.unpack(value)[0]
    array = value.numpy() if tf.is_tensor(value) else np.asarray(value)
    return pack(host_shards(array, layout), layout)


def pack(components, layout):
    return dtensor.pack([tf.convert_to_tensor(c) for c in components],
                        _dlayout(layout))


def unpack(x):
    return dtensor.unpack(_value(x))


def _make_dvariable(variable, value, layout):
    with tf.init_scope():
        value = distribute(value, layout)
        return dtensor.DVariable(
            value, trainable=variable.trainable, name=variable.name,
            aggregation=variable._map_aggregation(variable.aggregation),
            synchronization=variable._map_synchronization(
                variable.synchronization),
        )


def relayout_variable(variable, layout):
    variable._layout = layout
    variable._value = _make_dvariable(variable, variable.value.read_value(),
                                      layout)


def _wrap_initialize(original):
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
        from keras_layoutmap.layout import as_layout

        layout = as_layout(self._layout)
        if layout.mesh.size == 1:
            return original(self, value)  # one device: nothing to place
        if callable(value):
            with tf.init_scope():
                value = value()
        self._value = _make_dvariable(self, value, layout)

    return _initialize


def _wrap_direct_assign(original):
    def _direct_assign(self, value):
        if getattr(self, "_layout", None) is None or not _is_dtensor(self._value):
            return original(self, value)
        from keras_layoutmap.layout import as_layout

        value = tf.cast(value, self._value.dtype)
        if not _is_dtensor(value):
            value = distribute(value, as_layout(self._layout))
        self._value.assign(value)

    return _direct_assign


def _distribute_tensor(tensor, layout):
    """Keras' hook to relayout a layer output (`<layer>/output` rules)."""
    from keras_layoutmap.layout import as_layout

    layout = as_layout(layout)
    if tf.executing_eagerly():
        return distribute(tensor, layout)
    return dtensor.relayout(tensor, _dlayout(layout))


def install():
    from keras.src.backend.tensorflow import distribution_lib

    # DTensor's pass that combines all-reduces moves the reduction of a
    # gradient past reads of other variables, ignoring the control edges of
    # their assigns: Adam then reads its moments before this step's update
    # and the first step is lost. Off unless the user chose otherwise.
    os.environ.setdefault("DTENSOR_ENABLE_COMBINE_ALL_REDUCES_OPTIMIZATION", "0")

    # Keras' TensorFlow distribution module leaves this out ("DO NOT USE").
    distribution_lib.distribute_tensor = _distribute_tensor
    Variable = keras_tf_core.Variable
    Variable._initialize = _wrap_initialize(Variable._initialize)
    Variable._direct_assign = _wrap_direct_assign(Variable._direct_assign)
