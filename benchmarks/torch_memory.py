"""Model-parallel bytes per process on the torch backend, read from the real
DTensor local shards of 4 processes.

The script is the launcher's parent: it starts itself once per process with
`python -m keras_layoutmap.launch -n 4 benchmarks/torch_memory.py --worker`
(`KERAS_BACKEND=torch`, `OMP_NUM_THREADS=1`). In those 4 processes,
`klm.configure_virtual_devices(4)` joins the gloo process group and a model

    Embedding(8192, 512) -> Dense 2048 (relu) -> Dense 512 -> Dense 10

is built under a `klm.LayoutMap` on a `("model", 4)` mesh that splits its
big weights 4 ways: the embedding table by rows (`("model", None)`), the
first Dense kernel by columns (`(None, "model")`) with its bias
(`("model",)`), the second by rows (`("model", None)`); the second bias and
the head stay replicated. The model is compiled with Adam and the optimizer
built inside the scope, so the Adam slots (momentum, velocity) exist.

Nothing is computed from layouts: on every process the script sums
`v.value.to_local()`'s bytes (elements x element size of the process's own
DTensor shard) for the sharded weights, the replicated ones, and the Adam
slots of the sharded weights, and gathers the sums to process 0
(`torch.distributed.all_gather_object`), which prints them against the full
bytes (the DTensor's global shape x element size) / 4, plus the layout
(`klm.fetch_layout`, read from the DTensor's placements) and process 0's
local shape of every weight.

Goal: every process holds within 2% of 1/4 of the sharded weights' full
bytes.

Run: python benchmarks/torch_memory.py
"""

import argparse
import os
import subprocess
import sys
import tempfile

PROCESSES = 4
VOCAB, DIM, HIDDEN, CLASSES = 8192, 512, 2048, 10
TOLERANCE = 0.02
MIB = 1024 * 1024


def local_bytes(variable):
    """`(bytes of this process's shard, bytes of the whole tensor)`."""
    from torch.distributed.tensor import DTensor

    value = variable.value
    size = value.element_size()
    whole = value.numel() * size  # a DTensor's numel is the global one
    if isinstance(value, DTensor):
        return value.to_local().numel() * size, whole
    return whole, whole


def worker():
    import keras_layoutmap as klm

    klm.configure_virtual_devices(PROCESSES)

    import keras
    import torch.distributed as dist
    from rich.console import Console
    from rich.table import Table

    mesh = klm.create_mesh([("model", PROCESSES)])
    layout_map = klm.LayoutMap(mesh)
    layout_map[r"embed\.embeddings"] = ("model", None)
    layout_map[r"up\.kernel"] = (None, "model")
    layout_map[r"up\.bias"] = ("model",)
    layout_map[r"down\.kernel"] = ("model", None)
    with layout_map.scope():
        keras.utils.set_random_seed(0)
        model = keras.Sequential(
            [
                keras.Input((16,), dtype="int32"),
                keras.layers.Embedding(VOCAB, DIM, name="embed"),
                keras.layers.Dense(HIDDEN, activation="relu", name="up"),
                keras.layers.Dense(DIM, name="down"),
                keras.layers.Dense(CLASSES, name="head"),
            ],
            name="lm",
        )
        model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse")
        model.optimizer.build(model.trainable_variables)

    split = {w.path for w in model.weights
             if not klm.fetch_layout(w).is_fully_replicated()}
    sharded = [w for w in model.weights if w.path in split]
    replicated = [w for w in model.weights if w.path not in split]
    prefixes = tuple(w.path.replace("/", "_") + "_" for w in sharded)
    slots = [v for v in model.optimizer.variables
             if v.name.startswith(prefixes)]
    groups = {"sharded weights": sharded, "replicated weights": replicated,
              "Adam slots of sharded": slots}
    mine = {name: [sum(x) for x in zip(*map(local_bytes, vs))]
            for name, vs in groups.items()}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    if dist.get_rank() != 0:
        return

    console = Console(width=120)
    per_weight = Table(title="weights: layout read from the DTensor, process "
                       "0's local shard")
    for column in ("weight", "global shape", "layout", "local shape",
                   "local (MiB)", "full (MiB)", "local / full x n"):
        per_weight.add_column(column, justify="left" if column in (
            "weight", "layout") else "right")
    for w in model.weights:
        mine_bytes, whole = local_bytes(w)
        local = w.value.to_local() if hasattr(w.value, "to_local") else w.value
        per_weight.add_row(
            w.path, str(tuple(w.shape)), str(klm.fetch_layout(w).axes),
            str(tuple(local.shape)), f"{mine_bytes / MIB:.3f}",
            f"{whole / MIB:.3f}", f"{mine_bytes / whole * PROCESSES:.4f}")
    console.print(per_weight)

    table = Table(title=f"bytes per process from v.value.to_local(), "
                  f"{PROCESSES} processes, mesh ('model', {PROCESSES})")
    for column in ("process", "group", "local (MiB)", "full (MiB)",
                   "full / n (MiB)", "local / (full / n)", "goal"):
        table.add_column(column, justify="left" if column == "group" else "right")
    worst = 0.0
    for rank, groups_of_rank in enumerate(everyone):
        for name, (local, whole) in groups_of_rank.items():
            ratio = local / (whole / PROCESSES)
            goal = ""
            if name != "replicated weights":
                off = abs(ratio - 1)
                worst = max(worst, off)
                goal = "within 2%" if off <= TOLERANCE else "MISSES"
            table.add_row(str(rank), name, f"{local / MIB:.3f}",
                          f"{whole / MIB:.3f}",
                          f"{whole / PROCESSES / MIB:.3f}", f"{ratio:.4f}", goal)
        table.add_section()
    console.print(table)
    console.print(
        f"sharded weights and their Adam slots, largest deviation from 1/"
        f"{PROCESSES} on any process: {worst * 100:.2f}% (goal <= "
        f"{TOLERANCE * 100:.0f}%: {'met' if worst <= TOLERANCE else 'NOT met'})")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    if parser.parse_args().worker:
        worker()
        return
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, KERAS_BACKEND="torch", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(
                   p for p in (root, os.environ.get("PYTHONPATH")) if p))
    with tempfile.TemporaryDirectory() as tmp:
        done = subprocess.run(
            [sys.executable, "-m", "keras_layoutmap.launch", "-n",
             str(PROCESSES), "--log-dir", tmp, os.path.abspath(__file__),
             "--worker"], env=env, timeout=600, check=False)
    if done.returncode != 0:
        raise SystemExit(f"the worker processes failed ({done.returncode})")


if __name__ == "__main__":
    main()
