"""Reading: what Orbax reads a checkpoint into (`abstract_tree`: each value
laid out as the model's variable), and the tree assigned to the model's
own variables (`matched_to_model`), while Keras' `load_weights` or
`load_model` runs (`READING`, the one context of a read).
"""

import functools
import os
import sys

from keras_layoutmap import keras_internals
from keras_layoutmap.checkpoints.trees import (
    flat,
    map_leaves,
    mirrors,
    nested,
    orbax_arrays,
)


def abstract_tree(checkpoint_path, ref_state=None):
    """What Orbax reads a checkpoint into: every saved value that the
    model has, with the model's shape, dtype and layout (whatever backend,
    mesh or process count wrote it); the others as saved. A value whose
    saved shape is not the model's is refused, naming both."""
    ocp = keras_internals.orbax_lazy_module
    arrays = orbax_arrays()
    saved = ocp.pytree_metadata(
        checkpoint_path, checkpointable_name="pytree").metadata
    model_name = READING.get("model_name", "")

    def leaf(meta, ref, path):
        if not (hasattr(meta, "shape") and hasattr(meta, "dtype")):
            return meta  # a Python scalar (TensorFlow's, torch's): as saved
        if ref is None:
            return arrays.abstract(meta.shape, meta.dtype, None)
        shape = tuple(ref.shape)
        if tuple(meta.shape) != shape:
            raise ValueError(
                f"The checkpoint {checkpoint_path!r} holds {path!r} with "
                f"shape {tuple(meta.shape)}, but the model's variable has "
                f"shape {shape}. Restore it into the model it was written "
                "from (the same layer sizes).")
        return arrays.abstract(meta.shape, meta.dtype, ref)

    tree = {}
    for group, value in saved.items():
        refs = (ref_state or {}).get(group)
        if not isinstance(value, dict):
            tree[group] = leaf(value, refs, group)
            continue
        refs = flat(refs) if isinstance(refs, dict) else {}
        short = {_without_model_name(p, model_name): r
                 for p, r in refs.items()}
        tree[group] = nested({
            path: leaf(meta, refs.get(path, short.get(
                _without_model_name(path, model_name))), path)
            for path, meta in flat(value).items()})
    return tree


# The one context of a read: set while Keras' `load_weights` or
# `load_model` runs; "model_name": the model read into (`_without_model_name`).
READING = {}


def _reading_a_checkpoint(load, skip_mismatch_at=None):
    """Keras' loaders: within them, the state tree assigned is a
    checkpoint's (`matched_to_model`). `skip_mismatch_at`: the position of
    the loader's `skip_mismatch` argument (`load_weights(model, filepath,
    skip_mismatch=False)`), which leaves a weight the checkpoint lacks as
    it is, as Keras does."""

    @functools.wraps(load)
    def function(*args, **kwargs):
        READING.clear()
        skip = kwargs.get("skip_mismatch", False)
        if skip_mismatch_at is not None and len(args) > skip_mismatch_at:
            skip = args[skip_mismatch_at]
        READING["strict"] = not skip
        try:
            return load(*args, **kwargs)
        finally:
            READING.clear()

    return function


def _reading_into(get_state_tree):
    """Keras asks the model for its state tree right before it builds what
    Orbax reads into: remember whose it is (its name)."""

    @functools.wraps(get_state_tree)
    def method(self, *args, **kwargs):
        if READING:
            READING["model_name"] = self.name
        return get_state_tree(self, *args, **kwargs)

    return method


_GROUPS = {"trainable_variables": lambda m: m.trainable_variables,
           "non_trainable_variables": lambda m: m.non_trainable_variables,
           "optimizer_variables": lambda m: (
               m.optimizer.variables if getattr(m, "optimizer", None) else []),
           "metrics_variables": lambda m: m.metrics_variables}
_CHECKED = ("trainable_variables", "non_trainable_variables")


def _without_model_name(path, name):
    """`path` without the model's own name: Keras 3.15 names a model's
    variables `mlp/d1/kernel` when it builds them, `d1/kernel` when
    `load_model` rebuilds it from its config (and the optimizer's slots
    `mlp_d1_kernel_momentum`, `d1_kernel_momentum`)."""
    parts = [p[len(name) + 1:] if p.startswith(name + "_") else p
             for p in path.split("/") if p != name]
    return "/".join(parts)


def matched_to_model(model, tree):
    """`tree` (a state tree read from a checkpoint) with its paths those of
    `model`'s variables, where they differ only by the model's name; a
    weight of the model the checkpoint lacks is refused, naming it (Keras
    would leave it as initialized, silently)."""
    matched = dict(tree)
    for group, variables in _GROUPS.items():
        if not isinstance(tree.get(group), dict):
            continue
        paths = [v.path for v in variables(model)]
        saved = flat(tree[group])
        by_short = {}
        for path in paths:
            by_short.setdefault(_without_model_name(path, model.name),
                                []).append(path)
        renamed = {}
        for path, value in saved.items():
            if path not in paths:
                same = by_short.get(_without_model_name(path, model.name), [])
                if len(same) == 1:
                    path = same[0]
            renamed[path] = value
        missing = [p for p in paths if p not in renamed]
        if group in _CHECKED and missing and READING.get("strict", True):
            raise ValueError(
                f"The checkpoint holds no value for {len(missing)} of the "
                f"model's {group}: {missing[:5]}"
                f"{' ...' if len(missing) > 5 else ''}. It holds: "
                f"{sorted(saved)[:10]}. Restore it into the model it was "
                "written from.")
        matched[group] = nested(renamed)
    return matched


def _set_matched(set_state_tree):
    """A state tree read from a checkpoint, assigned to the model's own
    variables (`matched_to_model`); on TensorFlow and torch, each value
    Orbax read as a `jax.Array` made the backend's own, laid out as read.
    Any other tree, as Keras assigns it."""

    @functools.wraps(set_state_tree)
    def method(self, tree):
        if READING:
            tree = matched_to_model(self, tree)
        if mirrors() and "jax" in sys.modules:  # else no leaf is JAX's
            arrays = orbax_arrays()
            tree = map_leaves(tree, lambda leaf: arrays.from_jax(leaf)
                               if arrays.is_jax_array(leaf) else leaf)
        return set_state_tree(self, tree)

    return method


def _step_directory_too(is_orbax_checkpoint):
    """Keras' test for an Orbax checkpoint, also true of one step's
    directory (`<directory>/<step>`, which `load_weights` reads as such but
    Keras' test did not recognize: "File format not supported")."""

    @functools.wraps(is_orbax_checkpoint)
    def function(filepath):
        if is_orbax_checkpoint(filepath):
            return True
        try:
            contents = set(os.listdir(filepath))
        except (OSError, TypeError):
            return False
        return {"_CHECKPOINT_METADATA", "pytree"} <= contents

    return function
