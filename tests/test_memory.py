"""Memory per device: weights, gradients and optimizer state, from shapes
(`explain(model, optimizer=...)`, `klm explain --optimizer`), checked
against the bytes the backend holds after a `fit` step."""

import json

import keras
import numpy as np
import pytest
from helpers import fake_mesh, mp_mesh

import keras_layoutmap as klm
from keras_layoutmap import cli
from keras_layoutmap.memory import measured, parse_bytes


def mlp():
    inputs = keras.Input((64,))
    x = keras.layers.Dense(128, name="d1")(inputs)
    return keras.Model(inputs, keras.layers.Dense(8, name="d2")(x), name="mlp")


def planned():
    mesh = fake_mesh([("batch", 2), ("model", 4)])
    layout_map = klm.LayoutMap(mesh)
    layout_map[r"d1\.kernel"] = (None, "model")
    with keras.StatelessScope(initialize_variables=False):
        model = mlp()
    return layout_map, model


# d1.kernel 64x128 split 4 ways, the rest replicated, float32
WEIGHTS = (64 * 128 // 4 + 128 + 128 * 8 + 8) * 4


def test_weights_only_without_an_optimizer():
    layout_map, model = planned()
    report = layout_map.explain(model)
    assert report.memory.to_dict() == {"weights": WEIGHTS, "gradients": 0,
                                       "optimizer": 0, "total": WEIGHTS}
    assert report.to_dict()["per_device"]["total"] == WEIGHTS


@pytest.mark.parametrize("optimizer, slots", [
    ("adam", 2), (keras.optimizers.Adam(amsgrad=True), 3),
    (keras.optimizers.SGD(momentum=0.9), 1), ("sgd", 0)])
def test_optimizer_state_as_the_optimizer_lays_it_out(optimizer, slots):
    layout_map, model = planned()
    report = layout_map.explain(model, optimizer=optimizer)
    memory = report.memory
    assert memory.weights == memory.gradients == WEIGHTS  # all trainable
    counted = [r for r in memory.state if r.weight is not None]
    assert len(counted) == slots * 4
    for r in counted:  # each slot laid out like its weight
        row = next(w for w in report.rows if w.path == r.weight)
        assert r.layout == row.layout and r.shape == row.shape
    # The step count (int64) and, on TensorFlow, the learning rate
    # (float32): scalars on every device.
    scalars = [r for r in memory.state if r.weight is None]
    assert all(r.shape == () for r in scalars)
    assert {r.path.rpartition("/")[2] for r in scalars} <= {
        "iteration", "iterations", "learning_rate"}
    extra = sum(r.bytes_per_device for r in scalars)
    assert extra in (8, 12)
    assert memory.optimizer == slots * WEIGHTS + extra
    assert memory.total == WEIGHTS * (2 + slots) + extra
    assert report.to_dict()["per_device"] == memory.to_dict()


def test_non_trainable_weights_have_no_gradient():
    layout_map, model = planned()
    model.get_layer("d2").trainable = False
    memory = layout_map.explain(model, optimizer="adam").memory
    assert memory.gradients == WEIGHTS - (128 * 8 + 8) * 4
    assert memory.optimizer - 2 * memory.gradients in (8, 12)  # + scalars


def test_an_optimizer_that_cannot_be_built_from_shapes():
    """Adafactor's build makes a variable from a value, which Keras'
    StatelessScope refuses: a clear error, not a wrong count."""
    layout_map, model = planned()
    with pytest.raises(ValueError, match="cannot count the state of optimizer "
                       "Adafactor from shapes"):
        layout_map.explain(model, optimizer="adafactor")


@pytest.mark.parametrize("text, expected", [
    ("16GiB", 16 * 2**30), ("80GB", 80 * 10**9), ("512 MiB", 512 * 2**20),
    ("1000", 1000), ("1.5KiB", 1536)])
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["16 parsecs", "-3GB", "GiB", "0", ""])
def test_parse_bytes_refuses(text):
    with pytest.raises(ValueError, match=f"cannot parse the device memory {text!r}"):
        parse_bytes(text)


def test_budget_is_a_strict_finding():
    layout_map, model = planned()
    total = layout_map.explain(model, optimizer="adam").memory.total
    report = layout_map.explain(model, optimizer="adam",
                                device_memory=total - 1)
    assert report.memory.over_budget == [f"cpu:{i}" for i in range(8)]
    assert [f.kind for f in report.findings] == ["device_memory"]
    assert "OVER by" in report.render(width=120)
    with pytest.raises(klm.StrictModeError, match="more than the device memory"):
        report.raise_for_strict()
    fits = layout_map.explain(model, optimizer="adam", device_memory=total)
    assert fits.findings == [] and fits.memory.over_budget == []


def test_bad_optimizer():
    layout_map, model = planned()
    with pytest.raises(ValueError, match="unknown optimizer 'adamx'"):
        layout_map.explain(model, optimizer="adamx")
    with pytest.raises(TypeError, match="Received: 3 of type int"):
        layout_map.explain(model, optimizer=3)


BUILDERS = '''
import keras


def mlp():
    inputs = keras.Input((64,))
    x = keras.layers.Dense(128, name="d1")(inputs)
    return keras.Model(inputs, keras.layers.Dense(8, name="d2")(x), name="mlp")
'''


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    (tmp_path / "klm_memory_builders.py").write_text(BUILDERS)
    (tmp_path / "rules.json").write_text(
        json.dumps({"rules": [[r"d1\.kernel", [None, "model"]]]}))
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


ARGS = ["explain", "klm_memory_builders:mlp", "--mesh", "batch=2,model=4",
        "--rules", "rules.json"]


def test_cli_json_per_device(workdir, capsys):
    assert cli.main([*ARGS, "--optimizer", "adam", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    scalars = doc["per_device"]["optimizer"] - 2 * WEIGHTS  # step (and lr)
    assert scalars in (8, 12)
    assert doc["per_device"] == {
        "weights": WEIGHTS, "gradients": WEIGHTS,
        "optimizer": 2 * WEIGHTS + scalars, "total": 4 * WEIGHTS + scalars}
    assert doc["optimizer"] == "Adam" and doc["over_budget"] is False
    assert cli.main([*ARGS, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["per_device"] == {"weights": WEIGHTS, "gradients": 0,
                                 "optimizer": 0, "total": WEIGHTS}


def test_cli_device_memory(workdir, capsys):
    assert cli.main([*ARGS, "--optimizer", "adam", "--json"]) == 0
    total = json.loads(capsys.readouterr().out)["per_device"]["total"]
    over = [*ARGS, "--optimizer", "adam", "--device-memory", str(total - 1),
            "--width", "160"]
    assert cli.main(over) == 0  # marked, not an error without --strict
    out = capsys.readouterr().out
    assert "memory per device (optimizer Adam)" in out and "OVER by" in out
    assert "each of 8 (cpu:0 ... cpu:7)" in out
    assert cli.main([*over, "--strict"]) == 1
    assert "more than the device memory" in capsys.readouterr().out
    assert cli.main([*ARGS, "--optimizer", "adam", "--device-memory",
                     str(total), "--strict"]) == 0
    assert "fits" in capsys.readouterr().out


def test_cli_bad_input(workdir, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main([*ARGS, "--device-memory", "16 parsecs"])
    assert e.value.code == 2
    assert "cannot parse the device memory '16 parsecs'" in (
        capsys.readouterr().err)
    assert cli.main([*ARGS, "--optimizer", "adamx"]) == 2
    assert "--optimizer: unknown optimizer 'adamx'" in capsys.readouterr().err


# -- against what the backend holds -----------------------------------------


def assert_estimate_is_what_the_backend_holds(model, report):
    """After a step: the bytes of the model's weights and of its optimizer's
    variables on each of this process's devices, read from the backend,
    are the estimate's."""
    weights = measured(model.weights)
    state = measured(model.optimizer.variables)
    assert weights and set(weights) == set(state)
    for device in weights:
        assert weights[device] == report.memory.weights, device
        assert state[device] == report.memory.optimizer, device


@pytest.mark.sharding
@pytest.mark.training
def test_gemma_estimate_equals_backend_after_a_fit_step():
    import keras_hub  # noqa: F401  (the nlp extra)
    from helpers import gemma_data as data
    from helpers import gemma_lm as build_lm

    mesh = mp_mesh()
    layout_map = klm.LayoutMap.from_keras(
        keras_hub.models.GemmaBackbone.get_layout_map(mesh))
    with layout_map.scope():
        model = build_lm()
    report = layout_map.explain(model, optimizer=model.optimizer)
    assert report.memory.gradients == report.memory.weights  # all trainable
    assert report.memory.optimizer > 2 * report.memory.weights  # m, v, step
    assert any(not r.layout.is_fully_replicated() for r in report.memory.state)
    x, y = data()
    model.fit(x, y, batch_size=8, epochs=1, steps_per_epoch=1, verbose=0)
    assert int(np.asarray(model.optimizer.iterations)) == 1
    assert_estimate_is_what_the_backend_holds(model, report)


@pytest.mark.sharding
@pytest.mark.training
def test_mlp_estimate_equals_backend_after_a_fit_step():
    mesh = mp_mesh()
    layout_map = klm.LayoutMap(mesh)
    layout_map[r"d1\.kernel"] = (None, "model")
    layout_map[r"d1\.bias"] = ("model",)
    with layout_map.scope():
        model = mlp()
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse")
    report = layout_map.explain(model, optimizer=model.optimizer)
    x = np.random.default_rng(0).normal(size=(16, 64)).astype("float32")
    model.fit(x, np.zeros((16, 8), "float32"), batch_size=8, epochs=1,
              steps_per_epoch=1, verbose=0)
    assert_estimate_is_what_the_backend_holds(model, report)
