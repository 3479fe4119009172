"""Meshes, layouts and tensors on them: `dtensor.Mesh` / `dtensor.Layout`
for ours, `distribute` / `pack` / `unpack` / `fetch_layout`, and values
gathered back to the host."""


import numpy as np
import tensorflow as tf
from tensorflow.experimental import dtensor

from keras_layoutmap import one_writer
from keras_layoutmap.backends.tensorflow import devices, writer_transfers
from keras_layoutmap.backends.tensorflow import keras_internals as keras_tf
from keras_layoutmap.backends.tensorflow.processes import (
    device_spec,
    global_device_count,
    local_ids,
    process_count,
    set_cpu_devices,
)
from keras_layoutmap.layout import as_layout
from keras_layoutmap.mesh import Mesh, _mesh_key


def configure_virtual_devices(n):
    set_cpu_devices(n)


def list_devices():
    kind = devices.kind().lower()
    return [f"{kind}:{i}" for i in range(global_device_count())]


def device_id(name):
    return int(str(name).rpartition(":")[2])


def num_local_devices(mesh):
    local = set(local_ids())
    return sum(device_id(d) in local for d in np.ravel(mesh.devices))


_DMESHES = {}


def _tf_device(name):
    kind, index = str(name).split(":")
    return f"{kind.upper()}:{index}"


def to_dmesh(mesh):
    """The one `dtensor.Mesh` for meshes equal to `mesh` (same axes, sizes
    and devices), with a name of its own: DTensor keys compiled functions
    by mesh name, so meshes of other shapes must not share one."""
    key = _mesh_key(mesh)
    if key not in _DMESHES:
        dims = list(zip(mesh.axis_names, mesh.shape))
        name = f"klm_{len(_DMESHES)}"
        if process_count() == 1:
            _DMESHES[key] = dtensor.create_mesh(
                dims, devices=[_tf_device(d) for d in np.ravel(mesh.devices)],
                mesh_name=name)
        else:  # global ids; this client's devices among them
            ids = np.asarray([device_id(d) for d in np.ravel(mesh.devices)])
            local = local_ids()
            mine = [i for i in ids if i in local]
            _DMESHES[key] = dtensor.Mesh(
                list(mesh.axis_names), ids.reshape(mesh.shape), mine,
                [device_spec(i - local[0]) for i in mine], mesh_name=name)
    return _DMESHES[key]


def _local_positions(mesh):
    """Positions (in mesh order) of the mesh devices this process holds."""
    if process_count() == 1:
        return list(range(mesh.size))
    local = set(local_ids())
    return [i for i, d in enumerate(np.ravel(mesh.devices))
            if device_id(d) in local]


def to_dlayout(layout):
    specs = [dtensor.UNSHARDED if a is None else a for a in layout.axes]
    return dtensor.Layout(specs, to_dmesh(layout.mesh))


def value_of(x):
    """A tensor for `x`: a Keras or tf variable's current value."""
    if isinstance(x, keras_tf.Variable):
        x = x.value
    if isinstance(x, tf.Variable):
        x = x.read_value()
    return x


def is_dtensor(x):
    try:
        dtensor.fetch_layout(x)
        return True
    except Exception:
        return False


def fetch_layout(x):
    value = value_of(x)
    if not tf.is_tensor(value):
        raise TypeError(
            "Expected a tf.Tensor, DTensor or keras.Variable. Received: "
            f"{type(x).__name__}"
        )
    if not is_dtensor(value):
        device = tf.convert_to_tensor(value).device.split("device:")[-1].lower()
        rank = len(value.shape)
        return [None] * rank, Mesh((1,), ["device"], [device or "cpu:0"])
    layout = dtensor.fetch_layout(value)
    dmesh = layout.mesh
    if process_count() == 1:
        devices = [d.split("device:")[-1].lower() for d in dmesh.local_devices()]
    else:
        devices = [f"cpu:{i}" for i in np.ravel(dmesh.global_device_ids())]
    mesh = Mesh(dmesh.shape(), dmesh.dim_names, devices)
    axes = [None if s == dtensor.UNSHARDED else s for s in layout.sharding_specs]
    return axes, mesh


def is_on_mesh(x):
    """Whether `x` (a tensor or a variable) is a DTensor on a mesh."""
    value = value_of(x)
    return tf.is_tensor(value) and is_dtensor(value)


def device_bytes(x):
    """`{device: bytes}` of the pieces of `x` this process's devices hold
    (a value on no mesh: its one device)."""
    value = value_of(x)
    if not is_dtensor(value):
        axes, mesh = fetch_layout(value)
        return {str(mesh.devices.ravel()[0]): int(
            np.prod(value.shape)) * value.dtype.size}
    _, mesh = fetch_layout(value)
    devices = [str(d) for d in np.ravel(mesh.devices)]
    mine = [devices[i] for i in _local_positions(mesh)]
    return {d: int(np.prod(piece.shape)) * piece.dtype.size
            for d, piece in zip(mine, dtensor.unpack(value))}


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
    value = value_of(x)
    if tf.is_tensor(value) and not tf.executing_eagerly() and not isinstance(
            value, tf.Variable):
        # Inside a tf.function every tensor is on the function's mesh.
        return dtensor.relayout(value, to_dlayout(layout))
    if tf.is_tensor(value) and is_dtensor(value):
        source = dtensor.fetch_layout(value)
        if source.mesh == to_dmesh(layout.mesh):
            return dtensor.relayout(value, to_dlayout(layout))
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
    shards = host_shards(array, layout)
    return pack([shards[i] for i in _local_positions(layout.mesh)], layout)


def pack(components, layout):
    return dtensor.pack([tf.convert_to_tensor(c) for c in components],
                        to_dlayout(layout))


def unpack(x):
    value = value_of(x)
    if not (tf.is_tensor(value) and is_dtensor(value)):
        raise TypeError(
            "klm.unpack expects a tensor placed on a mesh (a DTensor) or a "
            f"keras.Variable made on one. Received: a plain {type(x).__name__}"
            f" of shape {tuple(getattr(value, 'shape', ()))}. Place it with "
            "klm.distribute(x, layout) or klm.pack(components, layout) first."
        )
    return dtensor.unpack(value)


def local_devices():
    """This process's devices (`"cpu:3"`, global ids), for
    `Mesh.local_devices()`."""
    kind = devices.kind().lower()
    return [f"{kind}:{i}" for i in local_ids()]


def distribute_tensor_hook(tensor, layout):
    """Keras' hook to relayout a layer output (`<layer>/output` rules).
    Inside a step traced for every batch size, a batch dimension of unknown
    size (`_klm_match_dims`, see `keras_classes.fit_output_layout`) keeps
    the split it has (`dtensor.MATCH`): split for a full batch, whole for a
    short one, as the data is."""
    match = getattr(layout, "_klm_match_dims", ())
    layout = as_layout(layout)
    if match and tf.is_tensor(tensor) and not tf.executing_eagerly():
        dlayout = to_dlayout(layout)
        specs = [dtensor.MATCH if i in match else spec
                 for i, spec in enumerate(dlayout.sharding_specs)]
        return dtensor.relayout(tensor, dtensor.Layout(specs, dlayout.mesh))
    return distribute(tensor, layout)


def mesh_distribution():
    """The active distribution if it spans more than one device."""
    from keras import distribution as keras_distribution

    dist = keras_distribution.distribution()
    mesh = getattr(dist, "device_mesh", None)
    if mesh is None or int(np.prod(mesh.shape)) == 1:
        return None
    return dist


def mesh_of(x):
    """The `dtensor.Mesh` an op on `x` runs on: eagerly, that of `x` if it
    is a DTensor; inside a `tf.function`, the active mesh distribution's;
    None off the mesh."""
    if tf.executing_eagerly():
        return dtensor.fetch_layout(x).mesh if is_dtensor(x) else None
    dist = mesh_distribution()
    return None if dist is None else to_dmesh(dist.device_mesh)


def copy_whole_to_mesh(x, dmesh):
    """A plain tensor `x` as a DTensor whole on every device of `dmesh` (a
    `dtensor.Mesh`); a DTensor as it is."""
    x = tf.convert_to_tensor(x)
    if is_dtensor(x):
        return x
    return dtensor.copy_to_mesh(
        x, dtensor.Layout.replicated(dmesh, x.shape.rank))


def runs_on_mesh(*values):
    """Whether an op on `values` runs on the mesh: eagerly, when one of them
    is a DTensor; inside a `tf.function` (where a symbolic tensor does not
    say its layout), whenever a mesh distribution is active."""
    if not tf.executing_eagerly():
        return mesh_distribution() is not None
    return any(tf.is_tensor(v) and is_dtensor(v) for v in values)


def to_host(x):
    """A DTensor output as one plain tensor on the host (an all-gather if it
    is sharded); anything else as it is. During a one-file save across
    processes (`one_writer`), a value sharded over processes goes to
    process 0 alone, as numpy (a placeholder on the other processes)."""
    if not (tf.is_tensor(x) and is_dtensor(x)):
        return x
    layout = dtensor.fetch_layout(x)
    if not layout.is_fully_replicated():
        if one_writer.active() and process_count() > 1:
            return one_writer.received(
                writer_transfers.send_to_writer(x, layout),
                tuple(int(d) for d in x.shape), x.dtype.as_numpy_dtype)
        x = dtensor.relayout(x, dtensor.Layout.replicated(layout.mesh, layout.rank))
    return tf.identity(dtensor.unpack(x)[0])
