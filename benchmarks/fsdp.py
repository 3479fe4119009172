"""FSDP against plain data parallel on a keras-hub Gemma backbone: bytes
per device of weights and optimizer state (read from the real shards), and
step time.

A `keras_hub.models.GemmaBackbone` from a small config (vocabulary 4096,
4 layers, hidden 256, 4 query / 2 key-value heads of 64, intermediate_dim
2048 (gated MLP of 1024): 4.98 M parameters, built from the config, no
preset) with a causal-LM head
(the tied embedding) and Adam is trained on 8 virtual CPU devices, a
("batch", 8) mesh, the same global batch, seed and data, two ways:

- **data parallel**: `klm.DataParallel(mesh)`: every weight and every Adam
  slot whole on every device;
- **FSDP**: `klm.fsdp(mesh, axis="batch", min_bytes=64 KiB)`: every weight
  of 64 KiB or more sharded over "batch" along its largest dimension the
  axis divides, its slots with it; the norms' scales replicated.

Bytes are read from `klm.unpack(variable)` (the per-device shards: `jax.Array`
shards on JAX, DTensor components on TensorFlow), summed per device; the
table shows the busiest device. Step time is the median wall time of a
training step (`model.fit`, after warm-up steps), in one process, one run.
The loss after the timed steps is printed for both: they train the same
numbers (FSDP changes where weights live, not what is computed).

Goal: weights + optimizer state per device under FSDP within 5% of
(sharded bytes / 8 + replicated bytes); step time reported, no goal (on
CPU the gathers are memory copies; on accelerators they overlap compute).

Measured (2-core machine, 8 virtual CPU devices, one run each):
JAX: weights + Adam 57.026 -> 7.151 MiB per device (0.125), step 552.7 ->
462.9 ms (0.84); TensorFlow: 57.026 -> 7.151 MiB, step 992.2 -> 1125.0 ms
(1.13); same loss to the last printed digit on each backend.

Run: KERAS_BACKEND=jax python benchmarks/fsdp.py
     KERAS_BACKEND=tensorflow python benchmarks/fsdp.py
     KERAS_BACKEND=torch python benchmarks/fsdp.py   # starts itself as 4
                                                     # processes, one device each
"""

import os

from bench_devices import mesh_devices

DEVICES = mesh_devices(__file__)  # a torch mesh spans processes: 4 of them
TORCH = os.environ["KERAS_BACKEND"] == "torch"

import keras_layoutmap as klm  # noqa: E402

klm.configure_virtual_devices(DEVICES)

import gc  # noqa: E402
import statistics  # noqa: E402
from collections import Counter  # noqa: E402

import keras  # noqa: E402
import numpy as np  # noqa: E402
from common import GEMMA_CONFIG, StepTimer, build_gemma_lm, gemma_data  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

MIN_BYTES = 64 * 1024
BATCH, SEQUENCE = 32, 32
WARMUP, STEPS = 3, 12
TOLERANCE = 0.05
MB = 1024 * 1024


def build_lm():
    model = build_gemma_lm()
    model.optimizer.build(model.trainable_variables)
    return model


def data():
    return gemma_data(BATCH * (WARMUP + STEPS), SEQUENCE)


def shard_info(shard):
    """`(device, bytes)` of one real shard (as benchmarks/memory.py)."""
    if hasattr(shard, "devices"):  # JAX
        (device,) = shard.devices()
        return f"{device.platform}:{device.id}", shard.nbytes
    if TORCH:  # this process's DTensor piece
        return f"cpu:{klm.process_index()}", shard.numel() * shard.element_size()
    return shard.device, shard.shape.num_elements() * shard.dtype.size


def busiest_device_bytes(variables):
    per_device = Counter()
    for variable in variables:
        for device, nbytes in map(shard_info, klm.unpack(variable)):
            per_device[device] += nbytes
    if TORCH and klm.process_count() > 1:  # each process knows its own piece
        import torch.distributed as dist

        everyone = [None] * klm.process_count()
        dist.all_gather_object(everyone, dict(per_device))
        per_device = Counter()
        for counts in everyone:
            per_device.update(counts)
    return max(per_device.values(), default=0)


def measure(name, scope):
    with scope:
        model = build_lm()
    x, y = data()
    weights = busiest_device_bytes(model.weights)
    optimizer = busiest_device_bytes(model.optimizer.variables)
    sharded = [w for w in model.weights
               if not klm.fetch_layout(w).is_fully_replicated()]
    whole = sum(int(np.prod(w.shape)) * 4 for w in model.weights)
    split = sum(int(np.prod(w.shape)) * 4 for w in sharded)
    timer = StepTimer()
    history = model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False,
                        verbose=0, callbacks=[timer])
    still_sharded = all(not klm.fetch_layout(w).is_fully_replicated()
                        for w in sharded)
    result = dict(
        name=name, weights=weights, optimizer=optimizer,
        params=sum(int(np.prod(w.shape)) for w in model.weights),
        sharded=len(sharded), total=len(model.weights),
        # weights + Adam's 2 slots each, if sharded ones split exactly
        ideal=3 * (split / DEVICES + whole - split),
        step=statistics.median(timer.times[WARMUP:]),
        loss=history.history["loss"][-1], still_sharded=still_sharded,
    )
    del model
    gc.collect()
    return result


def main():
    console = Console(width=120)
    mesh = klm.create_mesh([("batch", DEVICES)])
    results = [
        measure("data parallel", klm.DataParallel(mesh).scope()),
        measure("FSDP", klm.fsdp(mesh, axis="batch",
                                 min_bytes=MIN_BYTES).scope()),
    ]
    dp, fsdp = results
    if klm.process_index() != 0:
        return
    table = Table(
        title=f"GemmaBackbone ({dp['params'] / 1e6:.2f} M params, "
        f"{GEMMA_CONFIG['num_layers']} layers, hidden {GEMMA_CONFIG['hidden_dim']}) + "
        f"Adam, {DEVICES} CPU devices, {keras.backend.backend()}; bytes from "
        "klm.unpack shards, busiest device"
    )
    for col in ("", "data parallel", "FSDP", "FSDP / DP"):
        table.add_column(col, justify="left" if not col else "right")

    def row(label, key, fmt, scale=1.0):
        a, b = dp[key] / scale, fsdp[key] / scale
        table.add_row(label, fmt.format(a), fmt.format(b), f"{b / a:.3f}")

    row("weights (MiB / device)", "weights", "{:.3f}", MB)
    row("optimizer state (MiB / device)", "optimizer", "{:.3f}", MB)
    for r in results:
        r["state"] = r["weights"] + r["optimizer"]
    row("weights + optimizer (MiB / device)", "state", "{:.3f}", MB)
    table.add_row("sharded weights", f"{dp['sharded']} / {dp['total']}",
                  f"{fsdp['sharded']} / {fsdp['total']}", "")
    row(f"median step time (ms, batch {BATCH} x {SEQUENCE} tokens)", "step",
        "{:.1f}", 1e-3)
    table.add_row("loss after the timed steps", f"{dp['loss']:.6f}",
                  f"{fsdp['loss']:.6f}", "")
    console.print(table)
    total = fsdp["weights"] + fsdp["optimizer"]
    off = abs(total / fsdp["ideal"] - 1)
    console.print(
        f"FSDP bytes per device vs the ideal (sharded / {DEVICES} + "
        f"replicated): {total / MB:.3f} vs {fsdp['ideal'] / MB:.3f} MiB, "
        f"{off * 100:.2f}% off (goal <= {TOLERANCE * 100:.0f}%: "
        f"{'met' if off <= TOLERANCE else 'MISSED'}); storage still sharded "
        f"after training: {fsdp['still_sharded']}"
    )


if __name__ == "__main__":
    main()
