"""TensorFlow: layers whose ops DTensor computed wrongly, or refused, for
the layouts a plan gives them, against one device.

- DTensor's relayout that moves a mesh axis from one dimension of a tensor
  of rank 4 or more to another (its all-to-all) put values in the wrong
  places, eagerly and inside a step, where DTensor inserts it between ops
  itself: a `BatchNormalization` over images whose channels are split
  over `model` (the bias of the `Dense` before it), read by a head whose
  rows are split over `model`, trained to other weights than one device
  (the loss 10 % off after 2 epochs), silently. klm turns the all-to-all
  off (`DTENSOR_USE_ALL_TO_ALL_RELAYOUT=0`, backends/tensorflow/
  relayouts.py).
- A plain eager tensor a layer holds (`Normalization(mean=...,
  variance=...)`) was captured by the step as a plain input, which DTensor
  refused ("got a regular tensor for input 2 ... but was expecting a
  DTensor") under every plan: it is read from its copy on the mesh.
"""

import itertools
import os

import keras
import numpy as np
import pytest
import tensorflow as tf
from helpers import BACKEND, DEVICES, assert_same_weights, mp_mesh
from tensorflow.experimental import dtensor

import keras_layoutmap as klm

pytestmark = [
    pytest.mark.sharding,
    pytest.mark.training,
    pytest.mark.skipif(BACKEND != "tensorflow", reason="TensorFlow backend only"),
]

RELAYOUT = "DTENSOR_USE_ALL_TO_ALL_RELAYOUT"


def _dlayout(layout):
    from keras_layoutmap.backends.tensorflow.placement import to_dlayout
    return to_dlayout(layout)


def _host(x):
    return keras.ops.convert_to_numpy(x)


# -- relayouts that move a mesh axis between dimensions -------------------------


@pytest.mark.parametrize("rank", [4, 5])
def test_an_axis_moved_between_dimensions_keeps_every_value(rank):
    mesh = mp_mesh()
    shape = (2, 4, 2, 4, 2)[:rank]
    x = np.arange(np.prod(shape), dtype="float32").reshape(shape)
    move = tf.function(dtensor.relayout)
    for source, target in itertools.permutations(range(1, rank), 2):
        if shape[source] % 2 or shape[target] % 2:
            continue
        specs = [None] * rank
        specs[source] = "model"
        before = klm.distribute(x, klm.Layout(specs, mesh))
        specs = [None] * rank
        specs[target] = "model"
        layout = _dlayout(klm.Layout(specs, mesh))
        np.testing.assert_array_equal(
            _host(dtensor.relayout(before, layout)), x,
            err_msg=f"eager, dimension {source} to {target}")
        np.testing.assert_array_equal(
            _host(move(before, layout)), x,
            err_msg=f"tf.function, dimension {source} to {target}")


def test_all_to_all_relayouts_chosen_by_the_user_are_warned(monkeypatch):
    from keras_layoutmap.backends.tensorflow import relayouts
    monkeypatch.setenv(RELAYOUT, "1")
    with pytest.warns(RuntimeWarning, match=f"{RELAYOUT}=1.*wrong places"):
        relayouts.install()
    assert os.environ[RELAYOUT] == "1"  # the user's choice stands
    monkeypatch.setenv(RELAYOUT, "false")
    relayouts.install()  # no warning: off


# -- BatchNormalization over images --------------------------------------------

ROWS, BATCH = 20, 8  # batches of 8, 8 and 4 rows


def _images_model():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4, 4, 3))
    x = keras.layers.Dense(4, name="pre")(inputs)  # on each pixel
    x = keras.layers.BatchNormalization(name="bn")(x)
    x = keras.layers.Flatten()(x)
    outputs = keras.layers.Dense(2, name="head")(x)
    model = keras.Model(inputs, outputs)
    model.compile(keras.optimizers.SGD(0.1), "mse")
    return model


def _images():
    rng = np.random.default_rng(0)
    return (rng.normal(size=(ROWS, 4, 4, 3)).astype("float32"),
            rng.normal(size=(ROWS, 2)).astype("float32"))


def _fit(model, x, y, weights):
    model.set_weights(weights)
    history = model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False,
                        verbose=0)
    return (history.history["loss"], model.get_weights(),
            model.predict(x, batch_size=BATCH, verbose=0))


def _assert_same(got, reference):
    np.testing.assert_allclose(got[0], reference[0], rtol=1e-5)
    assert_same_weights(got[1], reference[1])
    np.testing.assert_allclose(got[2], reference[2], rtol=1e-5, atol=1e-5)


def test_batch_normalization_over_split_channels_equals_one_device():
    mesh = mp_mesh()
    x, y = _images()
    reference_model = _images_model()
    initial = reference_model.get_weights()
    reference = _fit(reference_model, x, y, initial)

    layout_map = klm.LayoutMap(mesh)
    layout_map["pre.bias"] = ("model",)  # the channels BN normalizes
    layout_map["head.kernel"] = ("model", None)  # the flattened pixels
    with layout_map.scope():
        model = _images_model()

    # One step's gradients, then 2 epochs of fit.
    def gradients(model, images):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(model(images, training=True) * [1.0, 2.0])
        return tape.gradient(loss, model.trainable_variables)

    model.set_weights(initial)
    reference_model.set_weights(initial)
    packed = klm.distribute(x[:BATCH], klm.Layout.batch_sharded(mesh, "batch", 4))
    got = tf.function(gradients)(model, packed)
    want = tf.function(gradients)(reference_model, tf.constant(x[:BATCH]))
    for variable, a, b in zip(model.trainable_variables, got, want):
        np.testing.assert_allclose(_host(a), _host(b), rtol=1e-4, atol=1e-4,
                                   err_msg=variable.path)
    _assert_same(_fit(model, x, y, initial), reference)


# -- a layer's constants -------------------------------------------------------


def _normalized_model():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((6,))
    x = keras.layers.Normalization(mean=np.arange(6.0),
                                   variance=np.arange(1.0, 7.0))(inputs)
    x = keras.layers.Dense(4, name="pre")(x)
    outputs = keras.layers.Dense(2, name="head")(x)
    model = keras.Model(inputs, outputs)
    model.compile(keras.optimizers.SGD(0.1), "mse")
    return model


@pytest.mark.parametrize("plan", ["data_parallel", "model_parallel", "auto"])
def test_normalization_with_fixed_statistics_equals_one_device(plan):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(ROWS, 6)).astype("float32") * 3 + 2
    y = rng.normal(size=(ROWS, 2)).astype("float32")
    reference_model = _normalized_model()
    initial = reference_model.get_weights()
    reference = _fit(reference_model, x, y, initial)
    mesh = mp_mesh()
    if plan == "data_parallel":
        scope = klm.DataParallel(
            device_mesh=klm.create_mesh([("batch", DEVICES)])).scope()
    elif plan == "model_parallel":
        layout_map = klm.LayoutMap(mesh)
        layout_map["pre.kernel"] = (None, "model")
        layout_map["head.kernel"] = ("model", None)
        scope = layout_map.scope()
    else:
        scope = klm.auto_layout_map(_normalized_model, mesh).scope()
    with scope:
        model = _normalized_model()
    _assert_same(_fit(model, x, y, initial), reference)


def test_a_layers_constant_in_a_tf_function_of_ones_own():
    """The DTensor tutorial's loop: the model called in a `tf.function` on
    packed inputs, outside `fit`."""
    mesh = mp_mesh()
    x = np.random.default_rng(0).normal(size=(8, 6)).astype("float32")
    reference_model = _normalized_model()
    layout_map = klm.LayoutMap(mesh)
    layout_map["pre.kernel"] = (None, "model")
    with layout_map.scope():
        model = _normalized_model()
    model.set_weights(reference_model.get_weights())
    packed = klm.distribute(x, klm.Layout.batch_sharded(mesh, "batch", 2))
    got = tf.function(lambda t: model(t, training=True))(packed)
    np.testing.assert_allclose(_host(got), reference_model(x), rtol=1e-5,
                               atol=1e-6)
