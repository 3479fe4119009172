"""The workflow matrix (rows declared in workflows.py): each row, written as
users write it, in this session's cell (backend, processes, Keras version),
compared with the same code on one device; where the row cannot work in
this cell, the clear error workflows.py names.

A row is a function `row(distributed, folder)` returning its numbers (a
dict of arrays): with `distributed=False` it runs on one device, with no
distribution; with True, as a user runs it on the mesh. The one-device
numbers are computed once per process and reused by the rows that share
them.
"""

import hashlib
import os
import pathlib
import pickle

import keras
import numpy as np
import pytest
import workflows
from helpers import (
    BACKEND,
    DEVICES,
    PROCESSES,
    assert_held_as_rules_say,
    digits_data,
    quantized_mlp,
)

import keras_layoutmap as klm

pytestmark = [pytest.mark.sharding, pytest.mark.training]

KERAS = "3.15" if keras.version().startswith("3.15") else "nightly"
ROWS = {}  # name -> row function
_REFERENCES = {}


def row(name):
    def register(function):
        ROWS[name] = function
        return function
    return register


def one_device(function, folder):
    """`function(False, folder)`, computed once per process, and once per
    session where nox names a folder for it (`KLM_TEST_REFERENCES`): the
    run in several processes then reads what the one-process run computed
    (same backend, Keras and compile settings, which name the file; not
    the device count: a one-device run uses one device however many the
    process has, and TensorFlow's multi-process cell has 4 in all, its
    one-process run 8), instead of each process computing it again. (torch has no
    one-process matrix run: its 4 processes compute their own; measured,
    that is not where their time goes: the 4-process matrix took 180 s
    either way, 2026-11-26.)"""
    name = function.__name__
    if name not in _REFERENCES:
        saved = _saved_reference(name)
        if saved is not None and saved.exists():
            _REFERENCES[name] = pickle.loads(saved.read_bytes())
        else:
            keras.distribution.set_distribution(None)
            _REFERENCES[name] = function(False, folder)
            # Written by one-process runs only: in a run of several, every
            # process must compute it or none (a reference may take part
            # in collectives: saves, BackupAndRestore), and a file that
            # appeared mid-run would split them.
            if saved is not None and PROCESSES == 1:
                scratch = saved.with_name(f"{saved.name}.{os.getpid()}")
                scratch.write_bytes(pickle.dumps(_REFERENCES[name]))
                os.replace(scratch, saved)  # whole, or not there
    return _REFERENCES[name]


def _saved_reference(name):
    folder = os.environ.get("KLM_TEST_REFERENCES")
    if not folder:
        return None
    cell = repr((BACKEND, keras.version(), name,
                 os.environ.get("XLA_FLAGS", ""),
                 os.environ.get("KLM_TEST_FAST_GRAPHS", "")))
    digest = hashlib.sha1(cell.encode()).hexdigest()[:16]
    path = pathlib.Path(folder, f"{name}-{digest}.pickle")
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def keras_mesh(shape, names):
    """A mesh as the Keras guide makes one, over Keras' device list: every
    device of every process, each named once (TensorFlow's listed each
    process's devices under the same names, so the guide's mesh was refused
    across processes), as many as Keras counts."""
    devices = keras.distribution.list_devices()
    assert len(set(devices)) == len(devices) == DEVICES, devices
    assert keras.distribution.get_device_count() == DEVICES
    return keras.distribution.DeviceMesh(shape, names, devices=devices)


def assert_equal_results(got, expected, tolerance):
    """Every number of `expected` in `got`: integers (ids, int8 kernels)
    identical, floats to `tolerance(key)`, an (rtol, atol) pair."""
    assert sorted(got) == sorted(expected)
    for key in expected:
        a, b = np.asarray(got[key]), np.asarray(expected[key])
        if a.dtype.kind in "iub":
            np.testing.assert_array_equal(a, b, err_msg=key)
        else:
            rtol, atol = tolerance(key)
            np.testing.assert_allclose(a, b, rtol=rtol, atol=atol, err_msg=key)


def numpy_weights(model):
    return [keras.ops.convert_to_numpy(w) for w in model.weights]


# -- Keras' own classes -------------------------------------------------------

DIGITS_ROWS = 300  # batch 64: a short last batch of 44 rows
MODEL_RULES = {"d1/kernel": (None, "model"), "d1/bias": ("model",),
               "d2/kernel": ("model", None)}


def mlp(name="mlp", optimizer=None, dropout=0.0, steps_per_execution=1):
    """The digits MLP; with `dropout`, a `Dropout` between its layers: a
    step then depends on which rows the batch holds and where (the masks),
    not only on their mean, as a batch of every process's copy showed."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((64,)),
        keras.layers.Dense(32, activation="relu", name="d1"),
        *([keras.layers.Dropout(dropout, name="drop")] if dropout else []),
        keras.layers.Dense(10, name="d2"),
    ], name=name)
    model.compile(optimizer or keras.optimizers.Adam(0.01),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"], steps_per_execution=steps_per_execution)
    return model


def on_batch_steps(model, x, y):
    """A step of each `*_on_batch` method, every process passing the same
    batch (as to `fit`); 40 rows to predict, which the batch axis divides."""
    return {"train_on_batch": model.train_on_batch(x[:64], y[:64]),
            "test_on_batch": model.test_on_batch(x[:64], y[:64]),
            "predict_on_batch": model.predict_on_batch(x[:40])}


def train_evaluate_predict(model):
    """`fit`, `evaluate`, `predict`, then `on_batch_steps`."""
    x, y = digits_data(DIGITS_ROWS)
    history = model.fit(x, y, batch_size=64, epochs=2, shuffle=False,
                        verbose=0).history
    return {"loss": history["loss"], "accuracy": history["accuracy"],
            "evaluate": model.evaluate(x, y, batch_size=64, verbose=0),
            "predict": model.predict(x[:37], batch_size=16, verbose=0),
            **on_batch_steps(model, x, y),
            **{f"w{i}": w for i, w in enumerate(numpy_weights(model))}}


@row("keras-data-parallel")
def keras_data_parallel(distributed, folder):
    if distributed:
        # The guide's first form: `DataParallel(devices=list_devices())`,
        # every device of every process, each named once.
        devices = keras.distribution.list_devices()
        assert len(set(devices)) == len(devices) == DEVICES, devices
        keras.distribution.set_distribution(
            keras.distribution.DataParallel(devices=devices))
    try:
        return train_evaluate_predict(mlp(dropout=0.2))
    finally:
        keras.distribution.set_distribution(None)


@row("keras-steps-per-execution")
def keras_steps_per_execution(distributed, folder):
    if distributed:
        keras.distribution.set_distribution(keras.distribution.DataParallel(
            devices=keras.distribution.list_devices()))
    try:
        model = mlp(dropout=0.2, steps_per_execution=2)
        x, y = digits_data(DIGITS_ROWS)  # 5 batches: 2 steps, 2, then 1
        history = model.fit(x, y, batch_size=64, epochs=2, shuffle=False,
                            verbose=0).history
        return {"loss": history["loss"], "accuracy": history["accuracy"],
                "evaluate": model.evaluate(x, y, batch_size=64, verbose=0),
                "predict": model.predict(x[:37], batch_size=16, verbose=0),
                **{f"w{i}": w for i, w in enumerate(numpy_weights(model))}}
    finally:
        keras.distribution.set_distribution(None)


def keras_model_parallel_plan():
    """The guide's `ModelParallel`: a Keras `LayoutMap` of `MODEL_RULES` on
    a (batch, model) mesh over Keras' device list."""
    mesh = keras_mesh((DEVICES // 2, 2), ["batch", "model"])
    layout_map = keras.distribution.LayoutMap(mesh)
    for key, axes in MODEL_RULES.items():
        layout_map[key] = axes
    return keras.distribution.ModelParallel(
        layout_map=layout_map, batch_dim_name="batch")


@row("keras-model-parallel")
def keras_model_parallel(distributed, folder):
    if not distributed:
        return train_evaluate_predict(mlp(dropout=0.2))
    distribution = keras_model_parallel_plan()
    with distribution.scope():
        model = mlp(dropout=0.2)
    kernel = model.get_layer("d1").kernel
    assert tuple(klm.fetch_layout(kernel).axes) == (None, "model")
    return train_evaluate_predict(model)


def own_rows(x, batch):
    """This process's rows of `x` when every global batch of `batch` rows
    (in order, the last one short) is the processes' local batches side by
    side: each process takes its contiguous share of each batch. The global
    batches are then the one-device run's, whatever the process count."""
    rank, count = klm.process_index(), klm.process_count()
    starts = range(0, len(x), batch)
    return np.concatenate([
        x[s:min(s + batch, len(x))][rank * (n := min(batch, len(x) - s))
                                    // count:(rank + 1) * n // count]
        for s in starts])


@row("keras-settings-after-use")
def keras_settings_after_use(distributed, folder):
    """Keras' objects changed after first use, as a user changes them. The
    guide's `DataParallel` builds a model, then `auto_shard_dataset =
    False` (Keras' own error for per-process numpy says to): it trains with
    each process passing its own rows, equal to one device on the same
    global batches. The guide's `ModelParallel` builds a model, then a rule
    is deleted from its `LayoutMap`, another added and `auto_shard_dataset`
    cleared: a second model built in its scope follows the changed map and
    evaluates each process's own rows as one device."""
    x, y = digits_data(DIGITS_ROWS)
    if not distributed:
        model = mlp()
        untrained = mlp().evaluate(x, y, batch_size=64, verbose=0)
        history = model.fit(x, y, batch_size=64, epochs=2, shuffle=False,
                            verbose=0).history
        return {"loss": history["loss"], "accuracy": history["accuracy"],
                "evaluate": model.evaluate(x, y, batch_size=64, verbose=0),
                "untrained": untrained,
                **{f"w{i}": w for i, w in enumerate(numpy_weights(model))}}
    batch = 64 // klm.process_count()
    mine = (own_rows(x, 64), own_rows(y, 64))
    data_parallel = keras.distribution.DataParallel(
        devices=keras.distribution.list_devices())
    with data_parallel.scope():
        model = mlp()
    data_parallel.auto_shard_dataset = False  # after first use
    with data_parallel.scope():
        assert keras.distribution.distribution().auto_shard_dataset is False
        history = model.fit(*mine, batch_size=batch, epochs=2,
                            shuffle=False, verbose=0).history
        evaluated = model.evaluate(*mine, batch_size=batch, verbose=0)
    model_parallel = keras_model_parallel_plan()
    layout_map = model_parallel._layout_map
    with model_parallel.scope():
        first = mlp()
    del layout_map["d1/bias"]  # the map changed after first use
    layout_map["d2/bias"] = ("model",)
    model_parallel.auto_shard_dataset = False
    with model_parallel.scope():
        second = mlp()
        untrained = second.evaluate(*mine, batch_size=batch, verbose=0)

    def specs(m, layer, name):
        return tuple(klm.fetch_layout(getattr(m.get_layer(layer), name)).axes)

    assert specs(first, "d1", "bias") == ("model",)  # placed before
    assert specs(first, "d2", "bias") == (None,)
    assert specs(second, "d1", "bias") == (None,)  # the rule deleted
    assert specs(second, "d2", "bias") == ("model",)  # the rule added
    assert specs(second, "d1", "kernel") == (None, "model")
    return {"loss": history["loss"], "accuracy": history["accuracy"],
            "evaluate": evaluated, "untrained": untrained,
            **{f"w{i}": w for i, w in enumerate(numpy_weights(model))}}


# -- klm rules ------------------------------------------------------------------


def encoder_and_classifier():
    keras.utils.set_random_seed(0)
    encoder = keras.Sequential([
        keras.Input((64,)), keras.layers.Dense(32, activation="relu", name="enc_1"),
        keras.layers.Dense(10, name="enc_2")], name="encoder")
    classifier = keras.Sequential([
        keras.Input((64,)), keras.layers.Dense(16, activation="relu", name="head_1"),
        keras.layers.Dense(10, name="head_2")], name="classifier")
    for model in (encoder, classifier):
        model.compile(keras.optimizers.Adam(0.01),
                      keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return encoder, classifier


@row("klm-strict-two-models")
def klm_strict_two_models(distributed, folder):
    if distributed:
        mesh = klm.create_mesh([("batch", DEVICES // 2), ("model", 2)])
        layout_map = klm.LayoutMap(mesh, strict=True)
        layout_map[r"enc_1\.kernel"] = (None, "model")
        layout_map[r"enc_2\.kernel"] = ("model", None)
        layout_map[r"head_1\.kernel"] = (None, "model")
        with layout_map.scope():
            models = encoder_and_classifier()
    else:
        models = encoder_and_classifier()
    x, y = digits_data(DIGITS_ROWS)
    out = {}
    for model in models:
        out[model.name] = model.fit(x, y, batch_size=64, epochs=1, verbose=0,
                                    shuffle=False).history["loss"]
        out.update({f"{model.name} {key}": value for key, value
                    in on_batch_steps(model, x, y).items()})
        for i, w in enumerate(numpy_weights(model)):
            out[f"{model.name}{i}"] = w
    return out


class Interrupt(keras.callbacks.Callback):
    """Stops a run after its first epoch, as a preempted job stops."""

    def on_epoch_end(self, epoch, logs=None):
        if epoch == 0:
            raise KeyboardInterrupt("preempted")


@row("callbacks")
def callbacks(distributed, folder):
    # Every process names the same files, as a user's script does (in a
    # run of several processes, process 0 writes them).
    folder = folder / ("mesh" if distributed else "one")
    backup, checkpoint = folder / "backup", folder / "last.weights.h5"
    distribution = None
    if distributed:
        mesh = klm.create_mesh([("batch", DEVICES // 2), ("model", 2)])
        layout_map = klm.LayoutMap(mesh)
        layout_map[r"d1\.kernel"] = (None, "model")
        layout_map[r"d2\.kernel"] = ("model", None)
        distribution = layout_map.distribution()
    x, y = digits_data(DIGITS_ROWS)

    def run(*extra):
        # SGD keeps no state but its step count: Keras' BackupAndRestore
        # restores the weights before the optimizer is built, and so drops
        # Adam's moments (a warning says so); SGD resumes exactly.
        with (distribution.scope() if distribution else _nothing()):
            model = mlp(optimizer=keras.optimizers.SGD(0.1))
        return model, model.fit(
            x, y, batch_size=64, epochs=3, shuffle=False, verbose=0,
            callbacks=[keras.callbacks.BackupAndRestore(str(backup)),
                       keras.callbacks.ModelCheckpoint(
                           str(checkpoint), save_weights_only=True), *extra])

    with pytest.raises(KeyboardInterrupt):
        run(Interrupt())
    model, history = run()
    assert len(history.history["loss"]) == 2  # resumed after epoch 1
    restored = mlp("restored")
    restored.load_weights(str(checkpoint))
    return {"loss": history.history["loss"],
            **{f"w{i}": w for i, w in enumerate(numpy_weights(model))},
            **{f"restored{i}": w for i, w in enumerate(numpy_weights(restored))}}


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


# -- sharded checkpoints (Keras' OrbaxCheckpoint) --------------------------------


def model_state(model, prefix=""):
    """`model`'s weights (`w0`, ...) and optimizer variables (`opt0`, ...)
    as numpy, each key after `prefix`."""
    out = {f"{prefix}w{i}": w for i, w in enumerate(numpy_weights(model))}
    out.update({f"{prefix}opt{i}": keras.ops.convert_to_numpy(v)
                for i, v in enumerate(model.optimizer.variables)})
    return out


def _assert_same_state(got, expected):
    for key in expected:
        np.testing.assert_array_equal(got[key], expected[key], err_msg=key)


def _assert_loads(step, expected):
    """`load_weights` of one step's directory gives `expected` exactly."""
    saved = mlp()
    saved.load_weights(str(step))
    for got, want in zip(numpy_weights(saved), expected):
        np.testing.assert_array_equal(got, want, err_msg=str(step))


@row("orbax-checkpoint")
def orbax_checkpoint(distributed, folder):
    # Every process names the same directory, as a user's script does;
    # each writes its own shards.
    folder = folder / ("mesh" if distributed else "one")
    x, y = digits_data(DIGITS_ROWS)
    plan = keras_model_parallel_plan() if distributed else None
    other = (keras.distribution.DataParallel(
        device_mesh=keras_mesh((DEVICES,), ["batch"])) if distributed
        else None)

    def fit(model, epochs, initial_epoch=0, callbacks=()):
        model.fit(x, y, batch_size=64, epochs=epochs, shuffle=False,
                  verbose=0, initial_epoch=initial_epoch,
                  callbacks=list(callbacks))

    try:
        keras.distribution.set_distribution(plan)
        model = mlp()
        epoch_ends = []
        fit(model, 2, callbacks=[
            keras.callbacks.LambdaCallback(on_epoch_end=lambda epoch, logs:
                                           epoch_ends.append(numpy_weights(model))),
            # In the background (Keras' default): written while training
            # goes on. (One callback a fit: two Orbax checkpointers saving
            # at once across processes collide in Orbax's own barriers.)
            keras.callbacks.OrbaxCheckpoint(str(folder / "ckpt"), max_to_keep=2)])
        out = model_state(model, "trained/")
        for step, expected in enumerate(epoch_ends):  # each epoch's weights
            _assert_loads(folder / "ckpt" / str(step), expected)
        resumed = keras.models.load_model(str(folder / "ckpt"))
        _assert_same_state(model_state(resumed, "trained/"), out)  # exact
        if distributed:
            kernel = resumed.get_layer("d1").kernel
            assert tuple(klm.fetch_layout(kernel).axes) == (None, "model")
        # Resumed at epoch 3 = never stopped: weights, Adam's moments and
        # step count. Saved before training goes on, while the loss
        # improves (it does).
        fit(resumed, 3, initial_epoch=2, callbacks=[
            keras.callbacks.OrbaxCheckpoint(
                str(folder / "sync"), save_on_background=False,
                save_best_only=True, monitor="loss")])
        fit(model, 3, initial_epoch=2)
        out.update(model_state(resumed, "resumed/"))
        _assert_same_state(out, model_state(model, "resumed/"))
        _assert_loads(folder / "sync" / "2", numpy_weights(resumed))
        keras.distribution.set_distribution(other)  # another plan reads it
        out.update(model_state(keras.models.load_model(str(folder / "ckpt")),
                               "read/"))
        return out
    finally:
        keras.distribution.set_distribution(None)


ORBAX_FIXTURES = pathlib.Path(__file__).parent / "data" / "orbax"


@row("orbax-other-backends")
def orbax_other_backends(distributed, folder):
    out = {}
    for saved in sorted(ORBAX_FIXTURES.glob("*-processes")):
        plan = keras_model_parallel_plan() if distributed else None
        keras.distribution.set_distribution(plan)
        try:
            model = keras.models.load_model(str(saved))
        finally:
            keras.distribution.set_distribution(None)
        expected = np.load(saved.with_suffix(".npz"))
        state = model_state(model)
        _assert_same_state(state, expected)
        out.update({f"{saved.name}/{k}": v for k, v in state.items()})
    assert len(out) > 0, f"no checkpoints in {ORBAX_FIXTURES}"
    return out


# -- keras-hub ----------------------------------------------------------------

VOCAB, LENGTH = 64, 12
GEMMA = dict(vocabulary_size=VOCAB, num_layers=1, num_query_heads=4,
             num_key_value_heads=2, hidden_dim=16, intermediate_dim=32,
             head_dim=8)


def keras_hub():
    return pytest.importorskip("keras_hub", reason="the `nlp` extra")


def recipe():
    """keras-hub's distributed-tuning recipe, as its guide writes it."""
    mesh = keras_mesh((DEVICES // 2, 2), ("batch", "model"))
    layout_map = keras_hub().models.GemmaBackbone.get_layout_map(mesh)
    return keras.distribution.ModelParallel(layout_map=layout_map,
                                            batch_dim_name="batch")


def causal_lm():
    hub = keras_hub()
    keras.utils.set_random_seed(0)
    backbone = hub.models.GemmaBackbone(**GEMMA)
    lm = hub.models.GemmaCausalLM(backbone=backbone, preprocessor=None)
    lm.compile(optimizer=keras.optimizers.Adam(1e-2),
               loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
               sampler="greedy")
    return lm


def built(distributed, distribution=None):
    if not distributed:
        return causal_lm()
    with (distribution or recipe()).scope():
        return causal_lm()


def mixed_prompts(rows):
    """`rows` prompts of 3 to 7 tokens, right-padded to LENGTH."""
    rng = np.random.default_rng(1)
    lengths = 3 + np.arange(rows) % 5
    mask = np.arange(LENGTH)[None, :] < lengths[:, None]
    ids = rng.integers(1, VOCAB, size=(rows, LENGTH))
    return {"token_ids": np.where(mask, ids, 0).astype("int32"),
            "padding_mask": mask}


def generated(lm, prompts, sampler="greedy"):
    lm.compile(sampler=sampler)
    ids = np.asarray(keras.ops.convert_to_numpy(
        lm.generate(prompts, stop_token_ids=None)["token_ids"]))
    mask = prompts["padding_mask"]
    np.testing.assert_array_equal(np.where(mask, ids, 0),
                                  prompts["token_ids"], "prompts overwritten")
    assert (ids[~mask] != 0).any()  # it generated
    return {"ids": ids}


def hub_fit(lm):
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, VOCAB, size=(16, 9)).astype("int32")
    x = {"token_ids": tokens[:, :-1], "padding_mask": np.ones((16, 8), "int32")}
    # keras-hub batches numpy with tf.data or grain; where neither is
    # installed (tests-jax, tests-torch) Keras' own fit runs the same step.
    fit = lm.fit if _pipeline_loader() else (
        lambda *a, **k: keras.Model.fit(lm, *a, **k))
    history = fit(x, tokens[:, 1:], batch_size=8, epochs=1, shuffle=False,
                  verbose=0).history
    return {"loss": history["loss"]}


def _pipeline_loader():
    import importlib.util

    return any(importlib.util.find_spec(m) for m in ("grain", "tensorflow"))


def lm_weights(model):
    return {v.path: keras.ops.convert_to_numpy(v) for v in model.weights}



@row("hub-fit")
def hub_fit_row(distributed, folder):
    if not distributed:
        lm = causal_lm()
        return {**hub_fit(lm), **lm_weights(lm)}
    distribution = recipe()
    with distribution.scope():
        lm = causal_lm()
    out = hub_fit(lm)
    # Read from the backend after training: as the rules say, and Adam's
    # moments laid out as their weights.
    assert_held_as_rules_say(distribution, lm.backbone, 4)
    optimizer = lm.optimizer
    slots = {v.path: v for v in optimizer.variables}
    for weight in lm.trainable_weights:
        for kind in ("momentum", "velocity"):
            slot = slots[f"{optimizer.name}/{weight.path.replace('/', '_')}_{kind}"]
            assert klm.fetch_layout(slot) == klm.fetch_layout(weight), slot.path
    return {**out, **lm_weights(lm)}


@row("hub-generate-greedy")
def hub_generate_greedy(distributed, folder):
    return generated(built(distributed), mixed_prompts(8))


@row("hub-generate-seeded")
def hub_generate_seeded(distributed, folder):
    sampler = keras_hub().samplers.TopKSampler(k=4, seed=7)
    return generated(built(distributed), mixed_prompts(8), sampler)


@row("hub-generate-indivisible")
def hub_generate_indivisible(distributed, folder):
    return generated(built(distributed), mixed_prompts(3))


@row("hub-generate-data-parallel")
def hub_generate_data_parallel(distributed, folder):
    distribution = keras.distribution.DataParallel(
        device_mesh=keras_mesh((DEVICES,), ["batch"]))
    # 8 prompts: one per device on JAX's and TensorFlow's 8, two per
    # process on torch's 4 (where a shard of several rows lost its prompts).
    return generated(built(distributed, distribution), mixed_prompts(8))


@row("hub-lora")
def hub_lora(distributed, folder):
    lm = built(distributed)
    frozen_before = lm_weights(lm)
    lm.backbone.enable_lora(2)
    out = hub_fit(lm)
    trained = {v.path: keras.ops.convert_to_numpy(v)
               for v in lm.trainable_weights}
    assert sum("lora" in path for path in trained) >= 4
    after = lm_weights(lm)
    for path in frozen_before:
        if path not in trained:
            np.testing.assert_array_equal(after[path], frozen_before[path],
                                          err_msg=path)
    return {**out, **trained}


@row("hub-preset")
def hub_preset(distributed, folder):
    if not distributed:
        return lm_weights(causal_lm().backbone)
    distribution = recipe()
    with distribution.scope():
        saved = causal_lm().backbone
        saved.save_to_preset(str(folder / "preset"))
        loaded = keras_hub().models.GemmaBackbone.from_preset(
            str(folder / "preset"))
        assert_held_as_rules_say(distribution, loaded, 4)
    return lm_weights(loaded)


# -- automatic plans -------------------------------------------------------------


def small_cnn():
    """A convolution, pooling and a Dense pair on the digits as 8x8 images,
    compiled: what `klm.auto_layout_map` plans from its builder."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8, 8, 1))
    h = keras.layers.Conv2D(8, 3, padding="same", activation="relu",
                            name="conv")(inputs)
    h = keras.layers.MaxPooling2D(name="pool")(h)
    h = keras.layers.Flatten(name="flat")(h)
    h = keras.layers.Dense(32, activation="relu", name="d1")(h)
    model = keras.Model(inputs, keras.layers.Dense(10, name="d2")(h), name="cnn")
    model.compile(keras.optimizers.Adam(0.01),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def built_as_planned(build):
    """`build()` in the scope of `klm.auto_layout_map(build, mesh)`,
    planned from the builder (shapes only), every weight held as the plan
    says, read from the backend; and {path: the mesh axes it is split
    over}."""
    mesh = klm.create_mesh([("batch", DEVICES // 2), ("model", 2)])
    plan = klm.auto_layout_map(build, mesh)
    with plan.scope():
        model = build()
    planned = {r.path: r.layout for r in plan.explain(model).rows}
    for variable in model.weights:
        assert klm.fetch_layout(variable) == planned[variable.path], \
            variable.path
    return model, {v.path: held_specs(v) for v in model.weights}


@row("auto-plan")
def auto_plan(distributed, folder):
    x, y = digits_data(DIGITS_ROWS)
    x = x.reshape(-1, 8, 8, 1)
    if distributed:
        model, held = built_as_planned(small_cnn)
        assert "model" in held["d1/kernel"] and "model" in held["d2/kernel"]
    else:
        model = small_cnn()
    history = model.fit(x, y, batch_size=64, epochs=1, shuffle=False,
                        verbose=0).history
    return {"loss": history["loss"],
            "predict": model.predict(x[:37], batch_size=16, verbose=0),
            **{f"w{i}": w for i, w in enumerate(numpy_weights(model))}}


def mistral_lm():
    """keras-hub's Mistral causal LM (no `get_layout_map`: a model users
    plan themselves), tiny, compiled to train and decode greedily."""
    hub = keras_hub()
    keras.utils.set_random_seed(0)
    backbone = hub.models.MistralBackbone(
        vocabulary_size=VOCAB, num_layers=1, num_query_heads=4,
        num_key_value_heads=2, hidden_dim=16, intermediate_dim=32)
    lm = hub.models.MistralCausalLM(backbone=backbone, preprocessor=None)
    lm.compile(optimizer=keras.optimizers.Adam(1e-2),
               loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
               sampler="greedy")
    return lm


@row("hub-auto-plan")
def hub_auto_plan(distributed, folder):
    if distributed:
        lm, held = built_as_planned(mistral_lm)
        assert sum("model" in specs for specs in held.values()) >= 6, held
    else:
        lm = mistral_lm()
    return {**hub_fit(lm), **lm_weights(lm),
            **generated(lm, mixed_prompts(8))}


# -- quantized models ------------------------------------------------------------

# Where `quantize` meets the plan, a mode in each way a user gets there
# (keras-hub's recipe quantizes all three inside its scope: hub-quantized):
# - int8 under Keras' `ModelParallel` set globally, whose rule `d1/kernel`
#   also matches `d1/kernel_scale`;
# - int4 on a model a klm `LayoutMap.scope()` placed before `quantize`
#   (the variables it adds are placed at the next call);
# - float8 inside a klm scope.
SITUATIONS = {"int8": "distribution set", "int4": "placed model",
              "float8": "klm scope"}


def regression_data():
    rng = np.random.default_rng(0)
    return (rng.normal(size=(16, 16)).astype("float32"),
            rng.normal(size=(16, 8)).astype("float32"))


def quantized_klm_rules():
    """klm's own (full-match) rules for `quantized_mlp`."""
    layout_map = klm.LayoutMap(
        klm.create_mesh([("batch", DEVICES // 2), ("model", 2)]))
    layout_map[r"d1\.kernel"] = (None, "model")
    layout_map[r"d1\.bias"] = ("model",)
    layout_map[r"d2\.kernel"] = ("model", None)
    return layout_map


def quantized_keras_rules():
    """The same plan written Keras' way: a rule matches anywhere in a path,
    so `d1/kernel` also matches `d1/kernel_scale`."""
    layout_map = keras.distribution.LayoutMap(
        keras_mesh((DEVICES // 2, 2), ["batch", "model"]))
    for key, axes in MODEL_RULES.items():
        layout_map[key] = axes
    return keras.distribution.ModelParallel(layout_map=layout_map,
                                            batch_dim_name="batch")


def held_specs(variable):
    return tuple(None if s in (None, klm.UNSHARDED) else s
                 for s in klm.fetch_layout(variable).sharding_specs)


def planned_specs(path, shape):
    """What the plan gives each weight of a quantized `quantized_mlp()`:
    d1's kernel split by columns (over "model"), d2's by rows; every
    variable quantization adds split where its dimension is the kernel's
    split one (d1's units, d2's inputs for int4's g_idx), LoRA's matrices
    as their kernel's split, else replicated."""
    layer, name = path.split("/")[-2:]
    rank = len(shape)
    if name == "kernel":
        return {"d1": (None, "model"), "d2": ("model", None)}.get(layer, (None, None))
    if name == "bias":
        return ("model",) if layer == "d1" else (None,)
    # int4's zero points: `kernel_zero` (Keras 3.15), `zero_point` (3.16)
    if layer == "d1" and name in ("kernel_scale", "kernel_zero",
                                  "zero_point") and rank:
        return (None,) * (rank - 1) + ("model",)
    if layer == "d2" and name == "g_idx":
        return ("model",)
    # LoRA: d1's b takes its kernel's columns, d2's a its rows
    if (layer, name) == ("d1", "lora_kernel_b"):
        return (None, "model")
    if (layer, name) == ("d2", "lora_kernel_a"):
        return ("model", None)
    return (None,) * rank


def assert_held_as_planned(model):
    assert any(str(v.dtype) == "int8" or "amax" in v.path
               for v in model.weights)  # it did quantize
    for v in model.weights:
        assert held_specs(v) == planned_specs(v.path, v.shape), v.path


def quantized_fit(distributed, mode, optimizer, lora):
    """`quantized_mlp()` quantized to `mode` (in its `SITUATIONS` on the
    mesh), LoRA of rank 2 on d1 and d2 if `lora`, `predict`, then 2 epochs
    of `fit` and `predict` again: losses, every weight (int8 kernels
    compared exactly), predictions; on the mesh, the quantized kernels
    before training too, and every weight where the plan puts it after."""
    x, y = regression_data()
    situation = SITUATIONS[mode] if distributed else None

    def quantized(model):
        model.quantize(mode)
        if lora:
            for name in ("d1", "d2"):
                model.get_layer(name).enable_lora(2)
        return model

    try:
        if situation == "distribution set":  # Keras' classes, set globally
            keras.distribution.set_distribution(quantized_keras_rules())
            model = quantized(quantized_mlp())
        elif situation == "placed model":
            with quantized_klm_rules().scope():
                model = quantized_mlp()
            model = quantized(model)  # outside the scope: placed at next call
        elif situation == "klm scope":
            with quantized_klm_rules().scope():
                model = quantized(quantized_mlp())
        else:
            model = quantized(quantized_mlp())
        out = {"predict before": model.predict(x, verbose=0)}
        model.compile(optimizer=optimizer, loss="mse")
        out.update({f"before {v.path}": keras.ops.convert_to_numpy(v)
                    for v in model.weights if str(v.dtype) == "int8"})
        out["loss"] = model.fit(x, y, batch_size=8, epochs=2, shuffle=False,
                                verbose=0).history["loss"]
        out["predict"] = model.predict(x, verbose=0)
        if distributed:
            assert_held_as_planned(model)
        return {**out, **lm_weights(model)}
    finally:
        keras.distribution.set_distribution(None)


@row("quantized-lora-fit")
def quantized_lora_fit(distributed, folder):
    out = {}
    for mode in ("int8", "int4"):
        got = quantized_fit(distributed, mode, keras.optimizers.SGD(0.1), True)
        for path in [p for p in got if p.startswith("before ")]:
            # the frozen quantized kernels: bit-identical after training
            np.testing.assert_array_equal(got[path[len("before "):]], got[path])
        assert sum("lora" in p for p in got) == 4
        out.update({f"{mode} {k}": v for k, v in got.items()})
    return out


@row("quantized-float8-fit")
def quantized_float8_fit(distributed, folder):
    got = quantized_fit(distributed, "float8", keras.optimizers.Adam(1e-2),
                        False)
    assert len([p for p in got if "amax_history" in p]) == 9
    return got


# One Gemma in the three modes, as `quantize(mode, filters=...)` mixes them
# (each layer is quantized by the same `layer.quantize(mode)` as a whole-
# model `quantize(mode)`): int4 where its packing and zero points meet the
# rules (the embedding, the query projection under LoRA, the (16, 16) gate),
# int8 on the value projection (under LoRA) and the output projection of
# the feed-forward, float8 on the rest (trained through its amax histories).
HUB_MODES = {"int4": r"^(token_embedding|query|ffw_gating)$",
             "int8": r"^(value|ffw_linear)$",
             "float8": r"^(key|attention_output|ffw_gating_2)$"}
FLOAT8_LAYERS = ("attention/key/", "attention/attention_output/",
                 "ffw_gating_2/")


def assert_hub_quantized_layouts(distribution, lm):
    """Read from the backend: each int8 kernel where the recipe's rule puts
    the float one, int4's packed kernels where the packed size divides,
    each scale following its kernel's split dimension, float8's per-tensor
    scales and histories replicated."""
    held = {v.path: held_specs(v) for v in lm.weights}
    block = "decoder_block_0/"
    for name in ("attention/value", "ffw_linear"):  # int8
        v = next(v for v in lm.weights if v.path == f"{block}{name}/kernel")
        assert str(v.dtype) == "int8", v.path
        assert held[v.path] == tuple(distribution.get_variable_layout(v).axes)
    # The value kernel's heads (dimension 0, over "model") are dimension 2
    # of its (1, 1, heads, head_dim) scale; ffw_linear's rows (over
    # "batch") its (1, 1, 16) scale's last.
    assert held[block + "attention/value/kernel_scale"] == (
        None, None, "model", None)
    assert held[block + "ffw_linear/kernel_scale"] == (None, None, "batch")
    # int4: ffw_gating's kernel (16, 16), rule ("batch", "model"), stored
    # (16, 8), two values a byte along its columns (Keras 3.15 and nightly
    # alike); the per-column scale takes the columns' axis.
    assert held[block + "ffw_gating/kernel"] == ("batch", "model")
    assert held[block + "ffw_gating/kernel_scale"][-1] == "model"
    assert held["token_embedding/embeddings_scale"][0] == "model"
    # float8: the kernels in float, where the rules put them
    assert held[block + "ffw_gating_2/kernel"] == ("batch", "model")
    float8 = [path for path in held if any(
        block + layer in path for layer in FLOAT8_LAYERS)
        and ("amax_history" in path or path.endswith("_scale"))]
    assert len(float8) == 18, float8
    assert all(spec is None for path in float8 for spec in held[path])


def quantize_mixed(lm):
    for mode, layers in HUB_MODES.items():
        lm.quantize(mode, filters=layers)


@row("hub-quantized")
def hub_quantized(distributed, folder, optimizer=None, fit=True, nudge=None):
    """The recipe's Gemma quantized in the recipe's scope (`HUB_MODES`),
    then greedy `generate()` of prompts of mixed lengths; then LoRA of rank
    2 on its query (int4) and value (int8) projections, compiled outside
    the scope (the model was placed: its next `fit` runs on the mesh), one
    epoch: the ids, losses, every weight, the quantized kernels before and
    after (bit-identical). One model for both: a model a user quantizes is
    one they generate with and tune.

    The fit is SGD's (`optimizer`, a function making one, else SGD(0.1)):
    the quantized layers turn a rounding-level change of an activation
    into a step of their grid, and Adam, whose first steps move each
    weight by its learning rate whatever its gradient's size, makes that
    the whole of LoRA's update (`hub_quantized_tolerance`). tests/
    tolerances.py calls this with `fit=False` (the weights before `fit`)
    and `nudge`, a numpy Generator: every norm scale moved by one float32
    ulp, each up or down at random, before `fit`."""
    distribution = recipe() if distributed else None
    with (distribution.scope() if distributed else _nothing()):
        lm = causal_lm()
        quantize_mixed(lm)
        out = generated(lm, mixed_prompts(8))
        if distributed:
            assert_hub_quantized_layouts(distribution, lm)
        lm.backbone.enable_lora(2)
    lm.compile(optimizer=(optimizer or (lambda: keras.optimizers.SGD(0.1)))(),
               loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
               weighted_metrics=[keras.metrics.SparseCategoricalAccuracy()],
               sampler="greedy")
    if not fit:
        return lm_weights(lm)
    for v in lm.weights if nudge is not None else ():
        if v.path.endswith("norm/scale"):  # Gemma's RMSNorm: x * (1 + scale)
            value = keras.ops.convert_to_numpy(v)
            ulp = np.maximum(np.abs(value), 1.0) * 2.0 ** -23
            v.assign(value + np.where(nudge.random(value.shape) < 0.5, ulp, -ulp))
    frozen = {f"before {v.path}": keras.ops.convert_to_numpy(v)
              for v in lm.weights if str(v.dtype) == "int8"}
    assert len(frozen) == 8, sorted(frozen)  # 5 kernels, int4's 3 zero points
    out.update({**hub_fit(lm), **lm_weights(lm)})
    for path in frozen:  # the frozen quantized kernels: untouched
        np.testing.assert_array_equal(out[path[len("before "):]], frozen[path],
                                      err_msg=path)
    assert sum("lora" in v.path for v in lm.trainable_weights) == 4
    if distributed:
        assert_hub_quantized_layouts(distribution, lm)
    return out


def hub_quantized_tolerance(key):
    """How far a rounding-level change moves the hub-quantized row's
    numbers on one device (`python tests/tolerances.py nudge`, JAX,
    2026-12-02: one float32 ulp on the norm scales before `fit`): LoRA's
    matrices up to 2.2e-4 (4 % to 12 % of their update's norm) under
    SGD(0.1), 2.1e-2 (up to 69 %) under Adam(1e-2); the loss up to 1.5e-4
    relative (3 nudges each).
    Everything else, amax histories and scales included, met (1e-3, 2e-5)
    on every cell measured (torch, 4 processes: 5e-6 on an embedding)."""
    if "lora_kernel" in key:
        return (1e-2, 1e-3)
    if key == "loss":
        return (3e-3, 0.0)
    return (1e-3, 2e-5)


def float8_tolerance(key):
    """Keras' float8 Dense passes its bias through bfloat16, so the bias's
    gradient is rounded to 8 bits: a sum over rows taken in another order
    (on a mesh) may round to the neighbouring value, 2**-8 apart, and Adam
    (lr 1e-2) moves a bias by up to lr x that a step, and the predictions
    with it (6e-5 apart, seen on torch with 4 processes). Everything else,
    losses, kernels, amax histories and scales, to float32 rounding."""
    loose = key.endswith("/bias") or key == "predict"
    return (1e-2, 2e-4) if loose else (1e-5, 1e-6)


# (rtol, atol), or a function of the key giving them; else (1e-4, 1e-5).
TOLERANCE = {"keras-data-parallel": (1e-5, 2e-6),
             "keras-settings-after-use": (1e-5, 2e-6),
             "keras-model-parallel": (1e-5, 2e-6),
             "klm-strict-two-models": (1e-5, 2e-6),
             "auto-plan": (1e-5, 2e-6),
             "callbacks": (1e-5, 2e-6),
             "quantized-lora-fit": (1e-5, 1e-6),
             "quantized-float8-fit": float8_tolerance,
             "hub-quantized": hub_quantized_tolerance}


# Rows whose one-device numbers are another row's: the same code runs
# there without a distribution.
SAME_REFERENCE = {"keras-model-parallel": "keras-data-parallel",
                  "hub-generate-data-parallel": "hub-generate-greedy"}


def test_every_declared_row_has_a_test_and_back():
    assert sorted(ROWS) == sorted(workflows.by_name())


@pytest.mark.parametrize("name", [w.name for w in workflows.WORKFLOWS])
def test_workflow(name, tmp_path):
    """Row `name` in this cell equals one device, or fails as declared."""
    function = ROWS[name]
    cannot = workflows.by_name()[name].expected(BACKEND, PROCESSES, KERAS)
    if cannot is not None:
        with pytest.raises(cannot.error, match=cannot.match):
            function(True, tmp_path)
        return
    reference = ROWS[SAME_REFERENCE.get(name, name)]
    expected = one_device(reference, tmp_path.parent / "one-device")
    got = function(True, tmp_path)
    tolerance = TOLERANCE.get(name, (1e-4, 1e-5))
    assert_equal_results(got, expected, tolerance if callable(tolerance)
                         else lambda key: tolerance)
