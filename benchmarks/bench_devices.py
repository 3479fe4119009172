"""The devices a benchmark's mesh spans, settled before Keras is imported.

JAX and TensorFlow: 8 virtual CPU devices in this process. torch, one
device per process: the script runs again as 4 processes under
`python -m keras_layoutmap.launch`, each holding one device. Only the
standard library is imported here, so a script calls it first:

    from bench_devices import mesh_devices
    DEVICES = mesh_devices(__file__)
    import keras_layoutmap as klm
    klm.configure_virtual_devices(DEVICES)
"""

import os
import subprocess
import sys


def mesh_devices(script, processes=4, devices=8):
    """How many devices the mesh has. Sets `KERAS_BACKEND` (JAX unless
    set) and quiets TensorFlow's log; on torch outside the launcher, runs
    `script` (with this command line's arguments) as `processes` processes
    (one thread each) and exits with their status."""
    os.environ.setdefault("KERAS_BACKEND", "jax")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    if os.environ["KERAS_BACKEND"] != "torch":
        return devices
    if "WORLD_SIZE" not in os.environ:
        sys.exit(subprocess.call(
            [sys.executable, "-m", "keras_layoutmap.launch", "-n",
             str(processes), script, *sys.argv[1:]],
            env=dict(os.environ, OMP_NUM_THREADS="1")))
    return int(os.environ["WORLD_SIZE"])
