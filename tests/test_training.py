"""`model.fit` under data, model and spatial parallelism matches one device.
Data parallel `fit`, `evaluate` and `predict` with a short last batch, in
every cell: the workflow matrix's keras-data-parallel row
(tests/test_workflows.py); here, klm's `DataParallel` on a batch no device
count divides."""

import keras
import numpy as np
import pytest
from helpers import (
    DEVICES,
    REORDER_ATOL,
    assert_same_history,
    assert_same_weights,
    compile_classifier,
    digits_data,
    dp_mesh,
    keras_mesh,
    mp_mesh,
    net_layout_map,
    sequential_mlp,
)

import keras_layoutmap as klm
from keras_layoutmap import backends

pytestmark = [pytest.mark.sharding, pytest.mark.training]

EPOCHS = 2
BATCH = 128  # 1797 * 0.8 -> 1437 training rows: the last batch holds 29


@pytest.fixture(scope="module")
def digits():
    return digits_data()


def build(seed=0):
    return sequential_mlp(64, 32, 10, name="mlp", seed=seed)


def train(model, digits, **kwargs):
    x, y = digits
    compile_classifier(model)
    history = model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, validation_split=0.2,
                        shuffle=False, verbose=0, **kwargs)
    return history.history


def weights(model):
    return [np.asarray(w) for w in model.get_weights()]


def model_parallel_map(mesh):
    lm = net_layout_map(mesh)
    lm[r"d3\.kernel"] = (None, "model")
    return lm


@pytest.fixture(scope="module")
def single(digits):
    model = build()
    history = train(model, digits)
    return model, history


def reordered_within_batches(x, y, seed):
    """`x`, `y` with the rows of each training batch permuted (the
    validation rows, those after the first 80 % (Keras' `validation_split`
    rounds the training rows down), as they were): the same batches, each
    summed in another order."""
    x, y = x.copy(), y.copy()
    rng = np.random.default_rng(seed)
    train = int(len(x) * 0.8)
    for start in range(0, train, BATCH):
        rows = start + rng.permutation(min(BATCH, train - start))
        x[start:start + len(rows)], y[start:start + len(rows)] = x[rows], y[rows]
    return x, y


def test_weight_tolerance_covers_a_reordered_sum(digits, single):
    """One device, the same batches with their rows permuted: the weights
    move, by rounding only, and stay within `REORDER_ATOL` of the
    unpermuted run (the tolerance every mesh-against-one-device comparison
    of weights uses)."""
    moved = []
    for seed in (0, 1):
        model = build()
        train(model, reordered_within_batches(*digits, seed))
        moved.append(max(float(np.max(np.abs(a - b))) for a, b in
                         zip(weights(model), weights(single[0]))))
    assert 0 < max(moved) < REORDER_ATOL, moved


def test_model_parallel_matches_single_device(digits, single):
    mesh = mp_mesh()
    lm = model_parallel_map(mesh)
    with lm.scope():
        model = build()
    history = train(model, digits)
    assert_same_history(history, single[1])
    assert_same_weights(weights(model), weights(single[0]))
    # Layouts as JAX holds them after training, weights and optimizer slots.
    d1 = model.get_layer("d1")
    assert klm.fetch_layout(d1.kernel) == klm.Layout([None, "model"], mesh)
    local = mesh.num_local_devices()  # all 8 in one process; 1 a process on torch
    assert [p.shape for p in klm.unpack(d1.kernel)] == [(64, 32)] * local
    assert [p.shape for p in klm.unpack(model.get_layer("d2").kernel)] == [
        (32, 32)] * local
    slots = [v for v in model.optimizer.variables if "d1_kernel" in v.path]
    assert slots and all(klm.fetch_layout(s) == klm.fetch_layout(d1.kernel)
                         for s in slots)
    # evaluate and predict outside the scope, every sample exactly once.
    x, y = digits
    expected = single[0].predict(x, batch_size=BATCH, verbose=0)
    got = model.predict(x, batch_size=BATCH, verbose=0)
    assert got.shape == (1797, 10)
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)
    ev = model.evaluate(x, y, batch_size=BATCH, verbose=0, return_dict=True)
    ev_single = single[0].evaluate(x, y, batch_size=BATCH, verbose=0, return_dict=True)
    np.testing.assert_allclose(ev["loss"], ev_single["loss"], rtol=1e-5)
    assert ev["accuracy"] == pytest.approx(ev_single["accuracy"], abs=1e-7)


def test_kernels_sharded_over_the_batch_axis_match_single_device(digits, single):
    """Kernels stored split over the batch axis too, as keras-hub's
    `get_layout_map` recipes store them (Keras' own classes, no FSDP
    policy): equal to one device, short batch included, the storage still
    split so after `fit`. DTensor refuses these matmuls as they stand; the
    TensorFlow backend gathers such a kernel for its layer's call."""
    lm = keras.distribution.LayoutMap(keras_mesh(mp_mesh()))
    lm["d1/kernel"] = ("batch", "model")
    lm["d1/bias"] = ("model",)
    lm["d2/kernel"] = ("batch", "model")  # contracts d1's `model` columns
    lm["d3/kernel"] = ("model", None)
    with keras.distribution.ModelParallel(layout_map=lm,
                                          batch_dim_name="batch").scope():
        model = build()
        history = train(model, digits)
    assert_same_history(history, single[1])
    assert_same_weights(weights(model), weights(single[0]))
    for name, axes in [("d1", ("batch", "model")), ("d2", ("batch", "model")),
                       ("d3", ("model", None))]:
        kernel = model.get_layer(name).kernel
        assert tuple(klm.fetch_layout(kernel).axes) == axes, name


def test_short_batch_loss_and_gradients_exact(digits):
    """A 29-row batch on the whole batch axis (8 or 4 devices, neither
    divides 29): one step, compared directly."""
    x, y = digits[0][:29], digits[1][:29]
    reference = compile_classifier(build())
    ref_logs = reference.train_on_batch(x, y, return_dict=True)
    mesh = dp_mesh()
    with klm.DataParallel(mesh).scope():
        model = compile_classifier(build())
    logs = model.train_on_batch(x, y, return_dict=True)  # outside the scope
    kernel = model.get_layer("d1").kernel  # the model remembers its plan
    assert klm.fetch_layout(kernel) == klm.Layout.replicated(mesh, 2)
    for key in ref_logs:
        np.testing.assert_allclose(logs[key], ref_logs[key], rtol=1e-6)
    assert_same_weights(weights(model), weights(reference))


def test_weights_move_between_meshes_and_no_distribution(tmp_path, digits, single):
    mesh = mp_mesh()
    with model_parallel_map(mesh).scope():
        model = build(seed=1)
    model.set_weights(single[0].get_weights())
    path = str(tmp_path / "mp.weights.h5")
    model.save_weights(path)
    # Another mesh (a model axis twice as wide), another layout.
    other = mp_mesh(width=4)
    lm = klm.LayoutMap(other)
    lm[r"d.\.kernel"] = ("model", None)
    with lm.scope():
        moved = build(seed=2)
    moved.load_weights(path)
    assert klm.fetch_layout(moved.get_layer("d1").kernel) == klm.Layout(
        ["model", None], other)
    plain = build(seed=3)
    plain.load_weights(path)
    x = digits[0][:64]
    expected = single[0].predict(x, verbose=0)
    # The kernels split by rows on `other` sum their partial products in
    # another order: rounding follows the largest logits (~10), so a logit
    # near 0 differs by up to 1.9e-6 on torch's 4 processes (measured).
    for m in (moved, plain):
        np.testing.assert_allclose(m.predict(x, verbose=0), expected, rtol=1e-5,
                                   atol=1e-5)


def test_layer_kwargs_model_trains_with_fit(digits, single):
    mesh = mp_mesh()
    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((64,)),
        keras.layers.Dense(64, activation="relu", name="d1",
                           kernel_layout=klm.Layout([None, "model"], mesh),
                           bias_layout=klm.Layout(["model"], mesh)),
        keras.layers.Dense(32, activation="relu", name="d2"),
        keras.layers.Dense(10, name="d3"),
    ], name="mlp")
    history = train(model, digits)
    assert_same_history(history, single[1])
    assert_same_weights(weights(model), weights(single[0]))
    assert klm.fetch_layout(model.get_layer("d2").kernel).mesh == mesh


@pytest.mark.skipif(backends.name() != "jax", reason="a jax.grad loop; the "
                    "TensorFlow GradientTape loop is in test_tf_custom_loop.py")
def test_custom_training_loop_with_pack(digits):
    """The DTensor tutorial's loop: packed inputs, mesh-aware optimizer and
    metric, outside any scope."""
    import jax

    mesh = dp_mesh()
    x, y = digits[0][:512], digits[1][:512]
    image_layout = klm.Layout.batch_sharded(mesh, "batch", rank=2)
    label_layout = klm.Layout.batch_sharded(mesh, "batch", rank=1)

    def run(model, optimizer, metric, pack):
        loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        optimizer.build(model.trainable_variables)

        def loss_and_logits(tv, ntv, xb, yb):
            logits, ntv = model.stateless_call(tv, ntv, xb, training=True)
            return loss_fn(yb, logits), (logits, ntv)

        grad_fn = jax.jit(jax.value_and_grad(loss_and_logits, has_aux=True))
        tv = [v.value for v in model.trainable_variables]
        ntv = [v.value for v in model.non_trainable_variables]
        ov = [v.value for v in optimizer.variables]
        for start in range(0, len(x), 128):
            xb, yb = x[start:start + 128], y[start:start + 128]
            if pack:
                xb = klm.pack(np.split(xb, DEVICES), image_layout)
                yb = klm.pack(np.split(yb, DEVICES), label_layout)
            (_, (logits, ntv)), grads = grad_fn(tv, ntv, xb, yb)
            tv, ov = optimizer.stateless_apply(ov, grads, tv)
            metric.update_state(yb, logits)
        for v, value in zip(model.trainable_variables, tv):
            v.assign(value)
        return float(metric.result())

    reference = run(build(), keras.optimizers.Adam(0.01),
                    keras.metrics.SparseCategoricalAccuracy(), pack=False)
    with klm.DataParallel(mesh).scope():
        model = build()
    accuracy = run(model, klm.optimizers.Adam(0.01, mesh=mesh),
                   keras.metrics.SparseCategoricalAccuracy(mesh=mesh), pack=True)
    assert accuracy == pytest.approx(reference, abs=1e-6)


def build_two_inputs():
    """Dict inputs, BatchNormalization and Dropout. A weight whose true
    gradient is zero gets float noise (~1e-7) as its gradient, which Adam's
    first step turns into lr * noise / (|noise| + epsilon): a full step
    with Keras' epsilon of 1e-7. So the bias before the normalization is
    left out, and epsilon is 1e-3: a digit pixel constant over a batch (the
    5-row batch has several) gives d1's kernel such rows too, whatever the
    bias. (Keras 3.16 shuffles a PyDataset's batches with `Random(epoch)`,
    which puts the 5-row batch first, and with epsilon 1e-7 the weights then
    differed from one device by 1e-2: rounding noise, amplified; every
    dropout mask, seed and batch was identical.)"""
    keras.utils.set_random_seed(0)
    inputs = {"a": keras.Input((32,), name="a"), "b": keras.Input((32,), name="b")}
    x = keras.layers.Concatenate()([inputs["a"], inputs["b"]])
    x = keras.layers.Dense(64, use_bias=False, name="d1")(x)
    x = keras.layers.BatchNormalization(name="bn")(x)
    x = keras.layers.Activation("relu")(x)
    x = keras.layers.Dropout(0.3)(x)
    return compile_classifier(
        keras.Model(inputs, keras.layers.Dense(10, name="d2")(x)),
        keras.optimizers.Adam(0.01, epsilon=1e-3))


class DigitBatches(keras.utils.PyDataset):
    """A Python data source whose last batch is short (1797 = 14 * 128 + 5)."""

    def __init__(self, digits):
        super().__init__()
        self.x, self.y = digits

    def __len__(self):
        return -(-len(self.y) // BATCH)

    def __getitem__(self, i):
        rows = slice(i * BATCH, (i + 1) * BATCH)
        return {"a": self.x[rows, :32], "b": self.x[rows, 32:]}, self.y[rows]


def _tf_dataset(digits):
    tf = pytest.importorskip(
        "tensorflow", reason="tf.data input needs TensorFlow, which the JAX "
        "and torch sessions do not install")
    x, y = digits
    return tf.data.Dataset.from_tensor_slices(
        ({"a": x[:, :32], "b": x[:, 32:]}, y)).batch(BATCH)


@pytest.mark.parametrize("source", ["pydataset", "tf.data"])
def test_batchnorm_dropout_dict_inputs_and_data_sources(digits, source):
    def data():
        return DigitBatches(digits) if source == "pydataset" else _tf_dataset(digits)

    reference = build_two_inputs()
    ref_history = reference.fit(data(), epochs=2, verbose=0).history
    mesh = mp_mesh()
    lm = klm.LayoutMap(mesh)
    lm[r"d1\.kernel"] = (None, "model")
    lm[r"bn\..*"] = ("model",)
    klm.set_distribution(klm.ModelParallel(layout_map=lm))
    model = build_two_inputs()
    klm.set_distribution(None)
    history = model.fit(data(), epochs=2, verbose=0).history
    assert history.keys() == ref_history.keys()
    np.testing.assert_allclose(history["loss"], ref_history["loss"], rtol=1e-5)
    # Accuracy counts argmaxes: with TensorFlow's oneDNN kernels (reduction
    # order) one row of the 1797 in epoch 1 lands on the other side of a
    # near tie (0.542014 against 0.542571, at ad4deab too). Within one row.
    np.testing.assert_allclose(history["accuracy"], ref_history["accuracy"],
                               rtol=0, atol=1.01 / len(digits[1]))
    # BatchNormalization divides by per-unit batch deviations; a unit with a
    # tiny one magnifies reduction-order rounding, so allow 1e-4 here.
    assert_same_weights(weights(model), weights(reference), rtol=1e-4, atol=1e-5)
    moving_mean = model.get_layer("bn").moving_mean
    assert klm.fetch_layout(moving_mean) == klm.Layout(["model"], mesh)
