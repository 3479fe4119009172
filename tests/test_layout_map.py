"""Rules: matching, precedence, errors and rules as data (backend-neutral)."""

import json

import keras
import pytest
from helpers import fake_mesh

import keras_layoutmap as klm


@pytest.fixture
def layout_map(mesh_2d):
    lm = klm.LayoutMap(mesh_2d)
    lm[r".*dense.*kernel"] = (None, "model")
    lm[r".*dense.*bias"] = ("model",)
    lm[r".*kernel"] = ("model", None)
    return lm


def test_is_a_keras_layout_map(layout_map):
    assert isinstance(layout_map, keras.distribution.LayoutMap)
    assert layout_map.get_default_mesh() is layout_map.device_mesh
    assert list(layout_map) == [r".*dense.*kernel", r".*dense.*bias", r".*kernel"]
    assert len(layout_map) == 3


def test_first_rule_in_insertion_order_wins(layout_map):
    # ".*dense.*kernel" and ".*kernel" both match; the earlier one wins.
    assert layout_map["dense_1.kernel"].axes == (None, "model")
    assert layout_map["conv.kernel"].axes == ("model", None)
    assert layout_map["dense_1.gamma"] is None


def test_exact_key_beats_earlier_regex(layout_map):
    layout_map["dense_1.kernel"] = (None, None)
    assert layout_map["dense_1.kernel"].axes == (None, None)
    assert layout_map["dense_2.kernel"].axes == (None, "model")


def test_match_uses_either_key_and_reports_rule(layout_map):
    rule, layout = layout_map.match("feature.kernel", "model/dense_3/kernel")
    # ".*dense.*kernel" (rule 0) matches the variable path; ".*kernel"
    # (rule 2) matches both; the earliest rule over both keys wins.
    assert rule == r".*dense.*kernel"
    assert layout.axes == (None, "model")


def test_fullmatch_not_search(mesh_2d):
    lm = klm.LayoutMap(mesh_2d)
    lm["d1"] = ("model",)
    assert lm["d1.bias"] is None
    assert lm["d1"] is not None


def test_rules_with_groups_and_backreferences(mesh_2d):
    lm = klm.LayoutMap(mesh_2d)
    lm[r"(a|b)\.(?P<w>kernel)"] = (None, "model")
    lm[r"(x)\1\.kernel"] = ("model", None)  # numbered back-reference
    lm[r".*"] = (None, None)
    assert lm["a.kernel"].axes == (None, "model")
    assert lm["xx.kernel"].axes == ("model", None)
    assert lm["xy.kernel"].axes == (None, None)


def test_tuple_value_uses_map_mesh(mesh_2d):
    lm = klm.LayoutMap(mesh_2d)
    lm["w"] = ("batch", "unsharded")
    assert lm["w"] == klm.Layout(["batch", None], mesh_2d)


def test_mesh_taken_from_first_layout(mesh_2d):
    lm = klm.LayoutMap()
    lm["w"] = klm.Layout(["model"], mesh_2d)
    assert lm.get_default_mesh() == mesh_2d
    lm["v"] = ("batch",)
    assert lm["v"].mesh == mesh_2d


def test_delete_rule(layout_map):
    del layout_map[r".*dense.*kernel"]
    assert layout_map["dense_1.kernel"].axes == ("model", None)


# --- errors, each naming the rule, the axis and sizes ----------------------

def test_invalid_regex(mesh_2d):
    lm = klm.LayoutMap(mesh_2d)
    with pytest.raises(ValueError, match=r"Rule '\(unclosed' is not a valid regex"):
        lm["(unclosed"] = ("model",)
    assert len(lm) == 0


def test_duplicate_key(layout_map):
    # It begins as TF-Keras 2's "<key> already exist in the LayoutMap ..."
    # (ported tests match that), then says more.
    with pytest.raises(ValueError) as info:
        layout_map[r".*kernel"] = (None, None)
    message = str(info.value)
    assert message.startswith(".*kernel already exist in the LayoutMap with "
                              "value ['model', 'unsharded']")
    assert "rule '.*kernel' is already there; delete it first" in message
    assert layout_map["x.kernel"].axes == ("model", None)
    # A ported TF-Keras 2 test's own pattern.
    layout_map["dense/kernel"] = (None, "model")
    with pytest.raises(ValueError, match="dense/kernel already exist in the "
                       "LayoutMap"):
        layout_map["dense/kernel"] = (None, None)


def test_value_not_a_layout(mesh_2d):
    lm = klm.LayoutMap(mesh_2d)
    # A TypeError, and the ValueError Keras 3 / TF-Keras 2 raise for it.
    for error in (TypeError, ValueError):
        with pytest.raises(error, match=r"Rule 'w'.*Received: 3 of type int"):
            lm["w"] = 3
    assert "w" not in list(lm)


def test_axis_not_in_mesh(mesh_2d):
    lm = klm.LayoutMap(mesh_2d)
    with pytest.raises(ValueError, match=r"^Rule 'w': axis 'feature' is not in "
                       r"the mesh.*'batch': 4, 'model': 2.*received sharding "
                       r"specs \[None, 'feature'\]"):
        lm["w"] = (None, "feature")
    assert len(lm) == 0


def test_axis_not_in_mesh_given_as_a_layout_without_mesh(mesh_2d):
    lm = klm.LayoutMap(mesh_2d)
    with pytest.raises(ValueError, match=r"^Rule 'w': axis 'feature' is not"):
        lm["w"] = keras.distribution.TensorLayout([None, "feature"])
    assert len(lm) == 0


def test_axis_used_twice(mesh_2d):
    lm = klm.LayoutMap(mesh_2d)
    with pytest.raises(ValueError, match=r"^Rule 'w': mesh axis 'model' is used "
                       r"for more than one dimension in \['model', 'model'\]"):
        lm["w"] = ("model", "model")
    assert len(lm) == 0


def test_axis_not_a_string(mesh_2d):
    lm = klm.LayoutMap(mesh_2d)
    with pytest.raises(TypeError, match=r"^Rule 'w': each sharding spec must be "
                       r"a mesh axis name.*Received: 3 of type int"):
        lm["w"] = (None, 3)
    assert len(lm) == 0


def test_spec_written_as_a_string_is_not_split_into_letters(mesh_2d):
    lm = klm.LayoutMap(mesh_2d)
    with pytest.raises(TypeError, match=r"^Rule 'w': a layout is a tuple.*not a "
                       r"string. Received: 'model'; for a rank-1 weight write "
                       r"\('model',\)"):
        lm["w"] = "model"
    assert len(lm) == 0


def test_refused_rule_leaves_a_meshless_map_unchanged(mesh_2d):
    lm = klm.LayoutMap()
    with pytest.raises(ValueError, match="Rule 'w'.*no mesh"):
        lm["w"] = keras.distribution.TensorLayout(["feature"])
    assert lm.device_mesh is None and len(lm) == 0


def test_batch_sharded_axis_out_of_range(mesh_2d):
    with pytest.raises(ValueError, match=r"Layout.batch_sharded: `axis` must be "
                       r"a dimension of a rank-2 tensor, an int in \[-2, 1\]. "
                       r"Received: axis=5"):
        klm.Layout.batch_sharded(mesh_2d, "batch", rank=2, axis=5)
    with pytest.raises(ValueError, match=r"`rank` must be a non-negative int.*"
                       r"rank=-1"):
        klm.Layout.replicated(mesh_2d, rank=-1)
    with pytest.raises(ValueError, match="rank-0 tensor has no last dimension"):
        klm.Layout.inner_sharded(mesh_2d, "model", rank=0)
    assert klm.Layout.batch_sharded(mesh_2d, "batch", 2, axis=-1).axes == (
        None, "batch")


def test_layout_on_another_mesh(mesh_2d):
    lm = klm.LayoutMap(mesh_2d)
    other = fake_mesh([("batch", 2), ("model", 4)])
    with pytest.raises(ValueError, match=r"Rule 'w'.*Mesh\(batch=2, model=4\)"):
        lm["w"] = klm.Layout(["model"], other)
    assert len(lm) == 0


def test_rank_mismatch_names_rule_path_and_sizes(layout_map):
    with pytest.raises(ValueError) as info:
        layout_map.resolve((64,), "d1.kernel", "seq/d1/kernel")
    message = str(info.value)
    for part in ["d1.kernel / seq/d1/kernel", "(64,)", "rank 1", "rank 2",
                 r"rule '.*kernel'"]:
        assert part in message


def test_indivisible_dimension_names_axis_and_sizes(layout_map):
    with pytest.raises(ValueError) as info:
        layout_map.resolve((64, 33), "dense.kernel", "m/dense/kernel")
    message = str(info.value)
    for part in ["dense.kernel", "(64, 33)", "dimension 1 (size 33)",
                 "mesh axis 'model' (size 2)", r"rule '.*dense.*kernel'"]:
        assert part in message


def test_unmatched_weight_is_replicated(layout_map):
    rule, layout = layout_map.resolve((3, 5), "norm.gamma", "m/norm/gamma")
    assert rule is None
    assert layout == klm.Layout.replicated(layout_map.device_mesh, 2)


# --- rules as data -----------------------------------------------------------

def test_json_roundtrip(layout_map):
    text = layout_map.to_json()
    data = json.loads(text)
    assert data["mesh"] == {"dims": [["batch", 4], ["model", 2]]}
    again = klm.LayoutMap.from_json(text, mesh=layout_map.device_mesh)
    assert list(again) == list(layout_map)
    for key in layout_map:
        assert again[key] == layout_map[key]


def test_json_onto_another_mesh(layout_map):
    other = fake_mesh([("batch", 2), ("model", 4)])
    again = klm.LayoutMap.from_json(layout_map.to_json(), mesh=other)
    assert again["x.dense.kernel"] == klm.Layout([None, "model"], other)


def test_rules_files(tmp_path, mesh_2d):
    yaml_text = """
mesh:
  dims: [[batch, 4], [model, 2]]
rules:
  - [".*dense.*kernel", [unsharded, model]]
  - [".*dense.*bias", [model]]
"""
    toml_text = """
rules = [[".*dense.*kernel", ["unsharded", "model"]],
         [".*dense.*bias", ["model"]]]
[mesh]
dims = [["batch", 4], ["model", 2]]
"""
    json_text = json.dumps({"rules": [[".*dense.*kernel", [None, "model"]],
                                      [".*dense.*bias", ["model"]]]})
    for name, text in [("r.yaml", yaml_text), ("r.toml", toml_text),
                       ("r.json", json_text)]:
        path = tmp_path / name
        path.write_text(text)
        lm = klm.LayoutMap.from_file(path, mesh=mesh_2d)
        assert list(lm) == [".*dense.*kernel", ".*dense.*bias"]
        assert lm["d.dense.kernel"] == klm.Layout([None, "model"], mesh_2d)
    bad = tmp_path / "r.ini"
    bad.write_text("")
    with pytest.raises(ValueError, match="Unknown rules file type"):
        klm.LayoutMap.from_file(bad)


def test_from_config_rejects_garbage():
    with pytest.raises(ValueError, match="'rules' list"):
        klm.LayoutMap.from_config({"nope": 1})


@pytest.mark.parametrize("entry, error, message", [
    ([".*kernel"], ValueError,
     r"Rule entry 0 is \['\.\*kernel'\]; expected a \[regex, sharding_specs\] pair"),
    ("not a pair", ValueError, r"Rule entry 0 is 'not a pair'; expected"),
    ({"rule": ".*kernel"}, ValueError,
     r"Rule entry 0 is a table .*expected exactly the keys 'rule'.*and "
     r"'layout'.*missing \['layout'\]"),
    ([".*kernel", "model"], TypeError,
     r"Rule '\.\*kernel': a layout is a tuple.*not a string. Received: 'model'"),
    ([".*kernel", [None, "feature"]], ValueError,
     r"Rule '\.\*kernel': axis 'feature' is not in the mesh"),
    ([".*kernel", ["model", "model"]], ValueError,
     r"Rule '\.\*kernel': mesh axis 'model' is used for more than one"),
    ([".*kernel", [None, 2]], TypeError,
     r"Rule '\.\*kernel': each sharding spec must be a mesh axis name.*"
     r"Received: 2 of type int"),
])
def test_malformed_rule_entries_name_the_rule(mesh_2d, entry, error, message):
    with pytest.raises(error, match=message):
        klm.LayoutMap.from_config({"rules": [entry]}, mesh=mesh_2d)


def test_rules_file_errors_name_the_file_and_rule(tmp_path, mesh_2d):
    toml = tmp_path / "r.toml"
    toml.write_text('[[rules]]\nrule = ".*kernel"\n')
    with pytest.raises(ValueError, match=r"r\.toml: Rule entry 0 is a table.*"
                       r"missing \['layout'\]"):
        klm.LayoutMap.from_file(toml, mesh=mesh_2d)
    yaml_file = tmp_path / "r.yaml"
    yaml_file.write_text("rules:\n  - ['.*kernel', model]\n")
    with pytest.raises(TypeError, match=r"r\.yaml: Rule '\.\*kernel': a layout is "
                       r"a tuple.*not a string"):
        klm.LayoutMap.from_file(yaml_file, mesh=mesh_2d)
    broken = tmp_path / "r.json"
    broken.write_text('{"rules": [')
    with pytest.raises(ValueError, match=r"r\.json: not valid JSON"):
        klm.LayoutMap.from_file(broken, mesh=mesh_2d)
    with pytest.raises(FileNotFoundError):
        klm.LayoutMap.from_file(tmp_path / "missing.json", mesh=mesh_2d)


def test_from_keras_layout_map(mesh_2d):
    keras_map = keras.distribution.LayoutMap(mesh_2d)
    keras_map["token_embedding/embeddings"] = ("model", None)
    keras_map[".*ffw.*kernel"] = (None, "model")
    lm = klm.LayoutMap.from_keras(keras_map)
    assert list(lm) == list(keras_map)
    assert lm["token_embedding/embeddings"].axes == ("model", None)


def test_matcher_agrees_with_a_naive_first_match_loop():
    import re

    from keras_layoutmap.rules.matching import Matcher as _Matcher

    rules = [r"block_1\.mlp\..*", r"(?i)BLOCK_2\..*kernel", r"ab*c", r"abc|xyz",
             r"block_1\.mlp\.w1\.kernel", r"(x)\1", r"model/block_\d+/.*bias",
             r"block_.*attention.*", r"block_3.*", r".*kernel", r"d1"]
    keys = ["block_1.mlp.w1.kernel", "block_2.attention.kernel", "ac", "abbbc",
            "xyz", "abc", "xx", "model/block_7/mlp/bias", "block_3.norm.gamma",
            "d1", "d1.kernel", "nothing", "block_10.attention.query.kernel"]
    matcher = _Matcher(rules)
    for key in keys:
        naive = next((i for i, r in enumerate(rules) if re.fullmatch(r, key)), None)
        assert matcher.first(key) == naive, key


@pytest.mark.parametrize("join_after", [1, 3, 10_000])
def test_matcher_blocks_agree_with_a_naive_loop(monkeypatch, join_after):
    # Many broad rules span several blocks; joined (after `join_after`
    # tries) or not, first() and all() agree with a naive loop.
    import re

    from keras_layoutmap.rules.matching import Matcher as _Matcher

    monkeypatch.setattr(_Matcher, "JOIN_AFTER", join_after)
    rules = [rf".*blk_{j}\..*" for j in range(100)]
    rules[37] = r".*blk_(\d)\1\..*"  # a back-reference: never joined
    rules[70] = r"(?i).*BLK_7\d\.kernel"  # inline flags: never joined
    rules += [r"blk_5\.kernel", r".*kernel", r"blk_.*"]
    keys = [f"blk_{j}.{w}" for j in range(0, 110, 3) for w in ("kernel", "bias")]
    matcher = _Matcher(rules)
    for _ in range(3):
        for key in keys:
            hits = [i for i, r in enumerate(rules) if re.fullmatch(r, key)]
            assert matcher.all(key) == hits, key
            assert matcher.first(key) == (hits[0] if hits else None), key
    for key in keys:  # first() without all() having seen the key
        fresh = _Matcher(rules)
        naive = next((i for i, r in enumerate(rules) if re.fullmatch(r, key)), None)
        assert fresh.first(key) == naive
