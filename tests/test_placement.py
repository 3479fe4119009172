"""A model moves freely between no distribution, one mesh and another: at
every stage its numbers equal a model that never moved, its variables are
where the active distribution wants them (read from the backend), and a
layout that does not fit moves nothing."""

import keras
import numpy as np
import pytest
from helpers import (
    DEVICES,
    assert_same_history,
    assert_same_weights,
    compile_classifier,
    digits_data,
    dp_mesh,
    mp_mesh,
    net_layout_map,
    sequential_mlp,
)

import keras_layoutmap as klm

pytestmark = [pytest.mark.sharding, pytest.mark.training]

BATCH = 32  # 200 rows: the last batch of an epoch holds 8


@pytest.fixture(scope="module")
def digits():
    return digits_data(200)


def build(width=32):
    return compile_classifier(sequential_mlp(width, 10, name="net"))


def fit(model, data, **kwargs):
    x, y = data
    return model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
                     **kwargs).history


def evaluate(model, data):
    x, y = data
    return model.evaluate(x, y, batch_size=BATCH, verbose=0)


def assert_same(model, reference):
    assert_same_weights(model.get_weights(), reference.get_weights())


def meshes(model):
    """The mesh size of every variable of the model, its metrics and its
    optimizer, read from the backend."""
    state = list(model.variables) + list(model.metrics_variables)
    state += list(model.optimizer.variables)
    return {klm.fetch_layout(v).mesh.size for v in state}


def data_parallel():
    return klm.DataParallel(dp_mesh())


def test_back_to_one_device_after_a_global_distribution_trains(digits):
    # Fault: on TensorFlow the model stopped training (loss 0.0, weights
    # frozen) once evaluate had moved it onto a mesh and the distribution
    # was cleared.
    model, reference = build(), build()
    assert_same_history(fit(model, digits), fit(reference, digits))

    klm.set_distribution(data_parallel())
    np.testing.assert_allclose(evaluate(model, digits), evaluate(reference, digits),
                               rtol=1e-5)
    assert meshes(model) == {DEVICES}
    assert_same_history(fit(model, digits), fit(reference, digits))
    klm.set_distribution(None)

    history = fit(model, digits)
    assert meshes(model) == {1}
    assert history["loss"][0] > 0.01  # it trains (the fault reported 0.0)
    klm.set_distribution(data_parallel())
    assert_same_history(history, fit(reference, digits))
    assert_same(model, reference)
    klm.set_distribution(None)


def test_failed_model_parallel_fit_moves_nothing(digits):
    model, reference = build(width=33), build(width=33)
    assert_same_history(fit(model, digits), fit(reference, digits))
    # d1's kernel has 33 columns: 2 does not divide them.
    layout_map = net_layout_map(mp_mesh(), bias=False)
    klm.set_distribution(klm.ModelParallel(layout_map=layout_map))
    with pytest.raises(ValueError, match=r"d1\.kernel.*size 33.*'model'"):
        fit(model, digits)
    assert meshes(model) == {1}  # nothing half-moved
    klm.set_distribution(None)
    assert_same_history(fit(model, digits), fit(reference, digits))
    assert_same(model, reference)


def test_failed_data_parallel_fit_then_plain_fit(digits):
    x, y = digits
    model, reference = build(), build()
    klm.set_distribution(data_parallel())
    with pytest.raises(ValueError):
        model.fit(x[:, :60], y, batch_size=BATCH, verbose=0)  # wrong width
    klm.set_distribution(None)
    assert_same_history(fit(model, digits), fit(reference, digits))
    assert meshes(model) == {1}
    assert_same(model, reference)


def test_model_moves_from_its_mesh_to_another_and_back(digits):
    # Built model-parallel on mesh B, fit under a data-parallel distribution
    # on mesh A (the global one wins), then outside it: back on B with its
    # rules. Equal to one device throughout.
    mesh_b = mp_mesh()
    layout_map = klm.LayoutMap(mesh_b)
    layout_map[r"d1\.kernel"] = (None, "model")
    with layout_map.scope():
        model = build()
    reference = build()
    kernel = model.layers[0].kernel
    assert klm.fetch_layout(kernel).sharding_specs == ["unsharded", "model"]

    klm.set_distribution(data_parallel())
    history = fit(model, digits)
    layout = klm.fetch_layout(kernel)
    assert layout.mesh == dp_mesh()
    assert layout.sharding_specs == ["unsharded", "unsharded"]
    klm.set_distribution(None)
    assert_same_history(history, fit(reference, digits))

    history = fit(model, digits)  # the model remembers mesh B and its rules
    layout = klm.fetch_layout(kernel)
    assert layout.mesh == mesh_b
    assert layout.sharding_specs == ["unsharded", "model"]
    moment = [v for v in model.optimizer.variables
              if v.shape == kernel.shape][0]  # Adam's slot follows its weight
    assert klm.fetch_layout(moment).sharding_specs == ["unsharded", "model"]
    assert_same_history(history, fit(reference, digits))
    assert_same(model, reference)


def test_layouts_on_two_meshes_in_one_model_are_refused_clearly(digits):
    mesh_a = dp_mesh()
    mesh_b = mp_mesh()
    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((64,)),
        keras.layers.Dense(32, name="d1",
                           kernel_layout=klm.Layout([None, "batch"], mesh_a)),
        keras.layers.Dense(10, name="d2",
                           kernel_layout=klm.Layout(["model", None], mesh_b)),
    ])
    model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(
        from_logits=True))
    with pytest.raises(ValueError, match=r"d2\.kernel.*One model lives on one mesh"):
        fit(model, digits)
