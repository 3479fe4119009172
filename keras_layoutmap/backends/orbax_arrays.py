"""Orbax's arrays for TensorFlow and torch: a value sharded over processes
seen as one `jax.Array` of this process's own shards, and back.

Orbax (Keras' `OrbaxCheckpoint`, `load_model(directory)`) writes and reads
`jax.Array`s: each process its own shards, the processes coordinated by
`jax.distributed`. On JAX the variables are such arrays already. On
TensorFlow and torch, in a run of several processes, `join()` starts a
CPU-only JAX world that mirrors the run (the same processes, in each as
many JAX CPU devices as the backend has devices there, `jax.distributed`'s
coordinator on the run's first host, at a port process 0 picks), and
`to_jax(value)` views a value on a mesh as a `jax.Array` on the mirror of
that mesh: each local shard on the JAX CPU device standing for the backend
device that holds it, nothing gathered. Values every process holds whole
are given to Orbax as numpy (its primary process writes them).
`from_jax(array)` goes back: the shards this process holds, packed by the
backend on the mesh the mirror stands for.

In one process nothing needs mirroring: Orbax writes every value whole
(Keras' own path), and reads each onto one JAX CPU device (`abstract`).

JAX is set to CPU only in these processes (`jax_platforms="cpu"`): the
checkpoint's bytes travel through host memory, and the GPUs stay the
backend's.
"""

import json
import socket

import jax
import keras
import numpy as np

from keras_layoutmap import join_deadline
from keras_layoutmap.cluster import Cluster
from keras_layoutmap.processes import cluster_from_environment

_WORLD = {}  # "devices": backend device name -> JAX device; "meshes"


def _backend():
    from keras_layoutmap import backends

    return backends.get()


def _free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _share(record, size=1 << 16):
    """Every process's JSON `record`, in process order (the backend's own
    collective: nothing of JAX runs yet)."""
    data = json.dumps(record).encode()
    if len(data) > size:
        raise ValueError(f"{len(data)} bytes to share, more than {size}.")
    row = np.zeros((1, size), np.uint8)
    row[0, : len(data)] = np.frombuffer(data, np.uint8)
    rows = _backend().gather_process_batches(row)
    return [json.loads(bytes(r[r != 0]).decode()) for r in rows]


def _cpu_only():
    """JAX on the CPU only, in a TensorFlow or torch process that reads a
    checkpoint: else a JAX built for GPUs would take most of their memory
    from the backend. (Already started: as it started.)"""
    try:
        jax.config.update("jax_platforms", "cpu")
    except RuntimeError:
        pass


def joined():
    """Whether this process mirrors a run of several processes in JAX."""
    return "devices" in _WORLD


def refuse_a_start_on_some_processes(backend, name):
    """Raise at once, on the processes that started an Orbax checkpoint
    (`name`), where not every process of the run started it: a handshake
    outside any collective (`enter_together`), instead of a wait in the
    checkpoint's first collective."""
    if backend.process_count() > 1 and not backend.enter_together(name):
        raise RuntimeError(
            f"An Orbax checkpoint was started on process "
            f"{backend.process_index()} but not on all "
            f"{backend.process_count()} processes of the run. Each process "
            "writes and reads its own shards, together: create "
            "`keras.callbacks.OrbaxCheckpoint` and call `load_model` / "
            "`load_weights` on every process, not under `if rank == 0:`.")


def join():
    """Mirror this run of several processes in JAX (the first time; every
    time a collective: every process calls it, for each checkpoint it
    starts). Returns False where there is one process."""
    backend = _backend()
    count = backend.process_count()
    if count == 1:
        return False
    index = backend.process_index()
    refuse_a_start_on_some_processes(backend, "orbax_checkpoint_join")
    if joined():
        return True
    local = [str(d) for d in backend.local_devices()]
    cluster = cluster_from_environment()
    host = (cluster.coordinator_address.rsplit(":", 1)[0]
            if cluster is not None else socket.getfqdn())
    records = _share({"devices": local, "host": host,
                      "port": _free_port() if index == 0 else None})
    address = f"{records[0]['host']}:{records[0]['port']}"
    if jax.distributed.is_initialized():
        raise RuntimeError(
            "jax.distributed already runs in this process; Orbax checkpoints "
            f"of a {backend.__name__.rsplit('.', 1)[-1]} run start their own "
            "CPU-only JAX world. Leave jax.distributed to keras_layoutmap.")
    try:
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", len(local))
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    except RuntimeError as error:
        raise RuntimeError(
            "JAX already started its devices in this process, before the "
            "first Orbax checkpoint of this run: a checkpoint across "
            "processes needs JAX's own world, made first. Create the "
            "`OrbaxCheckpoint` (or call `load_model`) before using JAX "
            f"directly. ({error})") from None
    mirror = Cluster(address, count, index, source="keras_layoutmap's "
                     "mirror of the run for Orbax checkpoints")
    timeout = join_deadline.seconds()
    with join_deadline.deadline(mirror, timeout):
        jax.distributed.initialize(
            coordinator_address=address, num_processes=count,
            process_id=index, cluster_detection_method="deactivate",
            initialization_timeout=int(timeout) + 30,
            heartbeat_timeout_seconds=30)
    by_process = {}
    for device in jax.devices():
        by_process.setdefault(device.process_index, []).append(device)
    names = {}
    for process, record in enumerate(records):
        mine = sorted(by_process.get(process, []), key=lambda d: d.id)
        if len(mine) != len(record["devices"]):
            raise RuntimeError(
                f"Process {process} holds {len(record['devices'])} devices, "
                f"but JAX's mirror made {len(mine)} there.")
        names.update(zip(record["devices"], mine))
    _WORLD["devices"] = names
    _WORLD["meshes"] = {}
    return True


def _mirror(mesh):
    """The `jax.sharding.Mesh` standing for the backend's `mesh`."""
    devices = tuple(str(d) for d in np.ravel(mesh.devices))
    key = (tuple(mesh.shape), tuple(mesh.axis_names), devices)
    meshes = _WORLD["meshes"]
    if key not in meshes:
        stand_ins = np.array([_WORLD["devices"][d] for d in devices],
                             dtype=object).reshape(tuple(mesh.shape))
        meshes[key] = (jax.sharding.Mesh(stand_ins, tuple(mesh.axis_names)),
                       mesh)
    return meshes[key][0]


def _local_positions(jax_mesh):
    return [d for d in np.ravel(jax_mesh.devices)
            if d.process_index == jax.process_index()]


def _sharded(value):
    """`(axes, mesh)` of a value sharded over the mesh, else None."""
    backend = _backend()
    if not backend.is_on_mesh(value):
        return None
    axes, mesh = backend.fetch_layout(value)
    if all(a is None for a in axes):
        return None
    return axes, mesh


def _host_view(piece, copy):
    """A piece this process holds, as numpy: a copy, or (`copy=False`) the
    tensor's own buffer where the backend allows (a CPU tensor's)."""
    if copy:
        return keras.ops.convert_to_numpy(piece)
    return np.asarray(keras.ops.stop_gradient(piece))


def to_jax(value, copy=True):
    """What Orbax writes of `value`: a `jax.Array` of this process's shards
    on the mirror of its mesh (only after `join()`), or numpy where every
    process holds it whole (0-d values as Python scalars, as Keras gives
    them). With `copy=False` the shards are this process's own buffers
    where the backend allows (CPU), nothing copied until Orbax writes: only
    for a save that ends before the variables change again (Orbax, as JAX,
    takes arrays for immutable; a save in the background needs a
    snapshot)."""
    sharded = _sharded(value) if joined() else None
    if sharded is None:
        if joined() and _backend().is_on_mesh(value):
            array = _host_view(_backend().unpack(value)[0], copy)
        else:
            array = keras.ops.convert_to_numpy(value)
        return array.item() if array.ndim == 0 else array
    axes, mesh = sharded
    jax_mesh = _mirror(mesh)
    pieces = _backend().unpack(value)
    local = _local_positions(jax_mesh)
    arrays = [jax.device_put(_host_view(piece, copy), device)
              for piece, device in zip(pieces, local)]
    sharding = jax.sharding.NamedSharding(
        jax_mesh, jax.sharding.PartitionSpec(*axes))
    return jax.make_array_from_single_device_arrays(
        tuple(value.shape), sharding, arrays)


def abstract(shape, dtype, target):
    """What Orbax reads into, for a value that will be assigned to
    `target` (a variable's value): sharded like it on the mirror where it
    is sharded over processes, else whole on one local JAX device."""
    if isinstance(target, jax.Array):  # JAX: the variable's own sharding
        return jax.ShapeDtypeStruct(tuple(shape), dtype,
                                    sharding=target.sharding)
    sharded = _sharded(target) if joined() and target is not None else None
    if sharded is None:
        if keras.backend.backend() != "jax":
            _cpu_only()
        sharding = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    else:
        axes, mesh = sharded
        sharding = jax.sharding.NamedSharding(
            _mirror(mesh), jax.sharding.PartitionSpec(*axes))
    return jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=sharding)


def host_local_as_numpy(value):
    """A JAX array this process holds alone in a run of several processes
    (on its own devices only), as numpy; any other value as it is."""
    if (isinstance(value, jax.Array) and jax.process_count() > 1
            and value.is_fully_addressable):
        return np.asarray(value)
    return value


def is_jax_array(value):
    return isinstance(value, jax.Array)


def from_jax(array):
    """A `jax.Array` Orbax read, as the backend's value: whole as numpy
    where this process holds all of it, else this process's shards packed
    on the backend mesh its mirror stands for."""
    if array.is_fully_addressable:
        return np.asarray(array)
    from keras_layoutmap.layout import Layout

    sharding = array.sharding
    key = next(k for k, (m, _) in _WORLD["meshes"].items()
               if m == sharding.mesh)
    mesh = _WORLD["meshes"][key][1]
    spec = tuple(sharding.spec) + (None,) * (array.ndim - len(sharding.spec))
    shards = {shard.device: shard.data for shard in array.addressable_shards}
    pieces = [np.asarray(shards[d]) for d in _local_positions(sharding.mesh)]
    return _backend().pack(pieces, Layout(list(spec), mesh))
