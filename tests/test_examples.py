"""Every example runs and passes its own check (accuracy, parity), each on
one backend (`ONLY_ON`): the session of that backend runs it."""

import os
import pathlib
import subprocess
import sys

import pytest

from keras_layoutmap import backends

pytestmark = [pytest.mark.sharding, pytest.mark.training]

EXAMPLES = pathlib.Path(__file__).parent.parent / "examples"

# (script, arguments, a line its check prints when it passes)
SCRIPTS = [
    # Fewer epochs than a user's run (25, 10): the same code, and past the
    # scripts' 0.9 accuracy check (after 3 epochs, 2026-11-26: 0.95 and 0.94
    # on JAX, 0.97 and 0.92 on TensorFlow).
    ("train_digits.py", ["--epochs", "3"], "model parallel: val_accuracy"),
    ("subclassed_scope.py", ["--epochs", "3"], "sequential: val_accuracy"),
    ("spatial_parallel.py", [], "matches the single-device one"),
    ("custom_training_loop.py", [], "final test accuracy"),
    ("dtensor_keras_tutorial.py", [],
     "OK: the sharded run equals the one-device run"),
    ("gemma_model_parallel.py", [],
     "OK: fit, LoRA and greedy generate equal the one-device run"),
]


# Scripts run on one backend: {script: (backend, reason to skip elsewhere)}.
# Each script starts a fresh Python with its backend (TensorFlow's import
# alone takes 7 s of CPU) and trains until its own check passes: once is
# what the script itself needs; what it shows is tested on every backend
# by the tests named here.
ONLY_ON = {
    "train_digits.py": (
        "jax",
        "train_digits.py runs on JAX, as `nox -s example` runs it; its data- "
        "and model-parallel fits are test_training.py's and the workflow "
        "matrix's on every backend",
    ),
    "subclassed_scope.py": (
        "tensorflow",
        "subclassed_scope.py is the TF DTensor tutorial's 'existing model "
        "code' part and runs on TensorFlow, its readers' backend; the scope "
        "of subclassed, Functional and Sequential models is "
        "test_sharding.py::test_subclassed_scope and test_keras_outputs.py "
        "on every backend",
    ),
    "spatial_parallel.py": (
        "jax",
        "spatial_parallel.py runs on JAX; the same split of the pixels is "
        "test_fit_features.py::test_spatial_parallel_fit_matches_single_device "
        "on every backend",
    ),
    "custom_training_loop.py": (
        "jax",
        "custom_training_loop.py is a jax.grad / jax.jit loop; "
        "dtensor_keras_tutorial.py is the TensorFlow one",
    ),
    "dtensor_keras_tutorial.py": (
        "tensorflow",
        "dtensor_keras_tutorial.py is the TF DTensor tutorial (tf.function, "
        "tf.GradientTape); custom_training_loop.py is the JAX one",
    ),
    # The same recipe, on every backend and process count, is the workflow
    # matrix's hub-fit, hub-lora and hub-generate-greedy rows; the script
    # itself runs once, for its own check and output.
    "gemma_model_parallel.py": (
        "jax",
        "gemma_model_parallel.py's recipe (fit, LoRA, greedy generate against "
        "one device) runs on this backend as the workflow matrix's hub-fit, "
        "hub-lora and hub-generate-greedy rows (tests/test_workflows.py)",
    ),
}


# Examples run on torch under its launcher: {script: processes}.
TORCH_LAUNCHED = {}


def test_every_example_is_listed():
    """A new example script gets a row in SCRIPTS, so it is run here."""
    scripts = {p.name for p in EXAMPLES.glob("*.py")}
    assert scripts == {script for script, _, _ in SCRIPTS}


@pytest.mark.processes
@pytest.mark.parametrize("script, args, passed", SCRIPTS)
def test_example_runs(script, args, passed):
    backend = backends.name()
    only, reason = ONLY_ON.get(script, (backend, None))
    if backend != only:
        pytest.skip(f"{reason} (this session runs {backend})")
    command = [sys.executable, str(EXAMPLES / script), *args]
    if backend == "torch":
        if script not in TORCH_LAUNCHED:
            pytest.skip("this example makes 8 devices: on torch 8 processes of "
                        "one device each, more than this test's time allows on 2 "
                        "cores; tests/test_torch_distributed.py runs the same "
                        "patterns on 4")
        # As a torch user runs it: one process per device, under the launcher.
        command = [sys.executable, "-m", "keras_layoutmap.launch", "-n",
                   str(TORCH_LAUNCHED[script]), *command[1:]]
    env = dict(os.environ, KERAS_BACKEND=backend, TF_CPP_MIN_LOG_LEVEL="3")
    if backend == "torch":
        env.setdefault("OMP_NUM_THREADS", "1")  # a process per device
    result = subprocess.run(command, env=env, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert passed in result.stdout, result.stdout[-3000:]
