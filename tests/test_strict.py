"""Strict mode: a rule that matches no weight, or a large weight no rule
places, is an error once the model is built and before it trains."""

import doctest

import keras
import numpy as np
import pytest
from helpers import fake_mesh, mp_mesh

import keras_layoutmap as klm
from keras_layoutmap import strict
from keras_layoutmap.explain import StrictModeError


def functional():
    inputs = keras.Input((16,))
    x = keras.layers.Dense(16, name="d1")(inputs)  # kernel: 1,024 bytes
    return keras.Model(inputs, keras.layers.Dense(2, name="d2")(x))


class Subclassed(keras.Model):
    def __init__(self):
        super().__init__()
        self.d1 = keras.layers.Dense(16)
        self.d2 = keras.layers.Dense(2)

    def call(self, x):
        return self.d2(self.d1(x))


def test_rule_matching_nothing():
    lm = klm.LayoutMap(fake_mesh([("batch", 4), ("model", 2)]), strict=True)
    lm[r"d1\.kernel"] = (None, "model")
    lm[r"attention\.query\.kernel"] = (None, "model")  # a renamed layer
    report = lm.explain(functional())
    assert [(f.kind, f.subject) for f in report.findings] == [
        ("unused_rule", r"attention\.query\.kernel")]
    assert "strict mode: 1 problem(s)" in report.render(width=200)
    with pytest.raises(StrictModeError, match=r"rule 'attention\\\\.query\\\\.kernel' "
                       r"matches no weight") as info:
        report.raise_for_strict()
    assert isinstance(info.value, ValueError)
    assert [f.subject for f in info.value.findings] == [r"attention\.query\.kernel"]


def test_large_replicated_weight_with_no_rule():
    lm = klm.LayoutMap(fake_mesh([("batch", 4), ("model", 2)]), strict=True,
                       max_replicated_bytes=1000)
    lm[r"d2\.kernel"] = (None, None)  # replicated on purpose: allowed
    with pytest.raises(StrictModeError) as info:
        lm.check(functional())
    message = str(info.value)
    assert "weight 'd1.kernel' (d1/kernel, shape (16, 16), 1,024 bytes)" \
        " matches no rule and is replicated on every device" in message
    assert "at most 1,000 bytes (max_replicated_bytes)" in message
    assert [f.subject for f in info.value.findings] == ["d1/kernel"]
    # The 1 MiB default lets it through.
    lm2 = klm.LayoutMap(lm.device_mesh, strict=True)
    lm2[r"d2\.kernel"] = (None, None)
    assert lm2.check(functional()).findings == []


def test_not_strict_reports_but_does_not_fail():
    lm = klm.LayoutMap(fake_mesh([("batch", 8)]))
    lm["nothing"] = ("batch",)
    report = lm.explain(functional())
    assert not report.strict and len(report.findings) == 1
    assert "strict mode would find: 1 problem(s)" in report.render(width=200)
    with pytest.raises(StrictModeError):  # an explicit check still checks
        lm.check(functional())


def test_strict_arguments_are_validated_and_round_trip():
    mesh = fake_mesh([("batch", 8)])
    with pytest.raises(TypeError, match="`strict` must be True or False. "
                       "Received: 'yes'"):
        klm.LayoutMap(mesh, strict="yes")
    with pytest.raises(ValueError, match="`max_replicated_bytes` must be a "
                       "non-negative int.*Received: -1"):
        klm.LayoutMap(mesh, max_replicated_bytes=-1)
    lm = klm.LayoutMap(mesh, strict=True, max_replicated_bytes=4096)
    again = klm.LayoutMap.from_json(lm.to_json(), mesh=mesh)
    assert (again.strict, again.max_replicated_bytes) == (True, 4096)


def data():
    rng = np.random.default_rng(0)
    return rng.normal(size=(8, 16)).astype("float32"), rng.normal(
        size=(8, 2)).astype("float32")


@pytest.mark.training
@pytest.mark.parametrize("method", ["fit", "evaluate", "predict", "train_on_batch"])
def test_fails_before_training_built_model(method):
    mesh = mp_mesh(width=1)
    lm = klm.LayoutMap(mesh, strict=True)
    lm[r"d1\.kernel"] = (None, "model")
    lm[r"renamed\.kernel"] = ("model", None)
    with lm.scope():
        model = functional()
        model.compile(optimizer="sgd", loss="mse")
    before = [np.array(w) for w in model.get_weights()]
    x, y = data()
    args = (x,) if method == "predict" else (x, y)
    with pytest.raises(StrictModeError, match=r"rule 'renamed\\\\.kernel' matches "
                       "no weight"):
        getattr(model, method)(*args)
    for a, b in zip(before, model.get_weights()):
        np.testing.assert_array_equal(a, b)
    assert int(model.optimizer.iterations) == 0


@pytest.mark.training
def test_fails_before_training_model_built_by_fit():
    # A subclassed model is built by fit itself: the check runs from a
    # callback once it is built, before the first step.
    mesh = mp_mesh(width=1)
    lm = klm.LayoutMap(mesh, strict=True)
    lm[r"d1\.kernel"] = (None, "model")
    lm[r"typo\.kernel"] = ("model", None)
    with lm.scope():
        model = Subclassed()
        model.compile(optimizer="sgd", loss="mse")
    x, y = data()
    seen = []

    class Spy(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            seen.append(batch)

    with pytest.raises(StrictModeError, match=r"typo\\\\.kernel"):
        model.fit(x, y, epochs=1, batch_size=4, verbose=0, callbacks=[Spy()])
    assert len(model.weights) == 4 and seen == []  # built, not stepped
    assert int(model.optimizer.iterations) == 0


@pytest.mark.training
def test_passing_plan_trains_and_is_checked_once(monkeypatch):
    mesh = mp_mesh(width=1)
    lm = klm.LayoutMap(mesh, strict=True)
    lm[r"d\d\.kernel"] = (None, "model")
    with lm.scope():
        model = functional()
        model.compile(optimizer="sgd", loss="mse")
    calls = []
    original = strict.check
    monkeypatch.setattr(strict, "check", lambda *a: calls.append(1) or original(*a))
    x, y = data()
    model.fit(x, y, epochs=2, batch_size=4, verbose=0)
    model.evaluate(x, y, verbose=0)
    assert int(model.optimizer.iterations) == 4
    assert len(calls) >= 1 and model._klm_strict_ok == (id(lm), lm._version)
    lm["new_rule_matching_nothing"] = (None,)  # the plan changed: re-checked
    with pytest.raises(StrictModeError, match="new_rule_matching_nothing"):
        model.evaluate(x, y, verbose=0)


def test_module_example():
    result = doctest.testmod(strict, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0 and result.attempted > 0
