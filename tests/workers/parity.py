"""Run by tests/test_processes.py under `python -m keras_layoutmap.launch -n 2`:
trains one model (model parallel) on a mesh of 8 devices spread over the
processes, and the same model on one device in this process, then writes
what it saw to OUT/rank<i>.json for the test to compare.

Usage: parity.py OUT
"""

import json
import os
import sys

import keras_layoutmap as klm

klm.configure_virtual_devices(8)

import keras  # noqa: E402
import numpy as np  # noqa: E402

# The tests' shared helpers, in this script's parent folder.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from helpers import (  # noqa: E402
    compile_classifier,
    digits_data,
    net_layout_map,
    sequential_mlp,
)

out = sys.argv[1]
rank = klm.process_index()
count = klm.process_count()
x, y = digits_data(200)
BATCH = 64  # the last global batch of an epoch holds 8 rows


def build():
    return compile_classifier(sequential_mlp(32, 10, name="net"))


def train(model, x, y, batch):
    history = model.fit(x, y, batch_size=batch, epochs=2, shuffle=False,
                        verbose=0).history
    return {
        "history": {k: [float(v) for v in vs] for k, vs in history.items()},
        "evaluate": [float(v) for v in model.evaluate(x, y, batch_size=batch,
                                                      verbose=0)],
        "predict": model.predict(x, batch_size=batch, verbose=0).tolist(),
        "weights": [w.tolist() for w in model.get_weights()],
    }


reference = train(build(), x, y, BATCH)

# The model axis spans the processes: each "model" pair joins a device of
# process 0 with one of process 1.
mesh_mp = klm.create_mesh([("model", 2), ("batch", 4)])
layout_map = net_layout_map(mesh_mp, bias=False)
runs = {}
# (Data parallel across processes, global data: the workflow matrix's
# keras-data-parallel row, in its 2-process cells.)
dp = klm.DataParallel(klm.create_mesh([("batch", 8)]))
with layout_map.scope():
    model_parallel = build()
runs["model_parallel"] = train(model_parallel, x, y, BATCH)
kernel = klm.fetch_layout(model_parallel.layers[0].kernel)
runs["model_parallel"]["kernel_layout"] = kernel.sharding_specs
runs["model_parallel"]["local_devices"] = kernel.mesh.num_local_devices()

# Each process passes its own slice, with a per-process batch size.
local = klm.DataParallel(klm.create_mesh([("batch", 8)]), auto_shard_dataset=False)
klm.set_distribution(local)
rows = slice(rank * len(x) // count, (rank + 1) * len(x) // count)
runs["own_slices"] = train(build(), x[rows], y[rows], BATCH // count)
klm.set_distribution(None)
# The global batches are the processes' local batches side by side: the
# same global batches, in one process, are the reference.
per = len(x) // count
order = np.concatenate([
    np.arange(p * per + start, p * per + min(start + BATCH // count, per))
    for start in range(0, per, BATCH // count) for p in range(count)])
reference_slices = train(build(), x[order], y[order], BATCH)
runs["own_slices"]["reference_weights"] = reference_slices["weights"]
runs["own_slices"]["reference_history"] = reference_slices["history"]
runs["own_slices"].pop("predict")  # this process's rows only
runs["own_slices"].pop("evaluate")

# One file written once, loadable on another mesh and on one device.
path = os.path.join(out, "weights.weights.h5")
model_parallel.save_weights(path)
with open(os.path.join(out, f"files{rank}.json"), "w") as f:
    json.dump(sorted(os.listdir(out)), f)
klm.set_distribution(dp)
restored = build()
restored.load_weights(path)
runs["restored_data_parallel"] = [w.tolist() for w in restored.get_weights()]
klm.set_distribution(None)

# The rest of the contract, unchanged across processes.
contract = {}
mesh = dp.device_mesh
layout = klm.Layout(["batch", None], mesh)
whole = np.arange(32, dtype="float32").reshape(16, 2)
pieces = klm.unpack(klm.distribute(whole, layout))  # this process's devices
contract["unpack"] = [np.asarray(p).tolist() for p in pieces]
repacked = klm.pack([np.asarray(p) for p in pieces], layout)
contract["repacked_layout"] = klm.fetch_layout(repacked).sharding_specs
contract["repacked_host"] = keras.ops.convert_to_numpy(repacked).tolist()
contract["explain_rules"] = sorted(
    str(r.rule) for r in layout_map.explain(model_parallel).rows if r.rule)
metric = keras.metrics.Mean(mesh=mesh)
metric.update_state(np.arange(8, dtype="float32"))
contract["metric"] = float(metric.result())
contract["metric_mesh"] = klm.fetch_layout(metric.variables[0]).mesh.size
model_path = os.path.join(out, "model.keras")
model_parallel.save(model_path)
loaded = keras.models.load_model(model_path)  # no distribution: one device
contract["loaded_weights"] = [w.tolist() for w in loaded.get_weights()]
contract["loaded_mesh"] = klm.fetch_layout(loaded.layers[0].kernel).mesh.size
if keras.backend.backend() == "tensorflow":  # DTensor's own checkpoints
    import tensorflow as tf

    prefix = os.path.join(out, "ckpt", "model")
    tf.train.Checkpoint(model=model_parallel).write(prefix)
    with layout_map.scope():
        fresh = build()
    tf.train.Checkpoint(model=fresh).read(prefix).expect_partial()
    contract["checkpoint_weights"] = [w.tolist() for w in fresh.get_weights()]

with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
    json.dump({"count": count, "devices": len(klm.list_devices()),
               "reference": reference, "runs": runs, "contract": contract}, f)
