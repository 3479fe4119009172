"""Small crashes: `set_distribution` / `scope` of something that is not a
distribution is a TypeError naming it, with nothing changed; empty data under
a distribution ends as it does on one device (the same error type, or none),
on every backend."""

import keras
import numpy as np
import pytest
from helpers import dp_mesh
from keras.src.distribution import distribution_lib

import keras_layoutmap as klm


def one_device():
    return klm.DataParallel(klm.create_mesh(
        [("batch", 1)], devices=klm.list_devices()[:1]))


SETTERS = {
    "klm.set_distribution": lambda v: klm.set_distribution(v),
    "keras.distribution.set_distribution":
        lambda v: keras.distribution.set_distribution(v),
    "distribution_lib.set_distribution":
        lambda v: distribution_lib.set_distribution(v),
}


@pytest.mark.parametrize("setter", list(SETTERS))
def test_set_distribution_of_a_string_is_a_type_error(setter):
    before = one_device()
    klm.set_distribution(before)
    with pytest.raises(TypeError, match=r"take a Keras distribution .* or None\. "
                       r"Received: 'dp' of type str"):
        SETTERS[setter]("dp")
    assert klm.distribution() is before  # nothing changed
    # The next build works (it used to die with "'str' object has no
    # attribute 'get_variable_layout'").
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    assert len(model.weights) == 2
    SETTERS[setter](None)
    assert klm.distribution() is None


def test_set_distribution_of_a_layout_map_says_what_to_pass():
    layout_map = klm.LayoutMap(one_device().device_mesh)
    with pytest.raises(TypeError, match=r"Received: LayoutMap\(.*\) of type "
                       r"LayoutMap\. To apply a LayoutMap, pass "
                       r"`layout_map.distribution\(\)`"):
        keras.distribution.set_distribution(layout_map)
    assert klm.distribution() is None
    klm.set_distribution(layout_map.distribution())  # what it says works
    assert klm.distribution().layout_map is layout_map


def test_scope_of_what_is_not_a_distribution_is_a_type_error():
    with pytest.raises(TypeError, match=r"Received: 'dp' of type str"):
        with keras.distribution.DataParallel.scope("dp"):
            pass
    assert klm.distribution() is None
    with pytest.raises(TypeError, match=r"Received: 'dp' of type str"):
        klm.layout_map_scope("dp")
    with one_device().scope():  # a distribution still enters and leaves
        assert klm.distribution() is not None
    assert klm.distribution() is None


# -- empty data -----------------------------------------------------------

def _model(built):
    layers = [keras.layers.Dense(2, name="d")]
    model = keras.Sequential(([keras.Input((3,))] if built else []) + layers)
    model.compile(optimizer="sgd", loss="mse")
    return model


def _data(kind):
    x, y = np.zeros((0, 3), "float32"), np.zeros((0, 2), "float32")
    if kind == "numpy":
        return (x, y), {"batch_size": 4}
    tf = pytest.importorskip("tensorflow", reason="tf.data needs TensorFlow")
    return (tf.data.Dataset.from_tensor_slices((x, y)).batch(4),), {}


def _outcome(method, kind, built, dist):
    """The error type `model.<method>` raises on empty data (None: none),
    and the model (to look at afterwards)."""
    args, kwargs = _data(kind)
    if method == "predict":
        args = args if kind != "numpy" else args[:1]
    klm.set_distribution(dist)
    try:
        model = _model(built)
        try:
            getattr(model, method)(*args, verbose=0, **kwargs)
            return None, model
        except Exception as error:  # noqa: BLE001 - its type is the point
            return type(error), model
    finally:
        klm.set_distribution(None)


@pytest.mark.training
@pytest.mark.parametrize("built", [True, False], ids=["built", "unbuilt"])
@pytest.mark.parametrize("kind", ["numpy", "tf.data"])
@pytest.mark.parametrize("method", ["fit", "evaluate", "predict"])
def test_empty_data_under_data_parallel_ends_as_on_one_device(
        method, kind, built):
    single, _ = _outcome(method, kind, built, None)
    keras.backend.clear_session()
    parallel, model = _outcome(method, kind, built, klm.DataParallel(dp_mesh()))
    assert parallel is single, (
        f"{method} on empty {kind}: one device -> {single}, DataParallel -> "
        f"{parallel}")
    # Nothing trained.
    if model.optimizer.built:
        assert int(model.optimizer.iterations) == 0
