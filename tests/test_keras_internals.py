"""The seam for Keras' internals: every name resolves on the installed Keras,
and an unsupported Keras is one clear ImportError naming the range."""

import importlib
import importlib.util
import pathlib

import keras
import pytest

import keras_layoutmap
from keras_layoutmap import backends, keras_internals

pytestmark = pytest.mark.keras_internals

SEAM = pathlib.Path(keras_internals.__file__)
BACKEND_SEAM = f"keras_layoutmap.backends.{backends.name()}.keras_internals"

NEUTRAL_NAMES = (
    "tree", "floatx", "standardize_dtype", "initializers", "StatelessScope",
    "TensorLayout", "Variable", "Model", "KerasDistribution", "Functional",
    "BaseOptimizer", "in_stateless_scope", "get_keras_mask", "set_keras_mask",
    "standardize_data_format", "distribution_module", "distribution_package",
    "global_state",
)
BACKEND_NAMES = {
    "jax": ("core", "Variable", "JaxVariable", "convert_to_numpy",
            "CONVERT_TO_NUMPY_MODULES", "trainer", "Trainer", "EpochIterator",
            "distribute_data", "random", "jax_draw_seed", "distribution_lib"),
    "tensorflow": ("core", "Variable", "convert_to_numpy",
                   "CONVERT_TO_NUMPY_MODULES", "distribution_lib", "TFOptimizer",
                   "random", "draw_seed", "cast_seed", "get_concrete_noise_shape",
                   "trainer", "Trainer"),
    "torch": ("core", "Variable", "convert_to_numpy", "convert_to_tensor",
              "get_device", "to_torch_dtype", "CONVERT_TO_NUMPY_MODULES", "nn",
              "numpy", "random", "torch_seed_generator", "trainer", "Trainer",
              "TorchOptimizer"),
}


def _message(found):
    return (f"keras-layoutmap {keras_layoutmap.__version__} supports keras "
            f"3.15 to 3.16; found {found}")


def test_installed_keras_is_supported():
    low, high = keras_internals.SUPPORTED_KERAS
    assert low <= keras_internals.check_keras_version() <= high
    assert keras_internals.LAYOUTMAP_VERSION == keras_layoutmap.__version__


@pytest.mark.parametrize("version, parsed", [
    ("3.15.1", (3, 15)), ("3.16.0.dev2026102704", (3, 16)), ("4.0", (4, 0)),
    ("nightly", None)])
def test_parse_version(version, parsed):
    assert keras_internals.parse_version(version) == parsed


@pytest.mark.parametrize(
    "version", ["3.15.0", "3.15.1", "3.16.0", "3.16.0.dev2026102704"])
def test_supported_versions_pass(version):
    keras_internals.check_keras_version(version)


@pytest.mark.parametrize("version", ["3.14.2", "3.17.0", "3.17.0.dev2027010100",
                                     "4.0.0", "nightly"])
def test_unsupported_version_is_one_clear_import_error(version):
    with pytest.raises(ImportError) as caught:
        keras_internals.check_keras_version(version)
    assert str(caught.value).startswith(_message(version))


@pytest.mark.parametrize("version", ["3.14.2", "3.17.0"])
def test_importing_the_seam_refuses_an_unsupported_keras(monkeypatch, version):
    # A fresh copy of the module, executed as an import would, under a Keras
    # that says it is `version`: the import itself fails, before any private
    # name is looked up.
    monkeypatch.setattr(keras, "version", lambda: version)
    spec = importlib.util.spec_from_file_location("_klm_seam_probe", SEAM)
    with pytest.raises(ImportError, match=_message(version).replace(".", r"\.")):
        spec.loader.exec_module(importlib.util.module_from_spec(spec))


def test_every_neutral_name_resolves():
    for name in NEUTRAL_NAMES:
        assert getattr(keras_internals, name) is not None, name


def test_public_names_are_keras_own_objects():
    # The public route gives the very objects Keras' private modules hold.
    private = keras_internals.private
    assert keras_internals.tree.map_structure is private(
        "keras.src.tree:map_structure")
    assert keras_internals.StatelessScope is private(
        "keras.src.backend.common.stateless_scope:StatelessScope")
    assert keras_internals.TensorLayout is private(
        "keras.src.distribution.distribution_lib:TensorLayout")
    assert keras_internals.Model is private("keras.src.models.model:Model")
    assert issubclass(keras.distribution.DataParallel,
                      keras_internals.KerasDistribution)
    assert issubclass(keras_internals.Functional, keras.Model)


def test_every_backend_name_resolves():
    seam = importlib.import_module(BACKEND_SEAM)
    for name in BACKEND_NAMES[backends.name()]:
        assert getattr(seam, name) is not None, name
    # Keras looks convert_to_numpy up on each of these modules.
    for module in seam.CONVERT_TO_NUMPY_MODULES:
        assert callable(module.convert_to_numpy)
    assert issubclass(seam.Trainer, object) and hasattr(seam.Trainer, "fit")
    assert isinstance(keras.Variable(1.0), seam.Variable)


def test_private_lookup_tries_each_location_in_turn():
    private = keras_internals.private
    assert private("keras.src.no_such_module:thing",
                   "keras.src.backend.common.masking:get_keras_mask") is (
        keras_internals.get_keras_mask)
    assert keras_internals.optional("keras.src.no_such_module") is None


def test_a_name_found_nowhere_is_the_clear_error():
    with pytest.raises(ImportError) as caught:
        keras_internals.private("keras.src.no_such_module:thing",
                                "keras.src.backend:no_such_name")
    message = str(caught.value)
    assert message.startswith(_message(keras_internals.keras_version()))
    assert "keras.src.no_such_module:thing" in message
