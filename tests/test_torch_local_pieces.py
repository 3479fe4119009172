"""The torch fast path (`backends/torch/local_pieces.py`,
`tensor_parallel.py`, `local_updates.py`): a model whose weights are
replicated, split over the batch axis (FSDP: gathered whole for the call)
or over the model axis (tensor parallelism: each process's piece, with
Megatron's all-reduces), runs its layers on each process's own rows, and
its optimizer on each process's pieces, only where that gives DTensor's
numbers. Each test checks which path a call took and that
training equals one process, with a short last batch.

Runs under `python -m keras_layoutmap.launch -n 4 -m pytest` (nox -s
tests-torch): every process runs each test, together."""

import keras
import numpy as np
import pytest
from helpers import (
    assert_same_history,
    assert_same_weights,
    compile_classifier,
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
                       reason="the fast path of the torch backend"),
]

# 280 rows in batches of 64: the last batch holds 24, split over the
# batch axis too. A batch of 66 the axis does not divide: whole on every
# process (DataParallel's data layout for it).
ROWS, BATCH, UNDIVIDED = 280, 64, 66


@pytest.fixture(scope="module")
def digits():
    return digits_data(ROWS)


def local_pieces():
    from keras_layoutmap.backends.torch import local_pieces

    return local_pieces


def build(middle=None, **dense_kwargs):
    return digits_net(middle=middle, d1=dense_kwargs)


def data_parallel(*args, mesh=None, **kwargs):
    with klm.DataParallel(mesh or dp_mesh()).scope():
        return build(*args, **kwargs)


def fit(model, digits):
    x, y = digits
    return model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False,
                     verbose=0).history


def assert_same_training(model, history, reference, ref_history):
    assert_same_history(history, ref_history)
    assert_same_weights(model.get_weights(), reference.get_weights())


@pytest.mark.parametrize("axes", ["batch", "batch x model"])
def test_data_parallel_fit_runs_locally_and_matches_one_process(digits, axes):
    """On a (batch, model) mesh the batch is split over `batch` only: the
    gradients are partial sums over that axis alone."""
    mesh = dp_mesh() if axes == "batch" else mp_mesh()
    reference = build()
    ref_history = fit(reference, digits)
    model = data_parallel(mesh=mesh)
    history = fit(model, digits)
    plans = local_pieces().local_plans(model)
    # Full batches, the 24-row batch: both signatures ran locally.
    assert len(plans) == 2 and all(plans.values()), plans
    assert_same_training(model, history, reference, ref_history)
    # The optimizer updated local copies: still replicated DTensors, equal
    # on every process.
    kernel = model.get_layer("d1").kernel
    assert klm.fetch_layout(kernel) == klm.Layout.replicated(mesh, 2)
    moments = [v for v in model.optimizer.variables if "d1_kernel" in v.path]
    assert moments and all(
        klm.fetch_layout(m) == klm.fetch_layout(kernel) for m in moments)
    x, y = digits
    for batch in (BATCH, UNDIVIDED):
        before = len(local_pieces().local_plans(model))
        np.testing.assert_allclose(
            model.predict(x, batch_size=batch, verbose=0),
            reference.predict(x, batch_size=batch, verbose=0),
            rtol=1e-5, atol=1e-6)
        got = model.evaluate(x, y, batch_size=batch, verbose=0, return_dict=True)
        expected = reference.evaluate(x, y, batch_size=batch, verbose=0,
                                      return_dict=True)
        np.testing.assert_allclose(got["loss"], expected["loss"], rtol=1e-6)
        assert got["accuracy"] == expected["accuracy"]
        plans = local_pieces().local_plans(model)
        assert len(plans) > before and all(plans.values()), plans


def test_fast_path_gives_the_dtensor_path_numbers(digits, monkeypatch):
    fast = data_parallel()
    fast_history = fit(fast, digits)
    monkeypatch.setattr(local_pieces(), "ENABLED", False)
    slow = data_parallel()
    slow_history = fit(slow, digits)
    assert local_pieces().local_plans(slow) == {}
    assert_same_training(fast, fast_history, slow, slow_history)


def test_masked_sequence_outputs_keep_their_mask(digits):
    """An output's padding mask (Embedding(mask_zero=True)) goes with its
    rows: the loss leaves the padded steps out, as on one process."""
    x, y = digits
    ids = (x * 16).astype("int32")  # 64 steps of ids 0..16, 0 = padding
    labels = np.repeat(y[:, None], 64, axis=1)

    def sequence_model():
        keras.utils.set_random_seed(0)
        inputs = keras.Input((64,), dtype="int32")
        h = keras.layers.Embedding(17, 8, mask_zero=True, name="embed")(inputs)
        outputs = keras.layers.Dense(10, name="head")(h)
        model = keras.Model(inputs, outputs)
        model.compile(optimizer=keras.optimizers.Adam(0.01), loss=keras.losses
                      .SparseCategoricalCrossentropy(from_logits=True))
        return model

    reference = sequence_model()
    ref_history = reference.fit(ids, labels, batch_size=BATCH, epochs=2,
                                shuffle=False, verbose=0).history
    with klm.DataParallel(dp_mesh()).scope():
        model = sequence_model()
    history = model.fit(ids, labels, batch_size=BATCH, epochs=2, shuffle=False,
                        verbose=0).history
    assert all(local_pieces().local_plans(model).values())
    assert_same_training(model, history, reference, ref_history)


class MinusBatchMean(keras.layers.Layer):
    """Mixes rows: subtracts the batch's mean."""

    def call(self, x):
        return x - keras.ops.mean(x, axis=0, keepdims=True)


class PlusRowIndex(keras.layers.Layer):
    """Mixes rows without communicating: adds each row's index in the batch
    (on one process's rows alone the indices would start at 0 again)."""

    def call(self, x):
        rows = keras.ops.arange(keras.ops.shape(x)[0], dtype=x.dtype)
        return x + 0.01 * rows[:, None]


class TimesBatchSize(keras.layers.Layer):
    """Reads the batch size as a number: on a process's rows it would read
    its share. No trial can see it; the first local call's numbers can."""

    def call(self, x):
        return x * (x.shape[0] / 64.0)


def untracked_scale():
    """A layer that reads a variable the model does not own (a closure):
    its local call would meet a DTensor; the first local call's check sees
    it."""
    scale = keras.Variable(1.5, name="scale")

    class Scaled(keras.layers.Layer):
        def call(self, x):
            return x * scale

    return Scaled()


CROSS_ROW = {
    "batch normalization": dict(
        middle=lambda: keras.layers.BatchNormalization(name="bn")),
    "seeded dropout": dict(middle=lambda: keras.layers.Dropout(0.2, seed=1)),
    "a batch mean": dict(middle=MinusBatchMean),
    "a row index": dict(middle=PlusRowIndex),
    "an activity regularizer": dict(activity_regularizer="l2"),
    "the batch size as a number": dict(middle=TimesBatchSize),
    "a variable the model does not own": dict(middle=untracked_scale),
}


@pytest.mark.parametrize("case", CROSS_ROW)
def test_calls_the_fast_path_cannot_take_stay_on_dtensors(digits, case):
    reference = build(**CROSS_ROW[case])
    ref_history = fit(reference, digits)
    model = data_parallel(**CROSS_ROW[case])
    history = fit(model, digits)
    plans = local_pieces().local_plans(model)
    assert plans and not any(plans.values()), plans
    assert_same_history(history, ref_history)
    # A batch statistic is summed in another order over 4 processes than on
    # one; after 2 epochs of Adam(0.01), which normalises each update, the
    # weights differ by up to 6.5e-5 with the batch mean and 3.2e-4 with
    # batch normalization (measured; it divides by per-unit deviations, and
    # tiny ones magnify the rounding), the losses by under 1e-5 relative.
    atol = 1e-3 if case == "batch normalization" else 1e-4
    assert_same_weights(model.get_weights(), reference.get_weights(), rtol=1e-4,
                        atol=atol)


def local_trials():
    from keras_layoutmap.backends.torch import local_trials

    return local_trials


def local_updates():
    from keras_layoutmap.backends.torch import local_updates

    return local_updates


MEGATRON = {r"d1\.kernel": (None, "model"), r"d1\.bias": ("model",),
            r"d2\.kernel": ("model", None)}
HEADS = {"mha/(query|key|value)/kernel": (None, "model", None),
         "mha/attention_output/kernel": ("model", None, None)}


def attention_block():
    """The digits as 4 rows of 16 pixels: a pre-norm self-attention (2 heads
    of 8, no biases) with a residual, flattened, then d1 -> d2."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((64,))
    x = keras.layers.Reshape((4, 16))(inputs)
    h = keras.layers.LayerNormalization(name="ln")(x)
    h = keras.layers.MultiHeadAttention(2, 8, use_bias=False, name="mha")(h, h)
    x = keras.layers.Flatten()(keras.layers.Add()([x, h]))
    x = keras.layers.Dense(32, activation="relu", name="d1")(x)
    outputs = keras.layers.Dense(10, name="d2")(x)
    return compile_classifier(keras.Model(inputs, outputs, name="net"))


def normed_convolution():
    """The digits as 4 rows of 16 pixels: a norm, a Conv1D of 8 filters (no
    bias: its add reshapes by the filter count), averaged over the rows,
    then d2 (the filters and d2's rows split alike: a column then a
    row)."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((64,))
    x = keras.layers.Reshape((4, 16))(inputs)
    x = keras.layers.LayerNormalization(name="ln")(x)
    x = keras.layers.Conv1D(8, 2, activation="relu", use_bias=False,
                            name="conv")(x)
    x = keras.layers.GlobalAveragePooling1D()(x)
    outputs = keras.layers.Dense(10, name="d2")(x)
    # (no accuracy: one row's logits tie to 2e-7 here, and the split
    # convolution sums in another order than one device's)
    return compile_classifier(keras.Model(inputs, outputs, name="net"),
                              accuracy=False)


# (model, rules, the weights they split, whether calls run on the pieces)
TENSOR_PARALLEL = {
    # a matmul keeps d1's split dim (f on its input), d2's sums over it (g)
    "the Megatron pair": (build, MEGATRON, 3, True),
    # einsums over the heads; f's gradient all-reduce reaches the norm
    "attention heads, then the pair": (attention_block, {**MEGATRON, **HEADS},
                                       7, True),
    # d1's columns into a whole d2: the pieces do not fit, DTensors do
    "a column without its row": (build, {r"d1\.kernel": (None, "model")}, 1,
                                 False),
    # right forward on the pieces, but the norm's gradient would need an f
    # after the convolution, which only DTensors place
    "a convolution split by filters": (
        normed_convolution, {r"conv\.kernel": (None, None, "model"),
                             r"d2\.kernel": ("model", None)}, 2, False),
}


@pytest.mark.parametrize("case", TENSOR_PARALLEL)
def test_tensor_parallel_calls_run_on_the_pieces_and_match_one_process(digits,
                                                                       case):
    """Weights split over "model", whose processes hold the same rows:
    each call reads this process's pieces, with Megatron's all-reduces
    around the products on them, where the pieces fit (else on DTensors),
    and Adam's update (elementwise, its moments laid out as the kernels)
    runs on the pieces. Equal to one process, in fit and predict."""
    make, rules, count, local = TENSOR_PARALLEL[case]
    layout_map = klm.LayoutMap(mp_mesh())
    for pattern, axes in rules.items():
        layout_map[pattern] = axes
    with layout_map.scope():
        model = make()
    reference = make()
    assert_same_training(model, fit(model, digits), reference, fit(reference, digits))
    x, _ = digits
    np.testing.assert_allclose(
        model.predict(x[:BATCH], batch_size=BATCH, verbose=0),
        reference.predict(x[:BATCH], batch_size=BATCH, verbose=0),
        rtol=1e-5, atol=1e-6)
    plans = local_pieces().local_plans(model)
    assert plans and set(plans.values()) == {local}, plans
    split = [v for v in model.trainable_variables
             if "model" in klm.fetch_layout(v).sharding_specs]
    assert len(split) == count, [v.path for v in split]  # still split
    assert (local_updates().local_update_mesh(
        model.optimizer, model.trainable_variables) == split[0].value.device_mesh)


# (optimizer, whether its update runs on each process's pieces)
FSDP_OPTIMIZERS = {
    "Adam": (lambda: keras.optimizers.Adam(0.01), True),
    "SGD with momentum": (lambda: keras.optimizers.SGD(0.1, momentum=0.9), True),
    # a norm reads the whole gradient: the update stays on DTensors
    "Adam with clipnorm": (lambda: keras.optimizers.Adam(0.01, clipnorm=0.5),
                           False),
}


GATHER = "_c10d_functional.all_gather_into_tensor.default"
REDUCE_SCATTER = "_c10d_functional.reduce_scatter_tensor.default"


@pytest.mark.parametrize("name", FSDP_OPTIMIZERS)
def test_fsdp_calls_gather_each_split_weight_and_match_one_process(digits, name):
    """`klm.fsdp` over the batch axis: each call gathers every split weight
    whole (one all-gather each) and runs on the process's rows; the
    backward sums each gradient into the pieces (one reduce-scatter each);
    the weights stay split. Equal to one process, with a short last
    batch."""
    import torch

    make, local_update = FSDP_OPTIMIZERS[name]
    mesh = dp_mesh()
    with klm.fsdp(mesh, axis="batch", min_bytes=0).scope():
        model = digits_net(optimizer=make())
    split = [v for v in model.trainable_variables
             if "batch" in klm.fetch_layout(v).sharding_specs]
    # d2's bias (10 numbers) does not split in 4: replicated
    assert [v.path for v in split] == ["d1/kernel", "d1/bias", "d2/kernel"]
    reference = digits_net(optimizer=make())
    ref_history = fit(reference, digits)
    history = fit(model, digits)
    plans = local_pieces().local_plans(model)
    assert len(plans) == 2 and all(plans.values()), plans
    assert_same_training(model, history, reference, ref_history)
    for v in split:  # still split after training
        assert "batch" in klm.fetch_layout(v).sharding_specs, v.path
    assert (local_updates().local_update_mesh(
        model.optimizer, model.trainable_variables) is not None) == local_update
    # One step's DTensor collectives: an all-gather and a reduce-scatter
    # per split weight (the loss and metrics add all-reduces of their own).
    x, y = digits
    counted = local_trials().Collectives()
    with counted:
        model.fit(x[:BATCH], y[:BATCH], batch_size=BATCH, verbose=0)
    reference.fit(x[:BATCH], y[:BATCH], batch_size=BATCH, verbose=0)
    names = [str(f) for f in counted.seen]
    assert names.count(GATHER) == len(split), names
    assert names.count(REDUCE_SCATTER) == len(split), names
    # Without gradients each weight is gathered where the call reads it,
    # and not kept: one all-gather each (and one of the predictions, which
    # predict returns whole), no reduce-scatter. (A signature's first call
    # gathers for its trial too.)
    model.predict(x[:BATCH], batch_size=BATCH, verbose=0)
    counted = local_trials().Collectives()
    with counted:
        predicted = model.predict(x[:BATCH], batch_size=BATCH, verbose=0)
    names = [str(f) for f in counted.seen]
    assert names.count(GATHER) == len(split) + 1, names
    assert REDUCE_SCATTER not in names, names
    np.testing.assert_allclose(
        predicted, reference.predict(x[:BATCH], batch_size=BATCH, verbose=0),
        rtol=1e-5, atol=1e-6)
    assert all(local_pieces().local_plans(model).values())
    torch.distributed.barrier()


def test_signatures_tried_per_model_are_bounded(digits, monkeypatch):
    """Shapes that keep changing (a trial call each) stay on DTensors past
    MAX_SIGNATURES, still equal to one process."""
    monkeypatch.setattr(local_pieces(), "MAX_SIGNATURES", 2)
    x = digits[0]
    model = data_parallel()
    reference = build()
    for rows in (8, 16, 24, 32):
        np.testing.assert_allclose(
            model.predict(x[:rows], batch_size=rows, verbose=0),
            reference.predict(x[:rows], batch_size=rows, verbose=0),
            rtol=1e-5, atol=1e-6)
    assert list(local_pieces().local_plans(model).values()) == [True, True]


def test_torch_style_loop_runs_locally_and_matches_one_process(digits):
    """forward, `loss.backward()`, `optimizer.apply` on packed batches of a
    replicated model."""
    import torch

    x, y = digits
    mesh = dp_mesh()
    rows = klm.Layout.batch_sharded(mesh, "batch", rank=2)
    labels = klm.Layout.batch_sharded(mesh, "batch", rank=1)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def run(model, placed):
        for start in range(0, len(x), BATCH):
            xb, yb = x[start:start + BATCH], y[start:start + BATCH]
            if placed:
                xb, yb = klm.distribute(xb, rows), klm.distribute(yb, labels)
            else:
                xb, yb = torch.tensor(xb), torch.tensor(yb)
            loss = loss_fn(yb, model(xb, training=True))
            model.zero_grad()
            loss.backward()
            grads = [v.value.grad for v in model.trainable_weights]
            with torch.no_grad():
                model.optimizer.apply(grads, model.trainable_weights)
        return float(klm.unpack(loss)[0]) if placed else float(loss)

    reference = build()
    ref_loss = run(reference, placed=False)
    model = data_parallel()
    loss = run(model, placed=True)
    assert all(local_pieces().local_plans(model).values())
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    assert_same_weights(model.get_weights(), reference.get_weights())
