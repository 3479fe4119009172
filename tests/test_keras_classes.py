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
