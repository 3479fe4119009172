"""Code written for Keras' own `keras.distribution` (the Keras distribution
guide), unchanged but for `import keras_layoutmap`, runs on every backend as
the klm classes do. Training with Keras' `DataParallel` and `ModelParallel`
equal to one device is the workflow matrix's `keras-data-parallel` and
`keras-model-parallel` rows (test_workflows.py), in every cell; here, the
conversion itself and the docs' guide code."""

import keras
import numpy as np
import pytest

import keras_layoutmap as klm


@pytest.fixture
def no_distribution():
    yield
    keras.distribution.set_distribution(None)


def test_a_keras_distribution_converts_once():
    mesh = keras.distribution.DeviceMesh(
        (1,), ["batch"], devices=klm.list_devices()[:1])
    distribution = keras.distribution.DataParallel(device_mesh=mesh)
    with distribution.scope():
        first = keras.distribution.distribution()
    with distribution.scope():
        assert keras.distribution.distribution() is first
    assert keras.distribution.distribution() is None


def test_a_keras_distribution_changed_after_first_use_is_read_live(
        no_distribution):
    """klm's view of a Keras distribution reads the Keras object each time
    (the matrix's keras-settings-after-use row trains with it): a setting,
    a rule added and one deleted after first use, seen at the next use by
    the same view; a setting made on the view is made on the Keras object."""
    mesh = keras.distribution.DeviceMesh(
        (1, 1), ["batch", "model"], devices=klm.list_devices()[:1])
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map["d1/kernel"] = (None, "model")
    distribution = keras.distribution.ModelParallel(
        layout_map=layout_map, batch_dim_name="batch")
    with distribution.scope():
        view = keras.distribution.distribution()
        assert view.auto_shard_dataset is True
        assert list(view.layout_map) == ["d1/kernel"]
    distribution.auto_shard_dataset = False
    layout_map["d2/kernel"] = ("model", None)
    del layout_map["d1/kernel"]
    keras.distribution.set_distribution(distribution)
    assert keras.distribution.distribution() is view
    assert view.auto_shard_dataset is False
    assert list(view.layout_map) == ["d2/kernel"]
    assert tuple(view.layout_map["d2/kernel"].axes) == ("model", None)
    view.auto_shard_dataset = True
    assert distribution.auto_shard_dataset is True
    data = keras.distribution.DataParallel(device_mesh=keras.distribution.DeviceMesh(
        (1,), ["batch"], devices=klm.list_devices()[:1]))
    with data.scope():
        data_view = keras.distribution.distribution()
    data.auto_shard_dataset = False
    assert data_view.auto_shard_dataset is False
    assert type(data_view).__name__ == "DataParallel"  # as errors name it
    # klm's own ModelParallel given a Keras map reads it live too.
    klm_distribution = klm.ModelParallel(layout_map=layout_map)
    layout_map["d3/kernel"] = (None, "model")
    assert list(klm_distribution.layout_map) == ["d2/kernel", "d3/kernel"]
    assert klm_distribution.layout_map is klm_distribution.layout_map


@pytest.mark.parametrize("value", ["dp", 3, keras.distribution.LayoutMap])
def test_set_distribution_of_something_else_is_a_type_error(value):
    with pytest.raises(TypeError, match="take a Keras distribution"):
        keras.distribution.set_distribution(value)
    with pytest.raises(TypeError, match="take a Keras distribution"):
        klm.set_distribution(value)
    assert keras.distribution.distribution() is None


@pytest.mark.sharding
@pytest.mark.training
def test_docs_keras_guide_runs(no_distribution):
    """docs/keras-distribution.md's Keras guide block, as it stands: both
    models train, and the backend holds d1's kernel split over `model` as
    the guide's rule says (the guide's d1 has no bias: its bias rule
    matches nothing)."""
    import pathlib
    import re

    page = pathlib.Path(__file__).parent.parent / "docs" / "keras-distribution.md"
    (code,) = re.findall(r"## The Keras distribution guide.*?```python\n(.*?)```",
                         page.read_text(), re.S)
    scope = {}
    exec(compile(code, str(page), "exec"), scope)
    model = scope["model"]
    d1 = model.get_layer("d1")
    assert klm.fetch_layout(d1.kernel).sharding_specs == ["unsharded", "model"]
    assert klm.fetch_layout(model.get_layer("d2").kernel).sharding_specs == [
        "unsharded", "unsharded"]
    assert isinstance(keras.distribution.distribution(), klm.ModelParallel)
    history = model.history.history["loss"]
    assert len(history) == 3 and np.isfinite(history).all()
