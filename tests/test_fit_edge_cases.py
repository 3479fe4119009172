"""`model.fit` on a mesh under faults and odd input, each checked against one
device from the same seed: a process killed mid-epoch and resumed with
BackupAndRestore (also a model-parallel backup resumed data-parallel), a batch
smaller than the batch axis, sample and class weights, loss reductions and a
loss that looks across the batch, batches of varying size from a Python
generator, and mixed precision."""

import json
import signal

import keras
import numpy as np
import pytest
from helpers import (
    FIT_PLANS,
    assert_same_history,
    assert_same_weights,
    digits_data,
    digits_net,
    dp_mesh,
    mp_mesh,
    net_layout_map,
    run_script,
)

import keras_layoutmap as klm
from keras_layoutmap import backends

pytestmark = [pytest.mark.sharding, pytest.mark.training]

BATCH = 64  # 270 rows: the last batch of an epoch holds 14, which 8 and 4 do not divide
ROWS = 270


@pytest.fixture(scope="module")
def digits():
    return digits_data(ROWS)


def build(loss=None, loss_weights=None):
    # Not Adam: it divides each gradient by its own size, so a gradient
    # scaled wrongly (summed over devices, loss scale left in, padding
    # counted) would barely show in the weights.
    return digits_net(keras.optimizers.SGD(0.1, momentum=0.9), loss,
                      loss_weights=loss_weights, weighted_metrics=["accuracy"])


def build_under(kind, loss=None, loss_weights=None):
    """The model built on one device, under DataParallel over every device
    or under ModelParallel on a (batch, model 2) mesh."""
    if kind == "data_parallel":
        with klm.DataParallel(dp_mesh()).scope():
            return build(loss, loss_weights)
    with net_layout_map(mp_mesh()).scope():
        return build(loss, loss_weights)


_ONE_DEVICE = {}


def one_device(key, run):
    """`run` on a one-device model: (its weights, what `run` returned).
    Trained once per key, for the data- and the model-parallel case."""
    if key not in _ONE_DEVICE:
        model = build()
        result = run(model)
        _ONE_DEVICE[key] = ([np.asarray(w) for w in model.get_weights()], result)
    return _ONE_DEVICE[key]


def assert_same(model, ref_weights, history=None, ref_history=None, rtol=1e-5,
                atol=2e-6, loss_rtol=1e-5):
    if history is not None:
        assert_same_history(history, ref_history, rtol=loss_rtol)
    weights = model.get_weights()
    assert len(weights) == len(ref_weights)
    assert_same_weights(weights, ref_weights, rtol=rtol, atol=atol)


# -- BackupAndRestore across a SIGKILL ----------------------------------------

# Run in a fresh process, as a user's script would: KERAS_BACKEND comes from
# the environment and configure_virtual_devices is the first call. (The
# model and its rules from helpers, on its PYTHONPATH: `helpers.run_script`.)
_SCRIPT = r'''
import os, signal, sys
import keras_layoutmap as klm
klm.configure_virtual_devices(8)
import keras
import numpy as np
from helpers import digits_net, net_layout_map

workdir = sys.argv[1]
data = np.load(os.path.join(workdir, "data.npz"))
x, y = data["x"], data["y"]


def build_under_model_parallel():
    with net_layout_map(klm.create_mesh([("batch", 4), ("model", 2)])).scope():
        return digits_net()


class KillMidEpoch(keras.callbacks.Callback):
    """At the 4th batch of the 3rd epoch, when the backup holds epochs 1-2:
    SIGKILL, as a preempted job ends."""

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if self.epoch == 2 and batch == 3:
            os.kill(os.getpid(), signal.SIGKILL)


def fit(model, backup, *callbacks):
    return model.fit(
        x, y, batch_size=64, epochs=4, shuffle=False, verbose=0,
        callbacks=[keras.callbacks.BackupAndRestore(os.path.join(workdir, backup)),
                   *callbacks])


fit(build_under_model_parallel(), "model_parallel", KillMidEpoch())
sys.exit("the training was not killed")
'''


@pytest.mark.processes
@pytest.mark.skipif(
    backends.name() == "torch",
    reason="kills a one-process run of 8 devices; a torch mesh is one process "
    "per device (BackupAndRestore across 4 processes: test_fit_features)")
def test_backup_and_restore_resumes_after_sigkill(tmp_path, digits):
    """Killed (SIGKILL) in its 3rd epoch under model parallel (a fresh
    process, as a user's script), resumed under data parallel (here, on the
    same 8 devices): the backup of epoch 2 was whole and reads under another
    plan, equal to a run never stopped. (Resumed on its own plan after an
    interruption, equal to one device: the workflow matrix's callbacks row,
    in every cell.)"""
    x, y = digits
    np.savez(tmp_path / "data.npz", x=x, y=y)
    script = tmp_path / "train.py"
    script.write_text(_SCRIPT)
    killed = run_script(script, tmp_path)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    metadata = json.loads(
        (tmp_path / "model_parallel" / "training_metadata.json").read_text())
    assert metadata["epoch"] == 2, metadata  # killed in the 3rd epoch
    runs = {}
    for backup in ("model_parallel", "uninterrupted"):
        with klm.DataParallel(dp_mesh()).scope():
            model = digits_net()  # the script's model
        history = model.fit(
            x, y, batch_size=64, epochs=4, shuffle=False, verbose=0,
            callbacks=[keras.callbacks.BackupAndRestore(str(tmp_path / backup))])
        runs[backup] = len(history.history["loss"]), model.get_weights()
    assert runs["uninterrupted"][0] == 4
    assert runs["model_parallel"][0] == 2  # epochs 3-4
    assert len(runs["uninterrupted"][1]) == 4  # two kernels, two biases
    # Epochs 1-2 ran model-parallel: equal up to float rounding.
    assert_same_weights(runs["model_parallel"][1], runs["uninterrupted"][1],
                        rtol=1e-5, atol=2e-6)
    # Training finished: the backup is gone.
    assert not (tmp_path / "model_parallel").exists()


# -- Odd batches ---------------------------------------------------------------


def test_batch_of_three_on_more_devices(digits):
    """Every batch holds fewer rows than the batch axis has devices (8, or
    4 on torch)."""
    x, y = digits[0][:48], digits[1][:48]

    def run(model):
        history = model.fit(x, y, batch_size=3, epochs=2, shuffle=False, verbose=0)
        logs = model.evaluate(x[:21], y[:21], batch_size=3, verbose=0,
                              return_dict=True)
        return history.history, logs, model.predict(x[:7], batch_size=3, verbose=0)

    reference = build()
    ref_history, ref_logs, ref_pred = run(reference)
    history, logs, pred = run(model := build_under("data_parallel"))
    assert_same(model, reference.get_weights(), history, ref_history)
    for key in ref_logs:
        np.testing.assert_allclose(logs[key], ref_logs[key], rtol=1e-5, err_msg=key)
    assert pred.shape == (7, 10)
    np.testing.assert_allclose(pred, ref_pred, rtol=1e-5, atol=1e-6)


SIZES = (64, 3, 40)  # full; 3 rows on 8 (or 4) batch shards; 40 rows, not a full batch


def _varying_batches(x, y):
    while True:
        start = 0
        for size in SIZES:
            yield x[start:start + size], y[start:start + size]
            start += size


@pytest.mark.parametrize("kind", FIT_PLANS)
def test_generator_with_varying_batch_sizes(kind, digits):
    x, y = digits

    def run(model):
        history = model.fit(_varying_batches(x, y), steps_per_epoch=len(SIZES),
                            epochs=2, verbose=0)
        logs = model.evaluate(_varying_batches(x, y), steps=len(SIZES), verbose=0,
                              return_dict=True)
        return history.history, logs

    ref_weights, (ref_history, ref_logs) = one_device("varying", run)
    history, logs = run(model := build_under(kind))
    assert_same(model, ref_weights, history, ref_history)
    for key in ref_logs:
        np.testing.assert_allclose(logs[key], ref_logs[key], rtol=1e-5, err_msg=key)


# -- Weighted samples ------------------------------------------------------------


def _weights(y, weighting):
    if weighting == "sample_weight":
        return np.random.default_rng(0).uniform(0.1, 2.0, len(y)).astype("float32")
    return {label: 0.2 + 0.3 * label for label in range(10)}


@pytest.mark.parametrize("weighting", ["sample_weight", "class_weight"])
@pytest.mark.parametrize("kind", FIT_PLANS)
def test_sample_and_class_weights(kind, weighting, digits):
    """Weighted loss and weighted metrics; the last batch (14 rows) is padded
    to fill the batch shards, and its padding must weigh nothing."""
    x, y = digits

    def fit(model, **weights):
        return model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0,
                         **weights).history

    def run(model):
        return fit(model, **{weighting: _weights(y, weighting)})

    ref_weights, ref_history = one_device(weighting, run)
    history = run(model := build_under(kind))
    assert "weighted_accuracy" in history
    assert_same(model, ref_weights, history, ref_history)
    # The weights changed the training: not a test that ignores them.
    unweighted, _ = one_device("unweighted", fit)
    assert not np.allclose(unweighted[0], ref_weights[0], rtol=1e-3, atol=1e-4)


# -- Loss reductions -------------------------------------------------------------


class BatchMeanPenalty(keras.losses.Loss):
    """Looks across rows: cross-entropy plus a penalty on the batch's mean
    logits."""

    def call(self, y_true, y_pred):
        values = keras.losses.sparse_categorical_crossentropy(
            y_true, y_pred, from_logits=True)
        mean = keras.ops.mean(y_pred, axis=0)
        return values + 0.1 * keras.ops.sum(keras.ops.square(mean))


def _cross_entropy(reduction):
    return lambda: keras.losses.SparseCategoricalCrossentropy(
        from_logits=True, reduction=reduction)


# name: (loss, its weight). A sum over 64 rows weighs 1/64: SGD(0.1) on
# the plain sum takes steps so large that rounding grows past float32's.
LOSSES = {
    "sum": (_cross_entropy("sum"), 1 / BATCH),
    "mean_with_sample_weight": (_cross_entropy("mean_with_sample_weight"), None),
    "a batch-mean penalty": (BatchMeanPenalty, None),
}


@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
@pytest.mark.parametrize("loss", LOSSES)
@pytest.mark.parametrize("kind", FIT_PLANS)
def test_loss_reductions_and_a_loss_across_rows(kind, loss, weighted, digits):
    """A summed loss, a mean over the sample weights and a loss that looks
    across the batch (its batch mean summed over the devices), with and
    without sample weights, the short last batch (14 rows, which the batch
    axis does not divide) included: as on one device."""
    x, y = digits
    weights = {"sample_weight": _weights(y, "sample_weight")} if weighted else {}

    def run(model):
        return model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False,
                         verbose=0, **weights).history

    make_loss, loss_weight = LOSSES[loss]
    reference = build(make_loss(), loss_weight)
    ref_history = run(reference)
    ref_weights = [np.asarray(w) for w in reference.get_weights()]
    history = run(model := build_under(kind, make_loss(), loss_weight))
    assert_same(model, ref_weights, history, ref_history)


# -- Mixed precision -------------------------------------------------------------


@pytest.fixture
def mixed_policy(request):
    keras.mixed_precision.set_global_policy(request.param)
    try:
        yield request.param
    finally:
        keras.mixed_precision.set_global_policy("float32")


@pytest.mark.parametrize("mixed_policy", ["mixed_float16", "mixed_bfloat16"],
                         indirect=True)
@pytest.mark.parametrize("kind", FIT_PLANS)
def test_mixed_precision(kind, mixed_policy, digits):
    x, y = digits

    def run(model):
        return model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False,
                         verbose=0).history

    ref_weights, ref_history = one_device(mixed_policy, run)
    history = run(model := build_under(kind))
    # Variables stay float32; the layers compute in the half type.
    dense = model.get_layer("d1")
    assert dense.kernel.dtype == "float32"
    assert dense.compute_dtype == mixed_policy.split("_")[1]
    if mixed_policy == "mixed_float16":
        # compile wraps the optimizer in a LossScaleOptimizer, whose scale
        # and step counter must live on the mesh like every other variable.
        assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    mesh = klm.fetch_layout(dense.kernel).mesh
    assert all(klm.fetch_layout(v).mesh == mesh for v in model.optimizer.variables)
    # Split over devices, the sums over the batch (gradients) and over the
    # model axis (d2's matmul) are added in another order, and rounded to
    # the half type in between: float16 keeps 11 significant bits (one
    # rounding ~5e-4 relative), bfloat16 only 8 (~4e-3). Five SGD steps of
    # lr 0.1 carry these into the float32 weights (measured over ten, worst case:
    # 8e-4 for float16, 1.8e-3 for bfloat16, TensorFlow; 5.4e-3 for
    # bfloat16 on torch, 4 processes); the tolerances leave a factor of
    # ~1.5-3. The loss, a mean over 64 rows, drifts far less
    # (measured <= 2e-5 relative). Accuracy counts argmaxes: a near-tie among
    # the logits can flip a few of the rows (measured: 6 in bfloat16).
    weight_atol, loss_rtol, accuracy_atol = {
        "mixed_float16": (2.5e-3, 1e-4, 5 / ROWS),
        "mixed_bfloat16": (8e-3, 1e-4, 15 / ROWS),
    }[mixed_policy]
    assert history.keys() == ref_history.keys()
    for key in history:
        if key.endswith("accuracy"):
            np.testing.assert_allclose(history[key], ref_history[key],
                                       atol=accuracy_atol, err_msg=key)
        else:
            np.testing.assert_allclose(history[key], ref_history[key],
                                       rtol=loss_rtol, err_msg=key)
    assert_same(model, ref_weights, rtol=0, atol=weight_atol)
