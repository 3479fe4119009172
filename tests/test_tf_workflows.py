"""TensorFlow: Keras' own distribution API and keras-hub's `generate()` on a
mesh.

- `keras.distribution.list_devices()` names every device once, as
  `klm.list_devices()` does, and `keras.distribution.get_device_count()`
  exists. Across processes (Keras' TensorFlow module listed each process's
  devices under the same names, `cpu:0 ...`, so the Keras guide's
  `DeviceMesh(..., devices=keras.distribution.list_devices())` was refused):
  the workflow matrix's rows that make the guide's mesh, in its cell of 2
  TensorFlow processes (test_workflows.py, `keras_mesh`).
- A keras-hub `GemmaCausalLM` generates on a mesh the ids one device does:
  Keras' TensorFlow einsum transposed the replicated KV cache into a matmul
  with the split query, which DTensor's Transpose refuses ("TransposeOp SPMD
  needs communication is not supported yet"); under `klm.fsdp`, DTensor's
  ArgMax refused the greedy sampler's logits. The kernels split over the
  prompts' axis are gathered once per call, not at each token.
- `ops.argmax` / `ops.argmin` on a mesh give one device's index (the first
  on a tie, -0.0 below 0.0, infinities), eagerly and in a `tf.function`;
  `ops.top_k` its indices and values (an infinity as the largest finite
  value).
"""

import keras
import numpy as np
import pytest
from helpers import BACKEND, DEVICES

import keras_layoutmap as klm

pytestmark = [
    pytest.mark.sharding,
    pytest.mark.training,
    pytest.mark.skipif(BACKEND != "tensorflow", reason="TensorFlow backend only"),
]


# -- Keras' own device list -----------------------------------------------------


def test_keras_list_devices_is_klms():
    devices = klm.list_devices()
    assert len(devices) == DEVICES
    assert keras.distribution.list_devices() == devices
    assert keras.distribution.list_devices("cpu") == devices
    assert keras.distribution.list_devices("CPU") == devices
    # Never a mix of types: none of another type on a CPU run.
    assert keras.distribution.list_devices("gpu") == []
    assert keras.distribution.list_devices("tpu") == []
    assert keras.distribution.get_device_count() == DEVICES
    assert keras.distribution.get_device_count("cpu") == DEVICES
    assert keras.distribution.get_device_count("gpu") == 0
    mesh = keras.distribution.DeviceMesh(
        (DEVICES,), ["batch"], devices=keras.distribution.list_devices())
    assert mesh.devices.size == DEVICES


# -- keras-hub generate() --------------------------------------------------------

keras_hub = pytest.importorskip("keras_hub")

GEMMA = dict(vocabulary_size=64, num_layers=1, num_query_heads=4,
             num_key_value_heads=2, hidden_dim=16, intermediate_dim=32,
             head_dim=8)
LENGTH = 12


def causal_lm():
    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.GemmaBackbone(**GEMMA)
    lm = keras_hub.models.GemmaCausalLM(backbone=backbone, preprocessor=None)
    lm.compile(sampler="greedy")
    return lm


def mixed_prompts(rows):
    """`rows` prompts of 3 to 7 tokens, right-padded to LENGTH."""
    rng = np.random.default_rng(1)
    lengths = 3 + np.arange(rows) % 5
    mask = np.arange(LENGTH)[None, :] < lengths[:, None]
    ids = rng.integers(1, 64, size=(rows, LENGTH))
    return {"token_ids": np.where(mask, ids, 0).astype("int32"),
            "padding_mask": mask}


def generated(lm, prompts):
    out = lm.generate(prompts, stop_token_ids=None, max_length=LENGTH)
    return np.asarray(keras.ops.convert_to_numpy(out["token_ids"]))


def data_parallel():
    mesh = keras.distribution.DeviceMesh(
        (DEVICES,), ["batch"], devices=keras.distribution.list_devices())
    return keras.distribution.DataParallel(device_mesh=mesh)


def model_parallel():
    mesh = keras.distribution.DeviceMesh(
        (DEVICES // 2, 2), ["batch", "model"],
        devices=keras.distribution.list_devices())
    return keras.distribution.ModelParallel(
        layout_map=keras_hub.models.GemmaBackbone.get_layout_map(mesh),
        batch_dim_name="batch")


def fsdp():
    """`klm.fsdp` over the batch axis: the logits come out split over the
    vocabulary and whole over the batch, the next token split over the
    batch (DTensor's ArgMax did not slice its rows: "SPMD expansion
    resulted in op output inconsistent with the provided layout")."""
    mesh = klm.create_mesh([("batch", DEVICES // 2), ("model", 2)])
    return klm.fsdp(mesh, axis="batch", min_bytes=0)


@pytest.mark.parametrize("distribution, rows", [
    (data_parallel, DEVICES),  # one prompt per device
    (model_parallel, DEVICES // 2),  # one prompt per batch shard
    (fsdp, DEVICES),
], ids=["data_parallel", "model_parallel", "fsdp"])
def test_generate_one_prompt_per_shard_equals_one_device(distribution, rows):
    prompts = mixed_prompts(rows)
    keras.distribution.set_distribution(None)
    expected = generated(causal_lm(), prompts)
    with distribution().scope():
        got = generated(causal_lm(), prompts)
    np.testing.assert_array_equal(got, expected)
    mask = prompts["padding_mask"]
    np.testing.assert_array_equal(np.where(mask, got, 0), prompts["token_ids"])
    assert (got[~mask] != 0).any()  # it generated


def gathers_in_the_loop(lm):
    """The weights `lm`'s traced generate function gathers inside its
    decoding loop: the `Relayout` ops of a variable's read in the bodies
    of its `tf.while_loop`s."""
    count = 0
    compiled = lm.generate_function.compiled  # the tf.function it runs
    for function in compiled._list_all_concrete_functions():
        for body in function.graph.as_graph_def().library.function:
            if "while_body" not in body.signature.name:
                continue
            ops = {node.name: node.op for node in body.node_def}
            count += sum(node.op == "Relayout"
                         and ops.get(node.input[0].split(":")[0]) == "ReadVariableOp"
                         for node in body.node_def)
    return count


@pytest.mark.parametrize("memory", ["enough", "short"])
def test_weights_split_over_the_rows_are_gathered_once_per_call(memory,
                                                                 monkeypatch):
    """keras-hub's decoding loop reads the kernels `klm.fsdp` splits over
    the prompts' axis gathered once, before the loop (`decoding.py`); with
    too little free memory for them, at each read inside it, as before. The
    ids are one device's either way, and the variables keep their
    layouts, read from the backend."""
    from keras_layoutmap.backends.tensorflow import decoding

    if memory == "short":
        monkeypatch.setattr(decoding, "free_bytes", lambda: 0)
    prompts = mixed_prompts(DEVICES)
    keras.distribution.set_distribution(None)
    expected = generated(causal_lm(), prompts)
    distribution = fsdp()
    with distribution.scope():
        lm = causal_lm()
    before = {v.path: klm.fetch_layout(v) for v in lm.weights}
    assert sum("batch" in layout.axes for layout in before.values()) >= 8
    np.testing.assert_array_equal(generated(lm, prompts), expected)
    gathers = gathers_in_the_loop(lm)
    if memory == "enough":
        assert gathers == 0
    else:
        assert gathers >= 7  # the block's 7 Dense / EinsumDense kernels
    assert {v.path: klm.fetch_layout(v) for v in lm.weights} == before


def test_argmax_argmin_and_top_k_on_a_mesh_give_one_devices_results():
    mesh = klm.create_mesh([("batch", DEVICES // 2), ("model", 2)])
    rng = np.random.default_rng(0)
    x = rng.integers(-3, 4, size=(DEVICES, 6)).astype("float32")  # ties
    x[0, :] = [0.0, -0.0, -0.0, 0.0, -1.0, -2.0]
    x[1, :] = [-0.0, -0.0, 0.0, 1.0, 2.0, 3.0]
    x[2, :] = [np.inf, 2.0, np.inf, -np.inf, 0.0, 1.0]
    x[3, :] = -np.inf
    layouts = [klm.Layout(specs, mesh) for specs in
               (["batch", "model"], ["batch", None], [None, "model"])]
    import tensorflow as tf

    for layout in layouts:
        placed = klm.distribute(x, layout)
        for axis in (-1, 0):
            for name in ("argmax", "argmin"):
                op = getattr(keras.ops, name)
                want = keras.ops.convert_to_numpy(op(x, axis=axis))
                got = keras.ops.convert_to_numpy(op(placed, axis=axis))
                np.testing.assert_array_equal(got, want, f"{name} {layout}")
                with model_parallel().scope():
                    traced = tf.function(lambda t, op=op, axis=axis: op(
                        t, axis=axis, keepdims=True))
                    got = keras.ops.convert_to_numpy(traced(placed))
                np.testing.assert_array_equal(
                    got, np.expand_dims(want, axis), f"{name} {layout} traced")
        want = [keras.ops.convert_to_numpy(t) for t in keras.ops.top_k(x, 3)]
        got = [keras.ops.convert_to_numpy(t)
               for t in keras.ops.top_k(placed, 3)]
        np.testing.assert_array_equal(got[1], want[1], f"top_k {layout}")
        big = np.finfo("float32").max
        np.testing.assert_array_equal(got[0], np.clip(want[0], -big, big),
                                      f"top_k {layout}")


@pytest.mark.parametrize("cache_axes, start, rows, update_split", [
    # A KV cache's write: the batch and the heads whole, the update split
    # like the cache, or whole on every device.
    (["batch", None, "model", None], (0, 2, 0, 0), None, True),
    (["batch", None, "model", None], (0, 2, 0, 0), None, False),
    # Past the end: XLA clips the start to 4.
    (["batch", None, "model", None], (0, 5, 0, 0), None, True),
    # Rows 1 and 2 only, of a cache split over the heads.
    ([None, None, "model", None], (1, 2, 0, 0), 2, False),
])
def test_slice_update_on_a_mesh_equals_one_device(cache_axes, start, rows,
                                                  update_split):
    """`ops.slice_update` of a cache on a mesh
    (`backends/tensorflow/slice_updates.py`), eagerly and in a
    `tf.function`, equals one device's dynamic-update-slice."""
    import tensorflow as tf

    mesh = klm.create_mesh([("batch", DEVICES // 2), ("model", 2)])
    rng = np.random.default_rng(0)
    cache = rng.normal(size=(DEVICES // 2 * 2, 6, 2, 3)).astype("float32")
    update = rng.normal(size=(rows or cache.shape[0], 2, 2, 3)).astype(
        "float32")
    want = keras.ops.convert_to_numpy(
        keras.ops.slice_update(cache, start, update))
    placed = klm.distribute(cache, klm.Layout(cache_axes, mesh))
    new = klm.distribute(update, klm.Layout(
        cache_axes if update_split else [None] * 4, mesh))
    for given in (new, update):  # a DTensor, a plain array
        got = keras.ops.slice_update(placed, start, given)
        np.testing.assert_array_equal(keras.ops.convert_to_numpy(got), want)
    with model_parallel().scope():
        traced = tf.function(lambda c, u: keras.ops.slice_update(c, start, u))
        got = traced(placed, new)
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(got), want)
