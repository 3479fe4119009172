"""Cost of building a model under `LayoutMap.scope()` against Keras' own
`keras.distribution.ModelParallel` with the same layouts.

keras-layoutmap hooks layer construction and weight creation (object paths,
`<weight>_layout=` kwargs, the layout of every weight). This builds the same
deep Functional MLP (N Dense layers) three ways, alternating in one process:
with no distribution (for scale), under Keras' `ModelParallel` (rules on
`variable.path`), and under `klm.LayoutMap.scope()` (rules on object paths),
and prints the median build time of each. The klm / Keras ratio is the cost
of the plugin; placing weights on 8 devices costs the same in both.

Run: KERAS_BACKEND=jax python benchmarks/build.py
"""

import os

os.environ.setdefault("KERAS_BACKEND", "jax")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras_layoutmap as klm  # noqa: E402

klm.configure_virtual_devices(8)

import statistics  # noqa: E402
import time  # noqa: E402

import keras  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

SIZES = (100, 200, 400)
ROUNDS = 3


def build(n):
    x = inputs = keras.Input((16,))
    for i in range(n):
        x = keras.layers.Dense(16, name=f"d{i}")(x)
    return keras.Model(inputs, x)


def timed(fn, n):
    keras.backend.clear_session()
    start = time.perf_counter()
    fn(n)
    return time.perf_counter() - start


def main():
    mesh = klm.create_mesh([("batch", 4), ("model", 2)])
    layout_map = klm.LayoutMap(mesh)
    layout_map[r"d\d+\.kernel"] = (None, "model")
    keras_map = keras.distribution.LayoutMap(mesh)
    keras_map[r".*/d\d+/kernel"] = (None, "model")
    keras_dist = keras.distribution.ModelParallel(
        layout_map=keras_map, batch_dim_name="batch")

    def with_scope(n):
        with layout_map.scope():
            build(n)

    def with_keras(n):
        with keras_dist.scope():
            build(n)

    table = Table(title="building an N-layer Functional MLP (median of "
                  f"{ROUNDS} alternating rounds)")
    for column in ("N layers", "no distribution (s)", "Keras ModelParallel (s)",
                   "klm scope (s)", "klm / Keras"):
        table.add_column(column, justify="right")
    for n in SIZES:
        times = {"none": [], "keras": [], "klm": []}
        for _ in range(ROUNDS):
            times["none"].append(timed(build, n))
            times["keras"].append(timed(with_keras, n))
            times["klm"].append(timed(with_scope, n))
        none, kd, kl = (statistics.median(times[k]) for k in ("none", "keras", "klm"))
        table.add_row(str(n), f"{none:.3f}", f"{kd:.3f}", f"{kl:.3f}",
                      f"{kl / kd:.2f}")
    Console().print(table)


if __name__ == "__main__":
    main()
