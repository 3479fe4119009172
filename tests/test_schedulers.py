"""Jobs a cluster's scheduler starts: `klm.initialize()` finds SLURM, Open
MPI and Kubernetes (Kubeflow) jobs from their variables, on every backend,
and a process never runs alone where the variables say there are several.

The jobs are simulated on this machine: processes started with a
scheduler's variables (loopback addresses) and no launcher."""

import json
import os
import pathlib
import random
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
from helpers import LAUNCHER_VARIABLES, process_environment, small_classifier, small_fit

import keras_layoutmap as klm
from keras_layoutmap import backends, schedulers
from keras_layoutmap.processes import cluster_from_environment

WORKER = pathlib.Path(__file__).parent / "workers" / "scheduled.py"
BACKEND = backends.name()


def slurm(job_id, tasks, index, nodes="localhost", per_node=None):
    """The variables `srun` sets for task `index` of a step on `nodes`."""
    per_node = per_node or tasks
    return {"SLURM_JOB_ID": str(job_id), "SLURM_STEP_NODELIST": nodes,
            "SLURM_NTASKS": str(tasks), "SLURM_STEP_NUM_TASKS": str(tasks),
            "SLURM_PROCID": str(index), "SLURM_LOCALID": str(index % per_node),
            "SLURM_NODEID": str(index // per_node),
            "SLURM_STEP_TASKS_PER_NODE": f"{per_node}(x{tasks // per_node})"}


def open_mpi(job_id, tasks, index, host="127.0.0.1", port=41000):
    """The variables Open MPI 4's `mpirun` sets (one host)."""
    return {"OMPI_MCA_orte_hnp_uri": f"{job_id}.0;tcp://{host},10.0.0.9:{port}",
            "OMPI_COMM_WORLD_SIZE": str(tasks), "OMPI_COMM_WORLD_RANK": str(index),
            "OMPI_COMM_WORLD_LOCAL_RANK": str(index),
            "OMPI_COMM_WORLD_LOCAL_SIZE": str(tasks)}


def kubeflow_jax(address, tasks, index):
    """The variables Kubeflow Trainer's JAX runtime sets in each pod."""
    return {"JAX_COORDINATOR_ADDRESS": address, "JAX_NUM_PROCESSES": str(tasks),
            "JAX_PROCESS_ID": str(index)}


# -- what the variables say (pure: no process joins) -------------------------

def test_slurm_step_across_nodes():
    env = slurm(70001, 8, 5, nodes="gpu[003-004]", per_node=4)
    cluster = cluster_from_environment(env)
    port = 61440 + 70001 % 4096
    assert (cluster.coordinator_address, cluster.num_processes,
            cluster.process_id) == (f"gpu003:{port}", 8, 5)
    assert (cluster.local_rank, cluster.local_size) == (1, 4)
    assert cluster.accelerator_index() == 1
    # DTensor's clients: a port per task of a node, after the job's.
    assert cluster.addresses == tuple(
        f"gpu00{3 + t // 4}:{port + 1 + t % 4}" for t in range(8))
    assert "SLURM_PROCID=5" in cluster.source


def test_a_step_smaller_than_its_job_ignores_the_jobs_layout():
    """`srun -n 2` inside a job of 8 tasks: the job's tasks per node do not
    describe the step, and are no error; the step's own are."""
    env = slurm(70002, 2, 1, nodes="gpu[003-004]", per_node=1)
    env.pop("SLURM_STEP_TASKS_PER_NODE")
    env["SLURM_TASKS_PER_NODE"] = "4(x2)"
    cluster = cluster_from_environment(env)
    assert (cluster.num_processes, cluster.process_id) == (2, 1)
    assert cluster.addresses is None and cluster.local_size is None


@pytest.mark.parametrize("nodes, first", [
    ("node001", "node001"), ("node001,host2", "node001"),
    ("node[001-0015],host2", "node001"), ("node[007,009-011]", "node007")])
def test_slurm_coordinator_is_the_first_node(nodes, first):
    env = slurm(5, 2, 0, nodes=nodes, per_node=1)
    env.pop("SLURM_STEP_TASKS_PER_NODE")
    assert cluster_from_environment(env).coordinator_address.split(":")[0] == first


def test_slurm_hostlist_and_tasks_per_node_expand():
    assert schedulers.expand_hostlist("a[1-3],b,c[08-10]") == [
        "a1", "a2", "a3", "b", "c08", "c09", "c10"]
    assert schedulers.expand_tasks_per_node("4(x2),3") == [4, 4, 3]


def test_open_mpi_coordinator_is_mpirun_host():
    cluster = cluster_from_environment(open_mpi(1531576320, 4, 2, host="10.96.0.1"))
    port = 61440 + (1531576320 // 4096) % 4096
    assert cluster.coordinator_address == f"10.96.0.1:{port}"
    assert (cluster.num_processes, cluster.process_id, cluster.local_rank) == (4, 2, 2)


def test_open_mpi_5_on_one_host_needs_no_uri():
    env = open_mpi(0, 2, 1)
    env.pop("OMPI_MCA_orte_hnp_uri")
    env["PMIX_NAMESPACE"] = "prterun-host-1234@1"
    cluster = cluster_from_environment(env)
    assert cluster.coordinator_address.startswith("127.0.0.1:")
    # ... and across hosts it asks for the coordinator's host.
    env.update(OMPI_COMM_WORLD_LOCAL_SIZE="1", OMPI_COMM_WORLD_LOCAL_RANK="0")
    with pytest.raises(ValueError, match="set MASTER_ADDR"):
        cluster_from_environment(env)
    env["MASTER_ADDR"] = "10.0.0.1"
    assert cluster_from_environment(env).coordinator_address.startswith("10.0.0.1:")


@pytest.mark.parametrize("env, expected", [
    (kubeflow_jax("node-0-0.svc:6666", 4, 3), ("node-0-0.svc:6666", 4, 3)),
    (kubeflow_jax("node-0-0.svc", 4, 3), ("node-0-0.svc:55527", 4, 3)),
    ({"COORDINATOR_ADDRESS": "jaxjob-worker-0", "COORDINATOR_PORT": "6666",
      "NUM_PROCESSES": "2", "PROCESS_ID": "1"}, ("jaxjob-worker-0:6666", 2, 1)),
    ({"PET_NNODES": "2", "PET_NODE_RANK": "1", "PET_MASTER_ADDR": "job-node-0-0",
      "PET_MASTER_PORT": "29400", "PET_NPROC_PER_NODE": "1"},
     ("job-node-0-0:29400", 2, 1)),
], ids=["trainer-jax", "trainer-jax-no-port", "jaxjob", "trainer-torch"])
def test_kubernetes_runtimes(env, expected):
    cluster = cluster_from_environment(env)
    assert (cluster.coordinator_address, cluster.num_processes,
            cluster.process_id) == expected


def test_launcher_and_keras_variables_come_before_a_scheduler():
    env = {**slurm(9, 2, 1), "MASTER_ADDR": "10.1.1.1", "MASTER_PORT": "29500",
           "WORLD_SIZE": "8", "RANK": "3"}  # torchrun inside an srun step
    assert cluster_from_environment(env).num_processes == 8
    env = {**slurm(9, 2, 1), "KERAS_DISTRIBUTION_JOB_ADDRESSES": "h0:1,h1:1",
           "KERAS_DISTRIBUTION_PROCESS_ID": "0"}
    assert cluster_from_environment(env).coordinator_address == "h0:1"
    # MASTER_ADDR / MASTER_PORT alone name the scheduler's coordinator.
    env = {**slurm(9, 2, 1), "MASTER_ADDR": "login7", "MASTER_PORT": "12345"}
    cluster = cluster_from_environment(env)
    assert (cluster.coordinator_address, cluster.process_id) == ("login7:12345", 1)


@pytest.mark.parametrize("env, match", [
    ({**slurm(1, 2, 0), "SLURM_PROCID": None}, "SLURM_PROCID is not set"),
    ({**slurm(1, 2, 0), "SLURM_PROCID": "2"}, r"index 2 is not in \[0, 2\)"),
    ({**slurm(1, 2, 0), "SLURM_STEP_NUM_TASKS": "4"}, "disagree"),
    ({**slurm(1, 2, 0), "SLURM_NTASKS": "x"}, "must be an integer"),
    ({**slurm(1, 4, 0, per_node=2), "SLURM_STEP_TASKS_PER_NODE": "3(x2)"},
     "do not make the 4 tasks"),
    ({**open_mpi(4096, 2, 0), "OMPI_COMM_WORLD_RANK": None}, "OMPI_COMM_WORLD_RANK"),
    ({**open_mpi(4096, 2, 0), "OMPI_MCA_orte_hnp_uri": "1.0;ucx://x"}, "no TCP"),
    ({**kubeflow_jax("h:1", 2, 0), "JAX_PROCESS_ID": None}, "JAX_PROCESS_ID"),
    ({"PET_NNODES": "2", "PET_NODE_RANK": "0", "PET_MASTER_ADDR": "h",
      "PET_NPROC_PER_NODE": "4"}, "torchrun"),
], ids=["slurm-missing", "slurm-index", "slurm-step-count", "slurm-not-int",
        "slurm-tasks-per-node", "mpi-missing", "mpi-uri", "kubeflow-missing",
        "pet-per-node"])
def test_bad_scheduler_variables_say_which_and_why(env, match):
    env = {k: v for k, v in env.items() if v is not None}
    with pytest.raises(ValueError, match=match) as raised:
        cluster_from_environment(env)
    assert "read:" in str(raised.value)


def test_jax_detects_the_same_jobs():
    """Our coordinator, count and index are what JAX's own cluster
    detection finds in the same variables (JAX is the reference)."""
    clusters = pytest.importorskip(
        "jax._src.clusters", reason="JAX, whose detection is the reference, "
        "is not installed in this session")
    for env, kind in ((slurm(123457, 4, 3, nodes="n[1-2]", per_node=2),
                       clusters.SlurmCluster),
                      (open_mpi(1531576320, 4, 2), clusters.OmpiCluster)):
        ours = cluster_from_environment(env)
        saved = dict(os.environ)
        try:
            os.environ.update(env)
            theirs = (kind.get_coordinator_address(None, None),
                      kind.get_process_count(), kind.get_process_id(),
                      kind.get_local_process_id())
        finally:
            os.environ.clear()
            os.environ.update(saved)
        assert (ours.coordinator_address, ours.num_processes, ours.process_id,
                ours.local_rank) == theirs


@pytest.fixture
def scheduler_environment(monkeypatch):
    """This process as a task of a simulated job: `set(env)` puts a
    scheduler's variables in place of any launcher's."""
    process_environment(monkeypatch, {})
    return lambda env: process_environment(monkeypatch, env)


def _batch_script():
    env = slurm(77, 4, 0)
    env.pop("SLURM_STEP_NODELIST")  # the batch script, not an srun step
    return env


@pytest.mark.parametrize("env, match", [
    (_batch_script(), "srun python train.py"),
    ({"JOB_COMPLETION_INDEX": "1"}, "pod 1 of a Kubernetes indexed Job"),
], ids=["slurm-batch-script", "indexed-job-pod"])
def test_initialize_outside_the_tasks_of_a_job_never_runs_alone(
        env, match, scheduler_environment):
    scheduler_environment(env)
    with pytest.raises(RuntimeError, match=match):
        klm.initialize()
    assert klm.initialize(num_processes=1) is None  # alone, on purpose
    # ... while a script that joins nothing runs as it would outside a job
    # (an indexed Job's pods may be meant to run on their own).
    assert cluster_from_environment() is None


def test_configure_virtual_devices_checks_the_job_size(scheduler_environment):
    scheduler_environment(slurm(78, 3, 1))
    error = RuntimeError if BACKEND == "torch" else ValueError
    with pytest.raises(error, match="over the 3 processes|this run has 3"):
        klm.configure_virtual_devices(8)


# -- simulated jobs: processes with a scheduler's variables, no launcher ------

def _free(port):
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _free_job_id():
    """A SLURM job id whose coordinator and client ports are free here."""
    while True:
        job_id = random.randrange(10**6)
        port = 61440 + job_id % 4096
        if port + 3 <= 65535 and all(_free(port + i) for i in range(3)):
            return job_id


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_job(tasks, out, *args, timeout=240):
    """Start one process per environment of `tasks` running the worker (as
    a scheduler would, with no launcher); wait for all. A process that
    fails ends the others (as `srun --kill-on-bad-exit` does). Returns the
    exit statuses and each process's output."""
    base = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES}
    # CPUs wherever the tests run: `klm.initialize()` takes a GPU per
    # process where torch sees GPUs, as a real job's processes do.
    base.update(OMP_NUM_THREADS="1", TF_CPP_MIN_LOG_LEVEL="3",
                KLM_JOIN_TIMEOUT="60", CUDA_VISIBLE_DEVICES="")
    logs = [open(out / f"log{i}", "w+") for i in range(len(tasks))]
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(out), *map(str, args)],
                              env={**base, **env}, stdout=log,
                              stderr=subprocess.STDOUT)
             for env, log in zip(tasks, logs)]
    deadline = time.monotonic() + timeout
    try:
        while any(p.poll() is None for p in procs):
            if time.monotonic() > deadline or any(p.poll() for p in procs):
                break
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    outputs = []
    for log in logs:
        log.seek(0)
        outputs.append(log.read())
        log.close()
    return [p.returncode for p in procs], outputs


def _jobs():
    """Each scheduler's two-task job: every task's variables and the
    worker's arguments. Together they train both plans on every backend:
    SLURM model-parallel, Kubernetes data-parallel (its script calls
    `configure_virtual_devices`; torch: one device per process), and on
    JAX Open MPI data-parallel."""
    devices = 2 if BACKEND == "torch" else 4
    slurm_id = _free_job_id()
    mpi_job = (_free_job_id() % 4096) * 4096  # the port it derives is free
    address = f"127.0.0.1:{_free_port()}"
    return {
        "slurm": ([slurm(slurm_id, 2, i) for i in range(2)],
                  ["model_parallel", "initialize"]),
        "open-mpi": ([open_mpi(mpi_job, 2, i) for i in range(2)],
                     ["data_parallel", "initialize"]),
        "kubernetes": ([kubeflow_jax(address, 2, i) for i in range(2)],
                       ["data_parallel", "configure", devices]),
    }


@pytest.fixture(scope="module")
def one_device():
    """The worker's model trained on one device, in this process."""
    klm.set_distribution(None)
    return small_fit(small_classifier())


# Every backend joins the `Cluster` that schedulers.py derives (tested
# above without processes for each scheduler), whichever scheduler it came
# from: the SLURM job runs that path on each backend, the Kubernetes job
# the `configure` one. Open MPI's job adds the end-to-end check of its
# derived address (a port from the job id); it runs on JAX, the quickest
# backend to start, once.
ONCE = pytest.mark.skipif(
    BACKEND != "jax", reason="Open MPI's job runs on JAX only: this backend "
    "joins the same Cluster as in the SLURM job, and Open MPI's address is "
    "derived without a backend (tests above)")


@pytest.mark.processes
@pytest.mark.parametrize("scheduler", [
    "slurm", pytest.param("open-mpi", marks=ONCE), "kubernetes"])
def test_a_scheduled_job_joins_and_trains_as_one_device(scheduler, tmp_path,
                                                        one_device):
    tasks, args = _jobs()[scheduler]
    codes, outputs = run_job(tasks, tmp_path, *args)
    assert codes == [0, 0], "\n".join(o[-3000:] for o in outputs)
    for rank in range(2):
        seen = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert seen["count"] == 2 and seen["devices"] in (2, 4)
        assert seen["local_devices"] == seen["devices"] // 2  # the mesh spans both
        if args[1] == "initialize":
            assert seen["cluster"][1:3] == [2, rank]
            assert seen["cluster"][3].startswith(
                {"slurm": "SLURM (", "open-mpi": "Open MPI ("}[scheduler])
        runs = seen["runs"]
        assert sorted(runs) == sorted(args[0].split(","))
        for name, run in runs.items():
            np.testing.assert_allclose(run["loss"], one_device["loss"],
                                       rtol=1e-5, err_msg=name)
            for got, want in zip(run["weights"], one_device["weights"]):
                np.testing.assert_allclose(got, want, atol=2e-6, err_msg=name)
        if "model_parallel" in runs:
            assert runs["model_parallel"]["kernel"] == ["unsharded", "model"]


@pytest.mark.processes
def test_a_task_that_never_starts_ends_the_others_with_a_clear_error(tmp_path):
    """Task 1 of 2 never starts: task 0 must not wait forever, nor abort
    with a runtime's stack trace, nor run alone."""
    task = {**slurm(_free_job_id(), 2, 0), "KLM_JOIN_TIMEOUT": "5"}
    start = time.monotonic()
    codes, outputs = run_job([task], tmp_path, "data_parallel", "initialize",
                             timeout=120)
    assert codes[0] != 0, outputs[0][-3000:]
    assert time.monotonic() - start < 100
    assert "JoinError: Process 0 of 2 could not join its run" in outputs[0]
    assert "SLURM_NTASKS=2" in outputs[0]
    assert not (tmp_path / "rank0.json").exists()


@pytest.mark.skipif(BACKEND != "jax", reason="JAX's own Cloud TPU detection")
def test_jax_joins_a_cloud_tpu_job_it_detects(monkeypatch, scheduler_environment):
    import jax

    from keras_layoutmap.backends.jax import processes

    joined = []
    monkeypatch.setattr(processes, "tpu_job_here", lambda: True)
    monkeypatch.setattr(jax.distributed, "is_initialized", lambda: False)
    monkeypatch.setattr(jax.distributed, "initialize",
                        lambda **kwargs: joined.append(kwargs))
    monkeypatch.setattr(jax, "process_count", lambda: 1)
    monkeypatch.setattr(jax, "process_index", lambda: 0)
    assert klm.initialize() is None  # one TPU host: nothing more to join
    assert joined == [{"initialization_timeout": 300}]
    monkeypatch.setattr(processes, "tpu_job_here", lambda: False)
    assert klm.initialize() is None and len(joined) == 1
