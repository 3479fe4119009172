"""JAX across processes: `jax.distributed` joins them, every batch is built
as one global array from the global data, and values read on the host are
gathered from every process.

The data contract (see `klm.DataParallel`): with `auto_shard_dataset=True`
every process passes the same global data and global `batch_size`, and each
process places only the rows of its own devices; with `False`, each process
passes its own slice and the global batch is the processes' slices in
process order. Either way every step sees one global batch, so a short
final batch (replicated by the distribution's data layout) is exact.
"""

import jax
import numpy as np
from jax.experimental import multihost_utils

from keras_layoutmap import join_deadline, one_writer
from keras_layoutmap.backends.jax import devices, writer_transfers
from keras_layoutmap.cluster import Cluster
from keras_layoutmap.processes import devices_per_process
from keras_layoutmap.same_value import check_same, digest

MULTI_PROCESS = True


def set_cpu_devices(n):
    """Make `n` CPU devices in this process (before JAX starts); meshes
    then use them, even where JAX sees GPUs."""
    devices.VIRTUAL_CPUS[0] = True
    try:
        jax.config.update("jax_num_cpu_devices", n)
    except RuntimeError:
        # JAX already initialised its devices; fine if it has what we need.
        have = len(jax.local_devices(backend="cpu"))
        if have != n:
            raise RuntimeError(
                f"configure_virtual_devices needs {n} CPU device(s) in this "
                f"process, but JAX already started with {have}. Call it right "
                "after `import keras_layoutmap`, or set XLA_FLAGS="
                f"--xla_force_host_platform_device_count={n}."
            ) from None


def join(cluster, total_devices=None, timeout=None):
    """Join `cluster` with `jax.distributed`. With `total_devices` (the
    CPU devices of the whole run), make `total_devices / num_processes` of
    them in this process, with collectives over gloo. Where several
    processes share a host, each takes the GPU of its local rank (JAX's
    rule; a process alone on its host takes them all). The join ends within
    `timeout` seconds (`join_deadline`)."""
    local_devices = None
    if total_devices is not None:
        local_devices = devices_per_process(total_devices, cluster)
    if jax.distributed.is_initialized():
        if jax.process_count() != cluster.num_processes:
            raise RuntimeError(
                f"jax.distributed already runs {jax.process_count()} processes;"
                f" this run asks for {cluster.num_processes}."
            )
        return
    visible = None
    if local_devices is not None:
        set_cpu_devices(local_devices)
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    elif cluster.accelerator_index() is not None:
        visible = [cluster.accelerator_index()]
    timeout = join_deadline.seconds() if timeout is None else timeout
    with join_deadline.deadline(cluster, timeout):
        jax.distributed.initialize(
            coordinator_address=cluster.coordinator_address,
            num_processes=cluster.num_processes,
            process_id=cluster.process_id,
            local_device_ids=visible,
            # Found already, by the rules of JAX's own detection.
            cluster_detection_method="deactivate",
            # Longer than ours: at its own timeout JAX aborts the process.
            initialization_timeout=int(timeout) + 30,
            heartbeat_timeout_seconds=30,
        )


def tpu_job_here():
    """Whether JAX's own detection finds a Cloud TPU job (a TPU VM on GCE,
    or GKE's TPU variables; a metadata query only on a TPU VM)."""
    try:
        from jax._src.clusters import cloud_tpu_cluster
    except ImportError:  # a JAX that moved its detection: none found
        return False
    kinds = (getattr(cloud_tpu_cluster, name, None)
             for name in ("GceTpuCluster", "GkeTpuCluster"))
    return any(kind.is_env_present() for kind in kinds if kind is not None)


def join_detected(timeout=None):
    """Where no variables of ours name a cluster, join the one JAX itself
    detects on Cloud TPU (`jax.distributed.initialize()` with no
    arguments). Returns the `Cluster` joined, or None where there is none."""
    if jax.distributed.is_initialized() or not tpu_job_here():
        return None
    timeout = join_deadline.seconds() if timeout is None else timeout
    jax.distributed.initialize(initialization_timeout=int(timeout))
    return Cluster("(found by JAX on Cloud TPU)", jax.process_count(),
                   jax.process_index(), source="JAX's Cloud TPU detection")


def process_count():
    return jax.process_count()


def process_index():
    return jax.process_index()


def barrier(name):
    """Wait until every process gets here."""
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)


def to_host(value):
    """A jax.Array as one numpy array, gathered from every process if this
    process does not hold all of it (during a one-file save, on process 0
    alone: `one_writer`)."""
    if isinstance(value, jax.Array) and not value.is_fully_addressable:
        if one_writer.active():  # a one-file save: to process 0 alone
            return one_writer.received(writer_transfers.send_to_writer(value),
                                       value.shape, value.dtype)
        return np.asarray(multihost_utils.process_allgather(value, tiled=True))
    return value


def gather_process_batches(local):
    """Every process's `local` batch, concatenated in process order, on
    every process (batches may differ in length: the last one of an epoch)."""
    local = np.asarray(local)
    sizes = np.asarray(multihost_utils.process_allgather(
        np.asarray([local.shape[0]], np.int64))).reshape(-1)
    longest = int(sizes.max())
    padded = np.zeros((longest, *local.shape[1:]), local.dtype)
    padded[: local.shape[0]] = local
    gathered = np.asarray(multihost_utils.process_allgather(padded))
    return np.concatenate(
        [gathered[i, : int(n)] for i, n in enumerate(sizes)], axis=0)


def global_array(host, sharding):
    """A global jax.Array from `host`, the whole value known to every
    process: each process places only its own devices' pieces."""
    host = np.asarray(host)
    return jax.make_array_from_callback(host.shape, sharding, lambda i: host[i])


def place_whole(value, sharding):
    """`value`, whole on this process (a numpy array, or a jax.Array this
    process holds all of), placed by `sharding`, which spans processes:
    each process places its own devices' pieces of it.

    JAX's `device_put` does the same after checking that every process
    passed the same value, by gathering the whole value from every process:
    15 s and +340 MiB for one 256 MiB kernel over 4 processes, against
    0.35 s (2026-11-27; `load_weights` of a 1 GiB file took 35 s). The same
    check here compares a CRC-32 of each process's bytes (with the shape
    and dtype): one small gather. A value that differs raises
    `same_value.ValueDiffersAcrossProcesses` on every process."""
    host = np.asarray(value, order="C")  # 0-d stays 0-d
    mine = digest(host.reshape(-1).view(np.uint8), host.shape, host.dtype)
    every = np.asarray(multihost_utils.process_allgather(mine))
    check_same(every, jax.process_index(), host.shape, host.dtype)
    return global_array(host, sharding)
