"""A Keras distribution made (or even set) before `import keras_layoutmap`,
as a script that imports Keras first does: one set before the import runs
as klm's, and one made before the import, then made current with a
`set_distribution` taken before the import, runs as klm's too, each with
the final short batch exact. Both in one fresh Python (a subprocess), on
JAX and TensorFlow with 8 CPU devices, on torch in 2 processes (one device
each: the short last batch of 5 rows still splits unevenly). On JAX a
Keras distribution made before the import starts JAX's devices (Keras
asks `jax.process_count()`), so the 8 CPU devices come from `XLA_FLAGS`, as
the error of `klm.configure_virtual_devices` says."""

import os
import subprocess
import sys

import pytest

from keras_layoutmap import backends

SCRIPT = '''
import keras
import numpy as np
from keras.distribution import DataParallel, DeviceMesh, set_distribution

mesh = DeviceMesh((N,), ["batch"], devices=[f"cpu:{i}" for i in range(N)])
set_before = DataParallel(device_mesh=mesh)
made_before = DataParallel(device_mesh=mesh)  # set after the import
set_distribution(set_before)

import keras_layoutmap as klm

klm.configure_virtual_devices(N)


def run():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    model.compile(loss="mse", optimizer="sgd")
    x = np.random.RandomState(0).rand(21, 4).astype("float32")
    # batches of 8, 8 and 5 rows: the last is short (on 8 or 2 devices)
    history = model.fit(x, x[:, :3], batch_size=8, epochs=2, verbose=0)
    return model, history.history["loss"], model.predict(x[:3], verbose=0)


# Set before the import: klm's distribution from the import on.
assert isinstance(keras.distribution.distribution(), klm.DataParallel)
runs = {"set before": run()}
# Made before the import, set now with Keras' own `set_distribution`,
# taken before the import.
set_distribution(made_before)
assert isinstance(keras.distribution.distribution(), klm.DataParallel)
runs["made before"] = run()
for name, (model, _, _) in runs.items():
    assert klm.fetch_layout(model.layers[0].kernel).mesh.size == N, name
set_distribution(None)
_, single_loss, single_predicted = run()
for name, (_, loss, predicted) in runs.items():
    np.testing.assert_allclose(loss, single_loss, rtol=1e-5, err_msg=name)
    np.testing.assert_allclose(predicted, single_predicted, rtol=1e-5,
                               atol=1e-6, err_msg=name)
print("BEFORE IMPORT OK", {k: v[1] for k, v in runs.items()})
'''


@pytest.mark.processes
def test_a_keras_distribution_made_before_the_import(tmp_path):
    """Both orders in one fresh Python (each such process imports Keras
    and its backend anew: 7 to 25 s of the suite per backend); on torch,
    2 processes under the launcher (one device each)."""
    torch = backends.name() == "torch"
    script = tmp_path / "script.py"
    script.write_text(f"N = {2 if torch else 8}\n" + SCRIPT)
    command = [sys.executable, str(script)]
    if torch:
        command[1:1] = ["-m", "keras_layoutmap.launch", "-n", "2"]
    env = dict(os.environ, KERAS_BACKEND=backends.name(),
               TF_CPP_MIN_LOG_LEVEL="3",
               XLA_FLAGS=os.environ.get("XLA_FLAGS", "")
               + " --xla_force_host_platform_device_count=8",
               PYTHONPATH=os.pathsep.join(
                   p for p in [os.getcwd(), os.environ.get("PYTHONPATH")] if p))
    if torch:
        env["OMP_NUM_THREADS"] = "1"
    result = subprocess.run(command, env=env,
                            cwd=tmp_path, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    assert "BEFORE IMPORT OK" in result.stdout
