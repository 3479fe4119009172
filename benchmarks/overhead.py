"""Per-step training overhead of keras-layoutmap against plain
`keras.distribution`.

The same MLP (Dense 512 -> 1024 -> 1024 -> 10, random float32 data, fixed
seed) is trained twice on a ("batch", 4) x ("model", 2) mesh of 8 virtual
CPU devices, with identical weight layouts and the same global batch:

- klm:   `klm.LayoutMap` rules on object paths, model built and trained
         under `layout_map.scope()`;
- plain: `keras.distribution.LayoutMap` keyed on `variable.path`,
         `keras.distribution.ModelParallel(layout_map=...,
         batch_dim_name="batch")`, model built and trained under
         `dist.scope()`.

Layouts (Megatron style): the first kernel is split by columns
(None, "model"), the second by rows ("model", None); the 1024 x 10 head is
replicated, because 10 does not split over "model" (2).

Each step is timed with `time.perf_counter()` in
`on_train_batch_begin` / `on_train_batch_end`. The first steps of every fit
call (compilation, warm-up) are skipped. The two runs alternate in one
process, the order flipping every round (klm, plain, plain, klm, ...), so
that machine noise and warm-up trends hit both alike. Both models start from
the same seed and see the same batches, so their weights must stay equal; the
script prints the largest difference at the end.

Note: both runs share the process, so both run with keras-layoutmap's Keras
patches installed (importing the package installs them); the ratio measures
the distribution's per-step cost (variable layouts, data layouts), not the
import.

Goal: median step time klm / plain <= 1.03.

Run: KERAS_BACKEND=jax python benchmarks/overhead.py
"""

import os

os.environ.setdefault("KERAS_BACKEND", "jax")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras_layoutmap as klm  # noqa: E402

klm.configure_virtual_devices(8)

import statistics  # noqa: E402

import keras  # noqa: E402
import numpy as np  # noqa: E402
from common import StepTimer  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

SEED = 1234
FEATURES, HIDDEN, CLASSES = 512, 1024, 10
GLOBAL_BATCH = 64  # divisible by the batch axis (4): plain Keras needs it
STEPS_PER_ROUND = 25
SKIP = 5  # first steps of each fit call: compile and warm-up
ROUNDS = 10
GOAL = 1.03

MESH_DIMS = [("batch", 4), ("model", 2)]
COLUMN, ROW = (None, "model"), ("model", None)


def build_model():
    keras.utils.set_random_seed(SEED)
    inputs = keras.Input((FEATURES,), name="x")
    h = keras.layers.Dense(HIDDEN, activation="relu", name="d0")(inputs)
    h = keras.layers.Dense(HIDDEN, activation="relu", name="d1")(h)
    outputs = keras.layers.Dense(CLASSES, name="head")(h)
    model = keras.Model(inputs, outputs, name="mlp")
    model.compile(
        optimizer=keras.optimizers.Adam(1e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


def make_data():
    rng = np.random.default_rng(SEED)
    n = GLOBAL_BATCH * STEPS_PER_ROUND
    x = rng.standard_normal((n, FEATURES), dtype=np.float32)
    y = rng.integers(0, CLASSES, size=(n,)).astype("int32")
    return x, y


def klm_setup():
    mesh = klm.create_mesh(MESH_DIMS)
    layout_map = klm.LayoutMap(mesh)
    layout_map[r"d0\.kernel"] = COLUMN
    layout_map[r"d0\.bias"] = ("model",)
    layout_map[r"d1\.kernel"] = ROW
    with layout_map.scope() as dist:
        model = build_model()
    return model, dist


def plain_setup():
    mesh = keras.distribution.DeviceMesh(
        shape=(4, 2),
        axis_names=["batch", "model"],
        devices=keras.distribution.list_devices()[:8],
    )
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map[r".*d0/kernel"] = COLUMN
    layout_map[r".*d0/bias"] = ("model",)
    layout_map[r".*d1/kernel"] = ROW
    dist = keras.distribution.ModelParallel(
        layout_map=layout_map, batch_dim_name="batch"
    )
    with dist.scope():
        model = build_model()
    return model, dist


def train_round(model, dist, x, y):
    timer = StepTimer()
    with dist.scope():
        model.fit(
            x, y, batch_size=GLOBAL_BATCH, epochs=1, shuffle=False,
            verbose=0, callbacks=[timer],
        )
    return timer.times[SKIP:]


def layout_of(model, name):
    return klm.fetch_layout(model.get_layer(name).kernel)


def main():
    console = Console(width=120)
    x, y = make_data()
    runs = {"klm": klm_setup(), "plain": plain_setup()}

    # Both runs must place the kernels identically, or the race is unfair.
    layouts = Table(title="kernel layouts (klm.fetch_layout)")
    layouts.add_column("kernel")
    for name in runs:
        layouts.add_column(name)
    layouts.add_column("same")
    all_same = True
    for layer in ("d0", "d1", "head"):
        found = {name: layout_of(model, layer) for name, (model, _) in runs.items()}
        same = found["klm"] == found["plain"]
        all_same &= same
        layouts.add_row(
            f"{layer}.kernel",
            *(str(lay.sharding_specs) for lay in found.values()),
            "yes" if same else "NO",
        )
    console.print(layouts)
    console.print(f"mesh: {layout_of(runs['klm'][0], 'd0').mesh!r}")
    if not all_same:
        console.print("[bold red]WARNING: the two runs place kernels differently")

    times = {name: [] for name in runs}
    per_round = {name: [] for name in runs}
    for i in range(ROUNDS):
        order = list(runs) if i % 2 == 0 else list(reversed(runs))
        for name in order:
            model, dist = runs[name]
            steps = train_round(model, dist, x, y)
            times[name].extend(steps)
            per_round[name].append(statistics.median(steps))

    table = Table(
        title=f"MLP {FEATURES}-{HIDDEN}-{HIDDEN}-{CLASSES}, mesh batch=4 x "
        f"model=2, global batch {GLOBAL_BATCH}, {ROUNDS} interleaved rounds "
        f"x {STEPS_PER_ROUND - SKIP} timed steps"
    )
    table.add_column("run")
    table.add_column("median step (ms)", justify="right")
    table.add_column("mean step (ms)", justify="right")
    table.add_column("min / max round median (ms)", justify="right")
    table.add_column("steps", justify="right")
    for name, steps in times.items():
        table.add_row(
            name,
            f"{statistics.median(steps) * 1e3:.2f}",
            f"{statistics.fmean(steps) * 1e3:.2f}",
            f"{min(per_round[name]) * 1e3:.2f} / {max(per_round[name]) * 1e3:.2f}",
            str(len(steps)),
        )
    console.print(table)
    weights = zip(
        runs["klm"][0].get_weights(), runs["plain"][0].get_weights(), strict=True
    )
    diff = max(float(np.max(np.abs(a - b))) for a, b in weights)
    console.print(
        f"largest weight difference klm vs plain after training: {diff:.2e}"
    )
    ratio = statistics.median(times["klm"]) / statistics.median(times["plain"])
    # Noise on a shared machine comes in bursts that can spoil one whole
    # round; the rounds of a pair ran back to back, so their ratio is robust.
    paired = statistics.median(
        k / p for k, p in zip(per_round["klm"], per_round["plain"], strict=True)
    )
    verdict = "meets" if ratio <= GOAL else "misses"
    console.print(
        f"ratio klm/plain (median step time): {ratio:.3f}  "
        f"(goal <= {GOAL}: {verdict})"
    )
    console.print(
        f"ratio klm/plain (median of per-round paired ratios): {paired:.3f}"
    )


if __name__ == "__main__":
    main()
