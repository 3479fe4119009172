"""Common Keras layers beyond Dense train on a mesh as on one device:
convolutions and pooling, recurrent layers, embeddings, normalization and
attention, through `fit`, model parallel (each model's natural split of its
kernels over `model`, on a mesh that splits the batch too) and, where
TensorFlow refuses that for a layer, data parallel, on handwritten digits
with a short last batch."""

import keras
import numpy as np
import pytest
from helpers import (
    DEVICES,
    FIT_PLANS,
    assert_same_history,
    digits_data,
    dp_mesh,
    mp_mesh,
)

import keras_layoutmap as klm
from keras_layoutmap import backends

pytestmark = [pytest.mark.sharding, pytest.mark.training]

TF = backends.name() == "tensorflow"
# What TensorFlow's DTensor cannot run, and the error that says so:
# (model, distribution or None for both) -> message.
TF_REFUSES = {
    ("conv", "model_parallel"): "Filter for convolution must have fully "
                                "replicated layout",
    ("tokens", "model_parallel"): "Filter for convolution must have fully "
                                  "replicated layout",
    ("lstm", "model_parallel"): "Spliting over sharded dimension is not "
                                "supported",  # the gates' split, sic
    ("gru", None): r"no layout rule for the op 'tf.ReverseV2' \(tf.reverse: "
                   "Keras' recurrent layers with go_backwards=True",
}

ROWS, BATCH = 280, 64  # the last batch of an epoch holds 24


@pytest.fixture(scope="module")
def digits():
    return digits_data(ROWS)


def conv():
    """8x8 images: two convolutions, pooling, a dense head."""
    inputs = keras.Input((8, 8, 1))
    h = keras.layers.Conv2D(8, 3, padding="same", activation="relu", name="c1")(inputs)
    h = keras.layers.MaxPooling2D(name="pool")(h)
    h = keras.layers.Conv2D(8, 3, padding="same", activation="relu", name="c2")(h)
    h = keras.layers.GlobalAveragePooling2D()(h)
    rules = {r"c\d\.kernel": (None, None, None, "model"), r"c\d\.bias": ("model",)}
    return inputs, h, rules


def lstm(unroll=TF):
    """Each image as a sequence of 8 rows of 8 pixels (unrolled on
    TensorFlow, whose DTensor cannot run the loop: see below)."""
    inputs = keras.Input((8, 8))
    h = keras.layers.LSTM(16, unroll=unroll, name="lstm")(inputs)
    rules = {r"lstm\.cell\.(kernel|recurrent_kernel)": (None, "model"),
             r"lstm\.cell\.bias": ("model",)}
    return inputs, h, rules


def gru():
    """A bidirectional GRU over the rows, its states pooled."""
    inputs = keras.Input((8, 8))
    h = keras.layers.Bidirectional(
        keras.layers.GRU(8, return_sequences=True), name="bi")(inputs)
    h = keras.layers.GlobalAveragePooling1D()(h)
    rules = {r"bi\..*\.kernel": (None, "model")}
    return inputs, h, rules


def tokens():
    """The 64 pixel values (0-16) as tokens: an embedding, a 1-D
    convolution, layer normalization, average pooling. (Not max pooling:
    identical windows of tokens tie, TensorFlow splits a tied maximum's
    gradient otherwise on a mesh than on one device, and its Adam, which
    squares an embedding's gradient occurrence by occurrence, sees that.)"""
    inputs = keras.Input((64,), dtype="int32")
    # 18 rows (ids 0-16 and one unused): the model axis splits them in 2.
    h = keras.layers.Embedding(18, 8, name="embed")(inputs)
    h = keras.layers.Conv1D(8, 3, activation="relu", name="c1")(h)
    h = keras.layers.LayerNormalization(name="norm")(h)
    h = keras.layers.GlobalAveragePooling1D()(h)
    rules = {r"embed\.embeddings": (None, "model"),
             r"c1\.kernel": (None, None, "model"), r"c1\.bias": ("model",)}
    return inputs, h, rules


def attention():
    """Self-attention over the 8 rows of each image, heads split."""
    inputs = keras.Input((8, 8))
    # No biases: the key's has a gradient of exactly 0 (it adds the same
    # number to every key's score), so only rounding noise moves it, and
    # Adam scales that noise up to whole steps.
    h = keras.layers.MultiHeadAttention(2, 4, use_bias=False, name="mha")(
        inputs, inputs)
    h = keras.layers.GlobalAveragePooling1D()(h)
    # Keras 3 variable paths (`mha/query/kernel`), as Keras' own layout
    # maps name them; the object paths are `mha._query_dense.kernel`.
    rules = {"mha/(query|key|value)/kernel": (None, "model", None),
             "mha/attention_output/kernel": ("model", None, None)}
    return inputs, h, rules


MODELS = {f.__name__: f for f in (conv, lstm, gru, tokens, attention)}


def data_for(kind, x):
    """The digits as `kind`'s model reads them."""
    if kind == "conv":
        return x.reshape(-1, 8, 8, 1)
    if kind == "tokens":
        return np.rint(x * 16).astype("int32")
    return x.reshape(-1, 8, 8)


def build(kind, x, optimizer=None, **kwargs):
    keras.utils.set_random_seed(0)
    inputs, hidden, rules = MODELS[kind](**kwargs)
    data = data_for(kind, x)
    outputs = keras.layers.Dense(10, name="head")(hidden)
    model = keras.Model(inputs, outputs)
    model.compile(optimizer=optimizer or keras.optimizers.Adam(0.01),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    return model, rules, data


def on_mesh(kind, distribution, x, rules=None, **kwargs):
    """The model built under `distribution` (model parallel: `rules`, by
    default its own, every one matching and splitting a weight)."""
    if distribution == "data_parallel":
        with klm.DataParallel(dp_mesh()).scope():
            return build(kind, x, **kwargs)[0]
    rules = rules or build(kind, x, **kwargs)[1]
    layout_map = klm.LayoutMap(mp_mesh(), strict=True)
    for pattern, axes in rules.items():
        layout_map[pattern] = axes
    with layout_map.scope():
        model = build(kind, x, **kwargs)[0]
    split = [w for w in model.weights
             if not klm.fetch_layout(w).is_fully_replicated()]
    assert len(split) >= len(rules)
    return model


def fit(model, data, y):
    """One epoch: 5 steps, the last short. (torch pays for each step on the
    mesh, its ops run one by one: with two epochs this file took 45 s in 4
    processes, the GRU 16.6 s; with one 40.5 s and 13.2 s, 2026-11-27. JAX
    and TensorFlow pay for compiling.)"""
    return model.fit(data, y, batch_size=BATCH, epochs=1, shuffle=False,
                     verbose=0).history


_ONE_DEVICE = {}  # kind -> (history, weights, predictions), once per process


def one_device(kind, x, y):
    """`kind` trained on one device: the reference of both its plans."""
    if kind not in _ONE_DEVICE:
        klm.set_distribution(None)
        reference, _, data = build(kind, x)
        history = fit(reference, data, y)
        _ONE_DEVICE[kind] = (history, reference.get_weights(),
                             reference.predict(data[:40], verbose=0))
    return _ONE_DEVICE[kind]


def plans(kind):
    """The plans `kind` trains in: `FIT_PLANS` (model parallel), and data
    parallel too where TensorFlow refuses the model-parallel plan, so that
    each layer trains on a mesh there."""
    refused = TF and (kind, "model_parallel") in TF_REFUSES
    return FIT_PLANS + (("data_parallel",) if refused else ())


@pytest.mark.parametrize("kind, distribution", [
    (kind, plan) for kind in sorted(MODELS) for plan in plans(kind)])
def test_fit_matches_one_device(digits, kind, distribution):
    x, y = digits
    model = on_mesh(kind, distribution, x)
    data = data_for(kind, x)
    refused = TF_REFUSES.get((kind, distribution)) or TF_REFUSES.get((kind, None))
    if TF and refused:
        with pytest.raises(ValueError, match=refused):
            fit(model, data, y)
        return
    ref_history, ref_weights, ref_predictions = one_device(kind, x, y)
    history = fit(model, data, y)
    assert_same(model, ref_weights, history, ref_history)
    np.testing.assert_allclose(model.predict(data[:40], verbose=0),
                               ref_predictions, rtol=1e-5, atol=1e-5)


def assert_same(model, ref_weights, history, ref_history):
    assert_same_history(history, ref_history, same_keys=False)
    for weight, a, b in zip(model.weights, model.get_weights(), ref_weights):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5, err_msg=weight.path)


@pytest.mark.parametrize("distribution", ["data_parallel", "model_parallel"])
def test_embedding_with_sparse_updates(digits, distribution):
    """SGD adds an embedding's gradient row by row (on TensorFlow a
    `tf.IndexedSlices`, added by `scatter_sub`, which DTensor has no rule
    for: keras-layoutmap adds it dense on a mesh), to an embedding held
    whole on every device (data parallel) or split (model parallel)."""
    x, y = digits

    def sgd():
        return keras.optimizers.SGD(0.1)

    reference, _, data = build("tokens", x, optimizer=sgd())
    ref_history = fit(reference, data, y)
    model = on_mesh("tokens", distribution, x, optimizer=sgd(),
                    rules={r"embed\.embeddings": ("model", None)})
    assert_same(model, reference.get_weights(), fit(model, data, y), ref_history)


@pytest.mark.skipif(not TF, reason="the loop DTensor cannot run is "
                    "TensorFlow's; JAX and torch run the LSTM as it is")
def test_a_recurrent_loop_on_tensorflow_says_to_unroll(digits):
    x, y = digits
    with klm.DataParallel(dp_mesh()).scope():
        model, _, data = build("lstm", x, unroll=False)
    with pytest.raises(ValueError, match=r"no layout rule for the op "
                       r"'tf\.\w*TensorList\w*' \(a tf.while_loop over a "
                       r"TensorArray.*build them with unroll=True\)"):
        fit(model, data, y)


def test_convolution_with_the_batch_on_the_second_mesh_axis(digits):
    """Whole conv kernels on a mesh whose second axis splits the batch (a
    dense kernel split over the first keeps the step on DTensors): their
    gradients are summed over the batch axis, whichever it is."""
    x, y = digits
    data = data_for("conv", x)
    mesh = klm.create_mesh([("model", 2), ("batch", DEVICES // 2)])
    layout_map = klm.LayoutMap(mesh, strict=True)
    layout_map[r"head\.kernel"] = ("model", None)
    with klm.ModelParallel(layout_map=layout_map, batch_dim_name="batch").scope():
        model, _, _ = build("conv", x)
    assert klm.fetch_layout(model.get_layer("c1").kernel).is_fully_replicated()
    if TF:
        with pytest.raises(ValueError, match="only supports batch parallel layouts"):
            fit(model, data, y)
        return
    ref_history, ref_weights, _ = one_device("conv", x, y)
    assert_same(model, ref_weights, fit(model, data, y), ref_history)


def test_convolution_of_an_input_split_over_space():
    """A convolution of an image split over its rows (spatial parallel):
    each output pixel needs its neighbours across the split, and gets them
    (torch computes it on the gathered input; before, DTensor's rule gave
    the output a wrong shape. TensorFlow too, eagerly: before, DTensor
    refused it, "Halo exchange is only supported on TPU")."""
    def conv():
        keras.utils.set_random_seed(0)
        layer = keras.layers.Conv2D(4, 3, padding="same")
        layer.build((None, 8, 8, 3))
        return layer

    x = np.random.default_rng(0).random((DEVICES, 8, 8, 3)).astype("float32")
    expected = keras.ops.convert_to_numpy(conv()(x))
    mesh = mp_mesh("space")
    with klm.DataParallel(mesh).scope():
        layer = conv()
    split = klm.distribute(x, klm.Layout(["batch", "space", None, None], mesh))
    # On TensorFlow, called eagerly: DTensor's halo exchange exists on TPUs
    # only, so the convolution runs on the gathered input
    # (`backends/tensorflow/eager_ops.py`).
    out = layer(split)
    np.testing.assert_allclose(keras.ops.convert_to_numpy(out), expected,
                               rtol=1e-5, atol=1e-6)
