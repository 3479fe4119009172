"""A keras-hub backbone trains model-parallel under its own layout rules."""

import keras
import numpy as np
import pytest
from helpers import mp_mesh

import keras_layoutmap as klm

pytestmark = [pytest.mark.sharding, pytest.mark.training]

TINY_GEMMA = dict(vocabulary_size=64, num_layers=2, num_query_heads=4,
                  num_key_value_heads=2, hidden_dim=16, intermediate_dim=32,
                  head_dim=8)


def build_lm():
    """A causal LM head on the backbone, as a plain Functional model (the
    keras-hub task class would need a data loader for its preprocessing)."""
    import keras_hub  # the `nlp` extra; tests-jax installs it

    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.GemmaBackbone(**TINY_GEMMA)
    inputs = {
        "token_ids": keras.Input((None,), dtype="int32", name="token_ids"),
        "padding_mask": keras.Input((None,), dtype="int32", name="padding_mask"),
    }
    hidden = backbone(inputs)
    logits = backbone.token_embedding(hidden, reverse=True)
    model = keras.Model(inputs, logits, name="gemma_lm")
    model.backbone = backbone
    model.compile(optimizer=keras.optimizers.Adam(1e-2),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    return model


def data():
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, 64, size=(36, 9)).astype("int32")
    x = {"token_ids": tokens[:, :-1], "padding_mask": np.ones((36, 8), "int32")}
    return x, tokens[:, 1:]


def assert_backend_holds(report, model):
    """Every weight has the layout explain reports, read from the backend."""
    weights = {v.path: v for v in model.weights}
    assert sorted(weights) == sorted(r.path for r in report.rows)
    for row in report.rows:
        assert klm.fetch_layout(weights[row.path]) == row.layout, row.path


def test_gemma_model_parallel_parity():
    x, y = data()
    reference = build_lm()
    ref_history = reference.fit(x, y, batch_size=8, epochs=2, shuffle=False,
                                verbose=0).history  # 36 rows: a short batch of 4

    import keras_hub

    mesh = mp_mesh()
    keras_map = keras_hub.models.GemmaBackbone.get_layout_map(mesh)
    layout_map = klm.LayoutMap.from_keras(keras_map)
    with layout_map.scope():
        model = build_lm()
    report = layout_map.explain(model)
    sharded = [r for r in report.rows if not r.layout.is_fully_replicated()]
    assert len(sharded) >= 8  # embeddings, attention and MLP kernels
    assert_backend_holds(report, model)
    history = model.fit(x, y, batch_size=8, epochs=2, shuffle=False,
                        verbose=0).history
    assert_backend_holds(report, model)  # training relaid out nothing
    optimizer = model.optimizer
    slots = {v.path: v for v in optimizer.variables}
    for weight in model.trainable_weights:  # Adam's m and v, like the weight
        for kind in ("momentum", "velocity"):
            slot = slots[f"{optimizer.name}/{weight.path.replace('/', '_')}_{kind}"]
            assert klm.fetch_layout(slot) == klm.fetch_layout(weight), slot.path

    for key in ref_history:
        np.testing.assert_allclose(history[key], ref_history[key], rtol=1e-4,
                                   err_msg=key)
    for a, b in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    embeddings = model.backbone.token_embedding.embeddings
    actual = klm.fetch_layout(embeddings)
    row = next(r for r in report.rows if r.path == embeddings.path)
    assert actual == row.layout and not actual.is_fully_replicated()
    shard = klm.unpack(embeddings)[0].shape
    assert shard == actual.shard_shape(embeddings.shape)
