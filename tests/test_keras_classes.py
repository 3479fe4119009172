"""Code written for Keras' own `keras.distribution` (the Keras distribution
guide), unchanged but for `import keras_layoutmap`, runs on every backend as
the klm classes do: exact short batches, rules with Keras' meaning, layouts
read back from the backend, numbers equal to one device."""

import keras
import numpy as np
import pytest
from helpers import DEVICES
from sklearn.datasets import load_digits

import keras_layoutmap as klm

EPOCHS = 2
BATCH = 128  # 1797 * 0.8 -> 1437 training rows: the last batch holds 29


@pytest.fixture(scope="module")
def digits():
    x, y = load_digits(return_X_y=True)
    return (x / 16.0).astype("float32"), y.astype("int32")


def build():
    keras.utils.set_random_seed(0)
    return keras.Sequential([
        keras.Input((64,)),
        keras.layers.Dense(64, activation="relu", name="d1"),
        keras.layers.Dense(10, name="d2"),
    ])


def train(model, digits):
    x, y = digits
    model.compile(
        optimizer=keras.optimizers.Adam(0.01),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    history = model.fit(x, y, batch_size=BATCH, epochs=EPOCHS,
                        validation_split=0.2, shuffle=False, verbose=0)
    return history.history, [np.asarray(w) for w in model.get_weights()]


@pytest.fixture(scope="module")
def single(digits):
    return train(build(), digits)


def assert_same(result, single):
    history, weights = result
    for key in single[0]:
        np.testing.assert_allclose(history[key], single[0][key], rtol=1e-5,
                                   err_msg=key)
    for a, b in zip(weights, single[1]):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=2e-6)


def keras_mesh(shape, names):
    """The guide's `keras.distribution.DeviceMesh` over every device."""
    return keras.distribution.DeviceMesh(
        shape, names, devices=keras.distribution.list_devices())


@pytest.fixture
def no_distribution():
    yield
    keras.distribution.set_distribution(None)


@pytest.mark.sharding
@pytest.mark.training
def test_keras_data_parallel_set_globally(digits, single, no_distribution):
    """The guide's data parallel: `set_distribution` of Keras' class, then
    `fit` whose last batch (29 rows) the batch axis does not divide."""
    mesh = keras_mesh((DEVICES,), ["batch"])
    keras.distribution.set_distribution(
        keras.distribution.DataParallel(device_mesh=mesh))
    assert isinstance(keras.distribution.distribution(), klm.DataParallel)
    model = build()
    assert klm.fetch_layout(model.layers[0].kernel).mesh.size == DEVICES
    assert_same(train(model, digits), single)


@pytest.mark.sharding
@pytest.mark.training
def test_keras_model_parallel_scope_keeps_keras_rule_meaning(digits, single):
    """The guide's model parallel: a Keras `LayoutMap` whose keys match
    anywhere in a weight's path (`d1/kernel` in `sequential/d1/kernel`),
    used with `with distribution.scope():`."""
    mesh = keras_mesh((DEVICES // 2, 2), ["batch", "model"])
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map["d1/kernel"] = (None, "model")
    layout_map["d1/bias"] = ("model",)
    layout_map["d2/kernel"] = ("model", None)
    distribution = keras.distribution.ModelParallel(
        layout_map=layout_map, batch_dim_name="batch")
    with distribution.scope():
        model = build()
        assert model.layers[0].kernel.path.endswith("/d1/kernel")
        assert isinstance(keras.distribution.distribution(), klm.ModelParallel)
    # read from the backend, not from the rules
    assert klm.fetch_layout(model.layers[0].kernel).sharding_specs == [
        "unsharded", "model"]
    assert klm.fetch_layout(model.layers[0].bias).sharding_specs == ["model"]
    assert klm.fetch_layout(model.layers[1].kernel).sharding_specs == [
        "model", "unsharded"]
    # the model remembers it: fit outside the scope
    assert_same(train(model, digits), single)


def test_a_keras_distribution_converts_once():
    mesh = keras.distribution.DeviceMesh(
        (1,), ["batch"], devices=klm.list_devices()[:1])
    distribution = keras.distribution.DataParallel(device_mesh=mesh)
    with distribution.scope():
        first = keras.distribution.distribution()
    with distribution.scope():
        assert keras.distribution.distribution() is first
    assert keras.distribution.distribution() is None


@pytest.mark.parametrize("value", ["dp", 3, keras.distribution.LayoutMap])
def test_set_distribution_of_something_else_is_a_type_error(value):
    with pytest.raises(TypeError, match="take a Keras distribution"):
        keras.distribution.set_distribution(value)
    with pytest.raises(TypeError, match="take a Keras distribution"):
        klm.set_distribution(value)
    assert keras.distribution.distribution() is None


@pytest.mark.sharding
@pytest.mark.training
def test_docs_keras_guide_runs(no_distribution):
    """docs/keras-distribution.md's Keras guide block, as it stands: both
    models train, and the backend holds d1's kernel split over `model` as
    the guide's rule says (the guide's d1 has no bias: its bias rule
    matches nothing)."""
    import pathlib
    import re

    page = pathlib.Path(__file__).parent.parent / "docs" / "keras-distribution.md"
    (code,) = re.findall(r"## The Keras distribution guide.*?```python\n(.*?)```",
                         page.read_text(), re.S)
    scope = {}
    exec(compile(code, str(page), "exec"), scope)
    model = scope["model"]
    d1 = model.get_layer("d1")
    assert klm.fetch_layout(d1.kernel).sharding_specs == ["unsharded", "model"]
    assert klm.fetch_layout(model.get_layer("d2").kernel).sharding_specs == [
        "unsharded", "unsharded"]
    assert isinstance(keras.distribution.distribution(), klm.ModelParallel)
    history = model.history.history["loss"]
    assert len(history) == 3 and np.isfinite(history).all()
