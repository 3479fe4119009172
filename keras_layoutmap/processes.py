"""Several processes, one mesh: joining the backend's multi-process runtime.

A mesh may span processes: `python -m keras_layoutmap.launch -n P script.py`
on one machine, or a cluster's scheduler starting one process per host. Each
process runs the same script with the same data; `klm.configure_virtual_devices(n)`
makes `n / P` devices in each and joins them (JAX: `jax.distributed`), and
`klm.initialize()` joins a real cluster's devices.

Where a process finds the cluster, first found wins:

- arguments to `klm.initialize(coordinator_address, num_processes, process_id)`;
- the launcher's (and torchrun's, and Kubeflow's PyTorchJob's)
  `MASTER_ADDR`, `MASTER_PORT`, `WORLD_SIZE`, `RANK` (with `LOCAL_RANK`,
  `LOCAL_WORLD_SIZE`);
- Keras' `KERAS_DISTRIBUTION_JOB_ADDRESSES` (comma-separated, the first is
  the coordinator), `KERAS_DISTRIBUTION_NUM_PROCESSES`,
  `KERAS_DISTRIBUTION_PROCESS_ID`;
- a cluster scheduler's own variables: SLURM, Open MPI, Kubernetes
  runtimes (`keras_layoutmap.schedulers`);
- on JAX, a Cloud TPU job JAX itself detects.

Where a scheduler says there are several tasks, a process never goes on
alone: it joins the others or raises. Joining ends within
`KLM_JOIN_TIMEOUT` seconds (`keras_layoutmap.join_deadline`).

`KLM_DEVICES_PER_PROCESS` (the launcher's `--devices-per-process K`) makes
`klm.initialize()` create K virtual CPU devices per process, so a cluster
script runs on a laptop.

Example:

>>> from keras_layoutmap.processes import Cluster, cluster_from_environment
>>> cluster_from_environment({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500",
...                           "WORLD_SIZE": "2", "RANK": "1"})
Cluster(coordinator_address='127.0.0.1:29500', num_processes=2, process_id=1)
>>> cluster_from_environment({}) is None
True
"""

import dataclasses
import os
import sys

import numpy as np

from keras_layoutmap import backends, join_deadline, schedulers
from keras_layoutmap.cluster import Cluster  # noqa: F401 (a public name here)


def _int(environ, name):
    value = environ.get(name)
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(
            f"Environment variable {name} must be an integer. Received: "
            f"{value!r}"
        ) from None


def _described(environ, names):
    return ", ".join(f"{n}={environ[n]}" for n in names if n in environ)


def cluster_from_environment(environ=None):
    """The `Cluster` the environment describes, or None outside one (see
    the module docstring for the variables, in order)."""
    environ = os.environ if environ is None else environ
    world = _int(environ, "WORLD_SIZE")
    if world is not None:
        rank = _int(environ, "RANK")
        address = environ.get("MASTER_ADDR", "127.0.0.1")
        port = environ.get("MASTER_PORT")
        if world == 1 and (rank is None or port is None):
            return None  # a world of one, as some platforms describe it
        if rank is None or port is None:
            raise ValueError(
                f"WORLD_SIZE={world} is set, but RANK or MASTER_PORT is not: "
                "start the script with `python -m keras_layoutmap.launch -n "
                f"{world} script.py` (or torchrun), which sets all of them."
            )
        return Cluster(
            f"{address}:{port}", world, rank,
            local_rank=_int(environ, "LOCAL_RANK"),
            local_size=_int(environ, "LOCAL_WORLD_SIZE"),
            addresses=_job_addresses(environ, world),
            source="the launcher's variables (" + _described(environ, (
                "MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK",
                "LOCAL_RANK")) + ")")
    jobs = environ.get("KERAS_DISTRIBUTION_JOB_ADDRESSES")
    if jobs:
        addresses = [a.strip() for a in jobs.split(",") if a.strip()]
        count = _int(environ, "KERAS_DISTRIBUTION_NUM_PROCESSES") or len(addresses)
        index = _int(environ, "KERAS_DISTRIBUTION_PROCESS_ID")
        if index is None:
            raise ValueError(
                "KERAS_DISTRIBUTION_JOB_ADDRESSES is set but "
                "KERAS_DISTRIBUTION_PROCESS_ID is not: set this process's id."
            )
        return Cluster(
            addresses[0], count, index,
            addresses=tuple(addresses) if len(addresses) == count else None,
            source="Keras' variables (" + _described(environ, (
                "KERAS_DISTRIBUTION_JOB_ADDRESSES",
                "KERAS_DISTRIBUTION_NUM_PROCESSES",
                "KERAS_DISTRIBUTION_PROCESS_ID")) + ")")
    return schedulers.detect(environ)


def _job_addresses(environ, count):
    """Every process's own address, where the launcher names them."""
    jobs = environ.get("KERAS_DISTRIBUTION_JOB_ADDRESSES", "")
    addresses = tuple(a.strip() for a in jobs.split(",") if a.strip())
    return addresses if len(addresses) == count else None


def initialize(coordinator_address=None, num_processes=None, process_id=None):
    """Join the backend's multi-process runtime (call it once, first).

    Missing arguments are read from the environment (see the module
    docstring): the launcher's, Keras', or a cluster scheduler's variables
    (SLURM, Open MPI, Kubernetes). The local devices are the ones the
    runtime finds (on a CPU machine, call `klm.configure_virtual_devices`
    instead: it makes the devices and joins). Returns the `Cluster` joined,
    or None when there is no cluster to join (one process);
    `num_processes=1` runs one process on purpose, inside a scheduler's
    job of several tasks too.

    Where the variables say there are several processes, this process
    joins them or raises: variables that are missing or disagree are a
    `ValueError` naming them, and a join that fails or is still waiting
    after `KLM_JOIN_TIMEOUT` seconds (default 300) ends every process that
    waits with a `JoinError` saying why.
    """
    given = (coordinator_address, num_processes, process_id)
    found = None if num_processes == 1 else cluster_from_environment()
    if found is None and given == (None, None, None):
        not_started = schedulers.not_started(os.environ)
        if not_started is not None:
            raise not_started
        return _join_detected(backends.get())
    if num_processes in (None, 1) and coordinator_address is None and found is None:
        return None
    if found is not None:
        coordinator_address = coordinator_address or found.coordinator_address
        num_processes = num_processes or found.num_processes
        process_id = found.process_id if process_id is None else process_id
    missing = [name for name, value in (
        ("coordinator_address", coordinator_address),
        ("num_processes", num_processes),
        ("process_id", process_id)) if value is None]
    if missing:
        raise ValueError(
            f"klm.initialize needs {', '.join(missing)}: pass them, or set the "
            "launcher's (MASTER_ADDR, MASTER_PORT, WORLD_SIZE, RANK) or "
            "Keras' KERAS_DISTRIBUTION_* variables, or start the script "
            "through a cluster scheduler (srun, mpirun, a Kubeflow job)."
        )
    cluster = Cluster(str(coordinator_address), int(num_processes), int(process_id))
    if found is not None:
        same = (found.coordinator_address, found.num_processes,
                found.process_id) == (cluster.coordinator_address,
                                      cluster.num_processes, cluster.process_id)
        cluster = dataclasses.replace(
            found, coordinator_address=cluster.coordinator_address,
            num_processes=cluster.num_processes, process_id=cluster.process_id,
            addresses=found.addresses if same else None,
            source=found.source if same else "klm.initialize's arguments")
    if cluster.num_processes == 1:
        return None
    backend = backends.get()
    _check_multi_process(backend)
    per_process = _devices_per_process()
    _join(backend, cluster, None if per_process is None
          else per_process * cluster.num_processes)
    return cluster


def _join_detected(backend):
    """The cluster a backend's runtime finds by itself (JAX on Cloud TPU),
    joined; None where it finds none (one process)."""
    join_detected = getattr(backend, "join_detected", None)
    cluster = None if join_detected is None else join_detected(
        join_deadline.seconds())
    if cluster is None or cluster.num_processes == 1:
        return None
    _joined(backend)
    return cluster


def _join(backend, cluster, total_devices):
    backend.join(cluster, total_devices=total_devices,
                 timeout=join_deadline.seconds())
    _joined(backend)


def configure_devices(n):
    """`klm.configure_virtual_devices(n)`: `n` devices in all, spread over
    the processes of the cluster the environment describes."""
    cluster = cluster_from_environment()
    backend = backends.get()
    if cluster is None or cluster.num_processes == 1:
        backend.configure_virtual_devices(n)
        return
    _check_multi_process(backend)
    per_process = _devices_per_process()
    if per_process is not None and per_process * cluster.num_processes != n:
        raise ValueError(
            f"configure_virtual_devices({n}): the launcher was given "
            f"--devices-per-process {per_process} for {cluster.num_processes} "
            f"processes, {per_process * cluster.num_processes} devices in all."
        )
    _join(backend, cluster, n)


def _joined(backend):
    """What every process does once it joined a run of several."""
    _agree_on_random_state(backend)
    if not getattr(sys.excepthook, "_klm_exits_at_once", False):
        sys.excepthook = _exit_at_once(sys.excepthook)


def _exit_at_once(excepthook):
    """An uncaught error ends this process at once with status 1, after its
    traceback. Left to the interpreter's shutdown, the runtime may keep it
    waiting on peers stuck in a collective it will never join (JAX's
    shutdown barrier, gloo), or abort it (torch's gloo threads, status
    134); the launcher then sees no failure and nothing ends."""

    def hook(kind, value, traceback):
        excepthook(kind, value, traceback)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)

    hook._klm_exits_at_once = True
    return hook


def _agree_on_random_state(backend):
    """Every process takes process 0's Python and NumPy random generators.

    Keras draws a weight's default seed from Python's `random`, and an
    unseeded process starts it from the OS: each process of a run would
    make its own value for a weight every process holds replicated, and
    train on a mesh whose copies disagree, with no error. Process 0's draws
    are those one process would make, so a script gives the same weights on
    one process and on several; one seeded before joining agrees already.
    (The torch backend does the same for torch's generator when it joins.)
    """
    import pickle
    import random

    state = pickle.dumps((random.getstate(), np.random.get_state()))
    mine = np.frombuffer(state, np.uint8)
    sizes = backend.gather_process_batches(np.asarray([mine.size], np.int64))
    first = backend.gather_process_batches(mine)[: int(sizes[0])]
    python_state, numpy_state = pickle.loads(first.tobytes())
    random.setstate(python_state)
    np.random.set_state(numpy_state)


def devices_per_process(total_devices, cluster):
    """How many of `total_devices` each process of `cluster` makes; an
    error that says which process counts fit when they do not spread
    evenly."""
    count = cluster.num_processes
    if total_devices % count:
        fits = [d for d in range(1, total_devices + 1) if total_devices % d == 0]
        raise ValueError(
            f"configure_virtual_devices({total_devices}): {total_devices} "
            f"devices cannot be spread evenly over the {count} processes of "
            f"this run. Launch a number of processes that divides "
            f"{total_devices} (one of {fits}): `python -m "
            f"keras_layoutmap.launch -n {fits[-2] if len(fits) > 1 else 1} "
            "script.py`."
        )
    return total_devices // count


def _devices_per_process():
    return _int(os.environ, "KLM_DEVICES_PER_PROCESS")


def _check_multi_process(backend):
    if not backend.MULTI_PROCESS:
        raise NotImplementedError(
            f"A mesh across processes is not built yet for the "
            f"{backends.name()} backend. Run one process "
            "(klm.configure_virtual_devices(n) makes n devices in it), or use "
            "KERAS_BACKEND=jax for several processes today."
        )


def process_count():
    """How many processes share the mesh (1 without a cluster)."""
    return backends.get().process_count()


def process_index():
    """This process's index, 0 to `process_count() - 1`."""
    return backends.get().process_index()
