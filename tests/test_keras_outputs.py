"""Keras' `"<layer path>/output"` activation layouts (`Layer.__call__` asks
the distribution for one and relays the output out), read back from the
backend inside the model, with klm's maps (fullmatch) and Keras' (search),
for Sequential, Functional and subclassed models; training and a short
`predict` equal to one device with such a rule; and the bad input around
it: a rank that differs, an axis that does not divide, a key that is not a
regex, a mesh that is not every device."""

import keras
import numpy as np
import pytest
from helpers import DEVICES, SPANS_PROCESSES, keras_mesh, mp_mesh
from sklearn.datasets import load_digits

import keras_layoutmap as klm

ROWS = 8  # the batch axis (DEVICES // 2 wide) divides it


class Probe(keras.layers.Layer):
    """Records the layout its input actually has on the devices."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.seen = []

    def call(self, x):
        if not isinstance(x, keras.KerasTensor):
            self.seen.append(klm.fetch_layout(x))
        return x

    def compute_output_shape(self, shape):
        return shape  # Keras need not trace `call` to know it


class Subclassed(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.d1 = keras.layers.Dense(8, name="d1")
        self.probe = Probe(name="probe")
        self.d2 = keras.layers.Dense(4, name="d2")

    def call(self, x):
        return self.d2(self.probe(self.d1(x)))


def build(kind):
    keras.utils.set_random_seed(0)
    if kind == "subclassed":
        model = Subclassed(name="sub")  # built by its first call
        return model, model.probe
    layers = [keras.layers.Dense(8, name="d1"), Probe(name="probe"),
              keras.layers.Dense(4, name="d2")]
    if kind == "sequential":
        model = keras.Sequential([keras.Input((6,)), *layers], name="seq")
    else:
        inputs = keras.Input((6,))
        x = inputs
        for layer in layers:
            x = layer(x)
        model = keras.Model(inputs, x, name="fun")
    return model, model.get_layer("probe")


def distribution_with(rule, layout, flavour):
    """A `ModelParallel` with one output rule, written for klm's map or
    for Keras' own (`keras.distribution.LayoutMap`, `re.search`)."""
    mesh = mp_mesh()
    if flavour == "keras":
        lm = keras.distribution.LayoutMap(keras_mesh(mesh))
        lm[rule] = layout
        return keras.distribution.ModelParallel(layout_map=lm,
                                                batch_dim_name="batch")
    lm = klm.LayoutMap(mesh)
    lm[rule] = layout
    return klm.ModelParallel(layout_map=lm, batch_dim_name="batch")


def call_on(model, rows):
    mesh = mp_mesh()
    x = np.random.RandomState(1).rand(rows, 6).astype("float32")
    layout = (klm.Layout.batch_sharded(mesh, "batch", 2)
              if rows % mesh.dim_size("batch") == 0
              else klm.Layout.replicated(mesh, 2))
    return model(klm.distribute(x, layout))


RULES = [
    ("klm", r".*d1/output"),  # fullmatch of the whole Keras path
    ("klm", "d1/output"),  # the path under the outermost model
    ("keras", "d1/output"),  # Keras' meaning: anywhere in the path
]


@pytest.mark.sharding
@pytest.mark.parametrize("kind", ["sequential", "functional", "subclassed"])
@pytest.mark.parametrize("flavour,rule", RULES)
def test_an_output_rule_lays_the_output_out(kind, flavour, rule):
    with distribution_with(rule, ("batch", "model"), flavour).scope():
        model, probe = build(kind)
        call_on(model, ROWS)
        full = probe.seen[-1]  # (a first call may also build the model)
        # a batch the batch axis does not divide: replicated, as data is
        call_on(model, 3)
        short = probe.seen[-1]
    assert (full.axes, short.axes) == (("batch", "model"), (None, "model"))
    assert full.mesh == mp_mesh()


@pytest.mark.sharding
def test_without_a_rule_the_output_stays_as_computed():
    with distribution_with("nothing/output", ("batch", "model"), "klm").scope():
        model, probe = build("sequential")
        call_on(model, ROWS)
    # as the backend computes it (split by rows, or whole), never by model
    assert probe.seen[-1].axes[1] is None


@pytest.mark.sharding
@pytest.mark.parametrize("flavour", ["klm", "keras"])
def test_an_output_rule_of_another_rank_names_path_rule_and_ranks(flavour):
    rule = "d1/output" if flavour == "keras" else ".*d1/output"
    with distribution_with(rule, ("batch", None, None), flavour).scope():
        model, _ = build("sequential")
        with pytest.raises(ValueError, match=(
                r"Layer output 'seq/d1/output' has shape \(8, 8\), but rule "
                f"'{rule}'.*rank 3, the output rank 2")):
            call_on(model, ROWS)
        with pytest.raises(ValueError, match="the rule has rank 3"):
            model.predict(np.zeros((ROWS, 6), "float32"), verbose=0)


@pytest.mark.sharding
def test_an_output_axis_that_does_not_divide_is_an_error():
    with distribution_with("d2/output", ("batch", "model"), "keras").scope():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((6,)),
                                  keras.layers.Dense(3, name="d2")])
        with pytest.raises(ValueError, match=(
                r"'seq.*d2/output'.*mesh axis 'model' \(2 devices\) does not "
                r"divide dimension 1 \(size 3\)")):
            call_on(model, ROWS)


@pytest.mark.sharding
@pytest.mark.parametrize("kind", ["sequential", "functional", "subclassed"])
def test_explain_and_strict_mode_count_an_output_rule_as_used(kind):
    """An output rule matches no weight: `explain` lists it with the outputs
    it lays out, not among the rules that match nothing, and a strict map
    builds the model (it raised `StrictModeError` before)."""
    lm = klm.LayoutMap(mp_mesh(), strict=True)
    lm["d1/output"] = ("batch", "model")
    lm[r".*d1\.kernel"] = (None, "model")
    with lm.scope():
        model, _ = build(kind)
        if kind == "subclassed":
            call_on(model, ROWS)  # built by its first call
    lm["nothing/output"] = ("batch", None)
    report = lm.explain(model)
    assert report.output_rules == {
        "d1/output": [{"sequential": "seq/d1/output", "functional":
                       "d1/output", "subclassed": "sub/d1/output"}[kind]]}
    assert report.unused_rules == ["nothing/output"]
    assert "layer output rule 'd1/output': ['batch', 'model'] for 1 " \
        "output(s)" in report.render(width=200)
    (listed,) = report.to_dict()["output_rules"]
    assert listed["rule"] == "d1/output" and listed["layout"] == [
        "batch", "model"]


# -- training and predict with an output rule, equal to one device ----------

@pytest.fixture(scope="module")
def digits():
    x, y = load_digits(return_X_y=True)
    return (x / 16.0).astype("float32"), y.astype("int32")


def digits_model():
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
    # 1437 training rows in batches of 128: the last holds 29
    history = model.fit(x, y, batch_size=128, epochs=2, validation_split=0.2,
                        shuffle=False, verbose=0)
    # generate()-style: a batch of 3 rows the batch axis does not divide
    predicted = model.predict(x[:3], verbose=0)
    return history.history, model.get_weights(), predicted


@pytest.mark.sharding
@pytest.mark.training
@pytest.mark.parametrize("output", [("batch", None), ("batch", "model")])
def test_fit_and_short_predict_with_an_output_rule_equal_one_device(
        digits, output):
    single = train(digits_model(), digits)
    mesh = mp_mesh()
    lm = keras.distribution.LayoutMap(keras_mesh(mesh))
    lm["d1/kernel"] = (None, "model")
    lm["d1/output"] = output
    with keras.distribution.ModelParallel(
            layout_map=lm, batch_dim_name="batch").scope():
        model = digits_model()
    history, weights, predicted = train(model, digits)
    for key in single[0]:
        np.testing.assert_allclose(history[key], single[0][key], rtol=1e-5,
                                   err_msg=key)
    for a, b in zip(weights, single[1]):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=2e-6)
    np.testing.assert_allclose(predicted, single[2], rtol=1e-5, atol=1e-6)
    assert predicted.shape == (3, 10)


# -- bad input ---------------------------------------------------------------

@pytest.fixture
def no_distribution():
    yield
    keras.distribution.set_distribution(None)


def test_a_keras_key_that_is_not_a_regex_is_an_error_when_used(
        no_distribution):
    mesh = klm.list_devices()[:1]
    keras_mesh = keras.distribution.DeviceMesh((1, 1), ["batch", "model"],
                                               devices=mesh)
    lm = keras.distribution.LayoutMap(keras_mesh)
    lm["d1/(output"] = ("batch", None)  # Keras takes any string
    distribution = keras.distribution.ModelParallel(layout_map=lm,
                                                    batch_dim_name="batch")
    match = r"Rule 'd1/\(output' is not a valid regex"
    with pytest.raises(ValueError, match=match):
        keras.distribution.set_distribution(distribution)
    with pytest.raises(ValueError, match=match):
        with distribution.scope():
            pass
    with pytest.raises(ValueError, match=match):
        klm.ModelParallel(layout_map=lm)
    assert keras.distribution.distribution() is None


@pytest.mark.sharding
@pytest.mark.training
def test_a_mesh_over_some_devices_in_another_order(digits, no_distribution):
    """In one process a mesh over some devices, in any order, trains as one
    device does; across processes it must hold every device of every
    process: an error on every process alike, before anything is placed."""
    devices = klm.list_devices()[::-1][: DEVICES // 2]
    mesh = keras.distribution.DeviceMesh((DEVICES // 2,), ["batch"],
                                         devices=devices)
    distribution = keras.distribution.DataParallel(device_mesh=mesh)
    if SPANS_PROCESSES:
        with pytest.raises(ValueError, match=(
                "across processes a distribution's mesh must use every "
                "device of every process")):
            keras.distribution.set_distribution(distribution)
        assert keras.distribution.distribution() is None
        # every device, in another order: fine
        devices = klm.list_devices()[::-1]
        distribution = keras.distribution.DataParallel(
            device_mesh=keras.distribution.DeviceMesh(
                (DEVICES,), ["batch"], devices=devices))
    single = train(digits_model(), digits)
    keras.distribution.set_distribution(distribution)
    model = digits_model()
    assert klm.fetch_layout(model.layers[0].kernel).mesh.size == len(devices)
    history, weights, predicted = train(model, digits)
    for key in single[0]:
        np.testing.assert_allclose(history[key], single[0][key], rtol=1e-5,
                                   err_msg=key)
    for a, b in zip(weights, single[1]):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=2e-6)
    np.testing.assert_allclose(predicted, single[2], rtol=1e-5, atol=1e-6)
