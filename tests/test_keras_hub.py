"""A keras-hub backbone trains model-parallel under its own layout rules."""

import pytest
from helpers import (
    assert_same_history,
    assert_same_weights,
    gemma_data,
    gemma_lm,
    mp_mesh,
)

import keras_layoutmap as klm

pytestmark = [pytest.mark.sharding, pytest.mark.training]

def assert_backend_holds(report, model):
    """Every weight has the layout explain reports, read from the backend."""
    weights = {v.path: v for v in model.weights}
    assert sorted(weights) == sorted(r.path for r in report.rows)
    for row in report.rows:
        assert klm.fetch_layout(weights[row.path]) == row.layout, row.path


def test_gemma_model_parallel_parity():
    x, y = gemma_data()
    reference = gemma_lm()
    # 36 rows: 5 steps, the last a short batch of 4 (one epoch: the
    # keras-hub task tests train Gemma, Llama and Qwen for longer)
    ref_history = reference.fit(x, y, batch_size=8, epochs=1, shuffle=False,
                                verbose=0).history

    import keras_hub

    mesh = mp_mesh()
    keras_map = keras_hub.models.GemmaBackbone.get_layout_map(mesh)
    layout_map = klm.LayoutMap.from_keras(keras_map)
    with layout_map.scope():
        model = gemma_lm()
    report = layout_map.explain(model)
    sharded = [r for r in report.rows if not r.layout.is_fully_replicated()]
    assert len(sharded) >= 8  # embeddings, attention and MLP kernels
    assert_backend_holds(report, model)
    history = model.fit(x, y, batch_size=8, epochs=1, shuffle=False,
                        verbose=0).history
    assert_backend_holds(report, model)  # training relaid out nothing
    optimizer = model.optimizer
    slots = {v.path: v for v in optimizer.variables}
    for weight in model.trainable_weights:  # Adam's m and v, like the weight
        for kind in ("momentum", "velocity"):
            slot = slots[f"{optimizer.name}/{weight.path.replace('/', '_')}_{kind}"]
            assert klm.fetch_layout(slot) == klm.fetch_layout(weight), slot.path

    assert_same_history(history, ref_history, rtol=1e-4, same_keys=False)
    assert_same_weights(model.get_weights(), reference.get_weights(), rtol=1e-4,
                        atol=1e-5)
    embeddings = model.backbone.token_embedding.embeddings
    actual = klm.fetch_layout(embeddings)
    row = next(r for r in report.rows if r.path == embeddings.path)
    assert actual == row.layout and not actual.is_fully_replicated()
    shard = klm.unpack(embeddings)[0].shape
    assert shard == actual.shard_shape(embeddings.shape)
