"""Quantized models under a sharding plan (issue 31): `model.quantize(mode)`
for int8, int4 and float8 with a distribution set, inside a scope and on an
already placed model; the quantized kernel keeps its rule's layout and the
variables quantization adds follow it (read from the backend with
`klm.fetch_layout`); every number equals one device's quantized model.
keras-hub's int8 recipe (`GemmaBackbone.get_layout_map` with Keras' own
`ModelParallel`) gives what plain Keras gives without the plugin.
"""

import json
import os
import subprocess
import sys

import keras
import numpy as np
import pytest
from helpers import BACKEND, DEVICES, SPANS_PROCESSES, fake_mesh, keras_mesh

import keras_layoutmap as klm
from keras_layoutmap.rules.resolve import resolve_weight

MODES = ("int8", "int4", "float8")
_ONE_DEVICE = {}  # one-device numbers, computed once per process


def one_device(key, compute):
    if key not in _ONE_DEVICE:
        klm.set_distribution(None)
        _ONE_DEVICE[key] = compute()
    return _ONE_DEVICE[key]


def mlp():
    """16 -> 32 -> 16 -> 8: d1 split by columns, d2 by rows, d3 unplaced."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((16,))
    x = keras.layers.Dense(32, activation="relu", name="d1")(inputs)
    x = keras.layers.Dense(16, activation="relu", name="d2")(x)
    return keras.Model(inputs, keras.layers.Dense(8, name="d3")(x))


def data():
    rng = np.random.default_rng(0)
    return (rng.normal(size=(16, 16)).astype("float32"),
            rng.normal(size=(16, 8)).astype("float32"))


def mesh():
    return klm.create_mesh([("batch", DEVICES // 2), ("model", 2)])


def keras_rules():
    """Rules written Keras' way (a rule matches anywhere in a path, so
    `d1/kernel` also matches `d1/kernel_scale`), under Keras' classes."""
    layout_map = keras.distribution.LayoutMap(keras_mesh(mesh()))
    layout_map["d1/kernel"] = (None, "model")
    layout_map["d1/bias"] = ("model",)
    layout_map["d2/kernel"] = ("model", None)
    return keras.distribution.ModelParallel(layout_map=layout_map,
                                            batch_dim_name="batch")


def klm_rules():
    """The same plan as klm's own (full-match) rules."""
    layout_map = klm.LayoutMap(mesh())
    layout_map["d1.kernel"] = (None, "model")
    layout_map["d1.bias"] = ("model",)
    layout_map["d2.kernel"] = ("model", None)
    return layout_map


def quantized_on_the_mesh(mode, situation):
    """`mlp()` quantized to `mode` on the mesh, in `situation`."""
    if situation == "distribution set":  # Keras' classes, set globally
        klm.set_distribution(keras_rules())
        model = mlp()
        model.quantize(mode)
        return model
    layout_map = klm_rules()
    with layout_map.scope():
        model = mlp()
        if situation == "inside a scope":
            model.quantize(mode)
    if situation == "placed model":
        model.quantize(mode)  # outside the scope: placed at the next call
    return model


def specs(variable):
    return tuple(None if s in (None, klm.UNSHARDED) else s
                 for s in klm.fetch_layout(variable).sharding_specs)


def expected_specs(mode, path, shape):
    """What the plan gives each weight of the quantized `mlp()`: d1's
    kernel split by columns (over "model"), d2's by rows; every variable
    that quantization adds split where its dimension is the kernel's split
    one (d1's units), else replicated."""
    layer, name = path.split("/")[-2:]
    rank = len(shape)
    if name == "kernel":
        return {"d1": (None, "model"), "d2": ("model", None)}.get(layer, (None, None))
    if name == "bias":
        return ("model",) if layer == "d1" else (None,)
    if layer == "d1" and name in ("kernel_scale", "kernel_zero") and rank:
        return (None,) * (rank - 1) + ("model",)  # d1's units
    if layer == "d2" and name == "g_idx":
        return ("model",)  # d2's inputs
    return (None,) * rank


@pytest.mark.sharding
@pytest.mark.parametrize("mode", MODES)
def test_quantize_under_a_plan_equals_one_device(mode):
    """Keras' rules with a distribution set, klm's inside a scope, and a
    model placed before `quantize`: the layouts the plan says, held by the
    backend, and one device's predictions."""
    x, _ = data()

    def reference():
        model = mlp()
        model.quantize(mode)
        return model.predict(x, verbose=0)

    expected = one_device(("predict", mode), reference)
    for situation in ("distribution set", "inside a scope", "placed model"):
        model = quantized_on_the_mesh(mode, situation)
        got = model.predict(x, verbose=0)
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6,
                                   err_msg=situation)
        quantized = [v.path for v in model.weights
                     if str(v.dtype) == "int8" or "amax" in v.path]
        assert quantized, situation  # it did quantize
        for v in model.weights:
            assert specs(v) == expected_specs(mode, v.path, v.shape), (
                situation, v.path)
        klm.set_distribution(None)


@pytest.mark.sharding
@pytest.mark.training
@pytest.mark.parametrize("mode", ("int8", "int4"))
def test_lora_on_quantized_fit_equals_one_device(mode):
    """int8 or int4, then `enable_lora`, then `fit`: losses, LoRA weights
    and predictions equal one device's; the quantized kernels stay
    bit-identical to one device's, before and after."""
    x, y = data()

    def run(layout_map):
        def body():
            model = mlp()
            model.quantize(mode)
            for name in ("d1", "d2"):
                model.get_layer(name).enable_lora(2)
            model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
            return model
        if layout_map is None:
            model = body()
        else:
            with layout_map.scope():
                model = body()
        before = {v.path: keras.ops.convert_to_numpy(v) for v in model.weights
                  if str(v.dtype) == "int8"}
        history = model.fit(x, y, batch_size=8, epochs=2, shuffle=False,
                            verbose=0).history
        weights = {v.path: keras.ops.convert_to_numpy(v) for v in model.weights}
        return model, before, history, weights, model.predict(x, verbose=0)

    _, ref_before, ref_history, ref_weights, ref_pred = one_device(
        ("lora", mode), lambda: run(None))
    model, before, history, weights, pred = run(klm_rules())
    assert sorted(before) == sorted(ref_before) and len(before) >= 3
    for path, kernel in ref_before.items():
        np.testing.assert_array_equal(before[path], kernel, err_msg=path)
        np.testing.assert_array_equal(weights[path], kernel, err_msg=path)
    np.testing.assert_allclose(history["loss"], ref_history["loss"], rtol=1e-5)
    for path, value in ref_weights.items():
        np.testing.assert_allclose(weights[path], value, rtol=1e-5, atol=1e-6,
                                   err_msg=path)
    np.testing.assert_allclose(pred, ref_pred, rtol=1e-5, atol=1e-6)
    lora = {v.path: specs(v) for v in model.weights if "lora" in v.path}
    assert lora == {  # d1 split by columns: b's columns; d2 by rows: a's rows
        "d1/lora_kernel_a": (None, None), "d1/lora_kernel_b": (None, "model"),
        "d2/lora_kernel_a": ("model", None), "d2/lora_kernel_b": (None, None)}


@pytest.mark.sharding
@pytest.mark.training
def test_float8_fit_equals_one_device():
    """float8 training: losses, kernels, and every scale and amax history
    equal one device's. Keras' float8 Dense passes its bias through
    bfloat16, so the bias's gradient is rounded to bfloat16 (8 bits): a sum
    over rows taken in another order (on a mesh) may round to the
    neighbouring value, 2**-8 apart, and Adam (lr 1e-2) moves a bias by up
    to lr x that relative change a step; biases are compared to that."""
    x, y = data()

    def run(layout_map):
        def body():
            model = mlp()
            model.quantize("float8")
            model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
            return model
        if layout_map is None:
            model = body()
        else:
            with layout_map.scope():
                model = body()
        history = model.fit(x, y, batch_size=8, epochs=2, shuffle=False,
                            verbose=0).history
        return history, {v.path: keras.ops.convert_to_numpy(v)
                         for v in model.weights}

    ref_history, ref_weights = one_device("float8 fit", lambda: run(None))
    history, weights = run(klm_rules())
    np.testing.assert_allclose(history["loss"], ref_history["loss"], rtol=1e-5)
    histories = [p for p in ref_weights if "amax_history" in p]
    assert len(histories) == 9 and ref_weights["d1/inputs_amax_history"].any()
    for path, value in ref_weights.items():
        rtol, atol = (1e-2, 2e-4) if path.endswith("/bias") else (1e-5, 1e-6)
        np.testing.assert_allclose(weights[path], value, rtol=rtol, atol=atol,
                                   err_msg=path)


# -- keras-hub ----------------------------------------------------------------

GEMMA = dict(vocabulary_size=64, num_layers=1, num_query_heads=4,
             num_key_value_heads=2, hidden_dim=16, intermediate_dim=32,
             head_dim=8)

# keras-hub's int8 recipe as its guide writes it, run by the test in this
# process (with the plugin) and in a fresh one without it: `run(devices)`
# returns the generated token ids, the prompts and each weight's split.
RECIPE = f"""
import keras
import keras_hub
import numpy as np

GEMMA = {GEMMA!r}


def prompts(rows):
    rng = np.random.default_rng(1)
    lengths = 3 + np.arange(rows) % 5
    mask = np.arange(12)[None, :] < lengths[:, None]
    ids = rng.integers(1, 64, size=(rows, 12))
    return {{"token_ids": np.where(mask, ids, 0).astype("int32"),
             "padding_mask": mask}}


def causal_lm():
    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.GemmaBackbone(**GEMMA)
    return keras_hub.models.GemmaCausalLM(backbone=backbone, preprocessor=None)


def generate(lm, rows):
    lm.quantize("int8")
    lm.compile(sampler="greedy")
    x = prompts(rows)
    out = lm.generate(x, stop_token_ids=None)["token_ids"]
    return x, np.asarray(keras.ops.convert_to_numpy(out))


def run(devices, spec_of):
    mesh = keras.distribution.DeviceMesh(
        (devices // 2, 2), ("batch", "model"),
        devices=keras.distribution.list_devices())
    layout_map = keras_hub.models.GemmaBackbone.get_layout_map(mesh)
    distribution = keras.distribution.ModelParallel(
        layout_map=layout_map, batch_dim_name="batch")
    with distribution.scope():
        lm = causal_lm()
        x, ids = generate(lm, devices)
    return x, ids, {{v.path: spec_of(v) for v in lm.weights}}
"""

PLAIN_KERAS = """
import json, os, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
assert "keras_layoutmap" not in sys.modules
exec(compile(open(sys.argv[1]).read(), "recipe", "exec"))
spec_of = lambda v: [s if isinstance(s, (str, type(None))) else list(s)
                     for s in v.value.sharding.spec]
x, ids, specs = run(8, spec_of)
assert "keras_layoutmap" not in sys.modules
json.dump({"ids": ids.tolist(), "specs": specs}, open(sys.argv[2], "w"))
"""


def recipe_namespace():
    pytest.importorskip("keras_hub", reason="the `nlp` extra")
    namespace = {}
    exec(compile(RECIPE, "recipe", "exec"), namespace)
    return namespace


def plain_keras(tmp_path):
    """The recipe in plain Keras on JAX: a fresh process that never imports
    keras_layoutmap (which patches Keras when imported)."""
    (tmp_path / "recipe.py").write_text(RECIPE)
    (tmp_path / "plain.py").write_text(PLAIN_KERAS)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("KLM_", "WORLD_SIZE", "RANK", "LOCAL_"))}
    env.update(KERAS_BACKEND="jax", JAX_PLATFORMS="cpu")
    done = subprocess.run(
        [sys.executable, str(tmp_path / "plain.py"), str(tmp_path / "recipe.py"),
         str(tmp_path / "plain.json")],
        capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads((tmp_path / "plain.json").read_text())


@pytest.mark.sharding
def test_keras_hub_int8_recipe(tmp_path):
    """keras-hub's GemmaCausalLM.quantize("int8") under
    GemmaBackbone.get_layout_map with Keras' ModelParallel: greedy
    generate() gives one device's token ids, prompts intact, with every
    kernel where the recipe's rules put it and each kernel_scale following
    its kernel's split; on JAX, the same ids and kernel splits as plain
    Keras without the plugin."""
    recipe = recipe_namespace()

    def reference():
        x, ids = recipe["generate"](recipe["causal_lm"](), DEVICES)
        return ids

    expected = one_device("gemma int8", reference)
    x, ids, held = recipe["run"](DEVICES, specs)
    mask = x["padding_mask"]
    np.testing.assert_array_equal(np.where(mask, ids, 0), x["token_ids"])
    assert (ids[~mask] != 0).any()
    np.testing.assert_array_equal(ids, expected)
    block = "decoder_block_0/"
    assert held["token_embedding/embeddings"] == ("model", "batch")
    assert held["token_embedding/embeddings_scale"] == ("model",)
    assert held[block + "ffw_gating/kernel"] == ("batch", "model")
    assert held[block + "ffw_gating/kernel_scale"] == (None, None, "model")
    assert held[block + "attention/query/kernel"] == ("model", "batch", None)
    # (1, 1, heads, head_dim): the heads are the kernel's split dimension 0
    assert held[block + "attention/query/kernel_scale"] == (
        None, None, "model", None)
    if BACKEND != "jax" or SPANS_PROCESSES or DEVICES != 8:
        return  # plain Keras places weights on JAX only
    plain = plain_keras(tmp_path)
    np.testing.assert_array_equal(np.asarray(plain["ids"]), ids)
    for path, spec in plain["specs"].items():
        if "scale" not in path:  # plain Keras replicates the scales
            assert tuple(spec) == held[path], path


# -- rules alone: no devices --------------------------------------------------


def test_int4_packed_axis_a_mesh_axis_does_not_divide_is_a_clear_error():
    """int4 stores Dense(6)'s kernel as (4, 3): rule (None, "model") on a
    2-wide model axis cannot split 3 columns. The error names the weight,
    the rule, the axis and the sizes; a divisible width is fine."""
    mesh_ = fake_mesh([("batch", 4), ("model", 2)])
    layout_map = klm.LayoutMap(mesh_)
    layout_map["d.kernel"] = (None, "model")
    layer = keras.layers.Dense(6, name="d")
    layer.build((None, 4))
    with pytest.raises(ValueError) as e:
        resolve_weight(layer, "kernel", (4, 3), "d.kernel", "d/kernel",
                       layout_map, mesh_)
    message = str(e.value)
    for part in ("'d.kernel'", "int4", "rule 'd.kernel'", "'model'",
                 "(size 2)", "does not divide 3", "(4, 3)", "(4, 6)"):
        assert part in message, (part, message)
    wide = keras.layers.Dense(8, name="d")
    wide.build((None, 4))
    _, layout = resolve_weight(wide, "kernel", (4, 4), "d.kernel", "d/kernel",
                               layout_map, mesh_)
    assert layout.sharding_specs == [klm.UNSHARDED, "model"]


def test_explain_lists_added_variables_with_the_kernel_they_follow():
    """explain() names, for every variable quantization added, the kernel it
    follows, counts it at its stored dtype (int8: 1 byte), and strict mode
    treats a scale as placed by its kernel's rule."""
    mesh_ = fake_mesh([("batch", 4), ("model", 2)])
    layout_map = klm.LayoutMap(mesh_, strict=True)
    layout_map["d1.kernel"] = (None, "model")
    layout_map["d2.kernel"] = ("model", None)
    model = mlp()
    model.quantize("int8")
    report = layout_map.explain(model)
    rows = {r.path: r for r in report.rows}
    scale = rows["d1/kernel_scale"]
    assert scale.follows == "d1.kernel" and scale.rule == "d1.kernel"
    assert scale.layout.sharding_specs == ["model"]
    assert rows["d1/kernel"].follows is None
    assert rows["d1/kernel"].bytes_per_device == 16 * 32 // 2  # int8, halved
    assert rows["d3/kernel_scale"].follows == "d3.kernel"
    assert rows["d3/kernel_scale"].rule is None
    text = report.render(width=200)
    assert "follows d1.kernel" in text
    assert report.to_dict()["weights"][1]["follows"] in (None, "d1.kernel")
    assert not report.findings
