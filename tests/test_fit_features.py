"""`model.fit` features on a mesh, each checked against one device: weight
regularization, Python generators, spatial (feature-dim) sharding, and the
ModelCheckpoint and EarlyStopping callbacks. BackupAndRestore, interrupted
and resumed, is the workflow matrix's `callbacks` row (every cell)."""

import keras
import numpy as np
import pytest
from helpers import (
    FIT_PLANS,
    assert_same_history,
    assert_same_weights,
    compile_classifier,
    digits_data,
    digits_net,
    dp_mesh,
    mp_mesh,
    net_layout_map,
)

import keras_layoutmap as klm
from keras_layoutmap import backends

pytestmark = [pytest.mark.sharding, pytest.mark.training]

BATCH = 64  # 600 rows: the last batch of an epoch holds 24


@pytest.fixture(scope="module")
def digits():
    return digits_data(600)


def build(regularized=False, spatial=False, optimizer=None):
    # Before the seed: an L2 regularizer draws nothing.
    regularizer = dict(kernel_regularizer=keras.regularizers.L2(0.01)
                       if regularized else None)
    return digits_net(
        optimizer, d1=regularizer, d2=regularizer,
        before=(lambda: keras.layers.Identity(name="pixels")) if spatial else None)


def model_parallel(mesh, **kwargs):
    with net_layout_map(mesh, bias=False).scope():
        return build(**kwargs)


def assert_same(model, reference, history=None, ref_history=None):
    if history is not None:
        assert_same_history(history, ref_history)
    assert_same_weights(model.get_weights(), reference.get_weights())


def test_regularization_losses_count_once(digits):
    x, y = digits
    reference = build(regularized=True)
    ref = reference.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    mesh = mp_mesh()
    model = model_parallel(mesh, regularized=True)
    history = model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    # A penalty counted once per device would show in the loss at once.
    assert_same(model, reference, history.history, ref.history)
    unregularized = build().fit(x, y, batch_size=BATCH, epochs=1, shuffle=False,
                                verbose=0)
    assert history.history["loss"][0] > unregularized.history["loss"][0]


# Keras optimizer options that act on all gradients or weights at once:
# each must see the batch's summed gradients (a norm taken over one
# process's or device's share would clip differently) and the whole of a
# sharded weight.
OPTIMIZER_OPTIONS = {
    "global_clipnorm": dict(global_clipnorm=0.3),
    "clipnorm": dict(clipnorm=0.05),
    "gradient_accumulation_steps": dict(gradient_accumulation_steps=3),
    "use_ema": dict(use_ema=True, ema_momentum=0.5),
    "weight_decay": dict(weight_decay=0.5),
}


_ONE_DEVICE = {}  # option (None: plain Adam) -> (history, weights)


def one_device(option, x, y):
    """Adam with `option` (None: without) trained on one device, once per
    process: the reference of both plans, and the run the option changed."""
    if option not in _ONE_DEVICE:
        klm.set_distribution(None)
        reference = build(optimizer=keras.optimizers.Adam(
            0.01, **OPTIMIZER_OPTIONS.get(option, {})))
        history = reference.fit(x, y, batch_size=BATCH, epochs=2,
                                shuffle=False, verbose=0).history
        _ONE_DEVICE[option] = (history, reference.get_weights())
    return _ONE_DEVICE[option]


@pytest.mark.parametrize("distribution", FIT_PLANS)
@pytest.mark.parametrize("option", sorted(OPTIMIZER_OPTIONS))
def test_optimizer_options_match_single_device(digits, option, distribution):
    x, y = digits
    optimizer = keras.optimizers.Adam(0.01, **OPTIMIZER_OPTIONS[option])
    if distribution == "data_parallel":
        with klm.DataParallel(dp_mesh()).scope():
            model = build(optimizer=optimizer)
    else:
        model = model_parallel(mp_mesh(), optimizer=optimizer)
    history = model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False,
                        verbose=0).history
    ref_history, ref_weights = one_device(option, x, y)
    assert_same_history(history, ref_history)
    assert_same_weights(model.get_weights(), ref_weights)
    # The option changed the training, so a wrong use of it would show.
    _, plain = one_device(None, x, y)
    assert max(float(np.max(np.abs(a - b))) for a, b in zip(
        plain, ref_weights)) > 1e-3


def _batches(x, y):
    for start in range(0, len(y), BATCH):
        yield x[start:start + BATCH], y[start:start + BATCH]


def test_python_generator_with_short_batch(digits):
    x, y = digits
    steps = -(-len(y) // BATCH)

    def fit(model):
        for _ in range(2):  # a generator is good for one epoch
            model.fit(_batches(x, y), steps_per_epoch=steps, epochs=1, verbose=0)
        return model.evaluate(_batches(x, y), steps=steps, verbose=0,
                              return_dict=True)

    ref_logs = fit(reference := build())
    mesh = dp_mesh()
    with klm.DataParallel(mesh).scope():
        model = build()
    logs = fit(model)
    for key in ref_logs:
        np.testing.assert_allclose(logs[key], ref_logs[key], rtol=1e-5, err_msg=key)
    assert_same(model, reference)


def test_spatial_parallel_fit_matches_single_device(digits):
    """The DTensor ML tutorial's third scheme through `fit`: the pixels are
    split over the `feature` axis (a `<layer>/output` rule), and so are the
    rows of the first kernel."""
    x, y = digits
    reference = build(spatial=True)
    ref = reference.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    mesh = mp_mesh("feature")
    lm = klm.LayoutMap(mesh)
    lm["pixels/output"] = ("batch", "feature")
    lm[r"d1\.kernel"] = ("feature", None)
    with klm.ModelParallel(layout_map=lm, batch_dim_name="batch").scope():
        model = build(spatial=True)
    history = model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    assert_same(model, reference, history.history, ref.history)
    assert klm.fetch_layout(model.get_layer("d1").kernel) == klm.Layout(
        ["feature", None], mesh)


def test_model_checkpoint_saves_weights_that_load_anywhere(tmp_path, digits):
    x, y = digits
    mesh = mp_mesh()
    model = model_parallel(mesh)
    path = str(tmp_path / "best.weights.h5")
    model.fit(x, y, batch_size=BATCH, epochs=2, validation_split=0.2, verbose=0,
              callbacks=[keras.callbacks.ModelCheckpoint(
                  path, save_weights_only=True, monitor="val_loss")])
    plain = build()
    plain.load_weights(path)
    assert_same(plain, model)
    full = str(tmp_path / "model.keras")
    model.save(full)
    loaded = keras.saving.load_model(full)
    np.testing.assert_allclose(loaded.predict(x[:32], verbose=0),
                               model.predict(x[:32], verbose=0), rtol=1e-5, atol=1e-6)


def test_early_stopping_restores_best_weights(digits):
    x, y = digits

    def fit(model):
        stop = keras.callbacks.EarlyStopping(monitor="loss", patience=0,
                                             restore_best_weights=True,
                                             baseline=None, min_delta=10.0)
        return model.fit(x, y, batch_size=BATCH, epochs=5, shuffle=False,
                         verbose=0, callbacks=[stop]).history

    ref_history = fit(reference := build())
    mesh = mp_mesh()
    model = model_parallel(mesh)
    history = fit(model)
    assert len(history["loss"]) == len(ref_history["loss"]) < 5
    assert_same(model, reference, history, ref_history)
    assert klm.fetch_layout(model.get_layer("d1").kernel) == klm.Layout(
        [None, "model"], mesh)


# Keras' torch trainer takes one step per execution, on one device too.
STEPS = 1 if backends.name() == "torch" else 3


def test_every_variable_on_the_mesh_and_steps_per_execution(digits):
    """Weights, BatchNormalization statistics, the dropout seed state,
    optimizer slots, iteration and learning rate, and metric state: none is
    left off the mesh. Several steps per execution give the same numbers."""
    x, y = digits

    def fit(model):
        compile_classifier(model, steps_per_execution=STEPS)
        return model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False,
                         verbose=0).history

    def build_bn_dropout():
        keras.utils.set_random_seed(0)
        return keras.Sequential([
            keras.Input((64,)),
            # No bias before BatchNormalization: its gradient is zero up to
            # rounding, which Adam would scale up to a step of its own.
            keras.layers.Dense(32, name="d1", use_bias=False),
            keras.layers.BatchNormalization(name="bn"),
            keras.layers.Dropout(0.3, name="drop"),
            keras.layers.Dense(10, name="d2"),
        ])

    ref_history = fit(reference := build_bn_dropout())
    mesh = mp_mesh()
    lm = klm.LayoutMap(mesh)
    lm[r"d1\.kernel"] = (None, "model")
    with klm.ModelParallel(layout_map=lm).scope():
        model = build_bn_dropout()
    history = fit(model)
    assert_same(model, reference, history, ref_history)
    variables = model.variables + model.optimizer.variables + model.metrics_variables
    for name in ("seed_generator_state", "moving_mean", "iteration",
                 "learning_rate", "velocity"):
        assert any(v.path.endswith(name) for v in variables), name
    off = [v.path for v in variables if klm.fetch_layout(v).mesh != mesh]
    assert off == []



def _outcome(call):
    """What a call on empty data gives: its result, or the kind of error."""
    try:
        result = call()
    except Exception as error:  # one device may fail too; then so must we
        return "error", type(error).__name__
    return "ok", getattr(result, "history", result)


def test_empty_data_ends_as_on_one_device():
    # Fault (TensorFlow): with metrics, empty data on a mesh raised
    # "Cannot get result() since the metric has not yet been built", where
    # one device returns empty results.
    x, y = np.zeros((0, 64), "float32"), np.zeros((0,), "int32")
    plain = build()
    expected = [_outcome(lambda: plain.evaluate(x, y, verbose=0)),
                _outcome(lambda: plain.fit(x, y, verbose=0))]
    model = build()
    klm.set_distribution(klm.DataParallel(dp_mesh()))
    assert [_outcome(lambda: model.evaluate(x, y, verbose=0)),
            _outcome(lambda: model.fit(x, y, verbose=0))] == expected
