"""What torch users do on a mesh, each checked against one process: a
`torch.utils.data.DataLoader` as `fit` input, a torch-style training loop
(forward, `loss.backward()`, `optimizer.apply`), the model's `state_dict`
of DTensor parameters, and `torch.distributed.checkpoint` (DCP) saved
under one mesh and loaded under another.

Runs under `python -m keras_layoutmap.launch -n 4 -m pytest` (nox -s
tests-torch): every process runs each test, together."""

import os

import keras
import numpy as np
import pytest
from helpers import (
    DEVICES,
    assert_same_history,
    assert_same_weights,
    digits_data,
    digits_net,
    dp_mesh,
    mp_mesh,
    net_layout_map,
)

import keras_layoutmap as klm
from keras_layoutmap import backends

pytestmark = [
    pytest.mark.sharding,
    pytest.mark.training,
    pytest.mark.skipif(backends.name() != "torch",
                       reason="torch's own APIs (DataLoader, DCP, backward)"),
]

BATCH = 64  # 280 rows: the last batch of an epoch holds 24


@pytest.fixture(scope="module")
def digits():
    return digits_data(280, labels="int64")


def build(model_class=keras.Model, dropout=0.2):
    return digits_net(model_class=model_class,
                      middle=lambda: keras.layers.Dropout(dropout, seed=1))


def model_parallel(mesh, **kwargs):
    with net_layout_map(mesh).scope():
        return build(**kwargs)


def assert_same(model, reference):
    assert_same_weights(model.get_weights(), reference.get_weights())


def test_dataloader_input_matches_one_process(digits):
    import torch

    def loader():
        x, y = digits
        data = torch.utils.data.TensorDataset(torch.tensor(x), torch.tensor(y))
        return torch.utils.data.DataLoader(data, batch_size=BATCH, shuffle=False)

    reference = build()
    ref_history = reference.fit(loader(), epochs=2, verbose=0).history
    model = model_parallel(mp_mesh())
    history = model.fit(loader(), epochs=2, verbose=0).history
    assert_same_history(history, ref_history, same_keys=False)
    assert_same(model, reference)
    assert klm.fetch_layout(model.get_layer("d1").kernel) == klm.Layout(
        [None, "model"], mp_mesh())


def test_torch_style_loop_matches_one_process(digits):
    """forward, `loss.backward()`, `optimizer.apply(grads, weights)` on
    packed batches, with a mesh-aware optimizer and metric."""
    import torch

    x, y = digits
    mesh = mp_mesh()
    rows = klm.Layout.batch_sharded(mesh, "batch", rank=2)
    labels = klm.Layout.batch_sharded(mesh, "batch", rank=1)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def run(model, optimizer, metric, placed):
        for start in range(0, len(x), BATCH):
            xb, yb = x[start:start + BATCH], y[start:start + BATCH]
            if placed:
                xb, yb = klm.distribute(xb, rows), klm.distribute(yb, labels)
            else:
                xb, yb = torch.tensor(xb), torch.tensor(yb)
            logits = model(xb, training=True)
            loss = loss_fn(yb, logits)
            model.zero_grad()
            loss.backward()
            grads = [v.value.grad for v in model.trainable_weights]
            with torch.no_grad():
                optimizer.apply(grads, model.trainable_weights)
            metric.update_state(yb, logits)
        return float(metric.result()), loss

    reference = build()
    ref_accuracy, ref_loss = run(reference, keras.optimizers.Adam(0.01),
                                 keras.metrics.SparseCategoricalAccuracy(),
                                 placed=False)
    model = model_parallel(mesh)
    optimizer = klm.optimizers.Adam(0.01, mesh=mesh)
    accuracy, loss = run(model, optimizer,
                         keras.metrics.SparseCategoricalAccuracy(mesh=mesh),
                         placed=True)
    assert accuracy == ref_accuracy
    np.testing.assert_allclose(float(klm.unpack(loss)[0]), float(ref_loss),
                               rtol=1e-5)
    assert_same(model, reference)
    # Adam's moments live like their weight, read from the DTensor.
    kernel = model.get_layer("d1").kernel
    (moment,) = [v for v in optimizer.variables
                 if v.path.endswith("d1_kernel_momentum")]
    assert klm.fetch_layout(moment) == klm.fetch_layout(kernel)
    assert klm.fetch_layout(moment) == klm.Layout([None, "model"], mesh)


class TorchTrainStep(keras.Model):
    """`train_step` overridden as Keras' guide "Customizing what happens in
    fit() with PyTorch" writes it."""

    def train_step(self, data):
        import torch

        x, y = data
        self.zero_grad()
        y_pred = self(x, training=True)
        loss = self.compute_loss(x=x, y=y, y_pred=y_pred)
        loss.backward()
        weights = self.trainable_weights
        with torch.no_grad():
            self.optimizer.apply([v.value.grad for v in weights], weights)
        for metric in self.metrics:
            if metric.name == "loss":
                metric.update_state(loss)
            else:
                metric.update_state(y, y_pred)
        return {m.name: m.result() for m in self.metrics}


@pytest.mark.parametrize("dropout", [0.0, 0.2], ids=["local", "dropout"])
@pytest.mark.parametrize("distribution", ["data_parallel", "model_parallel"])
def test_fit_with_a_torch_train_step_matches_one_process(digits, distribution,
                                                        dropout):
    """A model whose own `train_step` runs the backward pass and the
    optimizer, trained by `fit`: on the local fast path (no dropout: data
    parallel on each process's rows, model parallel on its pieces too) and
    on DTensors."""
    x, y = digits

    def fit(model):
        return model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False,
                         verbose=0).history

    ref_history = fit(reference := build(TorchTrainStep, dropout))
    if distribution == "data_parallel":
        with klm.DataParallel(dp_mesh()).scope():
            model = build(TorchTrainStep, dropout)
    else:
        model = model_parallel(mp_mesh(), model_class=TorchTrainStep,
                               dropout=dropout)
    history = fit(model)
    assert history.keys() == ref_history.keys() == {"loss", "accuracy"}
    assert_same_history(history, ref_history)
    assert_same(model, reference)
    from keras_layoutmap.backends.torch.local_pieces import local_plans

    assert any(local_plans(model).values()) == (not dropout)


def test_state_dict_holds_dtensor_parameters_with_their_layout():
    from torch.distributed.tensor import DTensor, Replicate, Shard

    mesh = mp_mesh()
    model = model_parallel(mesh)
    state = model.state_dict()
    kernel = next(v for k, v in state.items() if k.endswith("d1/kernel"))
    assert isinstance(kernel, DTensor)
    assert tuple(kernel.placements) == (Replicate(), Shard(1))
    assert tuple(kernel.to_local().shape) == (64, 16)


def test_dcp_checkpoint_loads_under_another_mesh(digits, tmp_path):
    import torch.distributed.checkpoint as dcp

    x, y = digits
    model = model_parallel(mp_mesh())
    model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
    expected = model.get_weights()
    dcp.save(model.state_dict(), checkpoint_id=os.path.join(tmp_path, "dcp"))

    # A fresh process names its layers as the first did: clear_session does
    # the same here, so the state_dict keys match.
    keras.backend.clear_session()
    other = mp_mesh(width=DEVICES)
    lm = klm.LayoutMap(other)
    lm[r"d1\.kernel"] = ("model", None)
    with lm.scope():
        restored = build()
    state = restored.state_dict()
    dcp.load(state, checkpoint_id=os.path.join(tmp_path, "dcp"))
    for a, b in zip(restored.get_weights(), expected):
        np.testing.assert_array_equal(a, b)
    assert klm.fetch_layout(restored.get_layer("d1").kernel) == klm.Layout(
        ["model", None], other)
