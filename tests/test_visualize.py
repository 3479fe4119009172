"""`klm.visualize`: which devices hold each block, checked against the
pieces the backend really holds; `Report.show` and `klm explain --show`
draw a plan's weights from shapes alone."""

import io

import keras
import numpy as np
import pytest
from helpers import DEVICES, fake_mesh, mp_mesh

import keras_layoutmap as klm
from keras_layoutmap import cli
from keras_layoutmap.visualize import block_bounds, block_devices, render

LAYOUTS = [("batch", None), (None, "model"), ("batch", "model"),
           ("model", "batch"), (None, None)]


@pytest.mark.sharding
@pytest.mark.parametrize("specs", LAYOUTS, ids=str)
def test_block_map_matches_the_pieces_the_backend_holds(specs):
    """Each local device's piece (`klm.unpack`, read from the backend)
    equals the block the picture puts that device in."""
    mesh = mp_mesh()
    value = np.arange(8 * 12, dtype="float32").reshape(8, 12)
    x = klm.distribute(value, klm.Layout(list(specs), mesh))
    layout = klm.fetch_layout(x)
    blocks = block_devices(layout, value.shape)
    bounds = block_bounds(layout, value.shape)
    assert sorted(d for held in blocks.values() for d in held) == sorted(
        str(d) for d in np.ravel(mesh.devices))  # each device once
    owner = {d: index for index, held in blocks.items() for d in held}
    pieces = klm.unpack(x)
    assert len(pieces) == len(mesh.local_devices())
    for device, piece in zip(mesh.local_devices(), pieces):
        index = owner[str(device)]
        region = tuple(slice(*bounds[dim][b]) for dim, b in enumerate(index))
        np.testing.assert_array_equal(np.asarray(piece), value[region],
                                      err_msg=str(device))


@pytest.mark.sharding
def test_picture_of_a_variable_printed_once():
    """A weight made under a LayoutMap: every block, its devices and its
    range; in a run of several processes only process 0 prints."""
    mesh = mp_mesh()
    rows = DEVICES // 2
    layout_map = klm.LayoutMap(mesh)
    layout_map["d1.kernel"] = ("batch", None)
    with layout_map.scope():
        model = keras.Sequential([keras.Input((4 * rows,)),
                                  keras.layers.Dense(6, name="d1")])
    kernel = model.layers[0].kernel
    out = io.StringIO()
    klm.visualize(kernel, file=out)
    text = out.getvalue()
    if klm.process_index() != 0:
        assert text == ""
        return
    assert kernel.path in text and "['batch', 'unsharded']" in text
    assert "rows: dimension 0 (size" in text
    for i in range(rows):  # batch row i of the mesh: devices 2i and 2i+1
        assert f"cpu {2 * i},{2 * i + 1}" in text
        assert f"[{4 * i}:{4 * i + 4}, 0:6]" in text
    bias = io.StringIO()
    klm.visualize(model.layers[0].bias, file=bias)  # replicated: all devices
    everyone = ",".join(str(i) for i in range(DEVICES))
    assert f"cpu {everyone}" in bias.getvalue()


@pytest.mark.sharding
def test_standard_output_by_default(capsys):
    mesh = mp_mesh()
    x = klm.distribute(np.zeros((4, 4)), klm.Layout([None, "model"], mesh))
    klm.visualize(x)
    out = capsys.readouterr().out
    if klm.process_index() == 0:
        assert "split over 'model' (2)" in " ".join(out.split())
        assert "[0:4, 2:4]" in out
    else:
        assert out == ""


@pytest.mark.parametrize("value, words", [
    (np.zeros((3, 2)), "numpy.ndarray of shape (3, 2), a host value on no mesh"),
    ([1.0, 2.0], "builtins.list"),
])
def test_host_values_are_refused(value, words):
    with pytest.raises(TypeError, match="klm.visualize expects a tensor") as e:
        klm.visualize(value)
    assert words in str(e.value) and "klm.distribute(x, layout)" in str(e.value)


def test_a_tensor_on_no_mesh_is_refused():
    with pytest.raises(TypeError, match="lives on one device, on no mesh"):
        klm.visualize(keras.ops.ones((3, 2)))


def test_higher_rank_says_which_dimensions_are_shown():
    mesh = fake_mesh([("batch", 2), ("model", 2)])
    text = render(klm.Layout([None, "model", None, None], mesh), (3, 4, 4, 8))
    assert ("rows: dimension 1 (size 4, split over 'model' (2)); columns: "
            "dimension 3 (size 8, whole); rank 4: dimension 0 (size 3), "
            "dimension 2 (size 4) whole in every block") in " ".join(
                text.split())
    assert "cpu 0,2" in text and "[0:2, 0:8]" in text
    assert "cpu 1,3" in text and "[2:4, 0:8]" in text


def test_three_split_dimensions_get_a_grid_per_block():
    mesh = fake_mesh([("a", 2), ("b", 2), ("c", 2)])
    text = render(klm.Layout(["a", "b", "c"], mesh), (4, 4, 4))
    assert "dimension 2 block 1 of 2 [0:2]" in text
    assert "dimension 2 block 2 of 2 [2:4]" in text
    # device at mesh position (i, j, k) = 4i + 2j + k
    first, second = text.split("dimension 2 block 2 of 2")
    for device in (0, 2, 4, 6):
        assert f"cpu {device} " in first and f"cpu {device} " not in second
    assert "cpu 7 " in second


def planned_model():
    inputs = keras.Input((16,))
    x = keras.layers.Dense(32, name="d1")(inputs)
    x = keras.layers.Reshape((4, 8))(x)
    x = keras.layers.EinsumDense("abc,cd->abd", (4, 6), name="e1")(x)
    return keras.Model(inputs, x, name="planned")


def test_report_show_draws_from_shapes(capsys):
    mesh = fake_mesh([("batch", 2), ("model", 4)])
    layout_map = klm.LayoutMap(mesh)
    layout_map[r"d1\.kernel"] = (None, "model")
    with keras.StatelessScope(initialize_variables=False):
        model = planned_model()
    report = layout_map.explain(model)
    out = io.StringIO()
    drawn = report.show(r"d1\..*", file=out)
    assert [r.object_path for r in drawn] == ["d1.kernel", "d1.bias"]
    text = out.getvalue()
    assert "d1.kernel (d1/kernel) (16, 32) float32" in text
    assert "cpu 0,4" in text and "[0:16, 0:8]" in text  # model column 0
    assert "cpu 0,1,2,3,4,5,6,7" in text  # the bias, replicated
    with pytest.raises(ValueError, match="matches no weight"):
        report.show("nothing")
    with pytest.raises(ValueError, match="not a valid regex"):
        report.show("(")


BUILDER = '''
import keras


def planned():
    inputs = keras.Input((16,))
    return keras.Model(inputs, keras.layers.Dense(128, name="d1")(inputs))
'''


def test_cli_show(tmp_path, monkeypatch, capsys):
    (tmp_path / "klm_show_builders.py").write_text(BUILDER)
    (tmp_path / "rules.json").write_text(
        '{"rules": [["d1\\\\.kernel", [null, "model"]]]}')
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    args = ["explain", "klm_show_builders:planned", "--mesh",
            "batch=1,model=64", "--rules", "rules.json"]
    assert cli.main([*args, "--show", r"d1\.kernel", "--width", "100"]) == 0
    out = capsys.readouterr().out
    assert "total bytes per device" in out
    assert "d1.kernel" in out and "cpu 63" in out and "[0:16, 126:128]" in out
    assert cli.main([*args, "--show", "nothing"]) == 2
    assert "--show: the regex 'nothing' matches no weight" in (
        capsys.readouterr().err)
    assert cli.main([*args, "--show", "d1.kernel", "--json"]) == 2
    assert "--json" in capsys.readouterr().err
