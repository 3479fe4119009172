"""Writes this folder's checkpoints: the matrix's MLP trained one epoch on
the digits under Keras' `ModelParallel` (the guide's (batch, model) mesh,
`d1` and `d2` split over `model`), saved by `keras.callbacks.OrbaxCheckpoint`
in several processes, each writing its own shards; beside it, the weights
and optimizer variables it must restore to (`<name>.npz`, written by
process 0). The matrix's row `orbax-other-backends` reads all three under
every backend. Run from the repository root, once per backend:

    KERAS_BACKEND=jax python -m keras_layoutmap.launch -n 2 \\
        tests/data/orbax/write.py
    KERAS_BACKEND=tensorflow python -m keras_layoutmap.launch -n 2 \\
        tests/data/orbax/write.py
    KERAS_BACKEND=torch python -m keras_layoutmap.launch -n 4 \\
        tests/data/orbax/write.py
"""

import pathlib
import shutil
import sys

import keras
import numpy as np

import keras_layoutmap as klm

klm.configure_virtual_devices(4 if keras.backend.backend() == "torch" else 8)

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
from helpers import digits_data  # noqa: E402
from test_workflows import keras_model_parallel_plan, mlp, model_state  # noqa: E402

HERE = pathlib.Path(__file__).resolve().parent


def main():
    name = f"{keras.backend.backend()}-{klm.process_count()}-processes"
    folder = HERE / name
    if klm.process_index() == 0 and folder.exists():
        shutil.rmtree(folder)
    keras.distribution.set_distribution(keras_model_parallel_plan())
    model = mlp()
    x, y = digits_data(300)
    model.fit(x, y, batch_size=64, epochs=1, shuffle=False, verbose=0,
              callbacks=[keras.callbacks.OrbaxCheckpoint(str(folder))])
    values = model_state(model)
    if klm.process_index() == 0:
        np.savez(HERE / f"{name}.npz", **values)
    print("wrote", folder)


if __name__ == "__main__":
    main()
