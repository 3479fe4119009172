"""Peak host memory while building a weight of 2 GiB sharded 8 ways (4 on
torch), over the weight's size (issue: weights born sharded; goal <= 1.25,
physical 1.0).

    python benchmarks/build_memory.py            # every backend installed
    python benchmarks/build_memory.py --gib 0.5  # a smaller weight

Each case runs in a fresh process (peak RSS, `VmHWM`, is per process). On
torch a mesh spans processes, one device each: the sharded cases run in 4
processes under `python -m keras_layoutmap.launch -n 4`, and the figure is
the largest process's peak (1/4 of the weight is what each one keeps).

- `klm`: an `Embedding` of `--gib` GiB built under `LayoutMap.scope()`,
  its table sharded over 8 devices: born sharded, each device making its
  shard;
- `klm whole`: the same, with the born-sharded path switched off (the
  whole weight made, then split: keras-layoutmap before weights were born
  sharded);
- `keras`: the same with Keras' own `ModelParallel` (JAX only: Keras'
  TensorFlow distribution is not implemented);
- `one device`: the same layer with no distribution;
- `rng only` (JAX): `jax.random.uniform` of the same shape in one jitted
  call on one device, no Keras: the working memory of JAX's random number
  generator on the CPU, which bounds what an initializer that matches one
  device's values can reach.
"""

import argparse
import os
import signal
import subprocess
import sys
import tempfile

CASE = r'''
import os, sys, time
backend, case, gib = sys.argv[1], sys.argv[2], float(sys.argv[3])
devices = int(sys.argv[4])  # the mesh's size
os.environ["KERAS_BACKEND"] = backend
def peak_gib():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM"):
                return int(line.split()[1]) / 2**20
import keras_layoutmap as klm
if backend != "torch" or case != "one device":
    klm.configure_virtual_devices(devices)
import keras
import numpy as np
dim = 1024
rows = int(gib * 2**30 / 4 / dim) // 8 * 8
base = peak_gib()
start = time.perf_counter()
if case == "rng only":
    import jax
    value = jax.jit(lambda k: jax.random.uniform(k, (rows, dim)))(jax.random.key(0))
    value.block_until_ready()
else:
    if case == "klm whole":  # switch the born-sharded path off
        if backend in ("jax", "torch"):
            from importlib import import_module
            initialization = import_module(
                f"keras_layoutmap.backends.{backend}.initialization")
            initialization.born_sharded = lambda *args, **kwargs: None
        else:
            from keras_layoutmap.backends.tensorflow import initialization
            initialization.MIN_BYTES = float("inf")
    if case in ("klm", "klm whole"):
        layout_map = klm.LayoutMap(klm.create_mesh([("model", devices)]))
        layout_map[r"emb\.embeddings"] = ("model", None)
        with layout_map.scope():
            layer = keras.layers.Embedding(rows, dim, name="emb")
            layer.build((None,))
    elif case == "keras":
        from keras import distribution as kd
        mesh = kd.DeviceMesh((8,), ["model"], kd.list_devices())
        layout_map = kd.LayoutMap(mesh)
        layout_map["emb/embeddings"] = ("model", None)
        kd.set_distribution(kd.ModelParallel(layout_map=layout_map,
                                             batch_dim_name="model"))
        layer = keras.layers.Embedding(rows, dim, name="emb")
        layer.build((None,))
    else:
        layer = keras.layers.Embedding(rows, dim, name="emb")
        layer.build((None,))
    if backend == "jax":
        layer.embeddings.value.block_until_ready()
seconds = time.perf_counter() - start
weight = rows * dim * 4 / 2**30
print(f"{(peak_gib() - base) / weight:.2f} {seconds:.1f} {weight:.2f}")
'''

CASES = {"jax": ["klm", "klm whole", "keras", "one device", "rng only"],
         "tensorflow": ["klm", "klm whole", "one device"],
         "torch": ["klm", "klm whole", "one device"]}
TORCH_PROCESSES = 4


def command(script, backend, case, gib):
    """The command line of one case (`script`: CASE's file): on torch a
    sharded case runs once per process under the launcher."""
    devices = TORCH_PROCESSES if backend == "torch" else 8
    run = [script, backend, case, str(gib), str(devices)]
    if backend == "torch" and case != "one device":
        return [sys.executable, "-m", "keras_layoutmap.launch", "-n",
                str(TORCH_PROCESSES), *run]
    return [sys.executable, *run]


def installed(backend):
    try:
        __import__(backend)
    except ImportError:
        return False
    return True


def _too_big(backend, case, gib):
    """Why a case would not fit in this machine's memory, or None. On torch
    `klm whole` makes the whole weight in each of the processes, about 3x
    its size each (Keras' `uniform` holds its draw, product and sum), and
    running it anyway only brings the kernel's out-of-memory killer."""
    if backend != "torch" or case != "klm whole":
        return None
    need = TORCH_PROCESSES * 3.1 * gib
    with open("/proc/meminfo") as f:
        available = next(int(line.split()[1]) for line in f
                         if line.startswith("MemAvailable")) / 2**20
    if need <= available:
        return None
    return (f"{TORCH_PROCESSES} processes x 3 x {gib:g} GiB = {need:.0f} GiB, "
            f"{available:.0f} GiB available")


def _figures(stdout):
    """`(ratio, seconds)`: the largest over the processes' result lines."""
    rows = []
    for line in stdout.splitlines():
        try:
            rows.append([float(x) for x in line.split()])
        except ValueError:
            continue
    rows = [row for row in rows if len(row) == 3]
    return max(r[0] for r in rows), max(r[1] for r in rows)


def _failure(result):
    """Why a case failed: a signal (the launcher returns the failing
    process's status; SIGKILL is most often the kernel out of memory), or
    its last error line."""
    status = result.returncode
    if status < 0 or status in (128 + signal.SIGKILL, 128 + signal.SIGTERM):
        number = -status if status < 0 else status - 128
        name = signal.Signals(number).name
        return f"{name}" + (" (out of memory?)" if name == "SIGKILL" else "")
    lines = [line for line in result.stderr.strip().splitlines()
             if "Error" in line] or result.stderr.strip().splitlines()[-1:]
    return lines[-1] if lines else f"status {status}"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=float, default=2.0,
                        help="size of the weight in GiB (default 2)")
    opts = parser.parse_args()
    print(f"peak host memory over the weight's size, building a {opts.gib:g} "
          f"GiB Embedding (sharded over 8 devices; torch: {TORCH_PROCESSES} "
          "processes, the largest one's peak)")
    print(f"{'backend':12}{'case':14}{'peak / weight':>14}{'build (s)':>11}")
    with tempfile.TemporaryDirectory() as folder:
        script = os.path.join(folder, "case.py")
        with open(script, "w") as f:
            f.write(CASE)
        for backend, cases in CASES.items():
            if not installed(backend):
                print(f"{backend:12}(not installed)")
                continue
            for case in cases:
                need = _too_big(backend, case, opts.gib)
                if need:
                    print(f"{backend:12}{case:14}skipped: {need}")
                    continue
                result = subprocess.run(
                    command(script, backend, case, opts.gib),
                    capture_output=True, text=True, timeout=1200,
                    env={"TF_CPP_MIN_LOG_LEVEL": "3", **os.environ})
                if result.returncode:
                    print(f"{backend:12}{case:14}failed: "
                          f"{_failure(result)}")
                    continue
                ratio, seconds = _figures(result.stdout)
                print(f"{backend:12}{case:14}{ratio:>14.2f}{seconds:>11.1f}")


if __name__ == "__main__":
    main()
