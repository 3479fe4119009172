"""Data-parallel `fit` on 4 processes: keras-layoutmap on the torch backend
against the same model in plain torch `DistributedDataParallel` (gloo).

The script is the launcher's parent: it starts itself once per process with
`python -m keras_layoutmap.launch -n 4 benchmarks/torch_ddp.py --worker`,
every process with `KERAS_BACKEND=torch` and `OMP_NUM_THREADS=1`, and
prints what process 0 measured. In those 4 processes:

- **klm**: `klm.configure_virtual_devices(4)` joins the gloo process group;
  the MLP (Dense 64 -> 512 -> 512 -> 10, Adam 1e-3, sparse categorical
  cross-entropy from logits, no metric) is built and compiled under
  `klm.DataParallel(klm.create_mesh([("batch", 4)]))`: its weights are
  replicated DTensor parameters, and `model.fit` on numpy arrays (every
  process passes the same global data) packs each global batch of 256 onto
  the mesh, each process keeping its quarter;
- **DDP**: the same model in plain torch (`nn.Sequential` of `Linear` /
  `ReLU`, the same sizes, `torch.optim.Adam(lr=1e-3, eps=1e-7)` as Keras',
  `nn.CrossEntropyLoss`), starting from the klm model's initial weights,
  wrapped in `torch.nn.parallel.DistributedDataParallel` over the same gloo
  process group; each step each process takes its quarter of the same
  global batch of 256 (the rows DTensor's `Shard(0)` gives it), so both
  runs train on the same data in the same order.

The two runs alternate in the same processes for `--rounds` rounds (the
order flipping each round), so machine noise hits both alike; each round is
one epoch of `--skip` dropped warm-up steps plus `--steps` timed steps. A klm
step is timed in a callback's `on_train_batch_begin` / `on_train_batch_end`
(Keras' whole step: packing the batch, forward, backward, the gradient
all-reduce DTensor inserts, Adam, the loss tracker, the logs); a DDP step
from slicing the batch to `optimizer.step()` and `loss.item()`. At the end
the script prints the largest difference of the klm model's weights from
the same Keras model trained with no distribution on the same batches
(float rounding) and from the DDP model's (the two Adams differ: Keras adds
epsilon to sqrt(v) before bias correction, torch after, which matters where
gradients are tiny).

With `--profile N`, process 0 also runs N more klm steps under cProfile and
prints the functions that take the most time (cumulative and own).

Goal: median step time klm / DDP <= 1.2.

Run: python benchmarks/torch_ddp.py [--steps 40] [--rounds 4] [--profile 20]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

PROCESSES = 4
FEATURES, HIDDEN, CLASSES = 64, 512, 10
GLOBAL_BATCH = 256
SEED = 0
GOAL = 1.2


def build_keras(keras):
    keras.utils.set_random_seed(SEED)
    model = keras.Sequential(
        [
            keras.Input((FEATURES,)),
            keras.layers.Dense(HIDDEN, activation="relu", name="d0"),
            keras.layers.Dense(HIDDEN, activation="relu", name="d1"),
            keras.layers.Dense(CLASSES, name="head"),
        ],
        name="mlp",
    )
    model.compile(
        optimizer=keras.optimizers.Adam(1e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def build_torch(torch, keras_model):
    """The same MLP in plain torch, holding the Keras model's weights
    (a Keras kernel is (in, out), a torch Linear weight (out, in))."""
    layers = []
    for name in ("d0", "d1", "head"):
        dense = keras_model.get_layer(name)
        kernel, bias = (w.numpy() for w in dense.weights)
        linear = torch.nn.Linear(*kernel.shape)
        with torch.no_grad():
            linear.weight.copy_(torch.from_numpy(kernel.T.copy()))
            linear.bias.copy_(torch.from_numpy(bias))
        layers.append(linear)
        if name != "head":
            layers.append(torch.nn.ReLU())
    return torch.nn.Sequential(*layers)


def worker(args):
    import cProfile
    import io
    import pstats

    import keras_layoutmap as klm

    klm.configure_virtual_devices(PROCESSES)

    import keras
    import numpy as np
    import torch
    import torch.distributed as dist
    from common import StepTimer
    from torch.nn.parallel import DistributedDataParallel

    rank, world = dist.get_rank(), dist.get_world_size()
    steps = args.skip + args.steps
    rng = np.random.default_rng(SEED)
    x = rng.random((steps * GLOBAL_BATCH, FEATURES), dtype=np.float32)
    y = rng.integers(0, CLASSES, steps * GLOBAL_BATCH).astype("int32")

    with klm.DataParallel(klm.create_mesh([("batch", PROCESSES)])).scope():
        model = build_keras(keras)
    kernel = model.get_layer("d0").kernel
    local_shape = tuple(klm.unpack(kernel)[0].shape)
    placement = (f"{type(kernel.value).__name__} {klm.fetch_layout(kernel)}, "
                 f"local {local_shape}")

    net = build_torch(torch, model)
    ddp = DistributedDataParallel(net)
    optimizer = torch.optim.Adam(ddp.parameters(), lr=1e-3, eps=1e-7)
    loss_fn = torch.nn.CrossEntropyLoss()
    local = GLOBAL_BATCH // world
    xt, yt = torch.from_numpy(x), torch.from_numpy(y.astype("int64"))

    def fit_klm():
        timer = StepTimer()
        history = model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=1,
                            shuffle=False, verbose=0, callbacks=[timer])
        return timer.times, history.history["loss"][-1]

    def fit_ddp():
        times = []
        for i in range(steps):
            start = time.perf_counter()
            rows = slice(i * GLOBAL_BATCH + rank * local,
                         i * GLOBAL_BATCH + (rank + 1) * local)
            optimizer.zero_grad()
            loss = loss_fn(ddp(xt[rows]), yt[rows])
            loss.backward()
            optimizer.step()
            value = loss.item()
            times.append(time.perf_counter() - start)
        return times, value

    times = {"klm": [], "ddp": []}
    first = {}
    for i in range(args.rounds):
        order = ("klm", "ddp") if i % 2 == 0 else ("ddp", "klm")
        for name in order:
            step_times, _ = (fit_klm if name == "klm" else fit_ddp)()
            first.setdefault(name, step_times[0])
            times[name].extend(step_times[args.skip:])

    # The same model with no distribution, trained on the same batches
    # (each process trains its own copy, outside the timing): klm must
    # equal it to float rounding.
    single = build_keras(keras)
    for _ in range(args.rounds):
        single.fit(x, y, batch_size=GLOBAL_BATCH, epochs=1, shuffle=False,
                   verbose=0)
    klm_weights = [w.numpy() for w in model.weights]
    single_diff = max(float(np.abs(a - w.numpy()).max())
                      for a, w in zip(klm_weights, single.weights))
    ddp_weights = []
    for linear in (m for m in net if isinstance(m, torch.nn.Linear)):
        ddp_weights += [linear.weight.detach().numpy().T,
                        linear.bias.detach().numpy()]
    ddp_diff = max(float(np.abs(a - b).max())
                   for a, b in zip(klm_weights, ddp_weights))

    profile = None
    if args.profile:
        # Every process runs the steps (they are collective); process 0
        # profiles them.
        px = x[: args.profile * GLOBAL_BATCH]
        py = y[: args.profile * GLOBAL_BATCH]
        profiler = cProfile.Profile()
        if rank == 0:
            profiler.enable()
        model.fit(px, py, batch_size=GLOBAL_BATCH, epochs=1, shuffle=False,
                  verbose=0)
        if rank == 0:
            profiler.disable()
            out = io.StringIO()
            stats = pstats.Stats(profiler, stream=out)
            stats.sort_stats("cumulative").print_stats(35)
            stats.sort_stats("tottime").print_stats(25)
            profile = out.getvalue()

    if rank == 0:
        result = {
            "placement": placement,
            "torch": torch.__version__,
            "keras": keras.__version__,
            "threads": torch.get_num_threads(),
            "first_ms": {k: v * 1e3 for k, v in first.items()},
            "median_ms": {k: statistics.median(v) * 1e3 for k, v in times.items()},
            "mean_ms": {k: statistics.fmean(v) * 1e3 for k, v in times.items()},
            "steps": {k: len(v) for k, v in times.items()},
            "single_diff": single_diff,
            "ddp_diff": ddp_diff,
            "profile": profile,
        }
        with open(args.out, "w") as f:
            json.dump(result, f)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40,
                        help="timed steps per round (default 40)")
    parser.add_argument("--skip", type=int, default=3,
                        help="warm-up steps dropped per round (default 3)")
    parser.add_argument("--rounds", type=int, default=4,
                        help="rounds, each one epoch of each run (default 4)")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="then profile N klm steps on process 0")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return

    from rich.console import Console
    from rich.table import Table

    console = Console(width=120)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, KERAS_BACKEND="torch", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(
                   p for p in (root, os.environ.get("PYTHONPATH")) if p))
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        command = [sys.executable, "-m", "keras_layoutmap.launch", "-n",
                   str(PROCESSES), "--log-dir", tmp, os.path.abspath(__file__),
                   "--worker", "--out", out, "--steps", str(args.steps),
                   "--skip", str(args.skip), "--rounds", str(args.rounds),
                   "--profile", str(args.profile)]
        done = subprocess.run(command, env=env, timeout=900, check=False)
        if done.returncode != 0:
            raise SystemExit(f"the worker processes failed ({done.returncode})")
        with open(out) as f:
            r = json.load(f)
    wall = time.perf_counter() - start

    cores = os.cpu_count()
    table = Table(title=(
        f"data-parallel fit, {PROCESSES} processes x 1 CPU device (gloo), "
        f"MLP {FEATURES}-{HIDDEN}-{HIDDEN}-{CLASSES}, Adam, global batch "
        f"{GLOBAL_BATCH}; OMP_NUM_THREADS=1 per process, {cores} cores; "
        f"{args.rounds} rounds x {args.steps} timed steps"))
    for column in ("run", "first step (ms)", "median step (ms)",
                   "mean step (ms)", "timed steps"):
        table.add_column(column, justify="left" if column == "run" else "right")
    for key, label in (("klm", "klm.DataParallel + model.fit"),
                       ("ddp", "torch DistributedDataParallel")):
        table.add_row(label, f"{r['first_ms'][key]:.1f}",
                      f"{r['median_ms'][key]:.2f}", f"{r['mean_ms'][key]:.2f}",
                      str(r["steps"][key]))
    console.print(table)
    ratio = r["median_ms"]["klm"] / r["median_ms"]["ddp"]
    console.print(
        f"klm / DDP, median step: {ratio:.2f} (goal <= {GOAL}: "
        f"{'met' if ratio <= GOAL else 'NOT met'})")
    console.print(
        f"largest weight difference after {args.rounds} epochs each: klm vs "
        f"the same Keras model on 1 device {r['single_diff']:.1e}; klm vs DDP "
        f"{r['ddp_diff']:.1e} (Keras' Adam adds epsilon to sqrt(v) before "
        "bias correction, torch's after: they differ where gradients are "
        "tiny)")
    console.print(f"d0.kernel: {r['placement']}; torch {r['torch']}, keras "
                  f"{r['keras']}, {r['threads']} torch thread(s) per process")
    console.print(f"(measured in {wall:.0f} s)")
    if r["profile"]:
        console.print(f"cProfile of process 0, {args.profile} klm steps:")
        print(r["profile"])


if __name__ == "__main__":
    main()
