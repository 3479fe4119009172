"""Fallback layouts: a rule's ordered list of layouts, the first that fits
the weight wins (grouped-query attention: fewer key/value heads than the
model axis)."""

import json

import keras
import pytest
from helpers import fake_mesh, mp_mesh

import keras_layoutmap as klm


@pytest.fixture
def mesh():
    return fake_mesh([("batch", 2), ("model", 4)])


def gqa_model():
    """Query heads (8) divisible by a 4-way model axis, key heads (2) not."""
    inputs = keras.Input((16,))
    q = keras.layers.EinsumDense("bd,dnh->bnh", (8, 4), name="query")(inputs)
    k = keras.layers.EinsumDense("bd,dnh->bnh", (2, 4), name="key")(inputs)
    return keras.Model(inputs, [q, k])


@pytest.fixture
def layout_map(mesh):
    lm = klm.LayoutMap(mesh)
    lm[r"(query|key)\.kernel"] = [(None, "model", None), (None, None, "model"),
                                  (None, None, None)]
    return lm


def test_first_layout_that_fits_wins(layout_map, mesh):
    assert layout_map.resolve((16, 8, 4), "query.kernel")[1].axes == (
        None, "model", None)
    # 2 heads on a 4-way axis: the head dim (4) is the next that fits.
    assert layout_map.resolve((16, 2, 4), "key.kernel")[1].axes == (
        None, None, "model")
    assert layout_map.resolve((16, 2, 2), "key.kernel")[1].axes == (
        None, None, None)
    choice = layout_map.choose((16, 2, 2), "key.kernel")
    assert (choice.index, choice.count) == (2, 3)
    assert [lt.axes for lt, _ in choice.refused] == [
        (None, "model", None), (None, None, "model")]
    assert "mesh axis 'model' (size 4) does not divide dimension 1 (size 2)" in (
        choice.refused[0][1])


def test_getitem_returns_the_first_layout(layout_map, mesh):
    # Keras' contract: `layout_map[path]` is one layout or None; a key has no
    # shape to choose by, so a rule with fallbacks gives its first layout.
    assert layout_map["key.kernel"] == klm.Layout([None, "model", None], mesh)
    assert isinstance(layout_map["key.kernel"], keras.distribution.TensorLayout)
    assert [lt.axes for lt in layout_map.alternatives("key.kernel")] == [
        (None, "model", None), (None, None, "model"), (None, None, None)]
    assert layout_map.alternatives("nothing") == ()


def test_explain_shows_the_alternative_and_refusals(layout_map):
    report = layout_map.explain(gqa_model())
    rows = {r.object_path: r for r in report.rows}
    query, key = rows["query.kernel"], rows["key.kernel"]
    assert (query.alternative, query.alternatives, query.refused) == (0, 3, ())
    assert key.layout.axes == (None, None, "model")
    assert (key.alternative, key.alternatives) == (1, 3)
    assert key.refused == (
        (["unsharded", "model", "unsharded"],
         "mesh axis 'model' (size 4) does not divide dimension 1 (size 2)"),)
    assert report.fallbacks_used == [key]
    text = report.render(width=200)
    assert "(alt 2/3)" in text
    assert ("fallback: key.kernel took layout 2 of 3 of rule '(query|key)\\\\.kernel'"
            in text)
    assert report.to_dict()["weights"][0]["alternatives"] in (1, 3)


def test_config_json_and_files_carry_fallbacks(layout_map, mesh, tmp_path):
    config = layout_map.get_config()
    assert config["rules"] == [[r"(query|key)\.kernel", [
        ["unsharded", "model", "unsharded"], ["unsharded", "unsharded", "model"],
        ["unsharded", "unsharded", "unsharded"]]]]
    again = klm.LayoutMap.from_json(layout_map.to_json(), mesh=mesh)
    assert again.alternatives("key.kernel") == layout_map.alternatives("key.kernel")
    yaml_file = tmp_path / "r.yaml"
    yaml_file.write_text(
        "rules:\n"
        "  - ['.*key.*kernel', [[null, model, null], [null, null, null]]]\n"
        "  - ['.*scale', []]\n")
    toml_file = tmp_path / "r.toml"
    toml_file.write_text(
        '[[rules]]\nrule = ".*key.*kernel"\n'
        'layout = [["unsharded", "model", "unsharded"], '
        '["unsharded", "unsharded", "unsharded"]]\n')
    for path in (yaml_file, toml_file):
        lm = klm.LayoutMap.from_file(path, mesh=mesh)
        assert [lt.axes for lt in lm.alternatives("key.kernel")] == [
            (None, "model", None), (None, None, None)]
    # `[]` in a file is one rank-0 layout (JSON has no tuple).
    assert klm.LayoutMap.from_file(yaml_file, mesh=mesh)["a.scale"].axes == ()
    keras_copy = klm.LayoutMap.from_keras(layout_map)
    assert keras_copy.alternatives("key.kernel") == layout_map.alternatives(
        "key.kernel")


def test_layouts_and_lists_of_lists_are_fallbacks(mesh):
    lm = klm.LayoutMap(mesh)
    lm["a"] = (klm.Layout(["model"], mesh), (None,))
    lm["b"] = [["model", None], [None, None]]
    lm["c"] = ["model", None]  # all axis names: one layout
    lm["d"] = ()  # rank 0
    assert len(lm.alternatives("a")) == 2 and len(lm.alternatives("b")) == 2
    assert lm.alternatives("c") == (klm.Layout(["model", None], mesh),)
    assert lm["d"].axes == ()


# --- bad input -----------------------------------------------------------------

def test_no_layout_fits_names_rule_path_each_alternative_and_why(mesh):
    lm = klm.LayoutMap(mesh)
    lm[r".*key.*kernel"] = [(None, "model", None), (None, None, "model")]
    with pytest.raises(ValueError) as info:
        lm.resolve((16, 2, 6), "attn.key.kernel", "m/attn/key/kernel")
    message = str(info.value)
    for part in [
        "Weight 'attn.key.kernel / m/attn/key/kernel' has shape (16, 2, 6)",
        "none of the 2 layouts of rule '.*key.*kernel' fits it",
        "alternative 1 ['unsharded', 'model', 'unsharded']: mesh axis 'model' "
        "(size 4) does not divide dimension 1 (size 2)",
        "alternative 2 ['unsharded', 'unsharded', 'model']: mesh axis 'model' "
        "(size 4) does not divide dimension 2 (size 6)",
    ]:
        assert part in message
    with pytest.raises(ValueError, match=r"alternative 1 .*: it has rank 3 but "
                       r"the weight has rank 2"):
        lm.resolve((16, 8), "key.kernel")


def test_no_layout_fits_in_explain_names_the_weight(mesh):
    lm = klm.LayoutMap(mesh)
    lm[r"key\.kernel"] = [(None, "model", None), ("batch", "model", None)]
    with pytest.raises(ValueError, match=r"Weight 'key\.kernel / .*key/kernel' "
                       r"has shape \(16, 2, 4\), and none of the 2 layouts"):
        lm.explain(gqa_model())


def test_empty_list(mesh):
    lm = klm.LayoutMap(mesh)
    with pytest.raises(ValueError, match=r"Rule 'w': received an empty list of "
                       r"layouts; expected a layout, or a non-empty list"):
        lm["w"] = []
    assert len(lm) == 0


def test_list_mixing_meshes(mesh):
    other = fake_mesh([("batch", 4), ("model", 2)])
    for lm in (klm.LayoutMap(mesh), klm.LayoutMap()):
        with pytest.raises(ValueError, match=r"Rule 'w': its layouts are on "
                           r"different meshes \(alternative 1 of 2: Mesh\(batch=2, "
                           r"model=4\), alternative 2 of 2: Mesh\(batch=4, "
                           r"model=2\)\)"):
            lm["w"] = [klm.Layout(["model"], mesh), klm.Layout(["model"], other)]
        assert len(lm) == 0
    # Nothing was adopted by the map without a mesh either.
    assert klm.LayoutMap().device_mesh is None


def test_list_mixing_axis_names_and_layouts(mesh):
    lm = klm.LayoutMap(mesh)
    with pytest.raises(TypeError, match=r"Rule 'w': \['model', \(None,\)\] mixes "
                       r"axis names and layouts"):
        lm["w"] = ["model", (None,)]
    assert len(lm) == 0


def test_bad_axis_in_an_alternative_names_it(mesh):
    lm = klm.LayoutMap(mesh)
    with pytest.raises(ValueError, match=r"Rule 'w', alternative 2 of 2: axis "
                       r"'feature' is not in the mesh"):
        lm["w"] = [("model",), ("feature",)]
    assert len(lm) == 0


@pytest.mark.sharding
def test_weights_are_placed_by_the_fallback():
    mesh = mp_mesh(width=4)
    lm = klm.LayoutMap(mesh)
    lm[r"(query|key)\.kernel"] = [(None, "model", None), (None, None, None)]
    with lm.scope():
        model = gqa_model()
    layers = {layer.name: layer for layer in model.layers}
    assert klm.fetch_layout(layers["query"].kernel).axes == (None, "model", None)
    assert klm.fetch_layout(layers["key"].kernel).axes == (None, None, None)
    assert json.loads(lm.to_json())["rules"][0][1][1] == [
        "unsharded", "unsharded", "unsharded"]
