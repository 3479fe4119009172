"""Bytes per device of weights and optimizer state under n-way model
parallelism, read from the backend's real shards.

A 4-layer MLP (Dense 1024 -> 1024, four times: 1024 x 1024 float32 kernels)
with a built Adam optimizer is created on 8 virtual CPU devices:

- replicated: `klm.DataParallel` on a ("batch", 8) mesh, every weight whole
  on every device;
- n-way model parallel, n in (2, 4, 8): a ("batch", 8 // n) x ("model", n)
  mesh, kernels split alternately by columns (None, "model") and by rows
  ("model", None) (Megatron style); the bias of a column-split layer is split
  ("model",), the bias of a row-split layer stays replicated.

Nothing is computed from layouts: for every variable the script takes
`klm.unpack(variable)` (the per-device shards in mesh order: `jax.Array`
shards on JAX, the DTensor components on TensorFlow) and adds up each
shard's bytes per device (the device each shard sits on, as the backend
reports it). "device 0" is the first shard of each variable;
"max device" is the busiest device, which shows the split is even.

The optimizer is built inside the scope (`model.compile` then
`model.optimizer.build(model.trainable_variables)`), so the Adam slots
(momentum, velocity) exist; each slot must have the layout of its weight,
which the script checks with `klm.fetch_layout`.

Goal: the sharded weights (and their optimizer slots) take within 2% of
1/n of their replicated bytes on each device.

Quantized plans: the same model, built under each n-way map and quantized
with `model.quantize("int8")` inside the scope, against its float plan:
the int8 kernels (which keep their rules' layouts) take 1/4 of the float
kernels' bytes on each device, and the scales quantization adds (one
float32 per output unit, split with their kernel's columns) are listed as
they are. Goal: int8 kernel bytes / float kernel bytes = 0.25 on every
device.

Run: KERAS_BACKEND=jax python benchmarks/memory.py
     KERAS_BACKEND=tensorflow python benchmarks/memory.py
"""

import os

os.environ.setdefault("KERAS_BACKEND", "jax")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras_layoutmap as klm  # noqa: E402

klm.configure_virtual_devices(8)

import gc  # noqa: E402
from collections import Counter  # noqa: E402

import keras  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

WIDTH, LAYERS = 1024, 4
DEVICES = 8
WAYS = (2, 4, 8)
TOLERANCE = 0.02
MB = 1024 * 1024


def build_model():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((WIDTH,))
    h = inputs
    for i in range(LAYERS):
        h = keras.layers.Dense(WIDTH, activation="relu", name=f"d{i}")(h)
    model = keras.Model(inputs, h, name="mlp")
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse")
    model.optimizer.build(model.trainable_variables)
    return model


def layout_map_for(n):
    mesh = klm.create_mesh([("batch", DEVICES // n), ("model", n)])
    layout_map = klm.LayoutMap(mesh)
    for i in range(LAYERS):
        if i % 2 == 0:
            layout_map[rf"d{i}\.kernel"] = (None, "model")
            layout_map[rf"d{i}\.bias"] = ("model",)
        else:
            layout_map[rf"d{i}\.kernel"] = ("model", None)
    return layout_map


def slots_of(model, weight):
    """The optimizer variables made from `weight` (Adam: momentum, velocity)."""
    prefix = weight.path.replace("/", "_") + "_"
    return [v for v in model.optimizer.variables if v.name.startswith(prefix)]


def shard_info(shard):
    """`(device, bytes)` of one real shard: a `jax.Array` shard on JAX, a
    DTensor component (an eager tensor on one logical device) on
    TensorFlow."""
    if hasattr(shard, "devices"):  # JAX
        (device,) = shard.devices()
        return f"{device.platform}:{device.id}", shard.nbytes
    # TensorFlow: the component's own device and its size in memory.
    return shard.device, shard.shape.num_elements() * shard.dtype.size


def shard_bytes(variables):
    """`(device-0 bytes, busiest-device bytes)` of the real shards of
    `variables`: device 0 is the first shard (mesh order) of each."""
    per_device = Counter()
    first = 0
    for variable in variables:
        shards = [shard_info(s) for s in klm.unpack(variable)]
        first += shards[0][1]
        for device, nbytes in shards:
            per_device[device] += nbytes
    return first, max(per_device.values(), default=0)


def groups_of(model, sharded_paths):
    """The variables of `model` in each reported group; `sharded_paths` are
    the weights the model-parallel map splits."""
    sharded = [w for w in model.weights if w.path in sharded_paths]
    return {
        "weights (sharded)": sharded,
        "weights (all)": list(model.weights),
        "Adam slots (of sharded)": [
            s for w in sharded for s in slots_of(model, w)
        ],
        "optimizer (all)": list(model.optimizer.variables),
    }


def check_slots(model):
    """Weights whose optimizer slots do not share their layout."""
    bad = []
    for w in model.trainable_variables:
        slots = slots_of(model, w)
        if len(slots) != 2:
            bad.append(f"{w.path}: {len(slots)} slots")
        for s in slots:
            if klm.fetch_layout(s) != klm.fetch_layout(w):
                bad.append(
                    f"{s.path}: {klm.fetch_layout(s).sharding_specs} != "
                    f"{klm.fetch_layout(w).sharding_specs}"
                )
    return bad


def quantized_table(console):
    """Bytes per device of the int8 plan against the float plan, for each
    n-way map (weights only: a quantized kernel does not train)."""
    table = Table(
        title=f"int8 plan vs float plan, bytes per device, {LAYERS}-layer "
        f"MLP {WIDTH}x{WIDTH}, {DEVICES} devices (from klm.unpack shards)")
    for col in ("n", "float kernels (MiB)", "int8 kernels (MiB)", "ratio",
                "int8 scales (KiB)", "all float (MiB)", "all int8 (MiB)",
                "goal"):
        table.add_column(col, justify="right")
    worst = 0.0
    for n in WAYS:
        row = []
        for mode in (None, "int8"):
            with layout_map_for(n).scope():
                model = build_model()
                if mode:
                    model.quantize(mode)
            kernels = [w for w in model.weights if w.name == "kernel"]
            scales = [w for w in model.weights if w.name == "kernel_scale"]
            row.append((shard_bytes(kernels)[1], shard_bytes(scales)[1],
                        shard_bytes(model.weights)[1]))
            del model
            gc.collect()
        (fk, _, fall), (qk, qs, qall) = row
        ratio = qk / fk
        worst = max(worst, abs(ratio - 0.25))
        table.add_row(str(n), f"{fk / MB:.3f}", f"{qk / MB:.3f}",
                      f"{ratio:.4f}", f"{qs / 1024:.1f}", f"{fall / MB:.3f}",
                      f"{qall / MB:.3f}",
                      "1/4" if abs(ratio - 0.25) < 1e-9 else "MISSES")
    console.print(table)
    console.print(f"int8 kernels / float kernels, busiest device: largest "
                  f"deviation from 1/4: {worst:.4f}")


def main():
    console = Console(width=120)

    # The replicated reference: every weight and slot whole on every device.
    mesh = klm.create_mesh([("batch", DEVICES)])
    with klm.DataParallel(mesh).scope():
        replicated_model = build_model()

    results, bad_slots = {}, {}
    for n in WAYS:
        with layout_map_for(n).scope():
            model = build_model()
        sharded_paths = {
            w.path for w in model.weights
            if not klm.fetch_layout(w).is_fully_replicated()
        }
        mine = groups_of(model, sharded_paths)
        base = groups_of(replicated_model, sharded_paths)
        results[n] = {
            group: (*shard_bytes(mine[group]), shard_bytes(base[group])[0])
            for group in mine
        }
        bad_slots[n] = check_slots(model)
        del model, mine, base  # free this mesh's arrays before the next
        gc.collect()

    table = Table(
        title=f"bytes per device, {LAYERS}-layer MLP {WIDTH}x{WIDTH} float32 "
        f"+ Adam, {DEVICES} devices (from klm.unpack shards)"
    )
    for col in ("n", "group", "device 0 (MiB)", "max device (MiB)",
                "replicated (MiB)", "ratio", "ratio x n", "goal"):
        table.add_column(col, justify="left" if col == "group" else "right")
    worst = 0.0
    for n in WAYS:
        for group, (dev0, busiest, reference) in results[n].items():
            ratio = dev0 / reference
            goal = ""
            if "sharded" in group:
                off = abs(ratio * n - 1)
                worst = max(worst, off)
                goal = "within 2%" if off <= TOLERANCE else "MISSES"
            table.add_row(
                str(n), group, f"{dev0 / MB:.3f}", f"{busiest / MB:.3f}",
                f"{reference / MB:.3f}", f"{ratio:.4f}", f"{ratio * n:.4f}",
                goal,
            )
        table.add_section()
    console.print(table)
    console.print(
        f"sharded weights and slots: largest deviation from 1/n: "
        f"{worst * 100:.2f}% (goal <= {TOLERANCE * 100:.0f}%)"
    )
    for n in WAYS:
        status = "all match" if not bad_slots[n] else f"MISMATCH {bad_slots[n]}"
        console.print(f"n={n}: optimizer slot layouts vs their weights: {status}")
    quantized_table(console)


if __name__ == "__main__":
    main()
