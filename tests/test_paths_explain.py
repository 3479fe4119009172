"""Object paths (TF-Keras convention) and `explain` (backend-neutral)."""

import keras
import pytest
from helpers import fake_mesh

import keras_layoutmap as klm
from keras_layoutmap import paths


class Block(keras.layers.Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(8)

    def call(self, x):
        return self.dense(x)


class Subclassed(keras.Model):
    def __init__(self):
        super().__init__()
        self.feature = keras.layers.Dense(16)
        self.blocks = [Block(), Block()]
        self.heads = {"out": keras.layers.Dense(4)}
        self.scale = self.add_weight(shape=(), name="scale")

    def call(self, x):
        x = self.feature(x)
        for block in self.blocks:
            x = block(x)
        return self.heads["out"](x) * self.scale


def _by_path(model):
    return {v.path: p for v, p in
            ((v, paths.object_paths(model)[id(v)]) for v in model.weights)}


def test_subclassed_attribute_paths():
    model = Subclassed()
    model(keras.ops.zeros((2, 4)))
    assert sorted(paths.object_paths(model).values()) == sorted([
        "scale", "feature.kernel", "feature.bias",
        "blocks.0.dense.kernel", "blocks.0.dense.bias",
        "blocks.1.dense.kernel", "blocks.1.dense.bias",
        "heads.out.kernel", "heads.out.bias",
    ])


def test_functional_and_sequential_use_layer_names():
    inputs = keras.Input((4,))
    x = keras.layers.Dense(8, name="d1")(inputs)
    x = Block(name="blk")(x)
    functional = keras.Model(inputs, keras.layers.Dense(2, name="d2")(x))
    assert sorted(paths.object_paths(functional).values()) == sorted([
        "d1.kernel", "d1.bias", "blk.dense.kernel", "blk.dense.bias",
        "d2.kernel", "d2.bias"])
    sequential = keras.Sequential([keras.Input((4,)),
                                   keras.layers.Dense(3, name="s1")])
    assert sorted(paths.object_paths(sequential).values()) == [
        "s1.bias", "s1.kernel"]


def test_bottom_up_path_agrees_with_top_down():
    model = Subclassed()
    model(keras.ops.zeros((2, 4)))
    dense = model.blocks[1].dense
    assert paths.object_path(dense, "kernel") == "blocks.1.dense.kernel"
    assert paths.object_path(model, "scale") == "scale"
    inputs = keras.Input((4,))
    layer = keras.layers.Dense(2, name="lonely")
    layer(inputs)
    assert paths.object_path(layer, "kernel") == "lonely.kernel"


class SelfAttentionHolder(keras.layers.Layer):
    """keras-hub's transformer layers keep attention in an attribute named
    `_self_attention_layer`, made in `build()`."""

    def build(self, shape):
        self._self_attention_layer = Block(name="self_attention")
        self._self_attention_layer.build(shape)

    def call(self, x):
        return self._self_attention_layer(x)


def test_a_layer_under_a_self_prefixed_attribute_has_one_path():
    """The path a weight gets while it is created (a rule placing it) is
    the one `explain` reports: an attribute starting with `_self_` holding
    a layer is a child like any other (tf.Module's own `_self_...`
    containers are not)."""
    inputs = keras.Input((4,))
    model = keras.Model(inputs, SelfAttentionHolder(name="decoder")(inputs))
    dense = model.get_layer("decoder")._self_attention_layer.dense
    expected = "decoder._self_attention_layer.dense.kernel"
    assert paths.object_path(dense, "kernel") == expected
    assert _by_path(model)[dense.kernel.path] == expected
    layout_map = klm.LayoutMap(fake_mesh([("batch", 4), ("model", 2)]))
    layout_map[r"decoder\._self_attention_layer\.dense\.kernel"] = (None, "model")
    row = next(r for r in layout_map.explain(model).rows
               if r.path == dense.kernel.path)
    assert row.object_path == expected and row.rule is not None


def test_explain_report():
    mesh = fake_mesh([("batch", 4), ("model", 2)])
    lm = klm.LayoutMap(mesh)
    lm[r"feature\.kernel"] = (None, "model")
    lm[r".*dense.*kernel"] = ("model", None)
    lm[r"blocks\.0\.dense\.kernel"] = (None, None)  # shadowed by the rule above
    lm[r"nothing.*"] = ("model",)  # matches nothing
    model = Subclassed()
    model(keras.ops.zeros((2, 4)))
    report = lm.explain(model)
    rows = {r.object_path: r for r in report.rows}
    assert len(rows) == len(model.weights)
    assert rows["feature.kernel"].rule == r"feature\.kernel"
    assert rows["feature.kernel"].layout.axes == (None, "model")
    assert rows["feature.kernel"].bytes_per_device == 4 * 16 // 2 * 4
    assert rows["blocks.0.dense.kernel"].rule == r".*dense.*kernel"
    assert rows["blocks.0.dense.kernel"].bytes_per_device == 16 // 2 * 8 * 4
    assert rows["feature.bias"].rule is None
    assert rows["feature.bias"].layout.axes == (None,)
    assert rows["feature.bias"].path == model.feature.bias.path
    assert rows["feature.bias"].shape == (16,)
    assert report.unused_rules == [r"nothing.*"]
    assert report.shadowed_rules == [r"blocks\.0\.dense\.kernel"]
    assert report.bytes_per_device == sum(r.bytes_per_device for r in report.rows)
    text = report.render(width=200)
    assert "feature.kernel" in text and "shadowed" in text
    assert f"{report.bytes_per_device:,}" in text


def test_explain_one_device_mesh_matches_variable_paths():
    mesh = fake_mesh([("batch", 1)])
    lm = klm.LayoutMap(mesh)
    lm["sequential.*/d1/kernel"] = (None, "batch")
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2, name="d1")],
                             name="sequential_x")
    report = lm.explain(model)
    row = next(r for r in report.rows if r.object_path == "d1.kernel")
    assert row.rule == "sequential.*/d1/kernel"


def test_explain_reports_bad_rule_for_weight(mesh_2d):
    lm = klm.LayoutMap(mesh_2d)
    lm["d1.kernel"] = (None, "batch")  # 3 % 4 != 0
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, name="d1")])
    with pytest.raises(ValueError, match=r"d1.kernel.*size 3.*'batch' \(size 4\)"):
        lm.explain(model)


def test_parent_links_survive_layers_added_after_construction():
    """Children attached in `build` or appended later are still found."""

    class Late(keras.layers.Layer):
        def build(self, shape):
            self.inner = keras.layers.Dense(2)
            self.inner.build(shape)

        def call(self, x):
            return self.inner(x)

    class Holder(keras.Model):
        def __init__(self):
            super().__init__()
            self.blocks = []
            for _ in range(2):
                self.blocks.append(Late())

        def call(self, x):
            for block in self.blocks:
                x = block(x)
            return x

    model = Holder()
    model(keras.ops.zeros((1, 2)))
    inner = model.blocks[1].inner
    assert paths.object_path(inner, "kernel") == "blocks.1.inner.kernel"
    assert paths.object_paths(model)[id(inner.kernel)] == "blocks.1.inner.kernel"


def test_model_inside_a_functional_model_keeps_its_own_paths():
    def backbone():
        inputs = keras.Input((4,))
        x = keras.layers.Dense(8, name="token_embedding")(inputs)
        return keras.Model(inputs, Block(name="blk")(x), name="backbone")

    inner = backbone()
    inputs = keras.Input((4,))
    wrapped = keras.Model(inputs, keras.layers.Dense(2, name="head")(inner(inputs)))
    top_down = sorted(paths.object_paths(wrapped).values())
    assert top_down == sorted(["token_embedding.kernel", "token_embedding.bias",
                               "blk.dense.kernel", "blk.dense.bias",
                               "head.kernel", "head.bias"])
    # Built lazily inside a Sequential wrapper: the same paths bottom-up.
    late = keras.Sequential([backbone(), keras.layers.Dense(2, name="head")])
    late.build((None, 4))
    dense = late.layers[0].get_layer("blk").dense
    assert paths.object_path(dense, "kernel") == "blk.dense.kernel"


def _long_names_report():
    mesh = fake_mesh([("batch", 4), ("model", 2)])
    lm = klm.LayoutMap(mesh)
    lm[r"a_rather_long_layer_name_for_a_block_\d+\.dense\.kernel"] = (None, "model")
    lm[r"a_rule_that_matches_nothing_at_all_and_has_a_long_name\.kernel"] = (None,)
    inputs = keras.Input((4,))
    x = inputs
    for i in range(3):
        x = keras.layers.Dense(8, name=f"a_rather_long_layer_name_for_a_block_{i}")(x)
    return lm.explain(keras.Model(inputs, x))


@pytest.mark.parametrize("width", [80, 120])
def test_table_fits_the_width(width):
    text = _long_names_report().render(width=width)
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= width
    assert "rules matching no weight" in text
    # Every weight has its row (long paths fold onto several lines).
    assert text.count("(4, 8)") == 1 and text.count("(8, 8)") == 2
    assert text.count("(8,) ") == 3


def test_str_uses_the_terminal_width(monkeypatch):
    report = _long_names_report()
    monkeypatch.setenv("COLUMNS", "80")
    narrow = str(report)
    monkeypatch.setenv("COLUMNS", "200")
    wide = str(report)
    assert max(len(line) for line in narrow.splitlines()) <= 80
    assert max(len(line) for line in wide.splitlines()) > 80
