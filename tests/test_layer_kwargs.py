"""`<weight>_layout=` kwargs on stock layers (backend-neutral)."""

import inspect

import keras
import numpy as np
import pytest
from helpers import fake_mesh

import keras_layoutmap as klm
from keras_layoutmap.layer_kwargs import weight_layouts


@pytest.fixture
def mesh1():
    return fake_mesh([("batch", 1)])


def _weight_creating_layers():
    """Every public stock layer whose constructor takes an initializer."""
    for name, cls in sorted(vars(keras.layers).items()):
        if not (inspect.isclass(cls) and issubclass(cls, keras.layers.Layer)):
            continue
        params = inspect.signature(cls.__init__).parameters
        if any(p.endswith("_initializer") for p in params):
            yield name, cls


def test_every_weight_creating_layer_accepts_layout_kwargs(mesh1):
    """Derived from the layers themselves: each `X_initializer` parameter
    means a weight; its `<weight>_layout=` is accepted and kept in config."""
    checked = 0
    for name, cls in _weight_creating_layers():
        params = inspect.signature(cls.__init__).parameters
        if not any(p.kind == p.VAR_KEYWORD for p in params.values()):
            continue
        required = [p for p in list(params.values())[1:]
                    if p.default is p.empty and p.kind == p.POSITIONAL_OR_KEYWORD]
        args = {p.name: 2 for p in required}
        if "kernel_size" in args:
            args["kernel_size"] = 1
        if name in ("MultiHeadAttention", "GroupedQueryAttention"):
            args = {"num_heads": 2, "key_dim": 2}
            if name == "GroupedQueryAttention":
                args = {"head_dim": 2, "num_query_heads": 2, "num_key_value_heads": 1}
        if name == "EinsumDense":
            args = {"equation": "ab,bc->ac", "output_shape": 2}
        try:
            layer = cls(**args, kernel_layout=klm.Layout([None, None], mesh1))
        except TypeError:
            continue  # needs arguments this generic constructor cannot guess
        assert weight_layouts(layer)["kernel"] == klm.Layout([None, None], mesh1)
        config = layer.get_config()
        assert config["kernel_layout"]["sharding_specs"] == ["unsharded"] * 2
        checked += 1
    assert checked >= 15


def test_dense_kwargs_roundtrip_config(mesh1):
    dense = keras.layers.Dense(4, kernel_layout=klm.Layout([None, "batch"], mesh1),
                               bias_layout=klm.Layout(["batch"], mesh1), name="d")
    again = keras.layers.Dense.from_config(dense.get_config())
    assert weight_layouts(again) == weight_layouts(dense)


def test_batchnorm_kwargs(mesh1):
    bn = keras.layers.BatchNormalization(
        gamma_layout=klm.Layout(["batch"], mesh1),
        moving_mean_layout=klm.Layout([None], mesh1))
    assert set(weight_layouts(bn)) == {"gamma", "moving_mean"}
    bn.build((2, 4))
    assert {v.name for v in bn.weights} >= {"gamma", "moving_mean"}


def test_unknown_weight_name_is_an_error(mesh1):
    layer = keras.layers.Dense(4, kernal_layout=klm.Layout([None, None], mesh1),
                               name="typo")
    with pytest.raises(ValueError, match=r"'typo'.*`kernal_layout`.*"
                       r"\['bias', 'kernel'\]"):
        layer.build((2, 3))


def test_not_a_layout_is_a_type_error():
    with pytest.raises(TypeError, match="`kernel_layout`.*Received: 5"):
        keras.layers.Dense(4, kernel_layout=5)


def test_other_unknown_kwargs_still_rejected():
    with pytest.raises(ValueError, match="Unrecognized keyword arguments"):
        keras.layers.Dense(4, kernel_layot=None, kernel_nonsense=1)


def test_model_save_and_load_keeps_layouts(tmp_path, mesh1):
    layout = klm.Layout(["batch", None], mesh1)
    model = keras.Sequential([
        keras.Input((3,)),
        keras.layers.Dense(4, name="d1", kernel_layout=layout),
        keras.layers.Dense(2, name="d2"),
    ])
    x = np.arange(6, dtype="float32").reshape(2, 3)
    expected = keras.ops.convert_to_numpy(model(x))
    path = tmp_path / "model.keras"
    model.save(path)
    loaded = keras.models.load_model(path)
    d1 = loaded.get_layer("d1")
    assert weight_layouts(d1)["kernel"].sharding_specs == ["batch", "unsharded"]
    assert weight_layouts(d1)["kernel"].mesh.dim_names == ["batch"]
    np.testing.assert_allclose(keras.ops.convert_to_numpy(loaded(x)), expected)
