"""TF-Keras 2 DTensor code, ported by changing imports (`tf.keras` -> `keras`,
`dtensor` / `tf.keras.dtensor.experimental` -> `klm`), runs: the patterns of
TF-Keras 2's `tf_keras/dtensor/*_test.py` and the DTensor tutorials. Each
test names the TF-Keras 2 idiom it ports; docs/porting.md lists them."""

import inspect
import os

import keras
import numpy as np
import pytest
from helpers import fake_mesh, mp_mesh

import keras_layoutmap as klm
from keras_layoutmap import backends

sharding = pytest.mark.sharding


@pytest.fixture
def mesh():
    return mp_mesh()


class SubclassModel(keras.Model):
    def __init__(self):
        super().__init__()
        self.d1 = keras.layers.Dense(16)
        self.d2 = keras.layers.Dense(8)

    def call(self, x):
        return self.d2(self.d1(x))


# -- tf.keras.dtensor.experimental.layout_map_scope (TF-Keras 2.9-2.12) ----

@sharding
def test_layout_map_scope_places_subclassed_model_weights(mesh):
    layout_map = klm.LayoutMap(mesh)
    layout_map["d1.kernel"] = klm.Layout([None, "model"], mesh)
    layout_map["d1.bias"] = klm.Layout(["model"], mesh)
    with klm.layout_map_scope(layout_map):
        model = SubclassModel()
    # Built by its first call, outside the scope, on an input on the mesh.
    model(klm.distribute(np.zeros((8, 4), "float32"),
                         klm.Layout.batch_sharded(mesh, "batch", rank=2)))
    assert klm.fetch_layout(model.d1.kernel) == klm.Layout([None, "model"], mesh)
    assert klm.fetch_layout(model.d1.bias) == klm.Layout(["model"], mesh)
    assert klm.fetch_layout(model.d2.kernel) == klm.Layout.replicated(mesh, 2)


def test_layout_map_scope_refuses_what_is_not_a_layout_map():
    with pytest.raises(TypeError, match="expects a `klm.LayoutMap`.*dict"):
        klm.layout_map_scope({"d1.kernel": ("model",)})


# -- dtensor.Mesh methods used by the strategy-integration tests -----------

def test_mesh_methods_ported_code_calls():
    mesh = fake_mesh([("batch", 4), ("model", 2)])
    # `mesh.shape()` (DTensor) and `mesh.shape` (Keras) both work.
    assert mesh.shape() == [4, 2] and tuple(mesh.shape) == (4, 2)
    assert mesh.device_type() == "CPU"
    assert mesh.strides == [2, 1]
    assert mesh.coords(7).tolist() == [3, 1]
    assert mesh.unravel_index()[2] == {"batch": 1, "model": 0}
    assert mesh.global_device_ids().shape == (4, 2)
    # Every device is this process's, unless each process has one of its own.
    # (on torch every process holds one device, in one process too).
    local = ([int(os.environ.get("RANK", "0"))] if backends.name() == "torch"
             else list(range(8)))
    assert mesh.local_device_ids() == local
    assert mesh.local_devices() == [f"cpu:{i}" for i in local]
    assert mesh.host_mesh() == mesh


# -- dtensor.experimental.optimizers.Adam(mesh=...).add_variable ----------

@sharding
def test_optimizer_add_variable_lives_on_the_optimizers_mesh(mesh):
    optimizer = klm.optimizers.Adam(mesh=mesh)
    variable = optimizer.add_variable(shape=(4, 6), name="extra")
    assert klm.fetch_layout(variable) == klm.Layout.replicated(mesh, 2)


@sharding
def test_optimizer_slot_takes_the_layout_of_its_reference(mesh):
    layout = klm.Layout([None, "model"], mesh)
    model_variable = keras.Variable(
        klm.distribute(np.ones((4, 6), "float32"), layout), name="w")
    optimizer = klm.optimizers.Adam(mesh=mesh)
    slot = optimizer.add_variable_from_reference(model_variable, "test")
    assert klm.fetch_layout(slot) == layout


# -- keras.Variable(DTensor value) keeps the value's layout ----------------

@sharding
def test_variable_made_from_a_mesh_value_keeps_its_layout_and_trains(mesh):
    layout = klm.Layout(["batch", "model"], mesh)
    init = np.arange(32, dtype="float32").reshape(8, 4) / 10
    grad = np.linspace(-1, 1, 32, dtype="float32").reshape(8, 4)
    variable = keras.Variable(klm.distribute(init, layout))
    assert klm.fetch_layout(variable) == layout

    optimizer = klm.optimizers.Adam(0.1, mesh=mesh)
    optimizer.apply_gradients([(klm.distribute(grad, layout), variable)])
    assert klm.fetch_layout(variable) == layout

    # The same step on one device.
    reference = keras.Variable(init)
    keras.optimizers.Adam(0.1).apply_gradients(
        [(keras.ops.convert_to_tensor(grad), reference)])
    np.testing.assert_allclose(keras.ops.convert_to_numpy(variable),
                               keras.ops.convert_to_numpy(reference), rtol=1e-6)
    assert not np.allclose(keras.ops.convert_to_numpy(variable), init)


# -- Dense(kernel_layout=...).kernel_layout and self.kernel_layout = ... ----

def test_layout_kwargs_are_readable_attributes():
    mesh = fake_mesh([("batch", 4), ("model", 2)])
    layout = klm.Layout([None, "model"], mesh)
    dense = keras.layers.Dense(4, kernel_layout=layout)
    assert dense.kernel_layout == layout
    # Only when given, as in TF-Keras 2.
    assert not hasattr(dense, "bias_layout")
    with pytest.raises(AttributeError, match="no attribute 'bias_layout'"):
        dense.bias_layout  # noqa: B018
    assert not hasattr(keras.layers.Dense(4, kernel_layout=None), "kernel_layout")
    with pytest.raises(AttributeError, match="no attribute 'kernel_layot_x'"):
        dense.kernel_layot_x  # noqa: B018


# TF-Keras 2's tf_keras/dtensor/layers_test.py: each layer, made without a
# layout, has no `<weight>_layout` attribute; made with one, has it (and
# its config carries it).
_LAYERS = [
    ("Dense", lambda **kw: keras.layers.Dense(4, **kw), ["kernel", "bias"], 2),
    ("Conv2D", lambda **kw: keras.layers.Conv2D(4, 3, **kw),
     ["kernel", "bias"], 4),
    ("SeparableConv2D", lambda **kw: keras.layers.SeparableConv2D(4, 3, **kw),
     ["depthwise_kernel", "pointwise_kernel", "bias"], 4),
    ("Embedding", lambda **kw: keras.layers.Embedding(10, 4, **kw),
     ["embeddings"], 2),
    ("BatchNormalization", lambda **kw: keras.layers.BatchNormalization(**kw),
     ["gamma", "beta", "moving_mean", "moving_variance"], 1),
    ("PReLU", lambda **kw: keras.layers.PReLU(**kw), ["alpha"], 3),
]


@pytest.mark.parametrize("name,make,weights,rank", _LAYERS,
                         ids=[n for n, *_ in _LAYERS])
def test_layout_attributes_exist_only_when_given(name, make, weights, rank):
    # One device: `from_config` makes the layout's mesh again, on any run.
    mesh = klm.create_mesh([("batch", 1), ("model", 1)],
                           devices=klm.list_devices()[:1])
    plain = make()
    for weight in weights:
        assert not hasattr(plain, f"{weight}_layout"), weight
        assert f"{weight}_layout" not in plain.get_config()
    first, layout = f"{weights[0]}_layout", klm.Layout.replicated(mesh, rank)
    given = make(**{first: layout})
    assert getattr(given, first) == layout
    for weight in weights[1:]:
        assert not hasattr(given, f"{weight}_layout"), weight
    # Serialized when given, and back.
    config = given.get_config()
    assert config[first] == layout.get_config()
    assert [k for k in config if k.endswith("_layout")] == [first]
    assert getattr(type(given).from_config(config), first) == layout


class LayoutDense(keras.layers.Layer):
    """The TF-Keras 2 idiom: the layer keeps `kernel_layout` and names it
    before `add_weight` (TF-Keras 2 passed it to add_weight as `layout=`)."""

    def __init__(self, units, kernel_layout=None, **kwargs):
        super().__init__(**kwargs)
        self.units = units
        self.kernel_layout = kernel_layout

    def build(self, input_shape):
        self.kernel = self.add_weight(
            name="kernel", shape=(input_shape[-1], self.units))

    def call(self, x):
        return keras.ops.matmul(x, self.kernel)

    def get_config(self):
        return {**super().get_config(), "units": self.units}


@sharding
def test_custom_layer_setting_kernel_layout_gets_it(mesh, tmp_path):
    layout = klm.Layout([None, "model"], mesh)
    layer = LayoutDense(4, kernel_layout=layout, name="ld")
    assert layer.kernel_layout == layout
    model = keras.Sequential([keras.Input((6,)), layer])
    assert klm.fetch_layout(layer.kernel) == layout

    clone = LayoutDense.from_config(layer.get_config())
    assert clone.kernel_layout == layout
    path = os.path.join(tmp_path, "m.keras")
    model.save(path)
    loaded = keras.models.load_model(
        path, custom_objects={"LayoutDense": LayoutDense})
    assert loaded.layers[0].kernel_layout == layout
    assert klm.fetch_layout(loaded.layers[0].kernel) == layout


@sharding
def test_kernel_layout_set_as_attribute_on_a_stock_layer(mesh):
    dense = keras.layers.Dense(4)
    dense.kernel_layout = klm.Layout([None, "model"], mesh)
    dense.build((None, 6))
    assert klm.fetch_layout(dense.kernel) == klm.Layout([None, "model"], mesh)
    dense.kernel_layout = None
    assert dense.kernel_layout is None


# -- initializer(shape, dtype, layout=L) ------------------------------------

def _initializer_classes():
    for name, cls in sorted(vars(keras.initializers).items()):
        if (inspect.isclass(cls) and issubclass(cls, keras.initializers.Initializer)
                and cls is not keras.initializers.Initializer
                and name[0].isupper()):
            yield name, cls


def _make(cls):
    if issubclass(cls, keras.initializers.Constant):
        return cls(0.5)
    if "seed" in inspect.signature(cls.__init__).parameters:
        return cls(seed=7)
    return cls()


@sharding
@pytest.mark.parametrize("name,cls", list(_initializer_classes()))
def test_every_initializer_accepts_layout(name, cls, mesh):
    shape = (8, 8)
    if name.startswith("STFT"):
        shape = (8, 1, 8)
    layout = klm.Layout(["batch"] + [None] * (len(shape) - 2) + ["model"], mesh)
    value = _make(cls)(shape, "float32", layout=layout)
    assert klm.fetch_layout(value) == layout
    expected = _make(cls)(shape, "float32")  # the same seed on one device
    np.testing.assert_allclose(keras.ops.convert_to_numpy(value),
                               keras.ops.convert_to_numpy(expected), rtol=1e-6)


def test_initializer_without_layout_is_unchanged_and_signature_kept():
    value = keras.initializers.Ones()((2, 3), "float32")
    assert keras.ops.convert_to_numpy(value).tolist() == [[1.0] * 3] * 2
    # Keras reads the signature to choose how it creates variables.
    params = inspect.signature(keras.initializers.Ones().__call__).parameters
    assert "layout" not in params


@sharding
def test_custom_initializer_subclass_accepts_layout(mesh):
    class Twos(keras.initializers.Initializer):
        def __call__(self, shape, dtype=None):
            return keras.ops.full(shape, 2.0, dtype=dtype)

    layout = klm.Layout(["batch", None], mesh)
    value = Twos()((4, 2), "float32", layout=layout)
    assert klm.fetch_layout(value) == layout
    assert keras.ops.convert_to_numpy(value).tolist() == [[2.0, 2.0]] * 4


@sharding
def test_initializer_layout_that_does_not_fit_is_a_clear_error(mesh):
    with pytest.raises(ValueError, match=r"dimension 0 \(size 3\).*'batch'"):
        keras.initializers.Zeros()((3, 2), layout=klm.Layout(["batch", None], mesh))


# -- dtensor.create_mesh refuses a mesh that is not every device -----------

@sharding
def test_create_mesh_of_another_size_than_the_devices_is_refused():
    n = len(klm.list_devices())
    with pytest.raises(ValueError, match=rf"has 3 devices, but there are {n}"):
        klm.create_mesh([("batch", 3)])
    assert klm.create_mesh([("batch", 3)], devices=klm.list_devices()[:3]).size == 3

