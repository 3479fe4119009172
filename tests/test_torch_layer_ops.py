"""Keras layers and ops on torch whose split operands DTensor's own rules
handled wrongly, each trained on a (batch 2, model 2) mesh under
`klm.fsdp(axis="model", min_bytes=0)` (every weight split over "model")
and the auto plan, against the same model with the same initial weights on
one device: forward, loss and the weights after two epochs of SGD.

- a grouped convolution whose kernel is split over its output channels
  (`backends/torch/convolution.py`: each process's channels meet the input
  channels of their own groups);
- `ops.cumsum` / `ops.cumprod` along a split axis given as negative
  (`backends/torch/dtensor_rules.py`: DTensor's scan rule read with the dim
  made non-negative);
- `ops.take` of a split tensor along any axis, or flattened
  (`backends/torch/lookups.py`: taken from each process's piece);
- what DTensor refused with a raw error: `Flatten`'s backward after a
  convolution (an uneven unflatten: the split gathered first), a 3-D max
  pooling's backward (pooling on each process's rows and channels), and
  Keras' recurrent loop under data parallel (an unbind along the batch
  rows: gathered first).

Run under `python -m keras_layoutmap.launch -n 4 -m pytest`."""

import keras
import numpy as np
import pytest
from helpers import DEVICES, mp_mesh

import keras_layoutmap as klm
from keras_layoutmap import backends

pytestmark = [
    pytest.mark.sharding, pytest.mark.training,
    pytest.mark.skipif(backends.name() != "torch" or DEVICES != 4,
                       reason="torch's DTensor rules, on 4 processes"),
]

ROWS, BATCH = 16, 8


def _plan(name, build):
    mesh = mp_mesh()
    if name == "fsdp":
        return klm.fsdp(mesh, axis="model", min_bytes=0)
    if name == "keras-data-parallel":
        return keras.distribution.DataParallel(
            devices=keras.distribution.list_devices())
    if name == "data-parallel":
        return klm.DataParallel(klm.create_mesh([("batch", DEVICES)]))
    return klm.auto_layout_map(build, mesh)


def assert_trains_as_on_one_device(build, x, y, plan, split_weight=None):
    """`build()` (a model) under `plan` trains as on one device, from the
    same weights; `split_weight` (a path) is split on the mesh."""
    klm.set_distribution(None)
    keras.utils.set_random_seed(0)
    reference = build()
    initial = reference.get_weights()
    expected = keras.ops.convert_to_numpy(reference(x[:BATCH]))
    reference.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    ref_history = reference.fit(x, y, batch_size=BATCH, epochs=2,
                                shuffle=False, verbose=0).history
    with _plan(plan, build).scope():
        keras.utils.set_random_seed(0)
        model = build()
    model.set_weights(initial)
    if split_weight is not None:
        weight = next(w for w in model.weights if w.path == split_weight)
        assert not klm.fetch_layout(weight).is_fully_replicated()
    np.testing.assert_allclose(keras.ops.convert_to_numpy(model(x[:BATCH])),
                               expected, rtol=1e-5, atol=1e-6)
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    history = model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False,
                        verbose=0).history
    np.testing.assert_allclose(history["loss"], ref_history["loss"], rtol=1e-5)
    for w, a, b in zip(model.weights, model.get_weights(),
                       reference.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=w.path)


# -- grouped convolutions -----------------------------------------------------

CONVOLUTIONS = {
    # (layer, input shape): each process's channels cover whole groups
    "two-groups": (lambda: keras.layers.Conv2D(4, 3, groups=2, name="c"),
                   (5, 5, 4)),
    # 3 groups of 2 channels, 3 channels a process: a group across the cut
    "a-group-across-the-split": (
        lambda: keras.layers.Conv2D(6, 3, groups=3, name="c"), (5, 5, 6)),
    "one-channel-a-group": (
        lambda: keras.layers.Conv1D(4, 2, groups=4, name="c"), (6, 4)),
    "channels-first": (
        lambda: keras.layers.Conv2D(4, 3, groups=2, padding="same",
                                    data_format="channels_first", name="c"),
        (4, 4, 4)),
}


def _convolution_model(layer, shape):
    def build():
        inputs = keras.Input(shape)
        conv = layer()
        h = conv(inputs)
        first = 2 if conv.data_format == "channels_first" else 1
        h = keras.ops.mean(h, axis=tuple(range(first, first + len(shape) - 1)))
        return keras.Model(inputs, keras.layers.Dense(3, name="d")(h))

    return build


@pytest.mark.parametrize("case, plan", [
    *[(case, "fsdp") for case in sorted(CONVOLUTIONS)], ("two-groups", "auto")])
def test_grouped_convolution_with_its_output_channels_split(case, plan):
    layer, shape = CONVOLUTIONS[case]
    rng = np.random.default_rng(0)
    x = rng.standard_normal((ROWS, *shape)).astype("float32")
    y = rng.standard_normal((ROWS, 3)).astype("float32")
    assert_trains_as_on_one_device(_convolution_model(layer, shape), x, y,
                                   plan, "c/kernel")


# -- scans along a split axis -------------------------------------------------


class Scan(keras.layers.Layer):
    """`op(x @ w, axis)`: the scan runs along the axis `w`'s columns give,
    which a plan splits over "model"."""

    def __init__(self, op="cumsum", axis=-1, **kwargs):
        super().__init__(**kwargs)
        self.op, self.axis = op, axis

    def build(self, shape):
        self.w = self.add_weight(shape=(shape[-1], 8), name="w",
                                 initializer="glorot_uniform")

    def call(self, x):
        return getattr(keras.ops, self.op)(keras.ops.matmul(x, self.w),
                                           axis=self.axis)


@pytest.mark.parametrize("op, axis, plan", [
    ("cumsum", -1, "fsdp"), ("cumsum", -1, "auto"), ("cumsum", 1, "fsdp"),
    ("cumprod", -1, "fsdp")])
def test_scan_along_a_split_axis(op, axis, plan):
    def build():
        inputs = keras.Input((6,))
        h = Scan(op, axis, name="scan")(inputs)
        return keras.Model(inputs, keras.layers.Dense(3, name="d")(h))

    rng = np.random.default_rng(0)
    scale = 0.3 if op == "cumprod" else 1.0
    x = (scale * rng.standard_normal((ROWS, 6))).astype("float32")
    y = rng.standard_normal((ROWS, 3)).astype("float32")
    assert_trains_as_on_one_device(build, x, y, plan, "scan/w")


@pytest.mark.parametrize("name", ["cumsum", "cumprod", "logcumsumexp"])
def test_dtensor_scan_of_a_negative_dim_gathers_the_split(name):
    """torch's own op on a DTensor split along the scanned dim, given as
    -1: the whole tensor's scan, and its gradient."""
    import torch
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from keras_layoutmap.backends.torch.placement import to_device_mesh

    mesh = to_device_mesh(mp_mesh())
    rng = np.random.default_rng(0)
    whole = torch.tensor(rng.uniform(0.5, 1.5, (4, 8)), dtype=torch.float32)
    weights = torch.tensor(rng.normal(size=(4, 8)), dtype=torch.float32)
    split = distribute_tensor(whole.clone(), mesh, [Shard(0), Shard(1)])
    split.requires_grad_()
    out = getattr(torch, name)(split, -1)
    assert not any(isinstance(p, Shard) and p.dim == 1 for p in out.placements)
    (out * distribute_tensor(weights, mesh, [Replicate()] * 2)).sum().backward()
    reference = whole.clone().requires_grad_()
    expected = getattr(torch, name)(reference, -1)
    (expected * weights).sum().backward()
    np.testing.assert_allclose(out.full_tensor().detach().numpy(),
                               expected.detach().numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(split.grad.full_tensor().numpy(),
                               reference.grad.numpy(), rtol=1e-5, atol=1e-6)


# -- ops.take -----------------------------------------------------------------


class Take(keras.layers.Layer):
    """`ops.take` of the weight `w` (6, 8), which a plan splits over its
    columns, or of the activations `x @ w`."""

    def __init__(self, kind, **kwargs):
        super().__init__(**kwargs)
        self.kind = kind

    def build(self, shape):
        self.w = self.add_weight(shape=(shape[-1], 8), name="w")

    def call(self, x):
        ids = keras.ops.convert_to_tensor([0, 2, 5, 7])
        ops = keras.ops
        if self.kind == "activations-along-the-split":
            return ops.take(ops.matmul(x, self.w), ids, axis=1)
        if self.kind == "weight-along-the-split":
            return ops.matmul(x, ops.take(self.w, ids, axis=1))
        if self.kind == "weight-rows":
            return ops.matmul(x[:, :3], ops.take(self.w, ids[:3] - 2, axis=0))
        return x[:, :1] * ops.take(self.w, ids)[None, :]  # flattened


@pytest.mark.parametrize("kind", [
    "activations-along-the-split", "weight-along-the-split", "weight-rows",
    "flattened"])
def test_take_from_a_split_tensor(kind):
    def build():
        inputs = keras.Input((6,))
        h = Take(kind, name="take")(inputs)
        return keras.Model(inputs, keras.layers.Dense(3, name="d")(h))

    rng = np.random.default_rng(0)
    x = rng.standard_normal((ROWS, 6)).astype("float32")
    y = rng.standard_normal((ROWS, 3)).astype("float32")
    assert_trains_as_on_one_device(build, x, y, "fsdp", "take/w")


# -- what DTensor refused ------------------------------------------------------


@pytest.mark.parametrize("layer, shape", [
    # Flatten's gradient comes split over the head's kernel rows: 36
    # features in two pieces of 18, which (3, 3, 4) does not unflatten
    (lambda: keras.layers.Conv2D(4, 3, name="c"), (5, 5, 2)),
    (lambda: keras.layers.Conv3D(4, 2, name="c"), (4, 4, 4, 2)),
    (lambda: keras.layers.MaxPooling3D(name="pool"), (4, 4, 4, 2)),
    (lambda: keras.layers.AveragePooling2D(2, name="pool"), (4, 4, 2)),
], ids=["Conv2D", "Conv3D", "MaxPooling3D", "AveragePooling2D"])
def test_flattened_convolutions_and_pooling(layer, shape):
    def build():
        inputs = keras.Input(shape)
        h = inputs
        if "pool" in layer().name:  # a convolution first, its kernel split
            h = getattr(keras.layers, f"Conv{len(shape) - 1}D")(
                4, 1, name="c")(h)
        h = keras.layers.Flatten()(layer()(h))
        return keras.Model(inputs, keras.layers.Dense(3, name="d")(h))

    rng = np.random.default_rng(0)
    x = rng.standard_normal((ROWS, *shape)).astype("float32")
    y = rng.standard_normal((ROWS, 3)).astype("float32")
    assert_trains_as_on_one_device(build, x, y, "fsdp", "c/kernel")


@pytest.mark.parametrize("rnn, masked, plan", [
    ("SimpleRNN", False, "keras-data-parallel"),
    ("LSTM", True, "keras-data-parallel"),
    ("GRU", False, "data-parallel"),
    ("GRU", True, "data-parallel"),
])
def test_recurrent_layers_under_data_parallel(rnn, masked, plan):
    def build():
        inputs = keras.Input((5, 3))
        h = keras.layers.Masking(0.0)(inputs) if masked else inputs
        h = getattr(keras.layers, rnn)(4, name="rnn")(h)
        return keras.Model(inputs, keras.layers.Dense(3, name="d")(h))

    rng = np.random.default_rng(0)
    x = rng.standard_normal((ROWS, 5, 3)).astype("float32")
    x[::3, 3:] = 0.0  # masked steps in some rows
    y = rng.standard_normal((ROWS, 3)).astype("float32")
    assert_trains_as_on_one_device(build, x, y, plan)
