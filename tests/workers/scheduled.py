"""Run by tests/test_schedulers.py in each task of a simulated scheduler's
job (the scheduler's variables only, no launcher): joins the job, trains
`RUNS` (`data_parallel`, `model_parallel`, comma-separated) on a mesh of
every process's devices, then writes what it saw to OUT/rank<i>.json (the
test compares it with `small_fit(small_classifier())` on one device).

Usage: scheduled.py OUT RUNS (initialize | configure DEVICES)
"""

import json
import os
import sys

import keras_layoutmap as klm

out, wanted, how = sys.argv[1], sys.argv[2].split(","), sys.argv[3]
if how == "initialize":
    cluster = klm.initialize()  # as a cluster script does
else:
    cluster = None
    klm.configure_virtual_devices(int(sys.argv[4]))

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from helpers import net_layout_map, small_classifier, small_fit  # noqa: E402

devices = len(klm.list_devices())
mesh = klm.create_mesh([("batch", devices // 2), ("model", 2)])
runs = {}
if "data_parallel" in wanted:
    klm.set_distribution(klm.DataParallel(klm.create_mesh([("batch", devices)])))
    runs["data_parallel"] = small_fit(small_classifier())
    klm.set_distribution(None)
if "model_parallel" in wanted:
    with net_layout_map(mesh).scope():
        model = small_classifier()
    runs["model_parallel"] = small_fit(model)
    runs["model_parallel"]["kernel"] = klm.fetch_layout(
        model.layers[0].kernel).sharding_specs
with open(os.path.join(out, f"rank{klm.process_index()}.json"), "w") as f:
    json.dump({"count": klm.process_count(), "devices": devices,
               "local_devices": mesh.num_local_devices(),
               "cluster": None if cluster is None else [
                   cluster.coordinator_address, cluster.num_processes,
                   cluster.process_id, cluster.source],
               "runs": runs}, f)
