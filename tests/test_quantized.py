"""Quantized models: what the workflow matrix does not run in every cell.
The matrix (tests/workflows.py: quantized-lora-fit, quantized-float8-fit,
hub-quantized) runs int8, int4 and float8 under
a plan on every backend, one process and several, against one device.
Here: keras-hub's int8 recipe under the plugin gives what plain Keras gives
without it (JAX, where plain Keras places weights), and the rules alone
(int4's packed axis, explain) on a mesh of named devices.
"""

import json
import os
import subprocess
import sys

import keras
import numpy as np
import pytest
from helpers import BACKEND, DEVICES, SPANS_PROCESSES, fake_mesh, quantized_mlp

import keras_layoutmap as klm
from keras_layoutmap.rules.resolve import resolve_weight

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
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")  # nox's level
                           + " --xla_force_host_platform_device_count=8")
assert "keras_layoutmap" not in sys.modules
exec(compile(open(sys.argv[1]).read(), "recipe", "exec"))
spec_of = lambda v: [s if isinstance(s, (str, type(None))) else list(s)
                     for s in v.value.sharding.spec]
x, ids, specs = run(8, spec_of)
assert "keras_layoutmap" not in sys.modules
json.dump({"ids": ids.tolist(), "specs": specs}, open(sys.argv[2], "w"))
"""


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


@pytest.mark.skipif(
    BACKEND != "jax" or SPANS_PROCESSES or DEVICES != 8,
    reason="plain Keras places weights on JAX only, in one process here "
    "(the matrix's hub-quantized row checks every other cell against "
    "one device)")
def test_keras_hub_int8_recipe_gives_what_plain_keras_gives(tmp_path):
    """keras-hub's GemmaCausalLM.quantize("int8") under
    GemmaBackbone.get_layout_map with Keras' ModelParallel (it worked in
    plain Keras before the plugin handled quantized weights, and broke
    when the plugin was imported): greedy generate() gives the same token
    ids as plain Keras without the plugin, prompts intact, and every
    kernel where plain Keras puts it (plain Keras replicates the scales;
    the plugin splits them with their kernels)."""
    pytest.importorskip("keras_hub", reason="the `nlp` extra")
    recipe = {}
    exec(compile(RECIPE, "recipe", "exec"), recipe)

    def held(variable):
        return [s if s not in (None, klm.UNSHARDED) else None
                for s in klm.fetch_layout(variable).sharding_specs]

    x, ids, specs = recipe["run"](DEVICES, held)
    mask = x["padding_mask"]
    np.testing.assert_array_equal(np.where(mask, ids, 0), x["token_ids"])
    assert (ids[~mask] != 0).any()
    plain = plain_keras(tmp_path)
    np.testing.assert_array_equal(np.asarray(plain["ids"]), ids)
    kernels = [path for path in plain["specs"] if "scale" not in path]
    assert len(kernels) >= 8
    for path in kernels:
        assert plain["specs"][path] == specs[path], path
    assert specs["token_embedding/embeddings_scale"] == ["model"]


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
    model = quantized_mlp()
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


@pytest.mark.parametrize("name", ["kernel_zero", "zero_point"])
def test_int4_zero_points_follow_the_kernel_under_either_name(name):
    """int4's zero points, (1, units) beside a kernel split by columns:
    Keras 3.15 names them `kernel_zero`, keras-nightly `zero_point`. Both
    take the kernel's split of the units (TensorFlow gathers them by group
    into the kernel's layout, and refuses replicated ones)."""
    mesh_ = fake_mesh([("batch", 4), ("model", 2)])
    layout_map = klm.LayoutMap(mesh_)
    layout_map["d.kernel"] = (None, "model")
    layer = keras.layers.Dense(32, name="d")
    layer.build((None, 16))
    rule, layout = resolve_weight(layer, name, (1, 32), f"d.{name}",
                                  f"d/{name}", layout_map, mesh_)
    assert rule == "d.kernel"
    assert layout.sharding_specs == [klm.UNSHARDED, "model"]
