"""keras-hub's `CausalLM.generate()` under `ModelParallel` on a mesh
(the KV cache update on DTensors, `backends/torch/cache_updates.py`): the
token ids are those of the same model on one device."""

import keras
import numpy as np
import pytest
from helpers import BACKEND, mp_mesh

import keras_layoutmap as klm

pytestmark = [
    pytest.mark.sharding, pytest.mark.training,
    pytest.mark.skipif(BACKEND != "torch", reason="the torch KV cache path; "
                       "JAX and TensorFlow generate are tested elsewhere"),
]

TINY_GEMMA = dict(vocabulary_size=64, num_layers=2, num_query_heads=4,
                  num_key_value_heads=2, hidden_dim=16, intermediate_dim=32,
                  head_dim=8)
PROMPT, MAX_LENGTH = 5, 10


def prompts():
    rng = np.random.default_rng(0)
    ids = np.zeros((4, MAX_LENGTH), "int32")
    ids[:, :PROMPT] = rng.integers(1, 64, (4, PROMPT))
    mask = np.zeros((4, MAX_LENGTH), "int32")
    mask[:, :PROMPT] = 1
    return {"token_ids": ids, "padding_mask": mask}


def build(sampler):
    import keras_hub  # the `nlp` extra

    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.GemmaBackbone(**TINY_GEMMA)
    lm = keras_hub.models.GemmaCausalLM(backbone=backbone, preprocessor=None)
    lm.compile(sampler=sampler)
    return lm


def samplers():
    import keras_hub

    return {"greedy": lambda: "greedy",
            "top_k": lambda: keras_hub.samplers.TopKSampler(k=8, seed=1234)}


def generate(lm):
    out = lm.generate(prompts(), max_length=MAX_LENGTH, stop_token_ids=None)
    return np.asarray(out["token_ids"])


@pytest.mark.parametrize("sampler", ["greedy", "top_k"])
def test_gemma_generate_model_parallel_equals_one_device(sampler):
    import keras_hub

    make = samplers()[sampler]
    expected = generate(build(make()))
    mesh = mp_mesh()
    layout_map = klm.LayoutMap.from_keras(
        keras_hub.models.GemmaBackbone.get_layout_map(mesh))
    with klm.ModelParallel(layout_map=layout_map).scope():
        lm = build(make())
        got = generate(lm)
    embeddings = lm.backbone.token_embedding.embeddings
    assert not klm.fetch_layout(embeddings).is_fully_replicated()
    np.testing.assert_array_equal(got[:, :PROMPT], prompts()["token_ids"][:, :PROMPT])
    np.testing.assert_array_equal(got, expected)


TINY_LLAMA = dict(vocabulary_size=64, num_layers=2, num_query_heads=4,
                  num_key_value_heads=2, hidden_dim=16, intermediate_dim=32)


def test_llama_greedy_generate_model_parallel_equals_one_device():
    import keras_hub

    def build_llama():
        keras.utils.set_random_seed(0)
        backbone = keras_hub.models.LlamaBackbone(**TINY_LLAMA)
        lm = keras_hub.models.LlamaCausalLM(backbone=backbone, preprocessor=None)
        lm.compile(sampler="greedy")
        return lm

    expected = generate(build_llama())
    layout_map = klm.LayoutMap.from_keras(
        keras_hub.models.LlamaBackbone.get_layout_map(mp_mesh()))
    with klm.ModelParallel(layout_map=layout_map).scope():
        lm = build_llama()
        got = generate(lm)
    embeddings = lm.backbone.token_embedding.embeddings
    assert not klm.fetch_layout(embeddings).is_fully_replicated()
    np.testing.assert_array_equal(got, expected)
