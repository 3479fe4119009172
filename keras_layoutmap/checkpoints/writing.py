"""Writing: what Keras' `OrbaxCheckpoint` hands Orbax, and where.

On TensorFlow and torch across processes each sharded value goes as this
process's shards (`backends.orbax_arrays.to_jax`), a copy only for a save
in the background; on JAX, values each process holds alone go as numpy.
The callback first checks that every process sees its directory, and the
model's config names optimizers so that another backend can build them.
"""

import functools
import json
import os

import numpy as np

from keras_layoutmap import backends, keras_internals
from keras_layoutmap.checkpoints.trees import map_leaves, mirrors, orbax_arrays


def _joined_first(initialize):
    """Orbax's first use by Keras (its lazy `ocp` module): a run of several
    TensorFlow or torch processes starts its JAX mirror before Orbax asks
    JAX anything."""

    @functools.wraps(initialize)
    def method(self, *args, **kwargs):
        result = initialize(self, *args, **kwargs)
        if mirrors():
            orbax_arrays().join()
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
    arrays = orbax_arrays()
    if not mirrors():
        return map_leaves(get_state_tree(model), arrays.host_local_as_numpy)
    if not arrays.join():
        return get_state_tree(model)
    tree = model.get_state_tree(value_format="backend_tensor")
    copy = _SAVING.get("in_background", True)
    return map_leaves(tree, lambda value: arrays.to_jax(value, copy=copy))


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


def _state_tree(get_state_tree):
    @functools.wraps(get_state_tree)
    def function(model):
        return state_tree(model, get_state_tree)

    return function


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


def check_shared(directory):
    """Raise on every process, at once, where some process of a run of
    several does not see `directory` as process 0 does (a path on each
    host's own disk): Orbax's processes write their shards there and
    process 0 commits them, so such a checkpoint would miss shards.
    Collective. Paths with a scheme (`gs://`, `s3://`) are shared by
    nature and not checked."""
    backend = backends.get()
    count = backend.process_count()
    if count == 1:
        return
    # (TensorFlow and torch: their JAX mirror's join did the same.)
    orbax_arrays().refuse_a_start_on_some_processes(
        backend, "orbax_checkpoint_directory")
    if "://" in str(directory):
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
