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
from helpers import BACKEND, DEVICES, assert_same_weights, mp_mesh

import keras_layoutmap as klm

if BACKEND != "tensorflow":  # (tensorflow is not installed beside the others)
    pytest.skip("TensorFlow backend only", allow_module_level=True)

import tensorflow as tf  # noqa: E402
from tensorflow.experimental import dtensor  # noqa: E402

pytestmark = [
    pytest.mark.sharding,
    pytest.mark.training,
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


# -- a Concatenate read by a head split over its rows ---------------------------


def _concatenated_model(axis=-1):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((6,))
    a = keras.layers.Dense(4, name="a")(inputs)
    b = keras.layers.Dense(4, name="b")(inputs)
    x = keras.layers.Concatenate(axis=axis)([a, b])
    outputs = keras.layers.Dense(3, name="head")(x)
    model = keras.Model(inputs, outputs)
    model.compile(keras.optimizers.SGD(0.1), "mse")
    return model


def _column_row_pair(mesh):
    """The auto plan's layouts for `_concatenated_model`: the two Dense
    split over their output columns, the head over its rows."""
    layout_map = klm.LayoutMap(mesh)
    layout_map["a.kernel"] = layout_map["b.kernel"] = (None, "model")
    layout_map["a.bias"] = layout_map["b.bias"] = ("model",)
    layout_map["head.kernel"] = ("model", None)
    return layout_map


@pytest.mark.parametrize("axis", [-1, 1])
def test_a_concatenate_read_by_a_head_split_over_its_rows_equals_one_device(
        axis):
    """DTensor concatenated the devices' own pieces along the split axis
    (axis -1; 1 it refused): the loss 1.82 for 2.65 from the first step."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(ROWS, 6)).astype("float32")
    y = rng.normal(size=(ROWS, 3)).astype("float32")
    reference_model = _concatenated_model(axis)
    initial = reference_model.get_weights()
    reference = _fit(reference_model, x, y, initial)
    with _column_row_pair(mp_mesh()).scope():
        model = _concatenated_model(axis)
    _assert_same(_fit(model, x, y, initial), reference)


def test_a_concatenate_in_a_tf_function_of_ones_own_equals_one_device():
    """The DTensor tutorial's loop: gradients and an update in a
    `tf.function` on packed inputs, outside `fit`."""
    mesh = mp_mesh()
    rng = np.random.default_rng(0)
    x = rng.normal(size=(8, 6)).astype("float32")
    y = rng.normal(size=(8, 3)).astype("float32")
    reference_model = _concatenated_model()
    with _column_row_pair(mesh).scope():
        model = _concatenated_model()
    model.set_weights(reference_model.get_weights())

    def step(model, x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x, training=True) - y))
        gradients = tape.gradient(loss, model.trainable_variables)
        for variable, gradient in zip(model.trainable_variables, gradients):
            variable.assign_sub(0.1 * gradient)
        return loss

    got = tf.function(step)(
        model, klm.distribute(x, klm.Layout.batch_sharded(mesh, "batch", 2)),
        klm.distribute(y, klm.Layout.batch_sharded(mesh, "batch", 2)))
    want = tf.function(step)(reference_model, tf.constant(x), tf.constant(y))
    np.testing.assert_allclose(_host(got), _host(want), rtol=1e-5)
    assert_same_weights(model.get_weights(), reference_model.get_weights())


# -- TimeDistributed and RandomCrop under data parallel -------------------------


def _data_parallel():
    return klm.DataParallel(
        device_mesh=klm.create_mesh([("batch", DEVICES)])).scope()


def _small_model(body, shape):
    keras.utils.set_random_seed(0)
    inputs = keras.Input(shape)
    x = keras.layers.Flatten()(body(inputs))
    outputs = keras.layers.Dense(2, name="head")(x)
    model = keras.Model(inputs, outputs)
    model.compile(keras.optimizers.SGD(0.1), "mse")
    return model


def _time_distributed(x):
    return keras.layers.TimeDistributed(keras.layers.Dense(4), name="td")(x)


def _random_crop(x):
    x = keras.layers.RandomCrop(6, 6, seed=1, name="crop")(x)
    x = keras.layers.Conv2D(4, 1, name="pre")(x)
    return keras.layers.GlobalAveragePooling2D()(x)


@pytest.mark.parametrize("body, shape", [
    # DTensor laid a step `inputs[t]` of (time, batch, 3) out as
    # [unsharded, batch]: "requires dimension 1 to be divisible ... size=3"
    (_time_distributed, (5, 3)),
    # ... and cropped `images[:, h:h + 6, w:w + 6]` empty in the step:
    # "input image must be of non-zero size"
    (_random_crop, (8, 8, 2)),
], ids=["TimeDistributed", "RandomCrop"])
def test_a_layer_whose_slices_dtensor_got_wrong_equals_one_device(body, shape):
    rng = np.random.default_rng(0)
    x = rng.uniform(size=(ROWS, *shape)).astype("float32")
    y = rng.normal(size=(ROWS, 2)).astype("float32")
    reference_model = _small_model(body, shape)
    initial = reference_model.get_weights()
    reference = _fit(reference_model, x, y, initial)
    with _data_parallel():
        model = _small_model(body, shape)
    _assert_same(_fit(model, x, y, initial), reference)


def test_time_distributed_under_the_auto_plan_equals_one_device():
    """The auto plan splits the head's rows over `model`: DTensor's `Pack`
    of the steps refused a result split along the time axis."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(ROWS, 6, 3)).astype("float32")
    y = rng.normal(size=(ROWS, 2)).astype("float32")
    reference_model = _small_model(_time_distributed, (6, 3))
    initial = reference_model.get_weights()
    reference = _fit(reference_model, x, y, initial)
    with klm.auto_layout_map(lambda: _small_model(_time_distributed, (6, 3)),
                             mp_mesh()).scope():
        model = _small_model(_time_distributed, (6, 3))
    _assert_same(_fit(model, x, y, initial), reference)


# -- DTensor's refusals name the Keras layer ------------------------------------


def test_an_op_without_a_layout_rule_names_the_layer_emitting_it():
    def flipped(x):
        x = keras.layers.Dense(4, name="pre")(x)
        return keras.layers.Lambda(lambda t: keras.ops.flip(t, axis=1),
                                   name="flipper")(x)

    rng = np.random.default_rng(0)
    with _data_parallel():
        model = _small_model(flipped, (6,))
    with pytest.raises(ValueError, match=r"'tf\.ReverseV2'.*comes from layer "
                       r"'flipper' \(Lambda\).*JAX or torch"):
        model.fit(rng.normal(size=(16, 6)), rng.normal(size=(16, 2)),
                  batch_size=8, epochs=1, verbose=0)


def test_layouts_dtensor_refuses_name_the_layer_emitting_the_op():
    def convolved(x):
        return keras.layers.Conv2D(4, 3, name="c1")(x)

    layout_map = klm.LayoutMap(mp_mesh())
    layout_map["c1.kernel"] = (None, None, None, "model")
    with layout_map.scope():
        model = _small_model(convolved, (6, 6, 2))
    rng = np.random.default_rng(0)
    with pytest.raises(ValueError, match=r"model '.*' with the layouts.*"
                       r"The op 'tf\.Conv2D\w*' comes from layer 'c1' "
                       r"\(Conv2D.*klm\.DataParallel.*klm\.explain"):
        model.fit(rng.normal(size=(16, 6, 6, 2)), rng.normal(size=(16, 2)),
                  batch_size=8, epochs=1, verbose=0)
