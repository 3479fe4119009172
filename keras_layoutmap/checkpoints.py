"""Keras' sharded checkpoints on every backend: `keras.callbacks.OrbaxCheckpoint`,
`keras.models.load_model(directory)` and `model.load_weights(directory)`.

Keras writes them with Orbax, whose multi-process support is JAX's: on
TensorFlow and torch, Keras hands Orbax every value whole (gathered on
every process) and every process writes the same files. Here, on those
backends and across processes, Orbax is given each sharded value as a
`jax.Array` of the shards this process holds (`backends.orbax_arrays`):
each process writes its own, in the format JAX writes, so that a
checkpoint written under one backend, mesh or process count restores
under another. Reading, every backend (JAX too) asks Orbax for each value
laid out as the model's variable is, whatever layout wrote it; a value
whose shape differs from the variable's is refused, naming it.

>>> import keras
>>> import keras_layoutmap as klm
>>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
>>> model.compile("sgd", "mse")
>>> saving = keras.callbacks.OrbaxCheckpoint("/tmp/klm_doc_ckpt")  # doctest: +SKIP
>>> model.fit(x, y, callbacks=[saving])  # doctest: +SKIP
>>> restored = keras.models.load_model("/tmp/klm_doc_ckpt")  # doctest: +SKIP
"""

import functools
import json
import os
import sys

import numpy as np

from keras_layoutmap import backends, keras_internals


def _arrays():
    from keras_layoutmap.backends import orbax_arrays

    return orbax_arrays


def _mirrors():
    """Whether values go through JAX's mirror (TensorFlow and torch)."""
    return backends.name() != "jax"


def _joined_first(initialize):
    """Orbax's first use by Keras (its lazy `ocp` module): a run of several
    TensorFlow or torch processes starts its JAX mirror before Orbax asks
    JAX anything."""

    @functools.wraps(initialize)
    def method(self, *args, **kwargs):
        result = initialize(self, *args, **kwargs)
        if _mirrors():
            _arrays().join()
        return result

    return method


def state_tree(model, get_state_tree):
    """What `OrbaxCheckpoint` writes of `model`: on TensorFlow and torch
    across processes, Keras' state tree with each sharded value as this
    process's shards (`orbax_arrays.to_jax`); in one process, Keras' own
    (every value whole, gathered in this process by `get_state_tree`). On
    JAX, Keras' own, with the values each process holds alone (metrics'
    counts, on one device of each process, the same everywhere) as numpy:
    Orbax refuses such arrays across processes."""
    arrays = _arrays()
    if not _mirrors():
        return _map_leaves(get_state_tree(model), arrays.host_local_as_numpy)
    if not arrays.join():
        return get_state_tree(model)
    tree = model.get_state_tree(value_format="backend_tensor")
    copy = _SAVING.get("in_background", True)
    return _map_leaves(tree, lambda value: arrays.to_jax(value, copy=copy))


_SAVING = {}  # "in_background": whether the save running goes on after it


def _snapshot_if_in_background(save_checkpoint):
    """A save in the background (`save_on_background=True`, Keras'
    default) is handed copies of the shards, as training goes on changing
    the variables; a save that ends before `fit` goes on is handed the
    variables' own buffers (no copy: per process at most its shards more
    than before, as Orbax writes them)."""

    @functools.wraps(save_checkpoint)
    def method(self, *args, **kwargs):
        _SAVING["in_background"] = bool(self.save_on_background)
        try:
            return save_checkpoint(self, *args, **kwargs)
        finally:
            _SAVING.clear()

    return method


def _map_leaves(tree, function):
    if isinstance(tree, dict):
        return {k: _map_leaves(v, function) for k, v in tree.items()}
    return function(tree)


def _state_tree(get_state_tree):
    @functools.wraps(get_state_tree)
    def function(model):
        return state_tree(model, get_state_tree)

    return function


def abstract_tree(checkpoint_path, ref_state=None):
    """What Orbax reads a checkpoint into: every saved value that the
    model has, with the model's shape, dtype and layout (whatever backend,
    mesh or process count wrote it); the others as saved. A value whose
    saved shape is not the model's is refused, naming both."""
    ocp = keras_internals.orbax_lazy_module
    arrays = _arrays()
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
        refs = _flat(refs) if isinstance(refs, dict) else {}
        short = {_without_model_name(p, model_name): r
                 for p, r in refs.items()}
        tree[group] = _nested({
            path: leaf(meta, refs.get(path, short.get(
                _without_model_name(path, model_name))), path)
            for path, meta in _flat(value).items()})
    return tree


# The one context of a read: set while Keras' `load_weights` or
# `load_model` runs; "model_name": the model read into (`_without_model_name`).
READING = {}


def _reading_a_checkpoint(load):
    """Keras' loaders: within them, the state tree assigned is a
    checkpoint's (`matched_to_model`)."""

    @functools.wraps(load)
    def function(*args, **kwargs):
        READING.clear()
        # load_weights(model, filepath, skip_mismatch=False): a weight the
        # checkpoint lacks is then left as it is, as Keras does.
        skip = kwargs.get("skip_mismatch", len(args) > 2 and args[2])
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


def _flat(tree, prefix=""):
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(_flat(value, f"{prefix}{key}/"))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _nested(flat):
    tree = {}
    for path, value in flat.items():
        *parents, last = path.split("/")
        node = tree
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value
    return tree


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
        saved = _flat(tree[group])
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
        matched[group] = _nested(renamed)
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
        if _mirrors() and "jax" in sys.modules:  # else no leaf is JAX's
            arrays = _arrays()
            tree = _map_leaves(tree, lambda leaf: arrays.from_jax(leaf)
                               if arrays.is_jax_array(leaf) else leaf)
        return set_state_tree(self, tree)

    return method


def _backend_neutral(config):
    """`config` (a serialized model) with each optimizer named by Keras'
    public module: TensorFlow and torch record their own optimizer classes
    (`keras.src.backend.torch.optimizers.torch_adam`), which another
    backend cannot import; `keras.optimizers.Adam` makes each backend's
    own."""
    from keras import optimizers

    if isinstance(config, list):
        return [_backend_neutral(c) for c in config]
    if not isinstance(config, dict):
        return config
    config = {k: _backend_neutral(v) for k, v in config.items()}
    module, name = config.get("module"), config.get("class_name")
    if (isinstance(module, str) and module.startswith("keras.src.backend.")
            and ".optimizers" in module and hasattr(optimizers, str(name))):
        config["module"] = "keras.optimizers"
    return config


def _neutral_json(serialize_model_as_json):
    @functools.wraps(serialize_model_as_json)
    def function(model):
        config_json, metadata_json = serialize_model_as_json(model)
        return json.dumps(_backend_neutral(json.loads(config_json))), \
            metadata_json

    return function


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


def check_shared(directory):
    """Raise on every process, at once, where some process of a run of
    several does not see `directory` as process 0 does (a path on each
    host's own disk): Orbax's processes write their shards there and
    process 0 commits them, so such a checkpoint would miss shards.
    Collective. Paths with a scheme (`gs://`, `s3://`) are shared by
    nature and not checked."""
    backend = backends.get()
    count = backend.process_count()
    if count == 1 or "://" in str(directory):
        return
    directory = os.path.abspath(str(directory))
    tokens = backend.gather_process_batches(
        np.frombuffer(os.urandom(8), np.int64).reshape(1, 1).copy())
    token = int(tokens[0, 0]) & (2**64 - 1)  # process 0's
    marker = os.path.join(directory, f".klm-shared-{token:016x}")
    index = backend.process_index()
    if index == 0:
        os.makedirs(directory, exist_ok=True)
        with open(marker, "w"):
            pass
    backend.barrier("klm_checkpoint_directory_written")
    seen = backend.gather_process_batches(
        np.asarray([[os.path.exists(marker)]], np.int32)).reshape(-1)
    backend.barrier("klm_checkpoint_directory_seen")
    if index == 0:
        os.remove(marker)
    blind = [i for i, ok in enumerate(seen) if not ok]
    if blind:
        raise ValueError(
            f"The checkpoint directory {directory!r} is not shared: process 0 "
            f"wrote a file there that process(es) {blind} of {count} do not "
            "see. Every process writes its own shards into that directory "
            "and process 0 completes the checkpoint, so it must be one "
            "directory for all: a shared file system (NFS, a bucket: "
            "`gs://...`), not each host's own disk.")


def _in_a_shared_directory(init):
    """`OrbaxCheckpoint(directory)` checks that every process sees
    `directory` (`check_shared`) before anything is written there."""

    @functools.wraps(init)
    def method(self, directory, *args, **kwargs):
        # Orbax first (an ImportError without it; on TensorFlow and torch
        # the JAX mirror, whose handshake refuses a start on some
        # processes only, before any collective).
        keras_internals.orbax_lazy_module.initialize()
        check_shared(directory)
        return init(self, directory, *args, **kwargs)

    return method


_INSTALLED = False


def install():
    """Route Keras' Orbax checkpoints through the functions above
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
    for name in ("load_weights", "_load_model_from_orbax_checkpoint"):
        setattr(loading, name, _reading_a_checkpoint(getattr(loading, name)))
    Model = keras_internals.Model
    Model.get_state_tree = _reading_into(Model.get_state_tree)
    Model.set_state_tree = _set_matched(Model.set_state_tree)
    saving_lib = keras_internals.saving_lib
    saving_lib._serialize_model_as_json = _neutral_json(
        saving_lib._serialize_model_as_json)
    _INSTALLED = True
