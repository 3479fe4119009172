"""The same data-parallel `model.fit` under `klm.DataParallel` on 8 devices:
JAX backend against TensorFlow backend.

The Keras backend is fixed when Keras is imported, so the script runs itself
twice, in one subprocess per backend (`KERAS_BACKEND=jax`, then
`KERAS_BACKEND=tensorflow`, each with `--child`). Each child:

- makes 8 virtual CPU devices (`klm.configure_virtual_devices(8)`) and a
  `("batch", 8)` mesh;
- builds, compiles and fits once a single-device MLP (Dense 64 -> 512 ->
  512 -> 10 on scikit-learn's digits, Adam 1e-3, sparse categorical
  cross-entropy from logits, accuracy metric, fixed seed): the backend's
  one-time start-up falls on it, and it serves for scale;
- builds and compiles the same MLP under `klm.DataParallel(mesh)` and times
  its first `fit` call (the first step compiles the train step: XLA on JAX,
  a `tf.function` that DTensor expands to the 8 devices on TensorFlow);
- then alternates `--rounds` one-epoch `fit` calls of the two models
  (global batch 128, numpy arrays, `--steps` timed steps each after 2
  dropped warm-up steps), timing each step in
  `on_train_batch_begin` / `on_train_batch_end`;
- prints one JSON line with its figures.

The parent prints them side by side. The two backends run one after the
other, not interleaved: compare their ratios to one device (each measured
in its own process, side by side) more than their absolute times.

Run: python benchmarks/backends.py [--steps 40] [--rounds 6]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

BACKENDS = ("jax", "tensorflow")
SEED = 0
DEVICES = 8
FEATURES, HIDDEN, CLASSES = 64, 512, 10
GLOBAL_BATCH = 128
SKIP = 2  # first steps of each fit call: warm-up


def child(steps, rounds):
    """Runs under one backend; returns its figures as a dict."""
    started = time.perf_counter()
    import keras_layoutmap as klm

    klm.configure_virtual_devices(DEVICES)

    import keras
    import numpy as np
    from common import StepTimer, build_mlp
    from sklearn.datasets import load_digits

    imported = time.perf_counter() - started

    def build_model():
        return build_mlp(SEED, FEATURES, HIDDEN, CLASSES)

    digits = load_digits()
    order = np.random.default_rng(SEED).permutation(len(digits.target))
    n = (steps + SKIP) * GLOBAL_BATCH
    reps = -(-n // len(order))
    x = np.tile((digits.data[order] / 16.0).astype("float32"), (reps, 1))[:n]
    y = np.tile(digits.target[order].astype("int32"), reps)[:n]

    def fit(model):
        timer = StepTimer()
        start = time.perf_counter()
        history = model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=1,
                            shuffle=False, verbose=0, callbacks=[timer])
        return (timer.times, time.perf_counter() - start,
                history.history["loss"][-1], history.history["accuracy"][-1])

    # The single-device model goes first: the backend's one-time start-up
    # (device clients, first trace) falls on it, not on the mesh model.
    start = time.perf_counter()
    single = build_model()
    single_first = fit(single)[1] + time.perf_counter() - start

    dist = klm.DataParallel(klm.create_mesh([("batch", DEVICES)]))
    start = time.perf_counter()
    with dist.scope():
        mesh_model = build_model()
    built = time.perf_counter() - start
    # `fit` outside the scope: the model remembers its distribution.
    first_steps, first_wall, first_loss, _ = fit(mesh_model)
    kernel = mesh_model.get_layer("d0").kernel
    placement = (f"{klm.fetch_layout(kernel)}, "
                 f"{len(klm.unpack(kernel))} shards")

    times = {"mesh": [], "single": []}
    for i in range(rounds):
        order = ("mesh", "single") if i % 2 == 0 else ("single", "mesh")
        for name in order:
            step_times, _, loss, accuracy = fit(
                mesh_model if name == "mesh" else single)
            times[name].extend(step_times[SKIP:])
            if name == "mesh":
                final = (loss, accuracy)

    versions = {"keras": keras.__version__}
    backend = keras.backend.backend()
    if backend == "jax":
        import jax

        versions["jax"] = jax.__version__
    else:
        import tensorflow as tf

        versions["tensorflow"] = tf.__version__
    return {
        "backend": backend,
        "versions": versions,
        "placement": placement,
        "import_s": imported,
        "single_first_s": single_first,
        "build_s": built,
        "first_step_s": first_steps[0],
        "first_fit_s": first_wall,
        "first_loss": first_loss,
        "median_step_ms": statistics.median(times["mesh"]) * 1e3,
        "mean_step_ms": statistics.fmean(times["mesh"]) * 1e3,
        "single_median_step_ms": statistics.median(times["single"]) * 1e3,
        "steps": len(times["mesh"]),
        "final_loss": final[0],
        "final_accuracy": final[1],
    }


def run_child(backend, steps, rounds):
    env = dict(os.environ, KERAS_BACKEND=backend, TF_CPP_MIN_LOG_LEVEL="3")
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, __file__, "--child", "--steps", str(steps),
         "--rounds", str(rounds)],
        env=env, capture_output=True, text=True, check=False)
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
    if done.returncode != 0 or not lines:
        sys.stderr.write(done.stderr[-4000:])
        raise SystemExit(f"the {backend} child failed ({done.returncode})")
    result = json.loads(lines[-1])
    result["process_s"] = time.perf_counter() - start
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40,
                        help="timed steps per round (default 40)")
    parser.add_argument("--rounds", type=int, default=6,
                        help="rounds per backend (default 6)")
    parser.add_argument("--child", action="store_true",
                        help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.steps, args.rounds)), flush=True)
        return

    from rich.console import Console
    from rich.table import Table

    console = Console(width=120)
    results = {}
    for backend in BACKENDS:
        results[backend] = run_child(backend, args.steps, args.rounds)
        console.print(json.dumps(results[backend]))
    jx, tf = results["jax"], results["tensorflow"]

    table = Table(
        title=f"klm.DataParallel on {DEVICES} virtual CPUs, MLP {FEATURES}-"
        f"{HIDDEN}-{HIDDEN}-{CLASSES} on digits, global batch {GLOBAL_BATCH}, "
        f"Adam; {args.rounds} rounds x {args.steps} timed steps per backend")
    for column in ("", "JAX", "TensorFlow", "TF / JAX"):
        table.add_column(column, justify="left" if not column else "right")

    def row(label, key, fmt, ratio=True):
        a, b = jx[key], tf[key]
        table.add_row(label, fmt.format(a), fmt.format(b),
                      f"{b / a:.2f}" if ratio else "")

    row("import klm + keras (s)", "import_s", "{:.2f}")
    row("1 device: build + first fit call (s)", "single_first_s", "{:.2f}")
    row("build + compile model (s)", "build_s", "{:.2f}")
    row("first step, compile (s)", "first_step_s", "{:.2f}")
    row("first fit call (s)", "first_fit_s", "{:.2f}")
    row("median step, 8 devices (ms)", "median_step_ms", "{:.2f}")
    row("mean step, 8 devices (ms)", "mean_step_ms", "{:.2f}")
    row("median step, 1 device (ms)", "single_median_step_ms", "{:.2f}")
    table.add_row(
        "8 devices / 1 device",
        f"{jx['median_step_ms'] / jx['single_median_step_ms']:.2f}",
        f"{tf['median_step_ms'] / tf['single_median_step_ms']:.2f}", "")
    row("loss after first fit call", "first_loss", "{:.4f}", ratio=False)
    row("final loss", "final_loss", "{:.4f}", ratio=False)
    row("final accuracy", "final_accuracy", "{:.4f}", ratio=False)
    row("whole subprocess (s)", "process_s", "{:.1f}")
    console.print(table)
    for backend, result in results.items():
        console.print(f"{backend}: d0.kernel {result['placement']}; "
                      f"{result['versions']}")


if __name__ == "__main__":
    main()
