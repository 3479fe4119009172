"""Saving and restoring a model-parallel model of 1 GiB across 4 processes:
Keras' sharded checkpoint (`keras.callbacks.OrbaxCheckpoint`, then
`model.load_weights(directory)`) against the one-file path
(`model.save_weights(path)` / `load_weights(path)`).

The script is the launcher's parent: it starts itself once per process with
`python -m keras_layoutmap.launch -n 4 benchmarks/checkpoint.py --worker`
(the backend from `--backend`, default torch; `OMP_NUM_THREADS=1`). In
those processes `klm.configure_virtual_devices(4)` gives each process one
device, and a model of 4 `Dense(8192, use_bias=False)` kernels (256 MiB
each in float32, 1 GiB in all) is born sharded by `(None, "model")` on a
`("model", 4)` mesh: each process holds 256 MiB, a quarter of each kernel.

Each process measures, for each save and restore: its wall seconds, the
model's bytes over them (MB/s, the whole model's bytes: what the save
writes), and the peak of its resident memory during the call above what it
held just before (sampled every 5 ms from /proc/self/statm: `ru_maxrss`
would hide a peak below the one the build reached). Process 0 prints every
process's figures.

Goals (issue 32): the sharded save adds, per process, at most that
process's own shards plus one weight's shard (here 256 + 64 MiB); the
one-file save adds to process 0 at most twice the largest weight (512 MiB),
to every other process at most one weight's shard (64 MiB). A save
in the background (`save_on_background=True`, Keras' default) first copies
the process's shards (training goes on changing them), so it holds them
twice until written.

Run: python benchmarks/checkpoint.py [--backend torch|jax|tensorflow]
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

PROCESSES = 4
WIDTH, LAYERS = 8192, 4
MIB = 1024 * 1024


def _rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def measured(call):
    """`(seconds, peak resident bytes added)` of `call()`."""
    before, peak, done = _rss(), [0], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], _rss())
            time.sleep(0.005)

    watcher = threading.Thread(target=sample, daemon=True)
    watcher.start()
    start = time.perf_counter()
    call()
    seconds = time.perf_counter() - start
    done.set()
    watcher.join()
    return seconds, max(peak[0], _rss()) - before


def worker(out):
    import keras_layoutmap as klm
    from keras_layoutmap import backends

    klm.configure_virtual_devices(PROCESSES)
    import keras

    mesh = klm.create_mesh([("model", PROCESSES)])
    layout_map = klm.LayoutMap(mesh)
    layout_map[r".*kernel"] = (None, "model")
    with layout_map.scope():
        model = keras.Sequential(
            [keras.Input((WIDTH,))] + [
                keras.layers.Dense(WIDTH, use_bias=False, name=f"d{i}")
                for i in range(LAYERS)])
    model.compile(keras.optimizers.SGD(), "mse")  # no slots: weights only
    model_bytes = sum(int(w.shape[0]) * int(w.shape[1]) * 4
                      for w in model.weights)
    folder = os.environ["KLM_BENCH_FOLDER"]
    figures = {}

    def orbax_save(step, in_background):
        callback = keras.callbacks.OrbaxCheckpoint(
            os.path.join(folder, "orbax"), save_on_background=in_background,
            save_weights_only=True)
        callback.set_model(model)
        callback.on_epoch_end(step, logs={})
        callback.on_train_end()  # waits for a save in the background

    cases = (
        ("OrbaxCheckpoint save", lambda: orbax_save(0, False)),
        ("... save_on_background", lambda: orbax_save(1, True)),
        ("load_weights(directory)",
         lambda: model.load_weights(os.path.join(folder, "orbax"))),
        ("save_weights (one file)",
         lambda: model.save_weights(os.path.join(folder, "one.weights.h5"))),
        ("load_weights (one file)",
         lambda: model.load_weights(os.path.join(folder, "one.weights.h5"))),
    )
    for name, call in cases:
        seconds, added = measured(call)
        figures[name] = {"seconds": seconds, "added": added}
    # What this process's devices hold, read from the backend.
    own = sum(sum(backends.get().device_bytes(w).values())
              for w in model.weights)
    result = {"process": klm.process_index(), "own": own,
              "model": model_bytes, "figures": figures}
    with open(os.path.join(out, f"process{klm.process_index()}.json"),
              "w") as f:
        json.dump(result, f)


def report(out):
    results = sorted((json.load(open(os.path.join(out, name)))
                      for name in os.listdir(out) if name.endswith(".json")),
                     key=lambda r: r["process"])
    model = results[0]["model"]
    own = max(r["own"] for r in results)
    shard = model // LAYERS // PROCESSES
    print(f"model {model / MIB:.0f} MiB in {LAYERS} kernels, "
          f"{PROCESSES} processes, each holding {own / MIB:.0f} MiB")
    print(f"{'':26}" + "".join(f"{'process ' + str(r['process']):>22}"
                               for r in results))
    for name in results[0]["figures"]:
        cells = []
        for r in results:
            f = r["figures"][name]
            cells.append(f"{f['seconds']:5.2f} s {model / MIB / f['seconds']:5.0f} MB/s"
                         f" {f['added'] / MIB:+5.0f}M")
        print(f"{name:26}" + "".join(f"{c:>22}" for c in cells))
    worst = max(r["figures"]["OrbaxCheckpoint save"]["added"] for r in results)
    goal = own + shard
    print(f"\nOrbaxCheckpoint save: at most {worst / MIB:.0f} MiB added per "
          f"process; goal <= own shards + one weight's shard = "
          f"{goal / MIB:.0f} MiB: {'met' if worst <= goal else 'NOT met'}")
    # The one-file save streams (keras_layoutmap/one_writer.py): process 0
    # receives one weight at a time, the others send their pieces of it.
    weight = model // LAYERS
    name = "save_weights (one file)"
    writer = results[0]["figures"][name]["added"]
    others = max(r["figures"][name]["added"] for r in results[1:])
    print(f"save_weights (one file): process 0 added {writer / MIB:.0f} MiB; "
          f"goal <= twice the largest weight = {2 * weight / MIB:.0f} MiB: "
          f"{'met' if writer <= 2 * weight else 'NOT met'}. The others added "
          f"at most {others / MIB:.0f} MiB; goal <= one weight's shard = "
          f"{shard / MIB:.0f} MiB: {'met' if others <= shard else 'NOT met'}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backend", default="torch",
                        choices=("torch", "jax", "tensorflow"))
    parser.add_argument("--worker", metavar="OUT")
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker)
    with tempfile.TemporaryDirectory() as out, \
            tempfile.TemporaryDirectory() as folder:
        env = dict(os.environ, KERAS_BACKEND=args.backend, OMP_NUM_THREADS="1",
                   TF_CPP_MIN_LOG_LEVEL="3", KLM_BENCH_FOLDER=folder)
        subprocess.run(
            [sys.executable, "-m", "keras_layoutmap.launch", "-n",
             str(PROCESSES), os.path.abspath(__file__), "--worker", out],
            env=env, check=True)
        report(out)


if __name__ == "__main__":
    main()
