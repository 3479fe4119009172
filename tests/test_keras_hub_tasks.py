"""keras-hub task models other than Gemma under Keras' own `ModelParallel`
with their backbone's `get_layout_map` (keras-hub's distributed-tuning
recipe, unchanged but for `import keras_layoutmap`): `CausalLM.fit` equal
to one device, and (Llama) greedy `generate()`, then the same in int8,
then LoRA and `fit` in int8; int4's layouts; the layouts read back from
the backend. Gemma's recipe (fit,
greedy and seeded generate of prompts of mixed lengths, an indivisible
batch, LoRA, presets, int8) is in the workflow matrix (test_workflows.py),
in every cell; here, the other architectures' rules, and the docs'
recipe."""

import keras
import numpy as np
import pytest
from helpers import DEVICES, assert_held_as_rules_say

import keras_layoutmap as klm

pytestmark = [pytest.mark.sharding, pytest.mark.training]

keras_hub = pytest.importorskip("keras_hub")

VOCAB = 64
# Tiny configs: (backbone, causal LM, config). Head counts that the (batch,
# model) mesh divides: the recipes shard heads over "model" and the hidden
# dimension over "batch".
ARCHS = {
    "llama": ("LlamaBackbone", "LlamaCausalLM", dict(
        vocabulary_size=VOCAB, num_layers=1, num_query_heads=4,
        num_key_value_heads=4, hidden_dim=16, intermediate_dim=32)),
    "qwen": ("QwenBackbone", "QwenCausalLM", dict(
        vocabulary_size=VOCAB, num_layers=1, num_query_heads=4,
        num_key_value_heads=4, hidden_dim=16, intermediate_dim=32)),
}
BATCH = 8  # prompts and training rows: the batch axis divides it
LENGTH = 8
PROMPT = 3


def keras_model_parallel(arch):
    """keras-hub's recipe: Keras' mesh, the backbone's rules, Keras' class."""
    backbone_cls = getattr(keras_hub.models, ARCHS[arch][0])
    mesh = keras.distribution.DeviceMesh(
        (DEVICES // 2, 2), ("batch", "model"),
        devices=keras.distribution.list_devices())
    layout_map = backbone_cls.get_layout_map(mesh)
    return keras.distribution.ModelParallel(layout_map=layout_map,
                                            batch_dim_name="batch")


def build(arch):
    backbone_name, lm_name, config = ARCHS[arch]
    keras.utils.set_random_seed(0)
    backbone = getattr(keras_hub.models, backbone_name)(**config)
    lm = getattr(keras_hub.models, lm_name)(backbone=backbone,
                                             preprocessor=None)
    lm.compile(optimizer=keras.optimizers.Adam(1e-2),
               loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
               sampler="greedy")
    return lm


def train_data():
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, VOCAB, size=(2 * BATCH, LENGTH + 1)).astype("int32")
    x = {"token_ids": tokens[:, :-1],
         "padding_mask": np.ones((2 * BATCH, LENGTH), "int32")}
    return x, tokens[:, 1:]


def prompts(rows=BATCH):
    rng = np.random.default_rng(1)
    tokens = rng.integers(1, VOCAB, size=(rows, LENGTH)).astype("int32")
    mask = np.arange(LENGTH)[None, :] < (PROMPT + np.arange(rows) % 4)[:, None]
    return {"token_ids": np.where(mask, tokens, 0), "padding_mask": mask}


def _pipeline_loader():
    """keras-hub's `CausalLM.fit` batches numpy with grain or tf.data; a
    session with neither (tests-jax, tests-torch install no TensorFlow)
    runs Keras' own `Model.fit`, the same train step: with
    `preprocessor=None` the pipeline only batches."""
    import importlib.util

    return any(importlib.util.find_spec(name) for name in ("grain", "tensorflow"))


def fit(lm):
    x, y = train_data()
    run = lm.fit if _pipeline_loader() else lambda *a, **k: keras.Model.fit(lm, *a, **k)
    return run(x, y, batch_size=BATCH, epochs=1, shuffle=False,
               verbose=0).history


def generate(lm, sampler, rows=BATCH):
    lm.compile(sampler=sampler)
    out = lm.generate(prompts(rows), stop_token_ids=None)
    return np.asarray(out["token_ids"])


def weights(model):
    return {v.path: np.asarray(keras.ops.convert_to_numpy(v)) for v in model.weights}



def assert_equal(actual, expected, rtol=1e-4, atol=1e-5):
    assert sorted(actual) == sorted(expected)
    for path in expected:
        np.testing.assert_allclose(actual[path], expected[path], rtol=rtol,
                                   atol=atol, err_msg=path)


@pytest.fixture
def no_distribution():
    keras.distribution.set_distribution(None)
    yield
    keras.distribution.set_distribution(None)


# Architectures whose recipe also runs greedy `generate()` here (Gemma's:
# the matrix's hub-generate-* rows, in every cell). Qwen's generate runs
# the same CausalLM loop over its own attention and cache: its recipe's
# rules are checked by `fit` and the layouts read back.
GENERATES = ("llama",)


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_fit_and_generate_equal_one_device(arch, no_distribution):
    """`fit`, then (`GENERATES`) greedy `generate()` of prompts of mixed
    lengths (ids identical, prompts intact), under the recipe's
    `ModelParallel`."""
    reference = build(arch)
    ref_history = fit(reference)
    distribution = keras_model_parallel(arch)
    with distribution.scope():
        lm = build(arch)
        assert_held_as_rules_say(distribution, lm.backbone, 8)
        history = fit(lm)
        assert_held_as_rules_say(distribution, lm.backbone, 8)
    np.testing.assert_allclose(history["loss"], ref_history["loss"], rtol=1e-4)
    assert_equal(weights(lm), weights(reference))
    if arch not in GENERATES:
        return
    ref_greedy = generate(reference, "greedy")
    with distribution.scope():
        greedy = generate(lm, "greedy")
    np.testing.assert_array_equal(greedy, ref_greedy)
    mask = prompts()["padding_mask"]
    np.testing.assert_array_equal(np.where(mask, greedy, 0),
                                  prompts()["token_ids"])
    assert (greedy[~mask] != 0).any()  # it generated
    if arch in QUANTIZED:
        assert_int8_generate_and_lora_fit_equal_one_device(distribution, lm, reference)


# Architectures whose recipe also runs quantized (Gemma's: the matrix's
# hub-quantized row, all three modes in one model).
QUANTIZED = ("llama",)


def assert_int8_generate_and_lora_fit_equal_one_device(distribution, lm, reference):
    """The trained model quantized to int8 on the mesh (as on one device):
    greedy ids identical, each int8 kernel where the recipe's rule puts it,
    each scale split as its kernel's split dimension; then LoRA of rank 2
    on its query and value projections and `fit` again: equal to one
    device, the int8 kernels bit-identical before and after."""
    reference.quantize("int8")
    with distribution.scope():
        lm.quantize("int8")
        ids = generate(lm, "greedy")
    np.testing.assert_array_equal(ids, generate(reference, "greedy"))
    kernels = [v for v in lm.weights if str(v.dtype) == "int8"]
    assert len(kernels) >= 7
    for v in kernels:
        assert tuple(klm.fetch_layout(v).axes) == tuple(
            distribution.get_variable_layout(v).axes), v.path
    # the query kernel (hidden, heads, head_dim) is split (model, batch,
    # None): its (1, 1, heads, head_dim) scale follows the heads
    scale = next(v for v in lm.weights
                 if v.path.endswith("query/kernel_scale"))
    assert tuple(klm.fetch_layout(scale).axes) == (None, None, "batch", None)
    # Tuned in int8 with LoRA, compiled outside the scope (the model was
    # placed: its `fit` runs on the mesh).
    frozen = {p: w for p, w in weights(lm).items() if w.dtype == np.int8}
    for model in (lm, reference):
        keras.utils.set_random_seed(1)  # the same LoRA draws for both
        model.backbone.enable_lora(2)
        model.compile(
            optimizer=keras.optimizers.Adam(1e-2),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    history, expected = fit(lm), fit(reference)
    np.testing.assert_allclose(history["loss"], expected["loss"], rtol=1e-4)
    assert_equal(weights(lm), weights(reference))
    for path, before in frozen.items():
        np.testing.assert_array_equal(weights(lm)[path], before, path)
    assert sum("lora" in v.path for v in lm.trainable_weights) == 4


def quantized_llama(distribution, mode):
    """A fresh Llama quantized to `mode` through its backbone
    (`Backbone.quantize`; Gemma's rows call `CausalLM.quantize`), in
    `distribution`'s scope."""
    with distribution.scope():
        lm = build("llama")
        lm.backbone.quantize(mode)
    return lm


def test_llama_int4_layouts(no_distribution):
    """Llama under its recipe quantized to int4: each packed int4 kernel
    where the rule puts it where its packed size allows, read from the
    backend. (Generating with int4 kernels on the mesh, ids identical to one
    device: the matrix's hub-quantized row, under Gemma's recipe, in
    every cell. float8 keeps its kernels in float, where the recipe's rules
    put them as they put any kernel: the same row.)"""
    distribution = keras_model_parallel("llama")
    lm = quantized_llama(distribution, "int4")
    # the gate kernel (hidden, intermediate): (batch, model)
    gate = next(v for v in lm.weights
                if v.path.endswith("feedforward_gate_dense/kernel"))
    assert str(gate.dtype) == "int8"
    assert tuple(klm.fetch_layout(gate).axes) == ("batch", "model")


def test_docs_recipe_runs(no_distribution):
    """docs/keras-distribution.md's keras-hub recipe, as it stands."""
    import pathlib
    import re

    page = pathlib.Path(__file__).parent.parent / "docs" / "keras-distribution.md"
    (code,) = re.findall(r"## The keras-hub recipe.*?```python\n(.*?)```",
                         page.read_text(), re.S)
    scope = {}
    exec(compile(code, str(page), "exec"), scope)
    backbone = scope["gemma_lm"].backbone
    query = backbone.get_layer("decoder_block_0").attention.query_dense.kernel
    assert tuple(klm.fetch_layout(query).axes) == ("model", "batch", None)
    ids = np.asarray(scope["output"]["token_ids"])
    assert ids.shape == (8, 8) and (ids[:, :3] == [5, 9, 2]).all()
