"""`klm.shard_optimizer_states` (ZeRO-1): optimizer slots split over the
data axis, weights where the map puts them, training equal to one device,
Adam's state per device divided by the axis size (read from the backend)."""

import keras
import numpy as np
import pytest
from helpers import fake_mesh, mp_mesh

import keras_layoutmap as klm
from keras_layoutmap.memory import measured
from keras_layoutmap.placement import reference_of


def build(compile=True):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((16,)),
        keras.layers.Dense(64, activation="relu", name="d1"),
        keras.layers.Dense(32, name="d2"),
        keras.layers.Dense(4, name="out"),
    ], name="zero_mlp")
    if not compile:
        return model
    model.compile(
        optimizer=keras.optimizers.Adam(1e-2),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"])
    return model


def data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(36, 16)).astype("float32")  # a short last batch
    return x, rng.integers(0, 4, size=36)


def rules(mesh):
    layout_map = klm.LayoutMap(mesh)
    layout_map[r"d1\.kernel"] = (None, "model")
    return layout_map


def slot_bytes(model):
    """{device: bytes} of Adam's slots (not the step count) on this
    process's devices, read from the backend."""
    return measured([v for v in model.optimizer.variables
                     if reference_of(v) is not None])


@pytest.mark.sharding
@pytest.mark.training
def test_training_equals_one_device_and_state_shrinks_by_the_axis():
    x, y = data()
    reference = build()
    ref_history = reference.fit(x, y, batch_size=8, epochs=2, shuffle=False,
                                verbose=0).history
    mesh = mp_mesh()
    n = mesh.dim_size("batch")

    plain_map = rules(mesh)
    with plain_map.scope():
        plain = build()
    plain.fit(x, y, batch_size=8, epochs=1, steps_per_epoch=1, verbose=0)

    plan = klm.shard_optimizer_states(rules(mesh), axis="batch", min_bytes=0)
    with plan.scope():
        model = build()
    report = plan.explain(model, optimizer=model.optimizer)
    assert all(r.split for r in report.memory.state if r.weight is not None)
    history = model.fit(x, y, batch_size=8, epochs=2, shuffle=False,
                        verbose=0).history
    for key in ref_history:
        np.testing.assert_allclose(history[key], ref_history[key], rtol=1e-4,
                                   err_msg=key)
    for a, b in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)

    # Weights keep the map's layouts; each slot is split over "batch" too.
    for weight in model.weights:
        row = next(r for r in report.rows if r.path == weight.path)
        assert klm.fetch_layout(weight) == row.layout, weight.path
    slots = [v for v in model.optimizer.variables if reference_of(v) is not None]
    assert len(slots) == 2 * len(model.trainable_weights)
    for slot in slots:
        specs = klm.fetch_layout(slot).sharding_specs
        weight_specs = klm.fetch_layout(reference_of(slot)).sharding_specs
        assert specs.count("batch") == 1, slot.path
        assert [s for s in specs if s != "batch"] == [
            s for s in weight_specs if s != "unsharded"] + ["unsharded"] * (
            len(specs) - 1 - sum(s != "unsharded" for s in weight_specs))
    kernel_m = next(s for s in slots if "d1_kernel_momentum" in s.path)
    assert klm.fetch_layout(kernel_m).sharding_specs == ["batch", "model"]
    assert klm.unpack(kernel_m)[0].shape == (16 // n, 32)

    # Measured: the slots' bytes on each device, plain plan / ZeRO plan.
    plain_bytes, zero_bytes = slot_bytes(plain), slot_bytes(model)
    assert set(plain_bytes) == set(zero_bytes)
    for device in zero_bytes:
        assert plain_bytes[device] == n * zero_bytes[device], device
    scalars = report.memory.optimizer - sum(
        r.bytes_per_device for r in report.memory.state if r.weight)
    assert report.memory.optimizer - scalars == next(iter(zero_bytes.values()))


def test_slots_that_cannot_be_split_keep_the_weights_layout():
    mesh = fake_mesh([("batch", 4), ("model", 2)])
    base = klm.fsdp(mesh, axis="batch", min_bytes=4096)  # d1.kernel on batch
    base[r"out\.kernel"] = (None, "model")
    base[r"d2\.kernel"] = (None, None)  # replicated by a rule, not FSDP
    plan = klm.shard_optimizer_states(base, min_bytes=256)
    with keras.StatelessScope(initialize_variables=False):
        model = build(compile=False)
    report = plan.explain(model, optimizer="adam")
    state = {r.path.rpartition("/")[2]: r for r in report.memory.state}
    d1 = state["zero_mlp_d1_kernel_momentum"]
    assert not d1.split and d1.why_not == "its weight is already split over 'batch'"
    out = state["zero_mlp_out_kernel_velocity"]  # (32, 4): dim 0 is whole
    assert out.split and out.layout.sharding_specs == ["batch", "model"]
    d2 = state["zero_mlp_d2_kernel_momentum"]
    assert d2.split and d2.layout.sharding_specs == ["batch", "unsharded"]
    small = state["zero_mlp_out_bias_momentum"]  # 16 bytes < min_bytes
    assert not small.split and small.why_not is None
    text = report.render(width=200)
    assert ("slot adam/zero_mlp_d1_kernel_momentum keeps its weight's layout: "
            "its weight is already split over 'batch'") in text
    # The base map is unchanged; the plan keeps its rules.
    assert type(base) is klm.fsdp(mesh).__class__ and not hasattr(
        base, "slot_layout")
    assert list(plan) == list(base)
    # Its config holds the rules (and FSDP's policy); the split is applied
    # again to a loaded map.
    # (on the planning mesh: a one-process torch run has one real device)
    again = klm.LayoutMap.from_json(plan.to_json(), mesh=mesh)
    assert list(again) == list(base) and not hasattr(again, "slot_layout")
    assert again.fsdp_axis == "batch" and again.device_mesh == mesh


def test_indivisible_slot_is_said():
    mesh = fake_mesh([("batch", 3)])
    plan = klm.shard_optimizer_states(klm.LayoutMap(mesh), min_bytes=0)
    layout, why = plan.slot_layout(klm.Layout([None, None], mesh), (4, 8))
    assert layout.sharding_specs == ["unsharded", "unsharded"]
    assert why == ("no dimension of (4, 8) left whole by the weight's layout "
                   "['unsharded', 'unsharded'] is divisible by 'batch' (size 3)")


@pytest.mark.parametrize("kwargs, error, words", [
    ({"axis": "data"}, ValueError, "`axis` must be an axis of the mesh, one of "
     "['batch', 'model']. Received: axis='data'"),
    ({"min_bytes": -1}, ValueError, "Received: min_bytes=-1"),
    ({"min_bytes": "64"}, ValueError, "Received: min_bytes='64'"),
])
def test_bad_input(kwargs, error, words):
    with pytest.raises(error) as e:
        klm.shard_optimizer_states(rules(fake_mesh([("batch", 4), ("model", 2)])),
                                   **kwargs)
    assert words in str(e.value)


def test_not_a_layout_map():
    with pytest.raises(TypeError, match="must be a `klm.LayoutMap`.*Received: "
                       "3 of type int"):
        klm.shard_optimizer_states(3)
