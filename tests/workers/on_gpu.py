"""The accelerator paths on a real GPU, in a fresh process of its own
(tests/test_gpu.py starts it: `python on_gpu.py OUT` on JAX, `python -m
keras_layoutmap.launch -n P on_gpu.py OUT` on torch). It starts as a GPU
script does, with `klm.initialize()` (which joins the processes, over NCCL
on torch, where there are several; one process joins none).

Writes OUT, a JSON object: the devices `klm.list_devices()` gives, the
kind of the mesh made of them, and for each plan (one device without any
distribution, klm rules, `klm.fsdp`, Keras' `DataParallel`) the device
kind of each weight and of its layout's mesh, read from the backend, then
the losses and weights of `small_fit`; and the weights a one-file
`save_weights` of the rules' model gave back to a fresh model.
"""

import json
import sys

import keras
from helpers import compile_classifier, net_layout_map, sequential_mlp, small_fit

import keras_layoutmap as klm


def mlp():
    return compile_classifier(sequential_mlp(32, 10), accuracy=False)


def placed(model):
    """Each weight's device kind, and the kind of the devices of the mesh
    of its layout, both read from the backend."""
    rows = {}
    for variable in model.weights:
        value = variable.value
        if callable(getattr(value, "devices", None)):  # JAX: a set of them
            device = next(iter(value.devices()))
        else:  # torch's "cuda:0", TensorFlow's "/job:.../device:GPU:0"
            device = value.device
        kind = str(device).split("device:")[-1].split(":")[0].lower()
        rows[variable.path.split("/", 1)[1]] = {  # "d1/kernel"
            "device": kind,
            "mesh_kind": klm.fetch_layout(variable).mesh.device_type()}
    return rows


def main(out):
    klm.initialize()
    devices = klm.list_devices()
    mesh = klm.create_mesh([("batch", len(devices)), ("model", 1)])
    result = {"devices": devices, "mesh_kind": mesh.device_type(),
              "processes": klm.process_count(), "plans": {}}
    reference = mlp()
    result["plans"]["one device"] = {"placed": placed(reference),
                                     **small_fit(reference)}
    rules = net_layout_map(mesh)
    scopes = {
        "rules": rules.scope,
        "fsdp": klm.fsdp(mesh, axis="batch", min_bytes=0).scope,
        "keras DataParallel": keras.distribution.DataParallel(
            devices=keras.distribution.list_devices()).scope,
    }
    for name, scope in scopes.items():
        with scope():
            model = mlp()
            result["plans"][name] = {"placed": placed(model), **small_fit(model)}
        if name == "rules":
            path = f"{out}.weights.h5"
            model.save_weights(path)
            with scope():
                loaded = mlp()
            loaded.load_weights(path)
            result["loaded"] = [w.tolist() for w in loaded.get_weights()]
    if klm.process_index() == 0:
        with open(out, "w") as file:
            json.dump(result, file)


if __name__ == "__main__":
    main(sys.argv[1])
