"""keras-hub's `CausalLM.generate()` on torch with prompts of different
lengths, split over the batch axis: the sampler starts at the shortest
prompt (`ops.min` over rows, a pending reduction on a DTensor) and indexes
with it; every process must read the whole minimum
(`backends/torch/scalar_reads.py`). Here: the scalar reads themselves, and
generate with stop tokens (the loop's condition is such a read); the
workflow matrix's hub-generate-greedy and hub-generate-data-parallel rows
check mixed lengths under keras-hub's recipe and `DataParallel`. And
the weights split over the prompts' rows, gathered once per call
(`backends/torch/decoding.py`)."""

import keras
import numpy as np
import pytest
from helpers import (
    BACKEND,
    DEVICES,
    counted_collectives,
    dp_mesh,
    keras_mesh,
    mp_mesh,
)

import keras_layoutmap as klm

pytestmark = [
    pytest.mark.sharding, pytest.mark.training,
    pytest.mark.skipif(BACKEND != "torch", reason="the torch DTensor path; "
                       "JAX and TensorFlow generate are tested elsewhere"),
]

TINY_GEMMA = dict(vocabulary_size=64, num_layers=1, num_query_heads=4,
                  num_key_value_heads=2, hidden_dim=16, intermediate_dim=32,
                  head_dim=8)
MAX_LENGTH = 12


def prompts(rows):
    """`rows` prompts of 3, 4, ... tokens, right-padded with zeros."""
    rng = np.random.default_rng(0)
    ids = np.zeros((rows, MAX_LENGTH), "int32")
    mask = np.zeros((rows, MAX_LENGTH), "bool")
    for row in range(rows):
        length = 3 + row % (MAX_LENGTH - 4)
        ids[row, :length] = rng.integers(1, 64, length)
        mask[row, :length] = True
    return {"token_ids": ids, "padding_mask": mask}


def build():
    import keras_hub  # the `nlp` extra

    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.GemmaBackbone(**TINY_GEMMA)
    lm = keras_hub.models.GemmaCausalLM(backbone=backbone, preprocessor=None)
    lm.compile(sampler="greedy")
    return lm


def generate(lm, inputs, stop_token_ids=None):
    out = lm.generate(dict(inputs), max_length=MAX_LENGTH,
                      stop_token_ids=stop_token_ids)
    return np.asarray(out["token_ids"])


def assert_equals_one_device(distribution, rows, stop_token_ids=None):
    inputs = prompts(rows)
    expected = generate(build(), inputs, stop_token_ids)
    with distribution.scope():
        got = generate(build(), inputs, stop_token_ids)
    mask = inputs["padding_mask"]
    np.testing.assert_array_equal(np.where(mask, got, 0), inputs["token_ids"])
    np.testing.assert_array_equal(got, expected)


def recipe():
    """keras-hub's own recipe: Keras' classes, `get_layout_map`."""
    import keras_hub

    mesh = keras_mesh(mp_mesh())
    return keras.distribution.ModelParallel(
        layout_map=keras_hub.models.GemmaBackbone.get_layout_map(mesh),
        batch_dim_name="batch")


def test_a_number_read_from_a_pending_reduction_is_the_whole_value():
    """`ops.min` over rows split over `batch` leaves a pending reduction;
    `int`, `bool`, `float` and indexing with it read the whole minimum on
    every process, not the minimum of the process's own rows."""
    rows = np.arange(3, 3 + DEVICES, dtype="int32")[:, None] * np.ones(
        (1, 2), "int32")
    x = klm.distribute(rows, klm.Layout.batch_sharded(dp_mesh(), "batch", 2))
    low = keras.ops.min(x)
    assert int(low) == 3 and float(low) == 3.0
    assert bool(low - 3) is False
    assert int(keras.ops.max(x)) == 2 + DEVICES
    table = keras.ops.convert_to_tensor(np.arange(10, 20, dtype="int32"))
    assert int(table[low]) == 13


@pytest.mark.parametrize("cache_axes, update_axes, start, expected", [
    # A whole cache (`ops.zeros`) takes the keys' split of the batch and
    # the heads at its first update, with no gather of the keys.
    ((None, None, None, None), ("batch", None, "model", None), (0, 1, 0, 0),
     ["batch", "unsharded", "model", "unsharded"]),
    # A cache split over the batch adds the keys' split of the heads.
    (("batch", None, None, None), ("batch", None, "model", None),
     (0, 2, 0, 0), ["batch", "unsharded", "model", "unsharded"]),
    # A dimension written in part (the rows from 1) is whole.
    (("batch", None, None, None), (None, None, "model", None), (1, 1, 0, 0),
     ["unsharded", "unsharded", "model", "unsharded"]),
])
def test_a_cache_takes_the_split_of_the_keys_written_whole_into_it(
        cache_axes, update_axes, start, expected):
    """`ops.slice_update` on DTensors (keras-hub's KV cache): the values
    equal numpy's, and the result is split where the cache or the update
    splits a dimension the update covers whole (read from the backend)."""
    mesh = mp_mesh()
    rows = mesh.shape[0] * 2
    rng = np.random.default_rng(0)
    cache = rng.normal(size=(rows, 6, 2, 3)).astype("float32")
    update = rng.normal(size=(rows - start[0], 2, 2, 3)).astype("float32")
    got = keras.ops.slice_update(
        klm.distribute(cache, klm.Layout(cache_axes, mesh)), start,
        klm.distribute(update, klm.Layout(update_axes, mesh)))
    want = cache.copy()
    want[start[0]:, start[1]:start[1] + 2] = update
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(got), want)
    assert klm.fetch_layout(got).sharding_specs == expected


def test_mixed_prompt_lengths_stop_tokens_equals_one_device():
    """With stop tokens the loop's condition is read from a reduction over
    the batch too: every process must stop at the same step."""
    # 8 prompts of 12 tokens: the shapes of the matrix's generate rows,
    # whose DTensor sharding plans torch then finds cached in this process
    # (planning a new shape is most of a first call's time).
    inputs = prompts(8)
    stop = (int(generate(build(), inputs)[0, 5]),)  # row 0 stops early
    assert_equals_one_device(recipe(), rows=8, stop_token_ids=stop)


@pytest.mark.parametrize("memory", ["enough", "short"])
def test_weights_split_over_the_rows_are_gathered_once_per_call(
        monkeypatch, memory):
    """Under `klm.fsdp`, `generate()` gathers each split weight once per
    call (one all-gather each, however many tokens it generates), where
    every process's free memory holds them; where one's does not, each
    weight is gathered where read, at every token. Either way the ids are
    one device's, and the variables hold their own pieces after the call,
    as they did before it (read from the backend), also after a call that
    raised."""
    from keras_layoutmap.backends.torch import decoding

    if memory == "short":
        monkeypatch.setattr(decoding, "free_bytes",
                            lambda device_type: 0 if klm.process_index() else None)
    short = prompts(8)
    long = dict(short, padding_mask=np.ones_like(short["padding_mask"]))
    long["padding_mask"][:, 8:] = False  # 8-token prompts: 4 new tokens
    long["token_ids"] = np.where(long["padding_mask"], 7, 0).astype("int32")
    expected = [generate(build(), x) for x in (short, long)]
    plan = klm.fsdp(mp_mesh(), axis="batch", min_bytes=0)
    with plan.scope():
        lm = build()
    values = [v._value for v in lm.weights]
    layouts = [klm.fetch_layout(v).sharding_specs for v in lm.weights]
    split = sum("batch" in axes for axes in layouts)
    assert split > 4
    gathers = []
    for x, want in zip((short, long), expected):
        with counted_collectives() as counts:
            np.testing.assert_array_equal(generate(lm, x), want)
        gathers.append(counts.get("all_gather_into_tensor", 0))
    if memory == "enough":
        assert gathers[0] == gathers[1] >= split, gathers
    else:  # 9 new tokens, then 4: gathers at every token
        assert gathers[0] - gathers[1] >= 5, gathers
    assert all(v._value is value for v, value in zip(lm.weights, values))
    assert [klm.fetch_layout(v).sharding_specs for v in lm.weights] == layouts

    def fails(*args, **kwargs):
        raise RuntimeError("a decoding step failed")

    monkeypatch.setattr(lm, "call_with_cache", fails)  # after the gathers
    with pytest.raises(RuntimeError, match="a decoding step failed"):
        generate(lm, short)
    assert all(v._value is value for v, value in zip(lm.weights, values))
