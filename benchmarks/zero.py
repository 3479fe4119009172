"""ZeRO-1 (`klm.shard_optimizer_states`) against the plain plan on a
keras-hub Gemma: Adam state bytes per device (read from the backend) and
step time, in one run.

The model and data are `benchmarks/fsdp.py`'s: a `GemmaBackbone` (vocabulary
4096, 4 layers, hidden 256, 4.98 M parameters) with its tied-embedding LM
head and Adam, on a ("batch", N) mesh (8 virtual CPU devices; 4 processes
on torch), the same global batch, seed and data, two ways:

- **plain**: `klm.LayoutMap(mesh)` with no rules: every weight replicated,
  every Adam slot with its weight (data parallel);
- **ZeRO-1**: `klm.shard_optimizer_states(that map, axis="batch",
  min_bytes=64 KiB)`: the same weights, each slot of a weight of 64 KiB or
  more split over "batch".

Bytes are the sum of each device's pieces of the optimizer's variables
(`klm.memory.measured`, the backend's shards), busiest device. Step time is
the median wall time of a `fit` step after warm-up; the ratio is ZeRO-1 /
plain, in this run. The losses after the timed steps are printed: the same
numbers.

Measured (2-core machine shared with other jobs, one run each): Adam state
per device 38.018 -> 4.768 MiB (0.125, 8 devices) on JAX and TensorFlow,
38.018 -> 9.518 MiB (0.250, 4 processes) on torch, explain's estimate
equal to the backend's bytes; 58 of 76 slots split (the others are under
64 KiB); median step time ZeRO-1 / plain: JAX 2876.0 / 2939.5 ms (0.98),
TensorFlow 3318.9 / 3273.7 ms (1.01), torch 4831.2 / 4128.4 ms (1.17);
the same loss to the printed digit on each backend.

Run: KERAS_BACKEND=jax python benchmarks/zero.py
     KERAS_BACKEND=tensorflow python benchmarks/zero.py
     KERAS_BACKEND=torch python benchmarks/zero.py   # starts itself as 4
                                                     # processes, one device each
"""

import os

from bench_devices import mesh_devices

DEVICES = mesh_devices(__file__)  # on torch: 4 processes
TORCH = os.environ["KERAS_BACKEND"] == "torch"

import keras_layoutmap as klm  # noqa: E402

klm.configure_virtual_devices(DEVICES)

import gc  # noqa: E402
import statistics  # noqa: E402

import keras  # noqa: E402
import numpy as np  # noqa: E402
from common import StepTimer, build_gemma_lm, gemma_data  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from keras_layoutmap.memory import measured  # noqa: E402

MIN_BYTES = 64 * 1024
BATCH, SEQUENCE = 32, 32
WARMUP, STEPS = 3, 12
MB = 1024 * 1024


build_lm = build_gemma_lm


def data():
    return gemma_data(BATCH * (WARMUP + STEPS), SEQUENCE)


def busiest(variables):
    per_device = measured(variables)
    if TORCH and klm.process_count() > 1:  # each process knows its piece
        import torch.distributed as dist

        everyone = [None] * klm.process_count()
        dist.all_gather_object(everyone, per_device)
        per_device = {k: v for counts in everyone for k, v in counts.items()}
    return max(per_device.values())


def measure(name, plan):
    with plan.scope():
        model = build_lm()
    estimate = plan.explain(model, optimizer=model.optimizer).memory
    x, y = data()
    timer = StepTimer()
    history = model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False,
                        verbose=0, callbacks=[timer])
    result = dict(
        name=name, weights=busiest(model.weights),
        optimizer=busiest(model.optimizer.variables),
        estimate=estimate.optimizer,
        params=sum(int(np.prod(w.shape)) for w in model.weights),
        split=sum(r.split for r in estimate.state),
        slots=sum(r.weight is not None for r in estimate.state),
        step=statistics.median(timer.times[WARMUP:]),
        loss=history.history["loss"][-1])
    del model
    gc.collect()
    return result


def main():
    mesh = klm.create_mesh([("batch", DEVICES)])
    plain_map = klm.LayoutMap(mesh)
    plain = measure("plain", plain_map)
    zero = measure("ZeRO-1", klm.shard_optimizer_states(
        plain_map, axis="batch", min_bytes=MIN_BYTES))
    if klm.process_index() != 0:
        return
    table = Table(
        title=f"GemmaBackbone ({plain['params'] / 1e6:.2f} M params) + Adam, "
        f"{DEVICES} CPU devices, {keras.backend.backend()}; bytes from the "
        "backend's shards, busiest device")
    for col in ("", "plain", "ZeRO-1", "ZeRO-1 / plain"):
        table.add_column(col, justify="left" if not col else "right")

    def row(label, key, fmt, scale=1.0):
        a, b = plain[key] / scale, zero[key] / scale
        table.add_row(label, fmt.format(a), fmt.format(b), f"{b / a:.3f}")

    row("weights (MiB / device)", "weights", "{:.3f}", MB)
    row("optimizer state (MiB / device)", "optimizer", "{:.3f}", MB)
    row("optimizer state, explain's estimate (MiB)", "estimate", "{:.3f}", MB)
    table.add_row("slots split over 'batch'", f"{plain['split']} / "
                  f"{plain['slots']}", f"{zero['split']} / {zero['slots']}", "")
    row(f"median step time (ms, batch {BATCH} x {SEQUENCE} tokens)", "step",
        "{:.1f}", 1e-3)
    table.add_row("loss after the timed steps", f"{plain['loss']:.6f}",
                  f"{zero['loss']:.6f}", "")
    Console(width=120).print(table)


if __name__ == "__main__":
    main()
