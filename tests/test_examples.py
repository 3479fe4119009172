"""Every example runs and passes its own check (accuracy, parity)."""

import os
import pathlib
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.sharding, pytest.mark.training]

EXAMPLES = pathlib.Path(__file__).parent.parent / "examples"


@pytest.mark.parametrize("script, args", [
    ("train_digits.py", []),
    ("subclassed_scope.py", []),
    ("spatial_parallel.py", []),
    ("custom_training_loop.py", []),
])
def test_example_runs(script, args):
    env = dict(os.environ, KERAS_BACKEND="jax", TF_CPP_MIN_LOG_LEVEL="3")
    result = subprocess.run([sys.executable, str(EXAMPLES / script), *args],
                            env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
