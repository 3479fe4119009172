"""Every Keras name keras-layoutmap uses that is not plain public API, in one
place (with `backends/<backend>/keras_internals.py` for each backend).

Keras moves its private modules between releases (3.16 moved each backend's
`core`, `nn`, `numpy`, ... under `keras.src.backend.<backend>.ops` and
renamed the trainers), so the rest of the package imports Keras' internals
only from here. Each name is taken from Keras' public API where Keras has one
and from `keras.src` only where it has none; every private lookup tries the
newest location first, then the older ones, and a name found nowhere is one
`ImportError` that names the supported Keras range, raised when the package
is imported, not an `AttributeError` deep inside a training step.

`check_keras_version()` runs at import: a Keras outside
`SUPPORTED_KERAS` is refused before any private name is looked up.
"""

import contextlib
import importlib
import re

import keras

LAYOUTMAP_VERSION = "0.1.0"  # keep equal to keras_layoutmap.__version__
# The Keras versions the suite runs on: `keras>=3.15,<3.17` in pyproject.toml.
# Raise the upper bound only together with a green run on the next release.
SUPPORTED_KERAS = ((3, 15), (3, 16))  # (major, minor), both inclusive
# The name of a `keras.random.SeedGenerator`'s state variable (its
# `(2,)` seed and counter, made in `SeedGenerator.__init__`), the same in
# 3.15 and 3.16: a random layer's own draws (Dropout, GaussianNoise, the
# Random* augmentations), never a weight to split.
SEED_STATE_NAME = "seed_generator_state"


def _unsupported_message(found, detail=None):
    low, high = SUPPORTED_KERAS
    message = (
        f"keras-layoutmap {LAYOUTMAP_VERSION} supports keras "
        f"{low[0]}.{low[1]} to {high[0]}.{high[1]}; found {found}"
    )
    if detail:
        message += f" ({detail})"
    return message + "."


class UnsupportedKerasError(ImportError):
    """The installed Keras is outside the range keras-layoutmap supports, or
    lacks a name it needs."""


def keras_version():
    """The installed Keras' version string (e.g. `"3.16.0.dev2026102704"`)."""
    return keras.version()


def parse_version(version):
    """`(major, minor)` of a Keras version string, or None when it has none
    (`"3.16.0.dev2026102704"` -> `(3, 16)`)."""
    match = re.match(r"\s*(\d+)\.(\d+)", str(version))
    return (int(match.group(1)), int(match.group(2))) if match else None


def check_keras_version(version=None):
    """Raise `UnsupportedKerasError` (an `ImportError`) unless `version`
    (default: the installed Keras) is in `SUPPORTED_KERAS`."""
    version = keras_version() if version is None else version
    parsed = parse_version(version)
    low, high = SUPPORTED_KERAS
    if parsed is None or not low <= parsed <= high:
        raise UnsupportedKerasError(_unsupported_message(version))
    return parsed


def private(*locations):
    """The first of `locations` ("module:attribute.path", or "module" for a
    module itself) that this Keras has; an `UnsupportedKerasError` naming
    them all when it has none. List the newest Keras' location first."""
    for location in locations:
        found = _lookup(location)
        if found is not _MISSING:
            return found
    raise UnsupportedKerasError(_unsupported_message(
        keras_version(), "none of " + ", ".join(locations) + " exists"))


def optional(*locations, default=None):
    """Like `private`, but `default` where this Keras has none of them (a
    name that one supported version has and another lacks by design)."""
    for location in locations:
        found = _lookup(location)
        if found is not _MISSING:
            return found
    return default


def modules_holding(name, *module_names):
    """The modules among `module_names` that exist and have an attribute
    `name`: where Keras looks `name` up, so a wrapper installed on each of
    them is seen by every caller (3.15 looks `convert_to_numpy` up on
    `keras.src.backend`, 3.16 on `keras.src.backend.<backend>.ops`)."""
    modules = []
    for module_name in module_names:
        module = _lookup(module_name)
        if module is not _MISSING and hasattr(module, name):
            modules.append(module)
    if not modules:
        raise UnsupportedKerasError(_unsupported_message(
            keras_version(),
            f"none of {', '.join(module_names)} has {name!r}"))
    return tuple(modules)


_MISSING = object()


def _lookup(location):
    module_name, _, path = location.partition(":")
    try:
        found = importlib.import_module(module_name)
    except ImportError:
        return _MISSING
    for attribute in path.split(".") if path else ():
        found = getattr(found, attribute, _MISSING)
        if found is _MISSING:
            return _MISSING
    return found


check_keras_version()

# --- Public Keras API (the same objects Keras' private modules hold) --------
tree = keras.tree  # flatten, map_structure (was keras.src.tree)
floatx = keras.config.floatx  # was keras.src.backend.config.floatx
standardize_dtype = keras.backend.standardize_dtype  # was keras.src.backend.…
initializers = keras.initializers  # Zeros, Ones, Constant, Initializer
StatelessScope = keras.StatelessScope  # was keras.src.backend.common.…
TensorLayout = keras.distribution.TensorLayout
Variable = keras.Variable  # isinstance checks (was keras.src.backend.Variable)
# `keras.Model` is `keras.src.models.model.Model`: patching `Model.__call__`
# / `Model.export` on it patches every model.
Model = keras.Model

# --- Private: no public name exists -----------------------------------------
# The base class of Keras' distributions (`keras.distribution` exports only
# DataParallel and ModelParallel).
KerasDistribution = private("keras.src.distribution.distribution_lib:Distribution")
# Functional models name their layers differently from subclassed ones.
Functional = private("keras.src.models.functional:Functional")
# Slot variables: `add_variable_from_reference` is defined on the base class
# of every backend's optimizer (TF's calls it through `super()`).
BaseOptimizer = private("keras.src.optimizers.base_optimizer:BaseOptimizer")
in_stateless_scope = private(
    "keras.src.backend.common.stateless_scope:in_stateless_scope")
get_keras_mask = private("keras.src.backend.common.masking:get_keras_mask")
set_keras_mask = private("keras.src.backend.common.masking:set_keras_mask")
standardize_data_format = private(
    "keras.src.backend.config:standardize_data_format")
# Runs a function on symbolic inputs with the backend's own tracing (no
# memory): the projection trace of `projection_inputs`.
compute_output_spec = private("keras.src.backend:compute_output_spec")
# The module `keras.distribution` calls for a backend's meshes, layouts and
# devices; its attribute `distribution_lib` is the backend's own module
# (None on torch before 3.16).
distribution_module = private("keras.src.distribution.distribution_lib")


def backend_distribution_lib():
    """The running backend's `distribution_lib` that `keras.distribution`
    uses (None where Keras has none: torch on 3.15)."""
    return getattr(distribution_module, "distribution_lib", None)
# `keras.src.distribution` (the package `keras.distribution` re-exports):
# `set_distribution` is replaced on it too.
distribution_package = private("keras.src.distribution")
# Keras' global attributes (the variables a stateless scope initialises).
global_state = private("keras.src.backend.common.global_state")

# Keras 3.16's tf.data adapter splits a dataset over processes itself (by
# `distribution.num_processes`, refusing a batch size tf.data cannot
# compute); 3.15's asks the distribution (`distribute_dataset`). None on
# 3.15.
tf_dataset_split = optional(
    "keras.src.trainers.data_adapters.tf_dataset_adapter:"
    "TFDatasetAdapter._distribute_dataset")
TFDatasetAdapter = private(
    "keras.src.trainers.data_adapters.tf_dataset_adapter:TFDatasetAdapter")

# Keras' Orbax checkpoints (`keras.callbacks.OrbaxCheckpoint`,
# `load_model(directory)`): the callback's module (its `_get_state_tree`),
# the loaders' modules (each holds `build_orbax_abstract_pytree` by name),
# the lazy `orbax.checkpoint.v1` (`ocp`, its class `OrbaxLazyModule`) and
# the model-config serializer the callback calls.
orbax_callback_module = private("keras.src.callbacks.orbax_checkpoint")
orbax_loading_modules = modules_holding(
    "build_orbax_abstract_pytree", "keras.src.saving.orbax_util",
    "keras.src.saving.saving_api")
orbax_lazy_module = private("keras.src.utils.module_utils:ocp")
saving_lib = private("keras.src.saving.saving_lib")
# `load_weights` / `load_model`'s module: its `is_orbax_checkpoint`, by name.
saving_api = private("keras.src.saving.saving_api")
# Where `Layer.__call__` checks its input against the layer's `input_spec`
# (by name, through the module): `input_specs_unchecked` sets it aside.
input_spec_module = private("keras.src.layers.input_spec")
private("keras.src.layers.input_spec:assert_input_compatibility")


@contextlib.contextmanager
def input_specs_unchecked():
    """Layers' `input_spec` checks set aside in this block: a call on
    tensor-parallel pieces passes each layer its piece (a row-parallel
    `Dense` gets 1/n of the features its spec names)."""
    saved = input_spec_module.assert_input_compatibility
    input_spec_module.assert_input_compatibility = _accept_any_input
    try:
        yield
    finally:
        input_spec_module.assert_input_compatibility = saved


def _accept_any_input(*args, **kwargs):
    return None


def compiled_metric_objects(model):
    """The metric objects passed to `model.compile(metrics=...,
    weighted_metrics=...)` (keras-hub's `CausalLM.compile` passes its own
    `SparseCategoricalAccuracy`). Their variables exist from `compile` on,
    made wherever `compile` ran, but `model.metrics_variables` lists them
    only once the first `fit` has built the compiled metrics (Keras'
    private `CompileMetrics._user_metrics`, in 3.15 and 3.16)."""
    compiled = getattr(model, "_compile_metrics", None)
    if compiled is None:
        return []
    found = []
    for attribute in ("_user_metrics", "_user_weighted_metrics"):
        for item in tree.flatten(getattr(compiled, attribute, None) or []):
            if isinstance(item, keras.metrics.Metric):
                found.append(item)
    return found
