"""On an NVIDIA GPU, the paths users' accelerators take, for real: the
devices klm lists and meshes are made of (torch: under `python -m
keras_layoutmap.launch -n 1`, the process on `cuda:0`), each weight on the
GPU, read from the backend, under each plan (klm rules, `klm.fsdp`, Keras'
`DataParallel`; on one GPU their layouts are all whole), training equal to
the same GPU without any distribution, a one-file `save_weights` and
`load_weights`, and torch's refusal of more processes than GPUs. A mesh
of several GPUs (NCCL between torch's processes) needs a machine with
several.

The selection logic is tested on CPU (tests/test_device_choice.py); this
file needs a GPU, which CI and the project's machine lack, and runs where
one is: `KERAS_BACKEND=torch pytest tests/test_gpu.py` on a GPU machine.
"""

import json
import os
import shutil

import numpy as np
import pytest
from helpers import (
    BACKEND,
    TESTS,
    assert_same_history,
    assert_same_weights,
    launch,
    run_script,
)

pytestmark = [
    pytest.mark.processes,
    pytest.mark.skipif(
        shutil.which("nvidia-smi") is None,
        reason="needs an NVIDIA GPU (no nvidia-smi here): CI has none; "
               "run on a GPU machine"),
]

WORKER = os.path.join(TESTS, "workers", "on_gpu.py")
# A GPU's kind, as JAX ("cuda:0", "gpu:0"), torch ("cuda:0") and TensorFlow
# (".../device:GPU:0") name its devices.
GPU_KINDS = {"cuda", "gpu"}


def _launch_worker(processes, out, timeout=300):
    """The worker under `python -m keras_layoutmap.launch -n processes`."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        filter(None, [os.path.dirname(TESTS), TESTS,
                      os.environ.get("PYTHONPATH")])))
    return launch(processes, WORKER, out, timeout=timeout, env=env)


def _run_worker(out):
    """The worker as users run a script: torch's under the launcher, in one
    process (NCCL, `cuda:0`), the others' alone."""
    if BACKEND == "torch":
        return _launch_worker(1, out)
    return run_script(WORKER, out, timeout=300)


def test_a_gpu_mesh_places_every_plan_on_the_gpu_and_trains_as_one_gpu(tmp_path):
    out = tmp_path / "result.json"
    done = _run_worker(out)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    result = json.loads(out.read_text())
    kinds = {name.split(":")[0].lower() for name in result["devices"]}
    if not kinds <= GPU_KINDS:
        pytest.skip(f"{BACKEND} sees no GPU on this machine: "
                    f"{result['devices']} (a CPU-only build)")
    assert result["mesh_kind"] == "GPU"
    plans = result["plans"]
    reference = plans.pop("one device")
    for name, plan in plans.items():
        for path, row in plan["placed"].items():
            assert row["device"] in GPU_KINDS, (name, path, row)
            assert row["mesh_kind"] == "GPU", (name, path, row)
        assert_same_history({"loss": plan["loss"]}, {"loss": reference["loss"]})
        assert_same_weights([np.array(w) for w in plan["weights"]],
                            [np.array(w) for w in reference["weights"]])
    for loaded, trained in zip(result["loaded"], plans["rules"]["weights"]):
        np.testing.assert_array_equal(loaded, trained)


@pytest.mark.skipif(BACKEND != "torch", reason="torch's processes take a GPU each")
def test_more_torch_processes_than_gpus_are_refused_with_what_to_do(tmp_path):
    import torch

    gpus = torch.cuda.device_count()
    if not gpus:
        pytest.skip("torch sees no GPU on this machine (a CPU-only build)")
    done = _launch_worker(gpus + 1, tmp_path / "result.json", timeout=120)
    assert done.returncode != 0
    output = done.stdout + done.stderr
    assert f"{gpus} GPU(s) on this host" in output, output[-4000:]
    assert "at most one process per GPU" in output, output[-4000:]
