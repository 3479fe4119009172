"""The same data-parallel `model.fit` on 4 devices under JAX, TensorFlow and
torch.

One child run per backend, one after the other, each printing its figures
as JSON; the parent prints them side by side:

- JAX and TensorFlow: one process, `klm.configure_virtual_devices(4)` makes
  4 virtual CPU devices (JAX CPU devices, TensorFlow logical CPUs);
- torch: 4 processes, one CPU device each, started with
  `python -m keras_layoutmap.launch -n 4`, `OMP_NUM_THREADS=1` each;
  `klm.configure_virtual_devices(4)` joins them in a gloo process group.

Each child builds the MLP of `torch_ddp.py` (Dense 64 -> 512 -> 512 -> 10,
Adam 1e-3, sparse categorical cross-entropy from logits, no metric, seed 0)
under `klm.DataParallel(klm.create_mesh([("batch", 4)]))`, times its first
`fit` call (the first step traces / compiles: XLA on JAX, a `tf.function`
DTensor expands on TensorFlow, DTensor's sharding propagation on torch),
then `--rounds` one-epoch `fit` calls on the same random numpy arrays,
global batch 256, `--steps` timed steps each after `--skip` dropped ones,
each step timed in `on_train_batch_begin` / `on_train_batch_end`.

Each backend needs its own interpreter only if one venv lacks a backend:
`--python-jax`, `--python-tf`, `--python-torch` (default: this
interpreter). torch must be torch==2.13.0 (the CPU build).

Run: python benchmarks/backends_torch.py [--steps 40] [--rounds 4]
         [--python-jax PY] [--python-tf PY] [--python-torch PY]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

DEVICES = 4
FEATURES, HIDDEN, CLASSES = 64, 512, 10
GLOBAL_BATCH = 256
SEED = 0
BACKENDS = (("jax", "JAX"), ("tensorflow", "TensorFlow"), ("torch", "torch"))


def child(args):
    started = time.perf_counter()
    import keras_layoutmap as klm

    klm.configure_virtual_devices(DEVICES)

    import keras
    import numpy as np
    from common import StepTimer, build_mlp

    startup = time.perf_counter() - started
    steps = args.skip + args.steps
    rng = np.random.default_rng(SEED)
    x = rng.random((steps * GLOBAL_BATCH, FEATURES), dtype=np.float32)
    y = rng.integers(0, CLASSES, steps * GLOBAL_BATCH).astype("int32")

    start = time.perf_counter()
    with klm.DataParallel(klm.create_mesh([("batch", DEVICES)])).scope():
        model = build_mlp(SEED, FEATURES, HIDDEN, CLASSES, metrics=())
    built = time.perf_counter() - start

    def fit():
        timer = StepTimer()
        start = time.perf_counter()
        history = model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=1,
                            shuffle=False, verbose=0, callbacks=[timer])
        return timer.times, time.perf_counter() - start, history.history["loss"][-1]

    first_steps, first_wall, first_loss = fit()
    times, walls = [], []
    for _ in range(args.rounds):
        step_times, wall, loss = fit()
        times.extend(step_times[args.skip:])
        walls.append(wall)

    backend = keras.backend.backend()
    module = {"tensorflow": "tensorflow"}.get(backend, backend)
    version = __import__(module).__version__
    kernel = model.get_layer("d0").kernel
    result = {
        "backend": backend,
        "version": version,
        "placement": f"{klm.fetch_layout(kernel)}, {len(klm.unpack(kernel))} "
                     f"shard(s) in this process",
        "processes": klm.process_count(),
        "startup_s": startup,
        "build_s": built,
        "first_step_s": first_steps[0],
        "first_fit_s": first_wall,
        "first_loss": first_loss,
        "median_step_ms": statistics.median(times) * 1e3,
        "mean_step_ms": statistics.fmean(times) * 1e3,
        "fit_wall_s": statistics.median(walls),
        "final_loss": loss,
        "steps": len(times),
    }
    if klm.process_index() == 0:
        with open(args.out, "w") as f:
            json.dump(result, f)


def run_child(backend, python, args, tmp):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, KERAS_BACKEND=backend, TF_CPP_MIN_LOG_LEVEL="3",
               PYTHONPATH=os.pathsep.join(
                   p for p in (root, os.environ.get("PYTHONPATH")) if p))
    out = os.path.join(tmp, f"{backend}.json")
    script = [os.path.abspath(__file__), "--child", "--out", out,
              "--steps", str(args.steps), "--skip", str(args.skip),
              "--rounds", str(args.rounds)]
    if backend == "torch":
        env["OMP_NUM_THREADS"] = "1"
        command = [python, "-m", "keras_layoutmap.launch", "-n", str(DEVICES),
                   "--log-dir", os.path.join(tmp, "torch-logs"), *script]
    else:
        command = [python, *script]
    start = time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, text=True,
                          timeout=900, check=False)
    if done.returncode != 0 or not os.path.exists(out):
        sys.stderr.write(done.stdout[-2000:] + done.stderr[-4000:])
        raise SystemExit(f"the {backend} run failed ({done.returncode})")
    with open(out) as f:
        result = json.load(f)
    result["process_s"] = time.perf_counter() - start
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40,
                        help="timed steps per round (default 40)")
    parser.add_argument("--skip", type=int, default=3,
                        help="warm-up steps dropped per round (default 3)")
    parser.add_argument("--rounds", type=int, default=4,
                        help="one-epoch fit calls per backend (default 4)")
    for flag, name in (("jax", "JAX"), ("tf", "TensorFlow"), ("torch", "torch")):
        parser.add_argument(f"--python-{flag}", default=sys.executable,
                            metavar="PY", help=f"the interpreter for {name} "
                            "(default: this one)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return

    from rich.console import Console
    from rich.table import Table

    console = Console(width=120)
    pythons = {"jax": args.python_jax, "tensorflow": args.python_tf,
               "torch": args.python_torch}
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for backend, _ in BACKENDS:
            results[backend] = run_child(backend, pythons[backend], args, tmp)
            console.print(json.dumps(results[backend]))

    table = Table(title=(
        f"klm.DataParallel fit on {DEVICES} CPU devices, MLP {FEATURES}-"
        f"{HIDDEN}-{HIDDEN}-{CLASSES}, Adam, global batch {GLOBAL_BATCH}; "
        f"{args.rounds} rounds x {args.steps} timed steps; {os.cpu_count()} "
        "cores"))
    table.add_column("")
    for _, label in BACKENDS:
        table.add_column(label, justify="right")
    table.add_column("torch / JAX", justify="right")
    table.add_column("torch / TF", justify="right")

    def row(label, key, fmt, ratio=True):
        values = [results[b][key] for b, _ in BACKENDS]
        cells = [fmt.format(v) for v in values]
        jx, tf, pt = values
        ratios = [f"{pt / jx:.2f}", f"{pt / tf:.2f}"] if ratio else ["", ""]
        table.add_row(label, *cells, *ratios)

    table.add_row("devices", f"1 process x {DEVICES}", f"1 process x {DEVICES}",
                  f"{DEVICES} processes x 1", "", "")
    row("import + join the devices (s)", "startup_s", "{:.2f}")
    row("build + compile on the mesh (s)", "build_s", "{:.2f}")
    row("first step (s)", "first_step_s", "{:.2f}")
    row("first fit call (s)", "first_fit_s", "{:.2f}")
    row("median step (ms)", "median_step_ms", "{:.2f}")
    row("mean step (ms)", "mean_step_ms", "{:.2f}")
    row("median fit call (s)", "fit_wall_s", "{:.2f}")
    row("loss after the first fit call", "first_loss", "{:.4f}", ratio=False)
    row("final loss", "final_loss", "{:.4f}", ratio=False)
    row("whole run (s)", "process_s", "{:.1f}")
    console.print(table)
    for backend, label in BACKENDS:
        r = results[backend]
        console.print(f"{label} {r['version']}: d0.kernel {r['placement']}")
    console.print("torch runs OMP_NUM_THREADS=1 per process; JAX and "
                  "TensorFlow run with their default thread pools in one "
                  "process.")


if __name__ == "__main__":
    main()
