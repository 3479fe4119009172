import keras
import pytest
from helpers import DEVICES, fake_mesh

import keras_layoutmap as klm


def test_create_mesh_properties(mesh_2d):
    assert isinstance(mesh_2d, keras.distribution.DeviceMesh)
    assert mesh_2d.dim_names == ["batch", "model"]
    assert tuple(mesh_2d.shape) == (4, 2)
    assert mesh_2d.size == 8
    assert mesh_2d.dim_size("model") == 2
    assert mesh_2d.devices.shape == (4, 2)


def test_mesh_equality_by_value():
    a = fake_mesh([("batch", 4), ("model", 2)])
    b = fake_mesh([("batch", 4), ("model", 2)])
    c = fake_mesh([("batch", 2), ("model", 4)])
    assert a == b and hash(a) == hash(b)
    assert a != c


def test_device_names_spelled_as_in_the_dtensor_tutorials_compare_equal():
    # The devices of this run, named three ways.
    dims, n = [("batch", DEVICES), ("model", 1)], DEVICES
    lower = fake_mesh(dims)
    upper = klm.create_mesh(dims, devices=[f"CPU:{i}" for i in range(n)])
    full = klm.create_mesh(
        dims,
        devices=[f"/job:localhost/replica:0/task:0/device:CPU:{i}" for i in range(n)])
    assert upper == lower == full
    assert list(upper.devices.ravel()) == [f"cpu:{i}" for i in range(n)]
    assert klm.Layout(["batch", None], upper) == klm.Layout(["batch", None], lower)


@pytest.mark.parametrize("dims", [[("batch",)], "batch", [("a", 2), ("a", 4)]])
def test_create_mesh_rejects_bad_dims(dims):
    with pytest.raises(ValueError):
        klm.create_mesh(dims, devices=[f"cpu:{i}" for i in range(8)])


def test_create_mesh_device_count_mismatch():
    with pytest.raises(ValueError, match="needs 8 devices. Received 3"):
        klm.create_mesh([("batch", 8)], devices=["cpu:0", "cpu:1", "cpu:2"])


def test_dim_size_unknown_axis(mesh_2d):
    with pytest.raises(ValueError, match="'feature' is not in this mesh"):
        mesh_2d.dim_size("feature")


def test_layout_basics(mesh_2d):
    layout = klm.Layout(["batch", klm.UNSHARDED], mesh_2d)
    assert isinstance(layout, keras.distribution.TensorLayout)
    assert layout.sharding_specs == ["batch", "unsharded"]
    assert layout.axes == ("batch", None)
    assert layout.rank == 2
    assert layout.mesh is mesh_2d
    assert layout == klm.Layout(["batch", None], mesh_2d)
    assert hash(layout) == hash(klm.Layout(["batch", None], mesh_2d))
    assert layout != klm.Layout([None, "batch"], mesh_2d)
    assert len({layout, klm.Layout(["batch", None], mesh_2d)}) == 1


def test_layout_constructors(mesh_2d):
    assert klm.Layout.replicated(mesh_2d, 3).sharding_specs == ["unsharded"] * 3
    assert klm.Layout.batch_sharded(mesh_2d, "batch", rank=2).axes == ("batch", None)
    assert klm.Layout.batch_sharded(mesh_2d, "model", rank=3, axis=1).axes == (
        None, "model", None)
    assert klm.Layout.inner_sharded(mesh_2d, "model", rank=2).axes == (None, "model")
    layout = klm.Layout(["batch", None, "model"], mesh_2d)
    assert layout.delete([1]).axes == ("batch", "model")
    assert layout.delete([0, -1]).axes == (None,)


def test_layout_errors(mesh_2d):
    with pytest.raises(ValueError, match="'feature' is not in the mesh"):
        klm.Layout(["feature", None], mesh_2d)
    with pytest.raises(ValueError, match="'model' is used for more than one"):
        klm.Layout(["model", "model"], mesh_2d)
    with pytest.raises(TypeError, match="not a string"):
        klm.Layout("batch", mesh_2d)
    with pytest.raises(TypeError, match="must be a mesh axis name"):
        klm.Layout([3, None], mesh_2d)


def test_layout_config_roundtrip(mesh_2d):
    layout = klm.Layout([None, "model"], mesh_2d)
    config = layout.get_config()
    assert config == {"sharding_specs": ["unsharded", "model"],
                      "mesh": {"dims": [["batch", 4], ["model", 2]]}}
    assert klm.Layout.from_config(config, mesh=mesh_2d) == layout


def test_shard_shape(mesh_2d):
    layout = klm.Layout([None, "model"], mesh_2d)
    assert layout.shard_shape((64, 32)) == (64, 16)


def test_mesh_shape_is_a_tuple_and_callable_like_dtensor(mesh_2d):
    assert mesh_2d.shape == (4, 2) and isinstance(mesh_2d.shape, tuple)
    assert mesh_2d.shape() == [4, 2] and isinstance(mesh_2d.shape(), list)
    # Keras' own uses of DeviceMesh.shape keep working.
    assert mesh_2d.devices.shape == tuple(mesh_2d.shape)


def test_mesh_has_the_dtensor_mesh_methods(mesh_2d):
    assert mesh_2d.device_type() == "CPU"
    assert mesh_2d.strides == [2, 1]
    assert mesh_2d.global_device_ids().tolist() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert mesh_2d.unravel_index()[5] == {"batch": 2, "model": 1}
    assert mesh_2d.coords(5).tolist() == [2, 1]
    assert mesh_2d.contains_dim("model") and not mesh_2d.contains_dim("x")
    local = mesh_2d.local_devices()
    assert len(local) == mesh_2d.num_local_devices() == len(mesh_2d.local_device_ids())
    assert set(local) <= {str(d) for d in mesh_2d.devices.ravel()}
    assert mesh_2d.host_mesh() == mesh_2d  # already on CPUs


def test_mesh_methods_agree_with_dtensor_mesh():
    tf = pytest.importorskip("tensorflow", reason="needs TensorFlow installed")
    from tensorflow.experimental import dtensor

    del tf
    devices = [f"CPU:{i}" for i in range(6)]
    ours = klm.create_mesh([("x", 3), ("y", 2)],
                           devices=[d.lower() for d in devices])
    theirs = dtensor.Mesh(["x", "y"], __import__("numpy").arange(6).reshape(3, 2),
                          list(range(6)), devices)
    assert ours.shape() == theirs.shape()
    assert ours.strides == theirs.strides
    assert ours.unravel_index() == theirs.unravel_index()
    assert ours.global_device_ids().tolist() == theirs.global_device_ids().tolist()
    assert ours.device_type() == theirs.device_type()
    for i in range(6):
        assert ours.coords(i).tolist() == theirs.coords(i).numpy().tolist()
