"""Accelerators chosen when present: each backend's device choice, with
the device query replaced (these tests need no GPU, and run on CPU)."""

import pytest
from helpers import BACKEND, SPANS_PROCESSES

import keras_layoutmap as klm

pytestmark = pytest.mark.skipif(
    SPANS_PROCESSES, reason="replaces the device query of a one-process run")


@pytest.mark.skipif(BACKEND != "torch", reason="torch's device choice")
def test_torch_choice_gpu_per_process_nccl_else_cpu_gloo():
    from keras_layoutmap.backends.torch import devices

    assert devices.choose(0, 0) == ("cpu", "gloo", "cpu")
    assert devices.choose(0, 5) == ("cpu", "gloo", "cpu")
    assert devices.choose(4, 0) == ("cuda", "nccl", "cuda:0")
    assert devices.choose(4, 3) == ("cuda", "nccl", "cuda:3")
    with pytest.raises(RuntimeError, match=r"local rank 4.*4 GPU\(s\)"):
        devices.choose(4, 4)
    # klm.configure_virtual_devices asked for CPUs: whatever torch sees
    assert devices.choose(4, 3, virtual_cpus=True) == ("cpu", "gloo", "cpu")
    assert devices.choose(1, 3, virtual_cpus=True) == ("cpu", "gloo", "cpu")


@pytest.mark.skipif(BACKEND != "torch", reason="torch's device choice")
def test_torch_list_devices_and_meshes_take_gpus_when_seen(monkeypatch):
    from keras_layoutmap.backends.torch import devices

    # As in a script that leaves out configure_virtual_devices (the test
    # run calls it: its devices are CPUs, tests/conftest.py).
    monkeypatch.setattr(devices, "VIRTUAL_CPUS", [False])
    monkeypatch.setattr(devices, "cuda_count", lambda: 0)
    assert klm.list_devices() == ["cpu:0"]
    monkeypatch.setattr(devices, "cuda_count", lambda: 2)
    assert klm.list_devices() == ["cuda:0"]
    from keras_layoutmap.backends.torch import keras_distribution

    assert keras_distribution.list_devices("gpu") == ["cuda:0"]
    assert keras_distribution.list_devices("cpu") == []
    mesh = klm.create_mesh([("batch", 1)])
    assert [str(d) for d in mesh.devices.ravel()] == ["cuda:0"]
    assert mesh.device_type() == "GPU"


@pytest.mark.skipif(BACKEND != "torch", reason="torch's device choice")
def test_torch_join_takes_local_gpu_and_nccl(monkeypatch):
    import torch
    import torch.distributed as dist

    from keras_layoutmap.backends.torch import devices, processes
    from keras_layoutmap.join_deadline import JoinError
    from keras_layoutmap.processes import Cluster

    taken, joined = [], []

    class Stop(Exception):
        pass

    def init_process_group(backend, **kwargs):
        joined.append((backend, kwargs["rank"], kwargs["world_size"]))
        raise Stop

    monkeypatch.setattr(devices, "cuda_count", lambda: 2)
    monkeypatch.setattr(devices, "VIRTUAL_CPUS", [False])  # as klm.initialize
    monkeypatch.setattr(devices, "LOCAL_RANK", [None])
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(torch.cuda, "set_device", taken.append)
    monkeypatch.setattr(dist, "init_process_group", init_process_group)

    def join(cluster):
        with pytest.raises(JoinError) as raised:  # the runtime's error, said
            processes.join(cluster)
        assert isinstance(raised.value.__cause__, Stop)
        assert "Process 1 of 2 could not join" in str(raised.value)

    join(Cluster("127.0.0.1:1234", 2, 1))
    assert taken == ["cuda:1"] and joined == [("nccl", 1, 2)]

    # A scheduler's local rank (SLURM_LOCALID, ...) picks the GPU.
    taken.clear(), joined.clear()
    monkeypatch.delenv("LOCAL_RANK")
    join(Cluster("127.0.0.1:1234", 2, 1, local_rank=1, local_size=2))
    assert taken == ["cuda:1"] and joined == [("nccl", 1, 2)]

    taken.clear(), joined.clear()
    monkeypatch.setattr(devices, "cuda_count", lambda: 0)
    join(Cluster("127.0.0.1:1234", 2, 1))
    assert taken == [] and joined == [("gloo", 1, 2)]

    # CPU devices asked for (configure_virtual_devices, the launcher's
    # --devices-per-process): the CPU over gloo where GPUs are seen, and
    # Keras makes its tensors there (it picked "cuda" at import).
    from keras_layoutmap.backends.torch import keras_internals as keras_torch

    taken.clear(), joined.clear()
    monkeypatch.setattr(devices, "cuda_count", lambda: 2)
    monkeypatch.setattr(keras_torch.core, "DEFAULT_DEVICE", "cuda")
    with pytest.raises(JoinError):
        processes.join(Cluster("127.0.0.1:1234", 2, 1), total_devices=2)
    assert taken == [] and joined == [("gloo", 1, 2)]
    assert devices.kind() == "cpu" and keras_torch.get_device() == "cpu"


@pytest.mark.skipif(BACKEND != "jax", reason="JAX's device choice")
def test_jax_meshes_take_its_gpus_unless_virtual_cpus(monkeypatch):
    import jax

    from keras_layoutmap.backends.jax import devices

    assert devices.choose("gpu", False) == "gpu"
    assert devices.choose("tpu", False) == "tpu"
    assert devices.choose("gpu", True) == "cpu"
    assert devices.choose("cpu", False) == "cpu"

    class Gpu:
        platform = "gpu"

        def __init__(self, i):
            self.id = i

    real_devices = jax.devices
    gpus = [Gpu(0), Gpu(1)]
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(jax, "devices", lambda backend=None: (
        gpus if backend == "gpu" else real_devices(backend)))
    # The session asked for virtual CPUs (the CPU demo path): they stay.
    monkeypatch.setattr(devices, "VIRTUAL_CPUS", [True])
    assert all(d.startswith("cpu:") for d in klm.list_devices())
    monkeypatch.setattr(devices, "VIRTUAL_CPUS", [False])
    assert klm.list_devices() == ["gpu:0", "gpu:1"]
    mesh = klm.create_mesh([("batch", 2)])
    assert [str(d) for d in mesh.devices.ravel()] == ["gpu:0", "gpu:1"]
    assert mesh.device_type() == "GPU"


@pytest.mark.skipif(BACKEND != "tensorflow", reason="TensorFlow's device choice")
def test_tensorflow_meshes_are_gpu_meshes_unless_virtual_cpus(monkeypatch):
    import tensorflow as tf

    from keras_layoutmap.backends.tensorflow import devices, processes

    assert devices.choose(2, False) == "GPU"
    assert devices.choose(2, True) == "CPU"
    assert devices.choose(0, False) == "CPU"

    real_logical = tf.config.list_logical_devices
    monkeypatch.setattr(devices, "gpu_count", lambda: 2)
    monkeypatch.setattr(tf.config, "list_logical_devices", lambda kind=None: (
        ["gpu0", "gpu1"] if kind == "GPU" else real_logical(kind)))
    monkeypatch.setattr(devices, "VIRTUAL_CPUS", [True])
    assert all(d.startswith("cpu:") for d in klm.list_devices())
    monkeypatch.setattr(devices, "VIRTUAL_CPUS", [False])
    monkeypatch.setitem(processes._STATE, "local", None)
    assert klm.list_devices() == ["gpu:0", "gpu:1"]
    mesh = klm.create_mesh([("batch", 2)])
    assert [str(d) for d in mesh.devices.ravel()] == ["gpu:0", "gpu:1"]
    assert mesh.device_type() == "GPU"
    assert processes.device_spec(1).endswith("/device:GPU:1")


def test_the_choice_examples_run():
    import doctest
    import importlib

    module = importlib.import_module(f"keras_layoutmap.backends.{BACKEND}.devices")
    result = doctest.testmod(module)
    assert result.failed == 0 and result.attempted > 0
