"""TensorFlow across processes: DTensor multi-client.

Each process (a DTensor *client*) holds `n / P` logical CPUs (or its GPUs,
where TensorFlow sees GPUs and no virtual CPUs were asked for: `devices`);
a mesh names global device ids, client `c` owning ids `c * L ... (c + 1) * L - 1`.
`dtensor.pack` takes this client's components only, and a value read on the
host is relayouted to replicated (a collective every client joins) and read
from a local copy. The data contract is JAX's (see `processes`).
"""

import atexit
import os
import sys

import numpy as np
import tensorflow as tf
from tensorflow.experimental import dtensor

from keras_layoutmap import join_deadline, same_value
from keras_layoutmap.backends.tensorflow import devices
from keras_layoutmap.processes import devices_per_process

MULTI_PROCESS = True

_STATE = {"clients": 1, "client": 0, "local": None}


def set_cpu_devices(n):
    """Make `n` logical CPU devices in this process (before TF starts);
    meshes then use them, even where TensorFlow sees GPUs."""
    devices.VIRTUAL_CPUS[0] = True
    cpus = tf.config.list_physical_devices("CPU")
    try:
        tf.config.set_logical_device_configuration(
            cpus[0], [tf.config.LogicalDeviceConfiguration()] * n
        )
    except RuntimeError:
        have = len(tf.config.list_logical_devices("CPU"))
        if have != n:
            raise RuntimeError(
                f"configure_virtual_devices needs {n} logical CPU device(s) in "
                f"this process, but TensorFlow already initialised {have}. "
                "Call it right after `import keras_layoutmap`."
            ) from None


def _job_addresses(cluster):
    """Every client's `host:port`: `DTENSOR_JOBS` where set, else the
    addresses the cluster's source names (the launcher's, Keras', a
    scheduler's), else, for processes that all share the coordinator's
    host, the ports after the coordinator's."""
    jobs = os.environ.get("DTENSOR_JOBS")
    if jobs:
        return jobs
    if cluster.addresses is not None:
        return ",".join(cluster.addresses)
    if cluster.local_size is not None and cluster.local_size < cluster.num_processes:
        raise RuntimeError(
            f"DTensor needs each client's own address, and the "
            f"{cluster.num_processes} processes of this run, on several hosts, "
            f"come with none (read from {cluster.source}). Set DTENSOR_JOBS "
            "(or KERAS_DISTRIBUTION_JOB_ADDRESSES) to every process's "
            "host:port, process 0's first, on every process.")
    host, _, port = cluster.coordinator_address.rpartition(":")
    return ",".join(f"{host}:{int(port) + 1 + i}"
                    for i in range(cluster.num_processes))


def join(cluster, total_devices=None, timeout=None):
    """Join `cluster` as a DTensor client; with `total_devices`, make
    `total_devices / num_processes` logical CPUs here. Where several
    processes share a host with GPUs, each takes the GPU of its local rank.
    The join ends within `timeout` seconds (`join_deadline`)."""
    if total_devices is not None:
        set_cpu_devices(devices_per_process(total_devices, cluster))
    jobs = _job_addresses(cluster)
    kind = devices.kind()
    if kind == "GPU" and cluster.accelerator_index() is not None:
        gpus = tf.config.list_physical_devices("GPU")
        if cluster.accelerator_index() >= len(gpus):
            raise RuntimeError(
                f"This process has local rank {cluster.accelerator_index()} "
                f"(read from {cluster.source}), but TensorFlow sees "
                f"{len(gpus)} GPU(s) on this host: start at most one process "
                "per GPU, or one process per host, which takes them all.")
        tf.config.set_visible_devices(gpus[cluster.accelerator_index()], "GPU")
    os.environ["DTENSOR_CLIENT_ID"] = str(cluster.process_id)
    os.environ["DTENSOR_NUM_CLIENTS"] = str(cluster.num_processes)
    os.environ.setdefault("DTENSOR_JOB_NAME", "worker")
    os.environ["DTENSOR_JOBS"] = jobs
    timeout = join_deadline.seconds() if timeout is None else timeout
    with join_deadline.deadline(cluster, timeout):
        dtensor.initialize_accelerator_system(kind)
    _STATE.update(clients=cluster.num_processes, client=cluster.process_id,
                  local=dtensor.num_local_devices(kind))
    # A normal exit waits for every process: a client serves the others'
    # reads of its pieces (the last `get_weights` relayouts to replicated),
    # and one that exits first refuses them ("Connection refused"). (An
    # uncaught error exits at once instead: keras_layoutmap.processes.)
    atexit.register(_leave)


EXIT_WAIT_SECONDS = 300


def _leave():
    """At exit, wait (at most `KLM_EXIT_WAIT` seconds, default 300) until
    every client gets here: through the coordination service alone, not a
    collective, so that a client exiting after a failure (pytest's exit
    with failed tests, `sys.exit(1)`) is not held forever by a peer still
    in a step; the launcher then ends the run."""
    if _STATE["clients"] <= 1:
        return
    from tensorflow.python.eager import context

    seconds = float(os.environ.get("KLM_EXIT_WAIT", EXIT_WAIT_SECONDS))
    try:
        context.context().wait_at_barrier("klm_exit", int(seconds * 1000))
    except Exception as error:  # a peer that never came: exit all the same
        print(f"keras_layoutmap: not every process reached the end of the run "
              f"within {seconds:g} s ({type(error).__name__}); exiting.",
              file=sys.stderr)


def process_count():
    return _STATE["clients"]


def process_index():
    return _STATE["client"]


def local_device_count():
    """Devices (logical CPUs, or GPUs) in this process."""
    if _STATE["local"] is not None:
        return _STATE["local"]
    return len(tf.config.list_logical_devices(devices.kind()))


def local_ids():
    """The global device ids this process owns."""
    local = local_device_count()
    start = _STATE["client"] * local
    return list(range(start, start + local))


def global_device_count():
    return local_device_count() * _STATE["clients"]


def device_spec(index):
    """The TF device of local device `index` in a multi-client run."""
    return (f"/job:{os.environ.get('DTENSOR_JOB_NAME', 'worker')}/replica:0/"
            f"task:{_STATE['client']}/device:{devices.kind()}:{index}")


def process_mesh():
    """A `proc x local` dtensor.Mesh over every device, by process."""
    clients, local = _STATE["clients"], local_device_count()
    ids = np.arange(clients * local).reshape(clients, local)
    mine = local_ids()
    return dtensor.Mesh(
        ["proc", "local"], ids, mine, [device_spec(i) for i in range(local)],
        mesh_name="klm_processes")


_PROCESS_MESH = []


def shared_process_mesh():
    """`process_mesh()`, made once."""
    if not _PROCESS_MESH:
        _PROCESS_MESH.append(process_mesh())
    return _PROCESS_MESH[0]


def gather_process_batches(local_batch):
    """Every process's batch, concatenated in process order, on every
    process (batches may differ in length)."""
    mesh = shared_process_mesh()
    local_batch = np.asarray(local_batch)
    sizes = _allgather(mesh, np.asarray([local_batch.shape[0]], np.int64))
    longest = int(sizes.max())
    padded = np.zeros((longest, *local_batch.shape[1:]), local_batch.dtype)
    padded[: local_batch.shape[0]] = local_batch
    gathered = _allgather(mesh, padded)
    return np.concatenate(
        [gathered[i, : int(n)] for i, n in enumerate(sizes.reshape(-1))], axis=0)


def check_same_everywhere(value):
    """Raise `same_value.ValueDiffersAcrossProcesses` on every process
    where `value`, a host value every process places on a mesh over all of
    them, is not the same on every process (each keeps its own pieces of
    what it holds): a CRC-32 of each process's bytes, gathered over the
    processes' mesh (a collective every client joins)."""
    if _STATE["clients"] == 1:
        return
    host = np.ascontiguousarray(value.numpy() if tf.is_tensor(value)
                                else np.asarray(value))
    mine = same_value.digest(host.reshape(-1).view(np.uint8), host.shape,
                             host.dtype)
    every = _allgather(shared_process_mesh(), mine)
    same_value.check_same(list(every), _STATE["client"], host.shape,
                          host.dtype)


def every_process_agrees(flag):
    """Whether `flag` holds on every process (a collective every client
    joins; eagerly)."""
    if _STATE["clients"] == 1:
        return bool(flag)
    every = _allgather(shared_process_mesh(), np.asarray([int(bool(flag))]))
    return bool(np.all(every))


def _allgather(mesh, value):
    rank = value.ndim + 1
    layout = dtensor.Layout(["proc"] + [dtensor.UNSHARDED] * value.ndim, mesh)
    piece = tf.convert_to_tensor(value[None])
    packed = dtensor.pack([piece] * local_device_count(), layout)
    whole = dtensor.relayout(packed, dtensor.Layout.replicated(mesh, rank))
    return dtensor.unpack(whole)[0].numpy()


def barrier(name):
    if _STATE["clients"] > 1:
        dtensor.barrier(shared_process_mesh(), barrier_name=name)
