"""The torch data-parallel step on plain tensors (`backends/torch/local_step.py`):
Keras' own `train_step` (and `test_step`) runs on each process's rows, the
gradients and the loss tracker's increments summed in one all-reduce, only
where that gives one device's numbers. Each test checks which path each
step took (the number of local steps) and that training equals one
process.

Runs under `python -m keras_layoutmap.launch -n 4 -m pytest` (nox -s
tests-torch): every process runs each test, together."""

import keras
import numpy as np
import pytest
from helpers import (
    assert_same_history,
    assert_same_weights,
    digits_data,
    digits_net,
    dp_mesh,
    mp_mesh,
)

import keras_layoutmap as klm
from keras_layoutmap import backends

pytestmark = [
    pytest.mark.sharding,
    pytest.mark.training,
    pytest.mark.skipif(backends.name() != "torch",
                       reason="the data-parallel step of the torch backend"),
]

# 280 rows in batches of 64 (split over 4 processes, 16 rows each), the
# last batch 24 (6 each); 2 epochs: 10 steps, the first of each batch shape
# on DTensors.
ROWS, BATCH, EPOCHS = 280, 64, 2
STEPS, FIRST_STEPS = 10, 2


@pytest.fixture(scope="module")
def digits():
    x, y = digits_data(ROWS)
    weights = np.random.default_rng(0).uniform(0.2, 2.0, ROWS).astype("float32")
    return x, y, weights


def local_steps(model, training=True):
    from keras_layoutmap.backends.torch import local_step

    return sum(local_step.local_steps(model, training).values())


def fit(model, digits, sample_weight=False, y=None, **kwargs):
    x, labels, weights = digits
    return model.fit(x, labels if y is None else y, batch_size=BATCH,
                     epochs=EPOCHS, shuffle=False, verbose=0,
                     sample_weight=weights if sample_weight else None,
                     **kwargs).history


def count_all_reduces(monkeypatch):
    """The sizes of the `torch.distributed.all_reduce` calls from now on
    (until `monkeypatch.undo()`)."""
    import torch.distributed

    calls = []
    all_reduce = torch.distributed.all_reduce

    def counted(*args, **kwargs):
        calls.append(args[0].numel())
        return all_reduce(*args, **kwargs)

    monkeypatch.setattr(torch.distributed, "all_reduce", counted)
    return calls


def on_mesh(build, mesh=None):
    with klm.DataParallel(mesh or dp_mesh()).scope():
        return build()


@pytest.mark.parametrize("axes", ["batch", "batch x model"])
@pytest.mark.parametrize("sample_weight", [False, True],
                         ids=["", "sample weights"])
def test_fit_runs_keras_step_locally_and_matches_one_process(
        digits, axes, sample_weight):
    """Loss and accuracy logs, weights and optimizer states equal one
    process's; on a (batch, model) mesh the sums run over `batch` only."""
    mesh = dp_mesh() if axes == "batch" else mp_mesh()
    reference = digits_net()
    ref_history = fit(reference, digits, sample_weight)
    model = on_mesh(digits_net, mesh)
    history = fit(model, digits, sample_weight)
    assert local_steps(model) == STEPS - FIRST_STEPS
    assert_same_history(history, ref_history)
    assert_same_weights(model.get_weights(), reference.get_weights())
    assert_same_weights([v.numpy() for v in model.optimizer.variables],
                        [v.numpy() for v in reference.optimizer.variables])
    kernel = model.get_layer("d1").kernel
    assert klm.fetch_layout(kernel) == klm.Layout.replicated(mesh, 2)
    # evaluate's steps run locally too (the first of each batch shape on
    # DTensors); every process holds the global metric states.
    x, y, weights = digits
    weights = weights if sample_weight else None
    got = model.evaluate(x, y, batch_size=BATCH, verbose=0, return_dict=True,
                         sample_weight=weights)
    expected = reference.evaluate(x, y, batch_size=BATCH, verbose=0,
                                  return_dict=True, sample_weight=weights)
    assert local_steps(model, training=False) == STEPS // EPOCHS - FIRST_STEPS
    assert got.keys() == expected.keys()
    for name in expected:
        np.testing.assert_allclose(got[name], expected[name], rtol=1e-5,
                                   err_msg=name)


def own_rows(x, batch):
    """This process's contiguous share of each global batch of `batch`."""
    rank, count = klm.process_index(), klm.process_count()
    return np.concatenate([
        x[s:s + batch][rank * len(x[s:s + batch]) // count:
                       (rank + 1) * len(x[s:s + batch]) // count]
        for s in range(0, len(x), batch)])


@pytest.mark.parametrize("axes", ["batch", "batch x model"])
def test_each_process_passing_its_own_rows_runs_locally_without_a_gather(
        digits, axes, monkeypatch):
    """`auto_shard_dataset=False`, each process passing its share of each
    global batch: on a batch axis over the processes in rank order the rows
    are already where the data layout puts them, so every step after the
    first of a batch shape runs locally, no rows gathered (one all-gather
    of the row counts a step); on a (batch, model) mesh a batch shard spans
    two processes, so the rows are gathered and the step runs on DTensors.
    Either way equal to one process on the global batches."""
    from keras_layoutmap.backends.torch import processes

    x, y, _ = digits
    reference = digits_net()
    ref_history = fit(reference, digits)
    mesh = dp_mesh() if axes == "batch" else mp_mesh()
    with klm.DataParallel(mesh, auto_shard_dataset=False).scope():
        model = digits_net()
    gathered = []
    gather = processes.all_gather_rows
    monkeypatch.setattr(processes, "all_gather_rows",
                        lambda local: gathered.append(1) or gather(local))
    share = BATCH // klm.process_count()
    history = model.fit(own_rows(x, BATCH), own_rows(y, BATCH),
                        batch_size=share, epochs=EPOCHS, shuffle=False,
                        verbose=0).history
    assert_same_history(history, ref_history)
    assert_same_weights(model.get_weights(), reference.get_weights())
    if axes == "batch":
        assert local_steps(model) == STEPS - FIRST_STEPS
        assert len(gathered) == 2 * FIRST_STEPS  # x and y, a shape's first
    else:
        assert local_steps(model) == 0
        assert len(gathered) == 2 * STEPS


def test_a_batch_the_axis_does_not_divide_runs_whole_on_every_process(digits):
    """66 rows over 4 processes: whole on each (DataParallel's data layout),
    so each process's step is the global one, with nothing to sum."""
    x, y, weights = digits
    data = (x[:66 * 4], y[:66 * 4], weights)

    def run(model):
        return model.fit(data[0], data[1], batch_size=66, epochs=2,
                         shuffle=False, verbose=0).history

    reference = digits_net()
    ref_history = run(reference)
    model = on_mesh(digits_net)
    history = run(model)
    assert local_steps(model) == 8 - 1
    assert_same_history(history, ref_history)
    assert_same_weights(model.get_weights(), reference.get_weights())


def test_a_training_step_with_compiled_metrics_takes_one_all_reduce(
        digits, monkeypatch):
    """Keras updates compiled metrics after the optimizer's update; their
    increments still go in the gradients' all-reduce, so a local training
    step is one collective (each more is one more wait for the slowest
    process), with one process's logs and weights. Evaluation: one too."""
    x, y, weights = digits
    metrics = ["accuracy", keras.metrics.SparseTopKCategoricalAccuracy(3)]
    reference = digits_net(metrics=metrics)
    model = on_mesh(lambda: digits_net(metrics=[
        "accuracy", keras.metrics.SparseTopKCategoricalAccuracy(3)]))
    for net in (reference, model):  # the first step of each shape: DTensors
        net.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    calls = count_all_reduces(monkeypatch)
    before = local_steps(model)
    history = model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False,
                        verbose=0, sample_weight=weights).history
    steps = local_steps(model) - before
    assert steps == STEPS // EPOCHS
    assert len(calls) == steps
    model.evaluate(x, y, batch_size=BATCH, verbose=0)  # first steps: DTensors
    calls.clear()
    before = local_steps(model, training=False)
    got = model.evaluate(x, y, batch_size=BATCH, verbose=0, return_dict=True)
    assert local_steps(model, training=False) - before == STEPS // EPOCHS
    assert len(calls) == STEPS // EPOCHS
    monkeypatch.undo()
    ref_history = reference.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False,
                                verbose=0, sample_weight=weights).history
    expected = reference.evaluate(x, y, batch_size=BATCH, verbose=0,
                                  return_dict=True)
    assert_same_history(history, ref_history)
    assert set(history) == {"loss", "accuracy", "sparse_top_k_categorical_accuracy"}
    assert_same_weights(model.get_weights(), reference.get_weights())
    assert got.keys() == expected.keys()
    for name in expected:
        np.testing.assert_allclose(got[name], expected[name], rtol=1e-5,
                                   err_msg=name)


@pytest.mark.parametrize("optimizer", [
    "adam", "adam, loss_scale_factor", "LossScaleOptimizer",
    "adam, gradient_accumulation_steps", "sgd, clipnorm"])
def test_each_process_gradient_is_scaled_by_its_share_of_the_rows_once(
        digits, optimizer):
    """Each process's gradient of its rows' mean loss counts by its share
    of the global batch: through the optimizer's `scale_loss` (the loss
    multiplied by it), else, where an optimizer's own `scale_loss` does not
    call Keras' (`LossScaleOptimizer`), when the gradients are summed.
    Either way exactly once: weights and optimizer states equal one
    process's."""

    def make():
        if optimizer == "adam":
            return keras.optimizers.Adam(1e-2)
        if optimizer == "adam, loss_scale_factor":
            return keras.optimizers.Adam(1e-2, loss_scale_factor=8.0)
        if optimizer == "adam, gradient_accumulation_steps":
            return keras.optimizers.Adam(1e-2, gradient_accumulation_steps=3)
        if optimizer == "sgd, clipnorm":  # clips the global batch's gradients
            return keras.optimizers.SGD(0.5, clipnorm=0.05)
        return keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(1e-2))

    reference = digits_net(make())
    ref_history = fit(reference, digits)
    model = on_mesh(lambda: digits_net(make()))
    history = fit(model, digits)
    assert local_steps(model) == STEPS - FIRST_STEPS
    assert_same_history(history, ref_history)
    assert_same_weights(model.get_weights(), reference.get_weights())
    assert_same_weights([v.numpy() for v in model.optimizer.variables],
                        [v.numpy() for v in reference.optimizer.variables])


def test_a_multi_optimizer_sums_all_its_gradients_in_one_all_reduce(
        digits, monkeypatch):
    """`MultiOptimizer` (Adam for d1, SGD for d2, each its own `apply`):
    the gradients are summed once, for both, before either applies them."""
    def make():
        def pick(variable):
            if variable.path.startswith("d1/"):
                return keras.optimizers.Adam(1e-2)
            return keras.optimizers.SGD(0.1)
        return digits_net(keras.optimizers.MultiOptimizer(pick))

    reference = make()
    model = on_mesh(make)
    x, y, _ = digits
    for net in (reference, model):  # the first step of each shape: DTensors
        net.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    calls = count_all_reduces(monkeypatch)
    before = local_steps(model)
    history = model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False,
                        verbose=0).history
    assert local_steps(model) - before == STEPS // EPOCHS
    assert len(calls) == STEPS // EPOCHS
    monkeypatch.undo()
    ref_history = reference.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False,
                                verbose=0).history
    assert_same_history(history, ref_history)
    assert_same_weights(model.get_weights(), reference.get_weights())


def test_a_loss_scale_optimizer_skips_a_step_on_every_process_alike(digits):
    """A `LossScaleOptimizer` skips a step whose gradients overflow. Its
    test must see the global batch's gradients: here only the first
    process's rows overflow (one pixel of 1e37 in the second batch, so a
    local step), and one device skips the step, halves its scale and goes
    on. So must every process: a process deciding alone would skip the
    all-reduce that the others wait in."""
    x, y, _ = digits
    x = x.copy()
    x[BATCH + 3, 0] = 1e37  # the first process's rows of the second batch

    def make():
        return digits_net(keras.optimizers.LossScaleOptimizer(
            keras.optimizers.Adam(1e-2)))

    reference = make()
    ref_history = fit(reference, (x, y, None))
    model = on_mesh(make)
    history = fit(model, (x, y, None))
    assert local_steps(model) == STEPS - FIRST_STEPS
    # one device halved its scale twice (each epoch's second batch)
    assert float(reference.optimizer.dynamic_scale.numpy()) == 2.0 ** 13
    assert_same_history(history, ref_history)
    assert_same_weights(model.get_weights(), reference.get_weights())
    assert_same_weights([v.numpy() for v in model.optimizer.variables],
                        [v.numpy() for v in reference.optimizer.variables])


def two_outputs():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((64,))
    hidden = keras.layers.Dense(32, activation="relu", name="d1")(inputs)
    digit = keras.layers.Dense(10, name="digit")(hidden)
    value = keras.layers.Dense(1, name="value")(hidden)
    model = keras.Model(inputs, {"digit": digit, "value": value}, name="net")
    model.compile(
        optimizer=keras.optimizers.Adam(0.01),
        loss={"digit": keras.losses.SparseCategoricalCrossentropy(from_logits=True),
              "value": "mse"},
        loss_weights={"digit": 1.0, "value": 0.5},
        metrics={"digit": ["accuracy"], "value": ["mae"]},
    )
    return model


def test_two_outputs_their_losses_and_metrics_match_one_process(digits):
    """Per-output losses (each with its own loss tracker) and metrics, and
    the validation logs fit takes with them."""
    x, labels, _ = digits
    y = {"digit": labels, "value": (labels / 9.0).astype("float32")}
    validation = (x[:200], {"digit": y["digit"][:200], "value": y["value"][:200]})
    reference = two_outputs()
    ref_history = fit(reference, digits, y=y, validation_data=validation)
    model = on_mesh(two_outputs)
    history = fit(model, digits, y=y, validation_data=validation)
    assert local_steps(model) == STEPS - FIRST_STEPS
    # 200 rows: 3 batches of 64 and one of 8, twice; the first of each on
    # DTensors.
    assert local_steps(model, training=False) == 8 - 2
    assert {"digit_loss", "value_loss", "digit_accuracy", "value_mae",
            "val_digit_loss", "val_value_mae"} <= set(history)
    assert_same_history(history, ref_history)
    assert_same_weights(model.get_weights(), reference.get_weights())


def batch_max_loss(y_true, y_pred):
    """The largest row loss of the batch: not a mean over rows."""
    rows = keras.losses.sparse_categorical_crossentropy(
        y_true, y_pred, from_logits=True)
    return keras.ops.max(rows)


def batch_max_metric(y_true, y_pred):
    return keras.ops.max(y_pred)


class OwnStep(keras.Model):
    def train_step(self, data):
        return super().train_step(data)


class ClippingAdam(keras.optimizers.Adam):
    """Clips each gradient element before Adam sees it, in its own
    `apply`: on one process's gradients, that is not one device's step."""

    def apply(self, grads, trainable_variables=None):
        grads = [keras.ops.clip(g, -1e-3, 1e-3) for g in grads]
        return super().apply(grads, trainable_variables)


NOT_ROW_MEANS = {  # digits_net's arguments, made for each model
    "a loss summed over the batch": lambda: dict(
        loss=keras.losses.SparseCategoricalCrossentropy(
            from_logits=True, reduction="sum"),
        optimizer=keras.optimizers.SGD(1e-4)),
    "a loss averaged by the sample weights": lambda: dict(
        loss=keras.losses.SparseCategoricalCrossentropy(
            from_logits=True, reduction="mean_with_sample_weight")),
    "a loss of the user's": lambda: dict(loss=batch_max_loss),
    "a metric of the user's": lambda: dict(metrics=[batch_max_metric]),
    "a weight regularizer": lambda: dict(d1={"kernel_regularizer": "l2"}),
    "a train_step of the user's": lambda: dict(model_class=OwnStep),
    "an optimizer's apply of the user's": lambda: dict(
        optimizer=ClippingAdam(1e-2)),
}


@pytest.mark.parametrize("case", NOT_ROW_MEANS)
def test_steps_that_are_not_row_means_stay_on_dtensors(digits, case):
    def build():
        return digits_net(**NOT_ROW_MEANS[case]())

    reference = build()
    ref_history = fit(reference, digits, sample_weight=True)
    model = on_mesh(build)
    history = fit(model, digits, sample_weight=True)
    assert local_steps(model) == 0
    assert_same_history(history, ref_history)
    assert_same_weights(model.get_weights(), reference.get_weights())
