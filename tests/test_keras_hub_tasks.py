"""keras-hub task models under Keras' own `ModelParallel` with a backbone's
`get_layout_map` (keras-hub's distributed-tuning recipe, unchanged but for
`import keras_layoutmap`): `CausalLM.fit`, `generate()` greedy and seeded,
LoRA, `save_to_preset`/`from_preset`, each equal to one device, with the
layouts read back from the backend."""

import keras
import numpy as np
import pytest
from helpers import BACKEND, DEVICES

import keras_layoutmap as klm

pytestmark = [pytest.mark.sharding, pytest.mark.training]

keras_hub = pytest.importorskip("keras_hub")

VOCAB = 64
# Tiny configs: (backbone, causal LM, config). Head counts that the (batch,
# model) mesh divides: the recipes shard heads over "model" and the hidden
# dimension over "batch".
ARCHS = {
    "gemma": ("GemmaBackbone", "GemmaCausalLM", dict(
        vocabulary_size=VOCAB, num_layers=1, num_query_heads=4,
        num_key_value_heads=2, hidden_dim=16, intermediate_dim=32,
        head_dim=8)),
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
    mask = np.zeros((rows, LENGTH), bool)
    mask[:, :PROMPT] = True
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


def assert_held_as_rules_say(distribution, backbone):
    """Every weight a rule names holds that layout on the backend, and the
    recipe shards something in every block."""
    sharded = 0
    for variable in backbone.weights:
        expected = distribution.get_variable_layout(variable)
        actual = klm.fetch_layout(variable)
        assert tuple(actual.axes) == tuple(expected.axes), variable.path
        sharded += not actual.is_fully_replicated()
    assert sharded >= 8


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


def one_device(arch):
    lm = build(arch)
    history = fit(lm)
    greedy = generate(lm, "greedy")
    top_k = generate(lm, keras_hub.samplers.TopKSampler(k=4, seed=7))
    return lm, history, greedy, top_k


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_fit_and_generate_equal_one_device(arch, no_distribution):
    """`fit`, then `generate()` greedy (ids identical) and with a seeded
    top-k sampler (ids identical; on TensorFlow a clear error: DTensor has
    no rule for the categorical draw), under the recipe's `ModelParallel`."""
    reference, ref_history, ref_greedy, ref_top_k = one_device(arch)
    distribution = keras_model_parallel(arch)
    with distribution.scope():
        lm = build(arch)
        assert_held_as_rules_say(distribution, lm.backbone)
        history = fit(lm)
        assert_held_as_rules_say(distribution, lm.backbone)
        greedy = generate(lm, "greedy")
        if BACKEND == "tensorflow":
            # DTensor has no rule for the draw's op: a clear error.
            with pytest.raises(ValueError, match="StatelessMultinomial.*greedy"):
                generate(lm, keras_hub.samplers.TopKSampler(k=4, seed=7))
            top_k = ref_top_k
        else:
            top_k = generate(lm, keras_hub.samplers.TopKSampler(k=4, seed=7))
    np.testing.assert_allclose(history["loss"], ref_history["loss"], rtol=1e-4)
    assert_equal(weights(lm), weights(reference))
    np.testing.assert_array_equal(greedy, ref_greedy)
    np.testing.assert_array_equal(top_k, ref_top_k)
    assert (greedy[:, PROMPT:] != 0).any()  # it generated


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_generate_a_batch_the_batch_axis_does_not_divide(arch, no_distribution):
    """Three prompts on a batch axis of 2 (torch) or 4: computed whole on
    every device, the ids identical to one device's."""
    expected = generate(build(arch), "greedy", rows=3)
    with keras_model_parallel(arch).scope():
        lm = build(arch)
        got = generate(lm, "greedy", rows=3)
    np.testing.assert_array_equal(got, expected)
    assert (got[:, PROMPT:] != 0).any()  # it generated


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_lora_fit_equal_one_device(arch, no_distribution):
    """`backbone.enable_lora(rank)` then `fit`: the frozen weights are
    bit-identical to before, the LoRA weights equal one device's."""
    reference = build(arch)
    reference.backbone.enable_lora(2)
    fit(reference)
    ref_lora = {v.path: np.asarray(v) for v in reference.trainable_weights}
    with keras_model_parallel(arch).scope():
        lm = build(arch)
        frozen_before = weights(lm)
        lm.backbone.enable_lora(2)
        fit(lm)
    trained = {v.path: keras.ops.convert_to_numpy(v) for v in lm.trainable_weights}
    assert sum("lora" in path for path in trained) >= 4
    assert_equal(trained, ref_lora)
    after = weights(lm)
    frozen = [path for path in frozen_before if path not in trained]
    assert len(frozen) >= 4
    for path in frozen:
        np.testing.assert_array_equal(after[path], frozen_before[path],
                                      err_msg=path)


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_preset_round_trip_lands_sharded(arch, tmp_path, no_distribution):
    """`save_to_preset` under the distribution, then `from_preset` of that
    folder under it: the weights land as the rules say, values exact."""
    distribution = keras_model_parallel(arch)
    backbone_cls = getattr(keras_hub.models, ARCHS[arch][0])
    with distribution.scope():
        saved = build(arch).backbone
        expected = weights(saved)
        saved.save_to_preset(str(tmp_path / "preset"))
        loaded = backbone_cls.from_preset(str(tmp_path / "preset"))
        assert_held_as_rules_say(distribution, loaded)
    actual = weights(loaded)
    assert sorted(actual) == sorted(expected)
    for path, value in expected.items():
        np.testing.assert_array_equal(actual[path], value, err_msg=path)


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
