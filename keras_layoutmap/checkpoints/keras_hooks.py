"""Keras' Orbax checkpoints routed through `writing` and `reading`."""

from keras_layoutmap import keras_internals
from keras_layoutmap.checkpoints.reading import (
    _reading_a_checkpoint,
    _reading_into,
    _set_matched,
    _step_directory_too,
    abstract_tree,
)
from keras_layoutmap.checkpoints.writing import (
    _in_a_shared_directory,
    _joined_first,
    _neutral_json,
    _snapshot_if_in_background,
    _state_tree,
)

_INSTALLED = False


def install():
    """Route Keras' Orbax checkpoints through `writing` and `reading`
    (idempotent)."""
    global _INSTALLED
    if _INSTALLED:
        return
    lazy = type(keras_internals.orbax_lazy_module)
    lazy.initialize = _joined_first(lazy.initialize)
    callback = keras_internals.orbax_callback_module
    callback._get_state_tree = _state_tree(callback._get_state_tree)
    saving = callback.OrbaxCheckpoint
    saving.__init__ = _in_a_shared_directory(saving.__init__)
    saving._save_checkpoint = _snapshot_if_in_background(
        saving._save_checkpoint)
    for module in keras_internals.orbax_loading_modules:
        module.build_orbax_abstract_pytree = abstract_tree
    loading = keras_internals.saving_api
    loading.is_orbax_checkpoint = _step_directory_too(
        loading.is_orbax_checkpoint)
    loading.load_weights = _reading_a_checkpoint(
        loading.load_weights, skip_mismatch_at=2)
    loading._load_model_from_orbax_checkpoint = _reading_a_checkpoint(
        loading._load_model_from_orbax_checkpoint)
    Model = keras_internals.Model
    Model.get_state_tree = _reading_into(Model.get_state_tree)
    Model.set_state_tree = _set_matched(Model.set_state_tree)
    saving_lib = keras_internals.saving_lib
    saving_lib._serialize_model_as_json = _neutral_json(
        saving_lib._serialize_model_as_json)
    _INSTALLED = True
