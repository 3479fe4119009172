"""Which job a process runs in, read from its scheduler's variables.

A cluster's scheduler starts one process per task and tells each, in its
environment, how many tasks there are and which one it is. `detect` reads
those variables for the schedulers below and returns what they say, a
`Cluster`, with nothing joined; `keras_layoutmap.processes` decides which
source wins (explicit arguments, then the launcher's and Keras' variables,
then these) and joins.

The coordinator (process 0's host and a port every process derives alike)
follows the rules of JAX's own cluster detection (`jax._src.clusters`), so
that the three backends join the same way JAX alone would:

- **SLURM** (`srun`): `SLURM_JOB_ID`, `SLURM_STEP_NODELIST`, `SLURM_NTASKS`,
  `SLURM_PROCID`, `SLURM_LOCALID`. The coordinator is the first host of the
  step's node list, on port `61440 + SLURM_JOB_ID % 4096`.
- **Open MPI** (`mpirun`): `OMPI_COMM_WORLD_SIZE`, `_RANK`, `_LOCAL_RANK`,
  `_LOCAL_SIZE`. The coordinator is the host `mpirun` ran on
  (`OMPI_MCA_orte_hnp_uri`, Open MPI 4), on a port derived from the job id.
  Open MPI 5 names no host: on one host it is this one; across hosts set
  `MASTER_ADDR` (`mpirun -x MASTER_ADDR=...`).
- **Kubernetes**: Kubeflow's PyTorchJob sets the launcher's variables
  (`MASTER_ADDR`, `MASTER_PORT`, `WORLD_SIZE`, `RANK`), read before these.
  Kubeflow Trainer's JAX runtime sets `JAX_COORDINATOR_ADDRESS`,
  `JAX_NUM_PROCESSES`, `JAX_PROCESS_ID`; Kubeflow's JAXJob
  `COORDINATOR_ADDRESS`, `COORDINATOR_PORT`, `NUM_PROCESSES`, `PROCESS_ID`;
  Kubeflow Trainer's torch runtime torchrun's `PET_NNODES`, `PET_NODE_RANK`,
  `PET_MASTER_ADDR`, `PET_MASTER_PORT`. An indexed Job (and a JobSet) gives
  only `JOB_COMPLETION_INDEX`: `klm.initialize()` in a pod other than index 0
  that finds no count and coordinator elsewhere is an error, never a run
  of its own.

`MASTER_ADDR` and `MASTER_PORT`, when set without `WORLD_SIZE` (an `sbatch`
script's `export MASTER_ADDR=$(hostname)`), name the coordinator of the job
the scheduler describes; `JAX_COORDINATOR_PORT` sets its port, as in JAX.

Example:

>>> from keras_layoutmap.schedulers import detect
>>> cluster = detect({"SLURM_JOB_ID": "1234", "SLURM_STEP_NODELIST": "node[07-08]",
...                   "SLURM_NTASKS": "4", "SLURM_PROCID": "3", "SLURM_LOCALID": "1",
...                   "SLURM_STEP_TASKS_PER_NODE": "2(x2)"})
>>> cluster.coordinator_address, cluster.num_processes, cluster.process_id
('node07:62674', 4, 3)
>>> cluster.local_rank, cluster.local_size, cluster.addresses[2:]
(1, 2, ('node08:62675', 'node08:62676'))
>>> detect({}) is None
True
"""

import re
import zlib

from keras_layoutmap.cluster import Cluster

# JAX's rule: a port in the ephemeral range [65535 - 4095, 65535] from the
# job's id, the same on every process of the job.
PORT_RANGE_START = 65535 - 2**12 + 1
# The coordinator's port where a Kubernetes runtime names a host only (JAX's
# own Kubernetes detection picks this one).
KUBERNETES_PORT = 55527


def _job_port(job_id, offset=0):
    """JAX's port for job `job_id`; `offset` more, wrapping in the range
    (the ports of the job's DTensor clients)."""
    return PORT_RANGE_START + (job_id % 2**12 + offset) % 2**12


class _Variables:
    """The environment, recording each variable read (for error messages)."""

    def __init__(self, environ, scheduler):
        self.environ = environ
        self.scheduler = scheduler
        self.read = {}

    def get(self, name, default=None):
        value = self.environ.get(name)
        if value is not None:
            self.read[name] = value
        return default if value is None else value

    def int(self, name, default=None, required=False):
        value = self.get(name)
        if value is None:
            if required:
                raise self.error(f"{name} is not set")
            return default
        try:
            return int(value)
        except ValueError:
            raise self.error(f"{name} must be an integer, not {value!r}") from None

    def first(self, *names):
        """The first of `names` that is set (a variable's older spelling)."""
        for name in names:
            if name in self.environ:
                return name
        return names[0]

    def describe(self):
        return ", ".join(f"{k}={v}" for k, v in self.read.items())

    def error(self, what):
        return ValueError(
            f"This process runs in a {self.scheduler} job, but {what} "
            f"(read: {self.describe() or 'nothing'}). Fix the job's variables, "
            "or pass klm.initialize(coordinator_address, num_processes, "
            "process_id) explicitly.")

    def cluster(self, host, port, count, index, local_rank=None,
                local_size=None, addresses=None):
        if count < 1:
            raise self.error(f"the job has {count} tasks")
        if not 0 <= index < count:
            raise self.error(f"this task's index {index} is not in [0, {count})")
        if local_rank is not None and local_size is not None and not (
                0 <= local_rank < local_size):
            raise self.error(f"its local rank {local_rank} is not in "
                             f"[0, {local_size})")
        host, port = _coordinator_override(self, host, port)
        return Cluster(f"{host}:{port}", count, index, local_rank=local_rank,
                       local_size=local_size, addresses=addresses,
                       source=f"{self.scheduler} ({self.describe()})")


def _coordinator_override(variables, host, port):
    """`MASTER_ADDR` / `MASTER_PORT` (without `WORLD_SIZE`) and JAX's
    `JAX_COORDINATOR_PORT` name the coordinator of a scheduler's job."""
    host = variables.get("MASTER_ADDR", host)
    port = variables.get("MASTER_PORT") or variables.get("JAX_COORDINATOR_PORT") or port
    if host is None:
        raise variables.error(
            "its variables name no coordinator host: set MASTER_ADDR to "
            "process 0's host (and MASTER_PORT to a free port) on every process")
    return host, port


# -- SLURM -----------------------------------------------------------------

def expand_hostlist(hostlist):
    """SLURM's compressed host list, expanded in order.

    >>> expand_hostlist("node[001-003,007],login1")
    ['node001', 'node002', 'node003', 'node007', 'login1']
    """
    hosts = []
    for prefix, ranges, suffix in re.findall(
            r"([^,\[\]]*)(?:\[([^\]]*)\])?([^,\[\]]*)", hostlist):
        if not prefix and not ranges:
            continue
        if not ranges:
            hosts.append(prefix + suffix)
            continue
        for part in ranges.split(","):
            first, _, last = part.partition("-")
            for number in range(int(first), int(last or first) + 1):
                hosts.append(f"{prefix}{number:0{len(first)}d}{suffix}")
    return hosts


def expand_tasks_per_node(spec):
    """SLURM's tasks per node (`2(x3),1`), one count per node.

    >>> expand_tasks_per_node("2(x3),1")
    [2, 2, 2, 1]
    """
    counts = []
    for part in spec.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if match is None:
            raise ValueError(f"not a SLURM tasks-per-node list: {spec!r}")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts


def _slurm(environ):
    if "SLURM_JOB_ID" not in environ and "SLURM_JOBID" not in environ:
        return None
    v = _Variables(environ, "SLURM")
    job_id = v.int(v.first("SLURM_JOB_ID", "SLURM_JOBID"), required=True)
    count = v.int(v.first("SLURM_NTASKS", "SLURM_NPROCS"))
    nodelist = v.get("SLURM_STEP_NODELIST")
    if nodelist is None:
        # The job's batch script (or an `salloc` shell), not a task that
        # `srun` started: one process, whatever the job was given.
        if count is not None and count > 1:
            return _NotStarted(
                f"This process runs in the batch script of a SLURM job of "
                f"{count} tasks ({v.describe()}), not in a task that `srun` "
                "started, so it would train alone. Start the script with "
                "`srun python train.py` (one process per task), or call "
                "klm.initialize(num_processes=1) to run one process on purpose.")
        return None
    if count is None:
        raise v.error("SLURM_NTASKS is not set")
    step_count = v.int("SLURM_STEP_NUM_TASKS")
    if step_count is not None and step_count != count:
        raise v.error(f"SLURM_STEP_NUM_TASKS={step_count} and SLURM_NTASKS="
                      f"{count} disagree")
    index = v.int("SLURM_PROCID", required=True)
    local_rank = v.int("SLURM_LOCALID", required=True)
    hosts = expand_hostlist(nodelist)
    step_spec = v.get("SLURM_STEP_TASKS_PER_NODE")
    per_node = expand_tasks_per_node(step_spec) if step_spec else None
    if per_node is not None and (len(per_node) != len(hosts)
                                 or sum(per_node) != count):
        raise v.error(f"{len(hosts)} node(s) with {per_node} tasks do not "
                      f"make the {count} tasks")
    if per_node is None:
        # The job's own layout (a step may use less of the job): used only
        # where it fits this step.
        job_spec = v.get("SLURM_TASKS_PER_NODE")
        per_node = (expand_tasks_per_node(job_spec) if job_spec else
                    [v.int("SLURM_NTASKS_PER_NODE") or count] * len(hosts))
        if len(per_node) != len(hosts) or sum(per_node) != count:
            per_node = None
    local_size = addresses = None
    if per_node is not None:
        node = v.int("SLURM_NODEID")
        starts = [sum(per_node[:i]) for i in range(len(per_node))]
        by_block = [i for i, start in enumerate(starts) if start <= index][-1]
        if node is None:
            node = by_block
        local_size = per_node[node]
        # Each task's address, where the tasks are laid out by node (SLURM's
        # default, `block`): this task's own place says whether they are.
        block = v.get("SLURM_DISTRIBUTION", "block").split(":")[0] in ("block", "")
        if block and node == by_block and local_rank == index - starts[node]:
            addresses = _block_addresses(hosts, per_node, job_id)
    return v.cluster(hosts[0], _job_port(job_id), count, index, local_rank,
                     local_size, addresses)


def _block_addresses(hosts, per_node, job_id):
    """Each task's `host:port` when SLURM lays tasks out by node (its
    default, `block`): a port per task of a node, after the job's port."""
    addresses = []
    for host, tasks in zip(hosts, per_node):
        addresses += [f"{host}:{_job_port(job_id, 1 + i)}" for i in range(tasks)]
    return tuple(addresses)


class _NotStarted:
    """A job of several tasks that this process runs in, but not as one of
    its tasks (a SLURM batch script without `srun`), or as one whose job
    cannot be found (an indexed Job's pod, with an index only): nothing to
    join, and `klm.initialize()` must not run alone. Anything else (one
    device, `configure_virtual_devices`) runs as outside a job: such a
    process may well be meant to run on its own."""

    def __init__(self, message):
        self.message = message

    def error(self):
        return RuntimeError(self.message)


# -- Open MPI --------------------------------------------------------------

def _open_mpi(environ):
    if "OMPI_COMM_WORLD_SIZE" not in environ:
        return None
    v = _Variables(environ, "Open MPI")
    count = v.int("OMPI_COMM_WORLD_SIZE", required=True)
    index = v.int("OMPI_COMM_WORLD_RANK", required=True)
    local_rank = v.int("OMPI_COMM_WORLD_LOCAL_RANK")
    local_size = v.int("OMPI_COMM_WORLD_LOCAL_SIZE")
    uri = v.get("OMPI_MCA_orte_hnp_uri")
    host = port = None
    if uri is not None:
        match = re.search(r"tcp://(.+?)[,:]|tcp6://\[(.+?)[,\]]", uri)
        if match is None:
            raise v.error("OMPI_MCA_orte_hnp_uri names no TCP address")
        host = next(h for h in match.groups() if h is not None)
        try:
            job_id = int(uri.split(".", 1)[0]) // 2**12
        except ValueError:
            raise v.error("OMPI_MCA_orte_hnp_uri starts with no job id") from None
    else:
        # Open MPI 5 (PRRTE) names no host; on one host, it is this one.
        job_id = zlib.crc32(v.get("PMIX_NAMESPACE", "").encode())
        if local_size == count:
            host = "127.0.0.1"
    port = _job_port(job_id)
    addresses = None
    if local_size == count:
        addresses = tuple(f"{host or '127.0.0.1'}:{_job_port(job_id, 1 + i)}"
                          for i in range(count))
    return v.cluster(host, port, count, index, local_rank, local_size, addresses)


# -- Kubernetes --------------------------------------------------------------

def _split_address(address, default_port):
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or host.endswith(":"):
        return address, default_port
    return host.strip("[]"), port


def _kubeflow_jax(environ):
    """Kubeflow Trainer's JAX runtime, then Kubeflow's JAXJob."""
    if "JAX_COORDINATOR_ADDRESS" in environ and "JAX_NUM_PROCESSES" in environ:
        v = _Variables(environ, "Kubeflow Trainer (JAX)")
        host, port = _split_address(v.get("JAX_COORDINATOR_ADDRESS"),
                                    KUBERNETES_PORT)
        return v.cluster(host, port, v.int("JAX_NUM_PROCESSES", required=True),
                         v.int("JAX_PROCESS_ID", required=True))
    if all(name in environ for name in ("COORDINATOR_ADDRESS", "NUM_PROCESSES",
                                        "PROCESS_ID")):
        v = _Variables(environ, "Kubeflow JAXJob")
        host, port = _split_address(v.get("COORDINATOR_ADDRESS"),
                                    v.get("COORDINATOR_PORT", KUBERNETES_PORT))
        return v.cluster(host, port, v.int("NUM_PROCESSES", required=True),
                         v.int("PROCESS_ID", required=True))
    return None


def _kubeflow_torch(environ):
    """Kubeflow Trainer's torch runtime: torchrun's arguments as `PET_*`
    variables. Run directly (not through torchrun), one process per node."""
    if "PET_NNODES" not in environ:
        return None
    v = _Variables(environ, "Kubeflow Trainer (torch)")
    per_node = v.get("PET_NPROC_PER_NODE", "1")
    if per_node != "1":
        raise v.error(
            f"PET_NPROC_PER_NODE={per_node} asks for several processes per "
            "node: start the script with `torchrun train.py`, which starts "
            "them and sets each one's RANK")
    nodes = v.get("PET_NNODES")
    if not nodes.isdigit():  # an elastic range, "1:4"
        raise v.error(f"PET_NNODES={nodes} is not a fixed count: start the "
                      "script with torchrun")
    return v.cluster(v.get("PET_MASTER_ADDR"), v.get("PET_MASTER_PORT", "29500"),
                     int(nodes), v.int("PET_NODE_RANK", required=True), 0, 1)


def _indexed_job(environ):
    """A Kubernetes indexed Job: an index, and nothing else. Index 0 may
    be a job of one pod; another index is one pod of several."""
    if "JOB_COMPLETION_INDEX" not in environ:
        return None
    v = _Variables(environ, "Kubernetes indexed Job")
    if v.int("JOB_COMPLETION_INDEX") == 0:
        return None
    return _NotStarted(
        f"This process is pod {v.get('JOB_COMPLETION_INDEX')} of a Kubernetes "
        f"indexed Job ({v.describe()}), which names neither the number of "
        "processes nor the coordinator, so it cannot join its job and would "
        "train alone. Set KERAS_DISTRIBUTION_JOB_ADDRESSES (every pod's "
        "host:port, process 0's first), KERAS_DISTRIBUTION_NUM_PROCESSES and "
        "KERAS_DISTRIBUTION_PROCESS_ID=$(JOB_COMPLETION_INDEX) in the pod "
        "template (or MASTER_ADDR, MASTER_PORT, WORLD_SIZE and RANK), or call "
        "klm.initialize(num_processes=1) to run one process on purpose.")


SCHEDULERS = (_slurm, _open_mpi, _kubeflow_jax, _kubeflow_torch, _indexed_job)


def detect(environ):
    """The `Cluster` a scheduler's variables in `environ` describe, or None
    where none does (or a job of one task). A job whose variables are
    missing or disagree is a `ValueError` naming them. A process inside a
    job but not one of its tasks gives None here (see `not_started`)."""
    for scheduler in SCHEDULERS:
        found = scheduler(environ)
        if isinstance(found, _NotStarted):
            return None
        if found is not None:
            return found
    return None


def not_started(environ):
    """The error for a process that a scheduler's job of several tasks runs
    outside its tasks (a SLURM batch script without `srun`, a pod of an
    indexed Job that names no job), else None. Only `klm.initialize()`
    raises it."""
    for scheduler in (_slurm, _indexed_job):
        found = scheduler(environ)
        if isinstance(found, _NotStarted):
            return found.error()
    return None
