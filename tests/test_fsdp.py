"""`klm.fsdp`: weights sharded over the data axis (ZeRO-3 style), alone and
with model-parallel rules on a second axis; numbers equal one device."""

import keras
import numpy as np
import pytest
from helpers import (
    assert_same_history,
    assert_same_weights,
    compile_classifier,
    fake_mesh,
    gemma_data,
    gemma_lm,
    mp_mesh,
    sequential_mlp,
)

import keras_layoutmap as klm


def mlp():
    """16 -> 64 -> 32 -> 4: d2's kernel is sharded on its input (the
    contracting) dimension, the case DTensor refuses without a gather."""
    return compile_classifier(sequential_mlp(
        64, 32, 4, inputs=16, names=("d1", "d2", "out"), name="mlp"))


def mlp_data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(38, 16)).astype("float32")  # batch 8: a short 6
    return x, rng.integers(0, 4, size=38)


# -- the policy (no devices needed) -------------------------------------------


def test_policy_shards_largest_divisible_dimension():
    mesh = fake_mesh([("batch", 4), ("model", 2)])
    layout_map = klm.fsdp(mesh, axis="batch", min_bytes=1024)
    assert layout_map.fsdp_layout((16, 64)).sharding_specs == [
        "unsharded", "batch"]
    assert layout_map.fsdp_layout((64, 32)).sharding_specs == [
        "batch", "unsharded"]
    # 66 is the largest dimension but 4 does not divide it.
    assert layout_map.fsdp_layout((66, 16)).sharding_specs == [
        "unsharded", "batch"]
    assert layout_map.fsdp_layout((66, 15)) is None  # nothing divisible
    assert layout_map.fsdp_layout((255,)) is None  # 1020 bytes < 1024
    assert layout_map.fsdp_layout((128, 2), dtype="float16") is None  # 512 B
    assert layout_map.fsdp_layout((256,)).sharding_specs == ["batch"]


def test_explain_names_the_policy_and_rules_win():
    mesh = fake_mesh([("batch", 4), ("model", 2)])
    layout_map = klm.fsdp(mesh, axis="batch", min_bytes=1024)
    layout_map["d1.kernel"] = (None, "model")
    report = layout_map.explain(mlp())
    rows = {r.object_path: r for r in report.rows}
    assert rows["d1.kernel"].rule == "d1.kernel"
    assert rows["d1.kernel"].layout.sharding_specs == ["unsharded", "model"]
    assert rows["d2.kernel"].rule == "fsdp(batch)"
    assert rows["d2.kernel"].layout.sharding_specs == ["batch", "unsharded"]
    assert rows["d2.kernel"].bytes_per_device == 64 * 32 * 4 // 4
    for small in ("d1.bias", "d2.bias", "out.kernel", "out.bias"):
        assert rows[small].rule is None
        assert rows[small].layout.is_fully_replicated()
    assert "fsdp(batch)" in report.render(width=200)
    assert report.unused_rules == [] and report.shadowed_rules == []


def test_rules_argument_and_config_round_trip():
    mesh = fake_mesh([("batch", 4), ("model", 2)])
    rules = klm.LayoutMap(mesh)
    rules["d1.kernel"] = [(None, "model"), (None, None)]
    layout_map = klm.fsdp(mesh, axis="model", min_bytes=0, rules=rules)
    assert layout_map.alternatives("d1.kernel") == rules.alternatives(
        "d1.kernel")
    again = type(layout_map).from_config(layout_map.get_config(), mesh=mesh)
    assert again.get_config() == layout_map.get_config()
    assert (again.fsdp_axis, again.min_bytes) == ("model", 0)
    assert again.choose((6,), "x.bias").layout.sharding_specs == ["model"]
    # Rules files and `klm.LayoutMap.from_json` carry the policy too.
    loaded = klm.LayoutMap.from_json(layout_map.to_json(), mesh=mesh)
    assert loaded.get_config() == layout_map.get_config()
    assert loaded.choose((6,), "x.bias").rule == "fsdp(model)"
    config = dict(layout_map.get_config(), fsdp={"axes": "model"})
    with pytest.raises(ValueError, match="'fsdp' entry"):
        klm.LayoutMap.from_config(config, mesh=mesh)


def test_batches_split_over_the_fsdp_axis_when_no_batch_axis():
    mesh = fake_mesh([("model", 2), ("data", 4)])
    layout_map = klm.fsdp(mesh, axis="data")
    assert layout_map.distribution().batch_dim_name == "data"
    assert layout_map.distribution() is layout_map.distribution()
    mesh = fake_mesh([("batch", 4), ("model", 2)])
    assert klm.fsdp(mesh, axis="model").distribution().batch_dim_name == "batch"


def test_strict_mode_counts_fsdp_weights_as_placed():
    mesh = fake_mesh([("batch", 4)])
    layout_map = klm.fsdp(mesh, min_bytes=1024, strict=True,
                          max_replicated_bytes=1024)
    assert layout_map.explain(mlp()).findings == []
    plain = klm.LayoutMap(mesh, strict=True, max_replicated_bytes=1024)
    found = plain.explain(mlp()).findings
    assert {f.subject for f in found} == {"mlp/d1/kernel", "mlp/d2/kernel"}


@pytest.mark.parametrize("kwargs, error, words", [
    (dict(axis="data"), ValueError, ["axis", "'data'", "['batch', 'model']"]),
    (dict(axis=3), ValueError, ["axis", "3", "['batch', 'model']"]),
    (dict(min_bytes=-1), ValueError, ["min_bytes", "-1", ">= 0"]),
    (dict(min_bytes=1e6), TypeError, ["min_bytes", "1000000.0", "float",
                                      "int"]),
    (dict(min_bytes="1MB"), TypeError, ["min_bytes", "'1MB'", "int"]),
    (dict(min_bytes=True), TypeError, ["min_bytes", "True", "int"]),
    (dict(rules={"a": 1}), TypeError, ["rules", "LayoutMap", "dict"]),
])
def test_bad_input(kwargs, error, words):
    mesh = fake_mesh([("batch", 4), ("model", 2)])
    with pytest.raises(error) as info:
        klm.fsdp(mesh, **kwargs)
    for word in words:
        assert word in str(info.value)


def test_rules_on_another_mesh_and_no_mesh():
    rules = klm.LayoutMap(fake_mesh([("batch", 2)]))
    with pytest.raises(ValueError, match="share one mesh"):
        klm.fsdp(fake_mesh([("batch", 4)]), rules=rules)
    with pytest.raises(ValueError, match="needs a mesh"):
        klm.fsdp(None)


@pytest.mark.sharding
def test_docstring_example():
    import doctest
    import importlib

    # (the package's `fsdp` attribute is the function, not the module)
    module = importlib.import_module("keras_layoutmap.fsdp")

    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0 and result.attempted > 0


# -- training on the mesh ----------------------------------------------------


def fit(model, x, y, epochs=2):
    """Epochs in batches of 8 (both data sets end on a short batch)."""
    return model.fit(x, y, batch_size=8, epochs=epochs, shuffle=False,
                     verbose=0).history


def assert_parity(model, ref_weights, history, ref_history):
    assert_same_history(history, ref_history, rtol=1e-4, same_keys=False)
    assert_same_weights(model.get_weights(), ref_weights, rtol=1e-4, atol=1e-5)


def assert_placed(model, report):
    """The real sharding of every weight and its optimizer slots is the
    one explain reports."""
    from keras_layoutmap.placement import reference_of

    rows = {r.path: r for r in report.rows}
    for variable in model.weights:
        assert klm.fetch_layout(variable) == rows[variable.path].layout, (
            variable.path)
    slots = 0
    for variable in model.optimizer.variables:
        weight = reference_of(variable)  # the weight a slot was made for
        if weight is not None:
            slots += 1
            assert klm.fetch_layout(variable) == klm.fetch_layout(weight), (
                variable.path)
    assert slots == 2 * len(model.trainable_weights)  # Adam: 2 a weight


@pytest.mark.sharding
@pytest.mark.training
@pytest.mark.parametrize("combined", [False, True], ids=["fsdp", "fsdp+tp"])
def test_mlp_parity(combined):
    x, y = mlp_data()
    reference = mlp()
    ref_history = fit(reference, x, y)
    mesh = mp_mesh()
    layout_map = klm.fsdp(mesh, axis="batch", min_bytes=1024)
    if combined:
        layout_map["d1.kernel"] = (None, "model")
    with layout_map.scope():
        model = mlp()
    report = layout_map.explain(model)
    fsdp_rows = [r for r in report.rows if r.rule == "fsdp(batch)"]
    assert [r.object_path for r in fsdp_rows] == (
        ["d2.kernel"] if combined else ["d1.kernel", "d2.kernel"])
    history = fit(model, x, y)
    assert_parity(model, reference.get_weights(), history, ref_history)
    assert_placed(model, report)  # after training: storage still sharded
    kernel = model.get_layer("d2").kernel
    assert klm.fetch_layout(kernel).sharding_specs == ["batch", "unsharded"]
    assert klm.unpack(kernel)[0].shape == (64 // mesh.dim_size("batch"), 32)
    np.testing.assert_allclose(model.evaluate(x, y, verbose=0),
                               reference.evaluate(x, y, verbose=0), rtol=1e-4)


@pytest.mark.sharding
@pytest.mark.training
def test_gemma_parity():
    """The MLP model-parallel, the rest FSDP: both kinds of weight in one
    step (FSDP alone is test_mlp_parity's first case)."""
    x, y = gemma_data()  # 36 rows: 5 steps, the last a short batch
    reference = gemma_lm()
    ref_history = fit(reference, x, y, epochs=1)
    ref_weights = reference.get_weights()
    mesh = mp_mesh()
    rules = klm.LayoutMap(mesh)
    rules["decoder_block.*ffw_gating.*kernel"] = (None, "model")
    rules["decoder_block.*ffw_linear.kernel"] = ("model", None)
    layout_map = klm.fsdp(mesh, axis="batch", min_bytes=512, rules=rules)
    with layout_map.scope():
        model = gemma_lm()
    report = layout_map.explain(model)
    by_rule = {}
    for r in report.rows:
        by_rule.setdefault(r.rule, []).append(r)
    assert len(by_rule["fsdp(batch)"]) == 9
    assert all(r.layout.sharding_specs.count("batch") == 1
               for r in by_rule["fsdp(batch)"])
    assert all(r.layout.is_fully_replicated() for r in by_rule[None])
    assert len(by_rule[None]) == 5  # the norms' scales
    history = fit(model, x, y, epochs=1)
    assert_parity(model, ref_weights, history, ref_history)
    assert_placed(model, report)
    embeddings = model.backbone.token_embedding.embeddings
    assert klm.fetch_layout(embeddings).sharding_specs == ["batch", "unsharded"]
    assert klm.unpack(embeddings)[0].shape == (64 // mesh.dim_size("batch"), 16)


@pytest.mark.sharding
@pytest.mark.training
def test_sharded_embedding_lookup_with_adam_equals_one_device():
    """An embedding only looked up (an untied head after it) has a sparse
    gradient, a row per id; ids repeat within each batch here. Adam squares
    those rows as one device does (on TensorFlow: before, gathering the
    FSDP shards made the gradient dense first, and the weights differed
    from one device's by Adam's whole step, 1e-2, silently)."""

    def build():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([
            keras.Input((8,), dtype="int32"),
            keras.layers.Embedding(64, 16, name="embedding"),
            keras.layers.GlobalAveragePooling1D(),
            keras.layers.Dense(64, name="head"),
        ])
        return compile_classifier(model, keras.optimizers.Adam(1e-2),
                                  accuracy=False)

    rng = np.random.default_rng(0)
    x = rng.integers(0, 12, size=(36, 8)).astype("int32")  # ids repeat
    y = rng.integers(0, 64, size=(36,)).astype("int32")
    reference = build()
    ref_history = fit(reference, x, y)
    layout_map = klm.fsdp(mp_mesh(), axis="batch", min_bytes=0)
    with layout_map.scope():
        model = build()
    embeddings = model.get_layer("embedding").embeddings
    assert klm.fetch_layout(embeddings).sharding_specs.count("batch") == 1
    history = fit(model, x, y)
    assert_parity(model, reference.get_weights(), history, ref_history)


@pytest.mark.sharding
@pytest.mark.training
def test_min_bytes_zero_shards_every_divisible_weight_batchnorm_included():
    """BatchNormalization's moving statistics, sharded, are read gathered
    and assigned back to their shards."""

    def build():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([
            keras.Input((16,)),
            keras.layers.Dense(64, use_bias=False, name="d1"),
            keras.layers.BatchNormalization(name="bn"),
            keras.layers.Dense(4, name="out"),
        ], name="bn_mlp")
        return compile_classifier(model)

    x, y = mlp_data()
    reference = build()
    ref_history = fit(reference, x, y)
    mesh = mp_mesh()
    layout_map = klm.fsdp(mesh, axis="batch", min_bytes=0)
    with layout_map.scope():
        model = build()
    report = layout_map.explain(model)
    assert all(r.rule == "fsdp(batch)" for r in report.rows)
    history = fit(model, x, y)
    assert_parity(model, reference.get_weights(), history, ref_history)
    assert_placed(model, report)
    moving_mean = model.get_layer("bn").moving_mean
    assert klm.fetch_layout(moving_mean).sharding_specs == ["batch"]
    assert not np.allclose(moving_mean.numpy(), 0)  # it was updated


@pytest.mark.sharding
@pytest.mark.parametrize("plan", ["fsdp", "rule"])
def test_a_random_layers_seed_state_is_never_split(plan):
    """`fsdp(min_bytes=0)` splits every weight the axis divides, and a rule
    naming the state asks to split it; neither splits a `SeedGenerator`'s (2,)
    state, which every draw reads whole (JAX refused the draw, torch
    failed to unbind it)."""
    mesh = mp_mesh()
    if plan == "fsdp":
        layout_map = klm.fsdp(mesh, axis="model", min_bytes=0)
    else:
        layout_map = klm.LayoutMap(mesh)
        layout_map[".*seed_generator_state"] = ("model",)
    with layout_map.scope():
        model = keras.Sequential([
            keras.Input((4,)), keras.layers.Dense(4, name="d1"),
            keras.layers.Dropout(0.5, seed=1, name="drop"),
            keras.layers.RandomFlip(seed=1, name="flip")])
    states = [v for v in model.variables if "seed_generator_state" in v.path]
    assert len(states) == 2
    for state in states:
        assert klm.fetch_layout(state).is_fully_replicated(), state.path
    if plan == "fsdp":
        assert not klm.fetch_layout(model.get_layer("d1").kernel
                                    ).is_fully_replicated()
