"""Meshes, layouts and tensors on them: `jax.sharding` does the work; Keras
variables placed, moved and read back to the host."""

import functools

import jax
import numpy as np

from keras_layoutmap import same_value
from keras_layoutmap.backends.jax import devices
from keras_layoutmap.backends.jax import keras_internals as keras_jax
from keras_layoutmap.backends.jax.processes import (
    place_whole,
    set_cpu_devices,
    to_host,
)
from keras_layoutmap.layout import Layout
from keras_layoutmap.mesh import Mesh


def configure_virtual_devices(n):
    set_cpu_devices(n)


def list_devices():
    return [f"{d.platform}:{d.id}" for d in devices.global_devices()]


def num_local_devices(mesh):
    local = {f"{d.platform}:{d.id}" for d in devices.local_devices()}
    return sum(str(d) in local for d in np.ravel(mesh.devices))


def _sharding(layout):
    return layout.backend_layout


def _device_name(device):
    return f"{device.platform}:{device.id}"


def _array(x):
    value = getattr(x, "value", x)  # keras.Variable -> jax.Array
    if not isinstance(value, jax.Array):
        raise TypeError(
            f"Expected a jax.Array or keras.Variable placed on devices. "
            f"Received: {type(x).__name__}"
        )
    return value


def fetch_layout(x):
    array = _array(x)
    sharding = array.sharding
    if isinstance(sharding, jax.sharding.NamedSharding):
        jmesh = sharding.mesh
        mesh = Mesh(
            jmesh.devices.shape,
            jmesh.axis_names,
            [_device_name(d) for d in np.ravel(jmesh.devices)],
        )
        spec = list(sharding.spec) + [None] * (array.ndim - len(sharding.spec))
        axes = []
        for entry in spec:
            if isinstance(entry, (tuple, list)):
                if len(entry) > 1:
                    raise ValueError(
                        f"Dimension sharded over several mesh axes {entry} "
                        "cannot be expressed as a klm.Layout."
                    )
                entry = entry[0] if entry else None
            axes.append(entry)
        return axes, mesh
    if len(sharding.device_set) == 1:
        (device,) = sharding.device_set
        return [None] * array.ndim, Mesh((1,), ["device"], [_device_name(device)])
    raise ValueError(
        f"Cannot express the sharding {sharding} as a klm.Layout."
    )


def is_on_mesh(x):
    """Whether `x` (an array or a variable) is laid out on a mesh."""
    value = getattr(x, "value", x)
    return isinstance(value, jax.Array) and isinstance(
        value.sharding, jax.sharding.NamedSharding)


def device_bytes(x):
    """`{device: bytes}` of the pieces of `x` this process's devices hold."""
    held = {}
    for shard in _array(x).addressable_shards:
        name = _device_name(shard.device)
        held[name] = held.get(name, 0) + shard.data.nbytes
    return held


def distribute(x, layout):
    x = getattr(x, "value", x)  # a keras.Variable: no np.asarray on it
    sharding = _sharding(layout)
    if _spans_processes(sharding) and _whole_here(x):
        return place_whole(x, sharding)
    if isinstance(x, jax.Array):
        return jax.device_put(x, sharding)
    return jax.device_put(np.asarray(x), sharding)


def _spans_processes(sharding):
    return (isinstance(sharding, jax.sharding.Sharding)
            and not sharding.is_fully_addressable)


def _whole_here(value):
    """A value this process holds all of: numpy, or a jax.Array on this
    process's devices (not a tracer: inside `jit` layouts are constraints)."""
    if isinstance(value, jax.core.Tracer):
        return False
    if isinstance(value, jax.Array):
        return value.is_fully_addressable
    return isinstance(value, (np.ndarray, np.generic))


def wrap_distribute_tensor(distribute_tensor):
    """Keras' `distribute_tensor(value, layout)`, by which a variable places
    each value assigned to it (`load_weights`, `set_weights`, `assign`): a
    value this process holds whole, on a mesh that spans processes, is
    placed by `place_whole` (each process its own pieces, after comparing
    a digest of the value across processes) in place of `device_put`,
    which gathers the whole value from every process to compare it."""

    @functools.wraps(distribute_tensor)
    def placed(tensor, layout):
        sharding = getattr(layout, "backend_layout", layout)
        if _spans_processes(sharding) and _whole_here(tensor):
            return place_whole(tensor, sharding)
        return distribute_tensor(tensor, layout)

    return placed


def wrap_direct_assign(direct_assign):
    """A variable's assignment, naming the variable where the value differs
    across processes."""

    @functools.wraps(direct_assign)
    def assign(self, value):
        with same_value.naming(self.path):
            return direct_assign(self, value)

    return assign


def pack(components, layout):
    sharding = _sharding(layout)
    local = set(devices.local_devices())
    mine = [d for d in np.ravel(sharding.mesh.devices) if d in local]
    shape = list(np.shape(components[0]))
    for dim, axis in enumerate(layout.axes):
        if axis is not None:
            shape[dim] *= layout.mesh.dim_size(axis)
    arrays = [
        jax.device_put(np.asarray(c) if not isinstance(c, jax.Array) else c, d)
        for c, d in zip(components, mine)
    ]
    return jax.make_array_from_single_device_arrays(tuple(shape), sharding, arrays)


def unpack(x):
    array = _array(x)
    order = {d: i for i, d in enumerate(_mesh_devices(array))}
    shards = sorted(array.addressable_shards, key=lambda s: order[s.device])
    return [s.data for s in shards]


def _mesh_devices(array):
    sharding = array.sharding
    if isinstance(sharding, jax.sharding.NamedSharding):
        return list(np.ravel(sharding.mesh.devices))
    return sorted(sharding.device_set, key=lambda d: d.id)


def relayout_variable(variable, layout):
    variable._layout = layout
    variable._direct_assign(variable.value)


def unplace_variable(variable):
    """Bring a variable back to one device, as if made with no distribution."""
    variable._layout = None
    variable._direct_assign(jax.numpy.asarray(np.asarray(variable.value)))


def wrap_convert_to_numpy(original):
    @functools.wraps(original)
    def convert_to_numpy(x):
        if isinstance(x, keras_jax.Variable):
            x = x.value
        host = to_host(x)
        if host is not x and isinstance(host, np.ndarray):
            return host  # gathered here already: Keras' copy would be a second
        return original(host)

    return convert_to_numpy


def variable_array(self, dtype=None, copy=None):
    array = np.asarray(to_host(self.value))
    return array if dtype is None else array.astype(dtype)


def local_devices():
    """This process's devices (`"cpu:3"`), for `Mesh.local_devices()`."""
    return [_device_name(d) for d in devices.local_devices()]


def wrap_initialize_keeps_value_layout(original):
    """`keras.Variable(value)` with `value` a sharded `jax.Array` and no
    distribution active: JAX keeps the sharding; record it as the
    variable's layout too, so assignments and optimizer slots follow it."""

    def _initialize(self, value):
        from keras import distribution as keras_distribution

        if (getattr(self, "_layout", None) is None
                and keras_distribution.distribution() is None
                and isinstance(value, jax.Array)
                and isinstance(value.sharding, jax.sharding.NamedSharding)
                and value.sharding.mesh.size > 1):
            axes, mesh = fetch_layout(value)
            self._layout = Layout(axes, mesh)
        return original(self, value)

    return _initialize
