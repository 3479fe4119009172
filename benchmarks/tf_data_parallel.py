"""Data-parallel `model.fit` on TensorFlow: keras-layoutmap on DTensor against
Keras 3 on `tf.distribute.MirroredStrategy`, on the same 8 logical CPUs.

The same MLP (Dense 64 -> 512 -> 512 -> 10 on scikit-learn's digits, scaled
to [0, 1], no download; Adam 1e-3, sparse categorical cross-entropy from
logits, accuracy metric, fixed seed) is trained with the same global batch
(128) three ways in one process:

- klm:      `klm.DataParallel(klm.create_mesh([("batch", 8)]))`, model built
            and compiled under its scope: every variable is a DTensor
            `DVariable` replicated on the 8 devices, each batch is packed
            onto the mesh split over "batch";
- Mirrored: `tf.distribute.MirroredStrategy` over the same 8 logical CPU
            devices, model built and compiled inside `strategy.scope()`
            (Keras' own tf.distribute path: `MirroredVariable`s, a
            distributed dataset, per-replica steps and an all-reduce);
- 1 device: no distribution, for scale (what 8 logical devices cost on a
            machine with fewer cores).

Both distributed runs get the same input: by default a
`tf.data.Dataset` of the arrays in global batches, prefetch 2, with tf.data
autotuning off (`--input numpy` passes the arrays and lets Keras build its
own, autotuned, pipeline). With autotuning on, destroying
MirroredStrategy's multi-device iterator (after every epoch) often waits,
idle, for tf.data's autotune thread: seconds, up to minutes as the process
goes on. That is TensorFlow's cost, outside any step, and it would make the
script's run time unbounded.

Each round is one `fit` call of one epoch (`--steps` timed steps plus the
first few, dropped: iterator warm-up). Each step is timed with
`time.perf_counter()` in `on_train_batch_begin` / `on_train_batch_end`; the
wall time of the whole `fit` call is reported too (it includes Keras' data
adapter and iterator set-up, which differ a lot between the two paths). The
runs alternate in one process for `--rounds` rounds, the order flipping each
round, so machine noise hits all of them alike. The first `fit` call of each
model (tracing the train step: its "compile") is timed apart and not counted
in the steady state. A throwaway single-device fit runs first, so neither
distributed run pays the process's one-time TensorFlow start-up.

All three start from the same seed and see the same batches (no shuffling):
their final losses should agree closely; the script prints them, and the
largest weight difference between klm and Mirrored.

Goal: median step time klm / Mirrored <= 1.1.

Run: KERAS_BACKEND=tensorflow python benchmarks/tf_data_parallel.py
     [--steps 40] [--rounds 10] [--input dataset|numpy]
"""

import argparse
import os
import sys

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
if os.environ["KERAS_BACKEND"] != "tensorflow":
    sys.exit("tf_data_parallel.py compares TensorFlow paths: run it with "
             "KERAS_BACKEND=tensorflow")

import keras_layoutmap as klm  # noqa: E402

klm.configure_virtual_devices(8)

import statistics  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from common import StepTimer, build_mlp  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402

SEED = 0
DEVICES = 8
FEATURES, HIDDEN, CLASSES = 64, 512, 10
GLOBAL_BATCH = 128  # 16 samples per device
SKIP = 2  # first steps of each fit call: iterator warm-up
GOAL = 1.1


def make_data(steps):
    """`steps` global batches of digits: the 1,797 samples, shuffled once,
    repeated as often as needed."""
    digits = load_digits()
    order = np.random.default_rng(SEED).permutation(len(digits.target))
    x = (digits.data[order] / 16.0).astype("float32")
    y = digits.target[order].astype("int32")
    n = steps * GLOBAL_BATCH
    reps = -(-n // len(y))
    return np.tile(x, (reps, 1))[:n], np.tile(y, reps)[:n]


def build_model():
    return build_mlp(SEED, FEATURES, HIDDEN, CLASSES)


def klm_setup():
    dist = klm.DataParallel(klm.create_mesh([("batch", DEVICES)]))
    with dist.scope():
        model = build_model()
    return model, dist.scope


def mirrored_setup():
    devices = [f"/cpu:{i}" for i in range(DEVICES)]
    strategy = tf.distribute.MirroredStrategy(devices)
    with strategy.scope():
        model = build_model()
    return model, strategy.scope


def single_setup():
    model = build_model()
    return model, None


def make_inputs(x, y, kind):
    """`fit` keyword arguments feeding `x, y` in global batches of
    `GLOBAL_BATCH`, in order: a `tf.data.Dataset` with autotuning off
    ("dataset"), or the arrays themselves ("numpy": Keras builds its own
    autotuned `tf.data` pipeline)."""
    if kind == "numpy":
        return {"x": x, "y": y, "batch_size": GLOBAL_BATCH, "shuffle": False}
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH)
    options = tf.data.Options()
    # With autotuning on, destroying MirroredStrategy's multi-device
    # iterator after an epoch often waits, idle, for tf.data's autotune
    # thread: seconds after the last step, growing to minutes in a long
    # process. See benchmarks/README.md.
    options.autotune.enabled = False
    return {"x": dataset.prefetch(2).with_options(options), "shuffle": False}


def fit_round(model, scope, inputs):
    """One `fit` call: (step times, wall time of the call, final loss,
    final accuracy)."""
    timer = StepTimer()
    start = time.perf_counter()
    if scope is None:
        history = model.fit(**inputs, epochs=1, verbose=0, callbacks=[timer])
    else:
        with scope():
            history = model.fit(**inputs, epochs=1, verbose=0,
                                callbacks=[timer])
    wall = time.perf_counter() - start
    return (timer.times, wall, history.history["loss"][-1],
            history.history["accuracy"][-1])


def describe_placement(runs):
    """One line per distributed run: where its first kernel lives."""
    model, _ = runs["klm"]
    kernel = model.get_layer("d0").kernel
    yield (f"klm: d0.kernel is a {type(kernel._value).__name__}, "
           f"{klm.fetch_layout(kernel)}, {len(klm.unpack(kernel))} components")
    model, _ = runs["Mirrored"]
    kernel = model.get_layer("d0").kernel.value
    yield (f"Mirrored: d0.kernel is a {type(kernel).__name__} with "
           f"{len(kernel.values)} replicas on "
           f"{sorted({v.device.rsplit('/', 1)[-1] for v in kernel.values})}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40,
                        help="timed steps per round (default 40)")
    parser.add_argument("--rounds", type=int, default=10,
                        help="interleaved rounds (default 10)")
    parser.add_argument(
        "--input", choices=("dataset", "numpy"), default="dataset",
        help="feed fit a tf.data.Dataset with autotuning off (default), or "
        "numpy arrays (Keras' own autotuned pipeline: MirroredStrategy's fit "
        "calls then stall after their last step)")
    args = parser.parse_args()
    console = Console(width=120)
    x, y = make_data(args.steps + SKIP)
    inputs = make_inputs(x, y, args.input)

    # Process start-up (TensorFlow's first function, Keras' lazy imports)
    # falls on a throwaway model, not on either contender.
    warmup, _ = single_setup()
    fit_round(warmup, None, make_inputs(x[: 2 * GLOBAL_BATCH],
                                        y[: 2 * GLOBAL_BATCH], args.input))
    del warmup

    setups = {"klm": klm_setup, "Mirrored": mirrored_setup, "1 device": single_setup}
    runs, first = {}, {}
    for name, setup in setups.items():
        start = time.perf_counter()
        runs[name] = setup()
        built = time.perf_counter() - start
        steps, wall, loss, _ = fit_round(*runs[name], inputs)
        first[name] = (built, steps[0], wall, loss)
    for line in describe_placement(runs):
        console.print(line)

    times = {name: [] for name in runs}
    per_round = {name: [] for name in runs}
    walls = {name: [] for name in runs}
    final = {}
    for i in range(args.rounds):
        order = list(runs) if i % 2 == 0 else list(reversed(runs))
        for name in order:
            steps, wall, loss, accuracy = fit_round(*runs[name], inputs)
            steps = steps[SKIP:]
            times[name].extend(steps)
            per_round[name].append(statistics.median(steps))
            walls[name].append(wall)
            final[name] = (loss, accuracy)

    compile_table = Table(
        title="first fit call of each model (tracing the train step)")
    for column in ("run", "build + compile (s)", "first step (s)",
                   "first fit call (s)", "loss after it"):
        compile_table.add_column(column, justify="left" if column == "run"
                                 else "right")
    for name, (built, step, wall, loss) in first.items():
        compile_table.add_row(name, f"{built:.2f}", f"{step:.2f}",
                              f"{wall:.2f}", f"{loss:.4f}")
    console.print(compile_table)

    table = Table(
        title=f"MLP {FEATURES}-{HIDDEN}-{HIDDEN}-{CLASSES} on digits, "
        f"{DEVICES} logical CPUs, global batch {GLOBAL_BATCH}, Adam, "
        f"{args.input} input; "
        f"{args.rounds} interleaved rounds x {args.steps} timed steps"
    )
    for column in ("run", "median step (ms)", "mean step (ms)",
                   "min / max round median (ms)", "fit call wall (s)",
                   "steps", "final loss", "final accuracy"):
        table.add_column(column, justify="left" if column == "run" else "right")
    for name, steps in times.items():
        table.add_row(
            name,
            f"{statistics.median(steps) * 1e3:.2f}",
            f"{statistics.fmean(steps) * 1e3:.2f}",
            f"{min(per_round[name]) * 1e3:.2f} / "
            f"{max(per_round[name]) * 1e3:.2f}",
            f"{statistics.median(walls[name]):.2f}",
            str(len(steps)),
            f"{final[name][0]:.4f}",
            f"{final[name][1]:.4f}",
        )
    console.print(table)

    weights = zip(runs["klm"][0].get_weights(),
                  runs["Mirrored"][0].get_weights(), strict=True)
    diff = max(float(np.max(np.abs(a - b))) for a, b in weights)
    console.print(
        f"largest weight difference klm vs Mirrored after training: {diff:.2e}")

    def ratio(a, b):
        return statistics.median(times[a]) / statistics.median(times[b])

    paired = statistics.median(
        k / m for k, m in zip(per_round["klm"], per_round["Mirrored"],
                              strict=True))
    step_ratio = ratio("klm", "Mirrored")
    verdict = "meets" if step_ratio <= GOAL else "misses"
    console.print(
        f"ratio klm/Mirrored (median step time): {step_ratio:.3f}  "
        f"(goal <= {GOAL}: {verdict})")
    console.print(
        f"ratio klm/Mirrored (median of per-round paired ratios): {paired:.3f}")
    console.print(
        "ratio klm/Mirrored (median fit call wall time): "
        f"{statistics.median(walls['klm']) / statistics.median(walls['Mirrored']):.3f}")
    console.print(
        f"ratio klm/Mirrored (first step, compile): "
        f"{first['klm'][1] / first['Mirrored'][1]:.3f}")
    console.print(
        f"8 logical devices vs 1 device (median step): klm "
        f"{ratio('klm', '1 device'):.2f}x, Mirrored "
        f"{ratio('Mirrored', '1 device'):.2f}x")


if __name__ == "__main__":
    main()
