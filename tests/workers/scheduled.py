"""Run by tests/test_schedulers.py in each task of a simulated scheduler's
job (the scheduler's variables only, no launcher): joins the job, trains
one model data-parallel and one model-parallel on a mesh of every
process's devices, and the same model on one device in this process, then
writes what it saw to OUT/rank<i>.json.

Usage: scheduled.py OUT (initialize | configure DEVICES)
"""

import json
import os
import sys

import keras_layoutmap as klm

out, how = sys.argv[1], sys.argv[2]
if how == "initialize":
    cluster = klm.initialize()  # as a cluster script does
else:
    cluster = None
    klm.configure_virtual_devices(int(sys.argv[3]))

import keras  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from helpers import (  # noqa: E402
    compile_classifier,
    digits_data,
    net_layout_map,
    sequential_mlp,
)

x, y = digits_data(96)
BATCH = 40  # the last batch of an epoch holds 16 rows


def trained(model):
    history = model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False,
                        verbose=0).history
    return {"loss": [float(v) for v in history["loss"]],
            "weights": [w.tolist() for w in model.get_weights()]}


def build():
    return compile_classifier(sequential_mlp(16, 10), accuracy=False)


devices = len(klm.list_devices())
runs = {"reference": trained(build())}
klm.set_distribution(klm.DataParallel(klm.create_mesh([("batch", devices)])))
runs["data_parallel"] = trained(build())
klm.set_distribution(None)
mesh = klm.create_mesh([("batch", devices // 2), ("model", 2)])
with net_layout_map(mesh).scope():
    model = build()
runs["model_parallel"] = trained(model)
runs["model_parallel"]["kernel"] = klm.fetch_layout(model.layers[0].kernel).sharding_specs
with open(os.path.join(out, f"rank{klm.process_index()}.json"), "w") as f:
    json.dump({"count": klm.process_count(), "devices": devices,
               "local_devices": mesh.num_local_devices(),
               "cluster": None if cluster is None else [
                   cluster.coordinator_address, cluster.num_processes,
                   cluster.process_id, cluster.source],
               "runs": runs}, f)
