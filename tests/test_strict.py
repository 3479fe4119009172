"""Strict mode: a large weight no rule places is refused at its creation,
before memory is allocated for it; a rule that matches no weight is an error
when a scope exits with a built model, else before the model trains."""

import doctest
import json
import os

import keras
import numpy as np
import pytest
from helpers import fake_mesh, mp_mesh

import keras_layoutmap as klm
from keras_layoutmap import cli, strict
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
        " matches no rule and is replicated on every device of the mesh " \
        "Mesh(batch=4, model=2)" in message
    assert "at most 1,000 bytes (max_replicated_bytes)" in message
    assert r"The rules closest to its name (none matches it): 'd2\\.kernel'" \
        in message
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
    # Made under set_distribution: no scope exits, so the check waits for
    # the first fit / evaluate / predict.
    klm.set_distribution(lm.distribution())
    model = functional()
    model.compile(optimizer="sgd", loss="mse")
    klm.set_distribution(None)
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
    # Checked as the scope exited; not again while the plan is unchanged.
    assert model._klm_strict_ok == (id(lm), lm._version)
    calls = []
    original = strict.check
    monkeypatch.setattr(strict, "check", lambda *a: calls.append(1) or original(*a))
    x, y = data()
    model.fit(x, y, epochs=2, batch_size=4, verbose=0)
    model.evaluate(x, y, verbose=0)
    assert int(model.optimizer.iterations) == 4 and calls == []
    lm["new_rule_matching_nothing"] = (None,)  # the plan changed: re-checked
    with pytest.raises(StrictModeError, match="new_rule_matching_nothing"):
        model.evaluate(x, y, verbose=0)


# -- refused at creation, before memory is allocated -------------------------

class NeverCalled(keras.initializers.Initializer):
    """An initializer that fails the test if it runs: a refused weight must
    not get a value (nor the memory for one)."""

    def __init__(self):
        self.calls = 0

    def __call__(self, shape, dtype=None, **kwargs):
        self.calls += 1
        raise AssertionError(f"initializer called for a refused weight {shape}")


def strict_map(mesh, **kwargs):
    lm = klm.LayoutMap(mesh, strict=True, max_replicated_bytes=1000, **kwargs)
    lm[r"dl\.kernel"] = (None, "model")  # a typo of d1
    lm[r"d2\.kernel"] = (None, None)  # replicated on purpose
    lm[r"head\.output\.bias"] = (None,)  # unrelated
    return lm


@pytest.mark.sharding
def test_large_unplaced_weight_refused_at_creation():
    mesh = mp_mesh()
    lm = strict_map(mesh)
    init = NeverCalled()
    d1 = keras.layers.Dense(16, name="d1", kernel_initializer=init)
    with pytest.raises(StrictModeError) as info:
        with lm.scope():
            keras.Sequential([keras.Input((16,)), d1,
                              keras.layers.Dense(2, name="d2")])
    message = str(info.value)
    assert message.startswith("Strict mode refused to create weight 'd1.kernel'"
                              " (nothing was allocated for it)")
    # The weight's paths, shape and bytes, the mesh and the closest rules.
    assert "(sequential/d1/kernel, shape (16, 16), 1,024 bytes) matches no " \
        "rule" in message
    assert f"every device of the mesh {mesh!r}" in message
    assert r"closest to its name (none matches it): 'dl\\.kernel', " \
        r"'d2\\.kernel'. Add a rule" in message
    assert [(f.kind, f.subject) for f in info.value.findings] == [
        ("replicated_weight", "sequential/d1/kernel")]
    # Nothing was allocated: the initializer never ran, the layer has no
    # weight, and the scope is gone.
    assert init.calls == 0 and d1.weights == [] and not d1.built
    assert klm.distribution() is None


@pytest.mark.sharding
def test_a_16_gib_weight_is_refused_instantly():
    lm = strict_map(mp_mesh())
    init = NeverCalled()
    embed = keras.layers.Embedding(1 << 22, 1024, name="embed",
                                   embeddings_initializer=init)  # 16 GiB
    with lm.scope(), pytest.raises(StrictModeError,
                                   match=r"'embed.embeddings' .*17,179,869,184 "
                                   "bytes"):
        embed.build((None, 4))
    assert init.calls == 0 and embed.weights == []


@pytest.mark.sharding
def test_refused_while_creation_is_deferred_leaves_nothing_behind():
    # In a StatelessScope Keras defers a variable's value to the scope's
    # end; the refused one is neither kept by the layer nor made then.
    lm = strict_map(mp_mesh())
    init = NeverCalled()
    d1 = keras.layers.Dense(16, name="d1", kernel_initializer=init)
    with lm.scope():
        with pytest.raises(StrictModeError, match="'d1.kernel'"):
            with keras.StatelessScope():
                d1.build((None, 16))
    assert init.calls == 0 and d1.weights == []


@pytest.mark.sharding
def test_placed_or_small_weights_are_created():
    mesh = mp_mesh()
    lm = klm.LayoutMap(mesh, strict=True, max_replicated_bytes=1000)
    lm[r"d1\.kernel"] = (None, "model")
    lm[r"d2\.kernel"] = (None, None)  # replicated on purpose
    with lm.scope():
        model = keras.Sequential([keras.Input((16,)),
                                  keras.layers.Dense(16, name="d1"),
                                  keras.layers.Dense(2, name="d2")],
                                 name="ok")
        # A kwarg places a weight as a rule does.
        other = keras.layers.Dense(32, name="x",
                                   kernel_layout=klm.Layout([None, "model"], mesh))
        other.build((None, 16))
    assert klm.fetch_layout(model.layers[0].kernel) == klm.Layout(
        [None, "model"], mesh)
    assert klm.fetch_layout(other.kernel) == klm.Layout([None, "model"], mesh)


@pytest.mark.sharding
def test_creation_error_explain_and_cli_report_the_same_finding(
        tmp_path, monkeypatch, capsys):
    mesh = mp_mesh()
    lm = strict_map(mesh)
    with pytest.raises(StrictModeError) as info:
        with lm.scope():
            functional()
    at_creation = info.value.findings[0]
    report = strict_map(mesh).explain(functional())
    assert at_creation in report.findings
    assert f"  - {at_creation.message}" in report.render(width=400)
    # `klm explain --strict`, on a planning mesh of the same shape. Under
    # torch's launcher every rank shares `tmp_path` (conftest.py) and runs
    # the CLI for itself: each writes and imports its own files, or one
    # rank imports the module while another is still writing it.
    tmp_path = tmp_path / f"process-{os.getpid()}"
    tmp_path.mkdir()
    (tmp_path / "strict_builders.py").write_text(
        "import keras\n\ndef model():\n    inputs = keras.Input((16,))\n"
        "    x = keras.layers.Dense(16, name='d1')(inputs)\n"
        "    return keras.Model(inputs, keras.layers.Dense(2, name='d2')(x))\n")
    (tmp_path / "rules.json").write_text(strict_map(mesh).to_json())
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    dims = ",".join(f"{a}={n}" for a, n in zip(mesh.axis_names, mesh.shape))
    code = cli.main(["explain", "strict_builders:model", "--mesh", dims,
                     "--rules", "rules.json", "--strict", "--json"])
    findings = json.loads(capsys.readouterr().out)["strict_findings"]
    assert code == 1
    assert {"kind": "replicated_weight", "subject": "d1/kernel",
            "message": at_creation.message} in findings


# -- a scope's exit -----------------------------------------------------------

@pytest.mark.sharding
def test_rule_matching_nothing_fails_as_the_scope_exits():
    lm = klm.LayoutMap(mp_mesh(), strict=True)
    lm[r"d1\.kernel"] = (None, "model")
    lm[r"attention\.query\.kernel"] = (None, "model")  # a renamed layer
    with pytest.raises(StrictModeError, match=r"layout plan of 'functional', "
                       r"found as the scope of the LayoutMap exited:\n  - rule "
                       r"'attention\\\\.query\\\\.kernel' matches no weight") as info:
        with lm.scope():
            functional()
    assert [f.subject for f in info.value.findings] == [
        r"attention\.query\.kernel"]
    assert klm.distribution() is None
    # ModelParallel's own scope checks the same way.
    with pytest.raises(StrictModeError, match="attention"):
        with klm.ModelParallel(layout_map=lm).scope():
            functional()


@pytest.mark.sharding
def test_scope_exit_counts_rules_over_every_model_made_in_it():
    lm = klm.LayoutMap(mp_mesh(), strict=True)
    lm[r"d1\.kernel"] = (None, "model")
    lm[r"g\.kernel"] = (None, "model")
    with lm.scope():  # each rule matches a weight of one of the two models
        models = [functional(), keras.Sequential(
            [keras.Input((4,)), keras.layers.Dense(8, name="g")])]
    assert all(m.built for m in models)  # both built, checked together: passed
    # A model not built at the exit is checked later (before it trains).
    with lm.scope():
        model = Subclassed()
    assert not model.built
    # A body that raises is not masked by the check.
    with pytest.raises(RuntimeError, match="body"):
        with lm.scope():
            keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, name="z")])
            raise RuntimeError("body")


def test_not_strict_scope_does_not_check():
    lm = klm.LayoutMap(klm.create_mesh([("batch", 1), ("model", 1)],
                                       devices=klm.list_devices()[:1]))
    lm["nothing"] = (None,)
    with lm.scope():
        functional()


def test_module_example():
    result = doctest.testmod(strict, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0 and result.attempted > 0
