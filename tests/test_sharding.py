"""Weights and tensors really placed on the mesh, read back from the backend."""

import keras
import numpy as np
import pytest
from helpers import DEVICES, dp_mesh, local_shards, mp_mesh

import keras_layoutmap as klm

pytestmark = pytest.mark.sharding

B = DEVICES // 2  # the batch axis of mp_mesh(): 4 on 8 devices, 2 on 4


@pytest.fixture
def mesh():
    return mp_mesh()


def shard_shapes(x):
    """The shapes of this process's shards of `x`."""
    return [tuple(s.shape) for s in klm.unpack(x)]


def on_each(mesh, shape):
    """`shape` once for each of this process's devices of `mesh`."""
    return [shape] * mesh.num_local_devices()


def host(x):
    """The whole value of a (possibly sharded) tensor, as numpy: gathered
    by a relayout to replicated, then one device's copy."""
    layout = klm.fetch_layout(x)
    whole = klm.distribute(x, klm.Layout.replicated(layout.mesh, layout.rank))
    return keras.ops.convert_to_numpy(klm.unpack(whole)[0])


class Tutorial(keras.Model):
    def __init__(self):
        super().__init__()
        self.feature = keras.layers.Dense(16)
        self.feature_2 = keras.layers.Dense(24)
        self.dropout = keras.layers.Dropout(0.1)

    def call(self, x, training=None):
        return self.feature_2(self.dropout(self.feature(x), training=training))


def tutorial_map(mesh):
    lm = klm.LayoutMap(mesh)
    lm["feature.*kernel"] = klm.Layout.batch_sharded(mesh, "batch", rank=2)
    lm["feature.*bias"] = klm.Layout.batch_sharded(mesh, "batch", rank=1)
    return lm


@pytest.mark.parametrize("build_inside", [True, False])
def test_subclassed_scope(mesh, build_inside):
    lm = tutorial_map(mesh)
    # Inputs go onto the mesh explicitly, as in the DTensor tutorial.
    x = klm.copy_to_mesh(np.zeros((8, 16), "float32"), klm.Layout.replicated(mesh, 2))
    with lm.scope():
        model = Tutorial()
        if build_inside:
            model(x)
    if not build_inside:
        model(x)
    for layer in (model.feature, model.feature_2):
        assert klm.fetch_layout(layer.kernel) == klm.Layout(["batch", None], mesh)
        assert klm.fetch_layout(layer.bias) == klm.Layout(["batch"], mesh)
    assert shard_shapes(model.feature.kernel) == on_each(mesh, (16 // B, 16))
    assert shard_shapes(model.feature_2.bias) == on_each(mesh, (24 // B,))


class Attention(keras.Model):
    """Its MultiHeadAttention makes its Dense sublayers in `build()`."""

    def __init__(self):
        super().__init__()
        self.attn = keras.layers.MultiHeadAttention(2, 8)

    def call(self, x):
        return self.attn(x, x)


@pytest.mark.parametrize("build_inside", [True, False])
def test_sublayers_made_in_build_follow_the_rules(mesh, build_inside):
    # Fault: built outside the scope, the query kernel was replicated while
    # explain() reported it sharded (JAX), or DTensor failed (TF).
    lm = klm.LayoutMap(mesh)
    lm[r"attn\._query_dense\.kernel"] = (None, "model", None)
    lm[r"attn\._output_dense\.kernel"] = ("model", None, None)
    x = np.random.RandomState(0).rand(8, 4, 16).astype("float32")
    keras.utils.set_random_seed(0)
    with lm.scope():
        model = Attention()
        if build_inside:
            model(klm.distribute(x, klm.Layout.batch_sharded(mesh, "batch", 3)))
    out = model(klm.distribute(x, klm.Layout.batch_sharded(mesh, "batch", 3)))
    assert klm.fetch_layout(model.attn._query_dense.kernel).sharding_specs == [
        "unsharded", "model", "unsharded"]
    report = lm.explain(model)
    assert sorted(r.rule for r in report.rows if r.rule) == sorted(lm)
    variables = {v.path: v for v in model.weights}
    for row in report.rows:  # what explain says is what the backend holds
        assert klm.fetch_layout(variables[row.path]) == row.layout, row.path
    keras.utils.set_random_seed(0)
    reference = Attention()
    np.testing.assert_allclose(host(out), keras.ops.convert_to_numpy(reference(x)),
                               rtol=1e-5, atol=1e-6)


def test_functional_and_sequential_scope(mesh):
    lm = tutorial_map(mesh)
    with lm.scope():
        inputs = keras.Input((16,))
        x = keras.layers.Dense(16, name="feature")(inputs)
        x = keras.layers.Dropout(0.1)(x)
        functional = keras.Model(inputs, keras.layers.Dense(32, name="feature_2")(x))
        sequential = keras.Sequential([
            keras.Input((16,)),
            keras.layers.Dense(16, name="feature"),
            keras.layers.Dropout(0.1),
            keras.layers.Dense(32, name="feature_2"),
        ])
    for model in (functional, sequential):
        kernel = model.get_layer("feature_2").kernel
        assert klm.fetch_layout(kernel) == klm.Layout(["batch", None], mesh)
        assert shard_shapes(kernel) == on_each(mesh, (16 // B, 32))


def test_rules_on_variable_path_and_unmatched_replicated(mesh):
    lm = klm.LayoutMap(mesh)
    lm[r"seq/dense_a/kernel"] = (None, "model")
    with lm.scope():
        model = keras.Sequential([keras.Input((8,)),
                                  keras.layers.Dense(4, name="dense_a"),
                                  keras.layers.Dense(4, name="dense_b")], name="seq")
    assert klm.fetch_layout(model.layers[0].kernel).axes == (None, "model")
    assert klm.fetch_layout(model.layers[1].kernel).axes == (None, None)
    assert klm.fetch_layout(model.layers[1].kernel).mesh == mesh
    assert shard_shapes(model.layers[1].kernel) == on_each(mesh, (4, 4))


def test_layer_kwargs_place_weights_without_scope(mesh):
    dense = keras.layers.Dense(
        8, kernel_layout=klm.Layout([None, "model"], mesh),
        bias_layout=klm.Layout(["model"], mesh))
    dense.build((2, 4))
    assert klm.fetch_layout(dense.kernel).axes == (None, "model")
    assert shard_shapes(dense.kernel) == on_each(mesh, (4, 4))
    assert shard_shapes(dense.bias) == on_each(mesh, (4,))


def test_kwarg_beats_rule_and_is_validated(mesh):
    lm = klm.LayoutMap(mesh)
    lm[".*kernel"] = ("model", None)
    with lm.scope():
        dense = keras.layers.Dense(8, kernel_layout=(None, "model"))
        dense.build((2, 4))
        bad = keras.layers.Dense(3, kernel_layout=(None, "model"), name="bad")
        with pytest.raises(ValueError, match=r"bad\.kernel.*size 3.*'model'"):
            bad.build((2, 4))
    assert klm.fetch_layout(dense.kernel).axes == (None, "model")
    assert not bad.weights


def test_kwarg_layout_on_another_mesh_is_refused(mesh):
    other = dp_mesh()
    with klm.DataParallel(other).scope():
        dense = keras.layers.Dense(8, kernel_layout=klm.Layout([None, "model"], mesh),
                                   name="elsewhere")
        with pytest.raises(ValueError, match=r"'elsewhere\.kernel'.*"
                           rf"elsewhere\.kernel_layout.*Mesh\(batch={B}, model=2\).*"
                           r"distribution places the model on "
                           rf"Mesh\(batch={DEVICES}\)"):
            dense.build((2, 4))
    assert not dense.weights


@pytest.mark.parametrize(
    "rule, match",
    # d1's kernel is (4, 5): 4 rows fit a batch axis of 4 or 2; 5 columns do not.
    [(("model",), r"d1\.kernel.*shape \(4, 5\) \(rank 2\).*rule 'd1\.kernel'.*rank 1"),
     (("batch", None), None),
     ((None, "batch"), r"d1\.kernel.*dimension 1 \(size 5\) over mesh axis 'batch' "
      rf"\(size {B}\)")],
)
def test_bad_rule_raises_before_allocation(mesh, rule, match):
    lm = klm.LayoutMap(mesh)
    lm["d1.kernel"] = rule
    if rule == ("batch", None):  # 4 % B == 0: this one fits
        with lm.scope():
            model = keras.Sequential([keras.Input((4,)),
                                      keras.layers.Dense(5, name="d1")])
        assert klm.fetch_layout(model.layers[0].kernel).axes == ("batch", None)
        return
    with lm.scope():
        layer = keras.layers.Dense(5, name="d1")
        with pytest.raises(ValueError, match=match):
            keras.Sequential([keras.Input((4,)), layer])
    assert not layer.built and not layer.weights


def test_fetch_layout_single_device_array():
    x = keras.ops.ones((3, 2))
    layout = klm.fetch_layout(x)
    assert layout.is_fully_replicated() and layout.mesh.size == 1


def test_distribute_pack_unpack_copy_to_mesh(mesh):
    x = np.arange(8 * 6, dtype="float32").reshape(8, 6)
    layout = klm.Layout(["batch", "model"], mesh)
    dx = klm.distribute(x, layout)
    assert klm.fetch_layout(dx) == layout
    parts = klm.unpack(dx)
    assert [p.shape for p in parts] == on_each(mesh, (8 // B, 3))
    # Each of this process's devices holds its block of x, in mesh order.
    expected = local_shards(x, layout)
    assert len(parts) == len(expected)
    for part, block in zip(parts, expected):
        np.testing.assert_array_equal(np.asarray(part), block)
    packed = klm.pack([np.asarray(p) for p in parts], layout)
    assert klm.fetch_layout(packed) == layout
    np.testing.assert_array_equal(host(packed), x)
    rep = klm.copy_to_mesh(x, klm.Layout.replicated(mesh, 2))
    assert [p.shape for p in klm.unpack(rep)] == on_each(mesh, (8, 6))
    np.testing.assert_array_equal(host(rep), x)
    # Keras' own conversion gathers a sharded tensor, as on one device.
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(dx), x)
    # A variable's pieces read as numpy too (a torch parameter's would
    # refuse: it requires grad).
    variable = keras.Variable(x, layout=layout)
    for part, block in zip(klm.unpack(variable), expected):
        np.testing.assert_array_equal(np.asarray(part), block)


def _metric_result(metric, y_true, y_pred):
    metric.update_state(y_true, y_pred)
    return metric.result()


OPS_WITH_A_PLAIN_OPERAND = {
    "add": lambda x, p: keras.ops.add(x, p),
    "where": lambda x, p: keras.ops.where(p > 0, x, p),
    "matmul": lambda x, p: keras.ops.matmul(x, keras.ops.transpose(p)),
    "einsum": lambda x, p: keras.ops.einsum("ij,kj->ik", x, p),
    "concatenate": lambda x, p: keras.ops.concatenate([x, p], axis=0),
    "stack": lambda x, p: keras.ops.stack([p, x]),
    "take": lambda x, p: keras.ops.take(x, np.array([0, 2]), axis=0),
    "loss": lambda x, p: keras.losses.MeanSquaredError()(p, x),
    "metric": lambda x, p: _metric_result(keras.metrics.MeanAbsoluteError(),
                                          p, x),
    "scatter_update": lambda x, p: keras.ops.scatter_update(
        x, np.array([[0, 1]]), np.array([5.0], "float32")),
    # No plain operand: ops TensorFlow's DTensor has no rule for on split
    # tensors ("Spliting over sharded dimension is not supported", ...).
    "split": lambda x, p: keras.ops.split(x, 2, axis=0)[1],
    "tile": lambda x, p: keras.ops.tile(x, (2, 1)),
    "pad": lambda x, p: keras.ops.pad(x, ((1, 1), (0, 2))),
    "flip": lambda x, p: keras.ops.flip(x, axis=0),
    "cumprod": lambda x, p: keras.ops.cumprod(x, axis=1),
    "triu": lambda x, p: keras.ops.triu(x),
    # ... and ops torch's DTensor has no rule for (no sharding strategy, an
    # in-place change of placement).
    "segment_sum": lambda x, p: keras.ops.segment_sum(
        x, np.array([0, 0, 1, 1, 2, 2, 3, 3]), num_segments=4),
    "searchsorted": lambda x, p: keras.ops.searchsorted(
        np.arange(6, dtype="float32"), keras.ops.reshape(x, (-1,))),
    "bincount": lambda x, p: keras.ops.bincount(keras.ops.reshape(
        keras.ops.cast(keras.ops.abs(x) * 2, "int32"), (-1,)), minlength=8),
    "rms_normalization": lambda x, p: keras.ops.rms_normalization(x),
    "argpartition": lambda x, p: keras.ops.sort(
        keras.ops.argpartition(x, 2, axis=-1)[:, :2], axis=-1),
}


@pytest.mark.parametrize("name", sorted(OPS_WITH_A_PLAIN_OPERAND))
def test_eager_ops_on_a_mesh_tensor_equal_one_device(mesh, name):
    """Keras ops called eagerly on a tensor on the mesh, some with a numpy
    array (labels, a mask, indices), give one device's numbers on every
    backend (TensorFlow's DTensor refused the array and the layouts of
    `split` to `triu` before `backends/tensorflow/eager_ops.py`; torch's
    refused the last five and `scatter_update` before
    `backends/torch/whole_fallbacks.py`)."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(8, 6)).astype("float32")
    plain = rng.normal(size=(8, 6)).astype("float32")
    op = OPS_WITH_A_PLAIN_OPERAND[name]
    want = keras.ops.convert_to_numpy(op(x, plain))
    placed = klm.distribute(x, klm.Layout(["batch", "model"], mesh))
    got = keras.ops.convert_to_numpy(op(placed, plain))
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_data_errors(mesh):
    layout = klm.Layout(["batch", None], mesh)
    rows = B + 1  # not a multiple of the batch axis
    with pytest.raises(ValueError, match=rf"dimension 0 \(size {rows}\).*'batch' "
                       rf"\(size {B}\)"):
        klm.distribute(np.zeros((rows, 2)), layout)
    with pytest.raises(ValueError, match="one component per local device.*"
                       f"{mesh.num_local_devices()}. Received 3"):
        klm.pack([np.zeros((2, 2))] * 3, layout)
    with pytest.raises(ValueError, match="fully replicated"):
        klm.copy_to_mesh(np.zeros((8, 2)), layout)
    with pytest.raises(TypeError):
        klm.fetch_layout(np.zeros(3))


def test_spatial_parallel_forward_matches_single_device():
    mesh = mp_mesh("feature")
    keras.utils.set_random_seed(1)
    single = keras.Sequential([keras.Input((8,)), keras.layers.Dense(6, name="d")])
    x = np.random.default_rng(0).normal(size=(16, 8)).astype("float32")
    expected = keras.ops.convert_to_numpy(single(x))
    lm = klm.LayoutMap(mesh)
    lm["d.kernel"] = ("feature", None)
    with lm.scope():
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(6, name="d")])
    model.set_weights(single.get_weights())
    dx = klm.distribute(x, klm.Layout(["batch", "feature"], mesh))
    assert [p.shape for p in klm.unpack(dx)] == on_each(mesh, (16 // B, 4))
    with lm.scope():
        out = model(dx)
    np.testing.assert_allclose(host(out), expected, rtol=1e-5, atol=1e-6)


def test_optimizer_mesh_and_slot_layouts(mesh):
    lm = klm.LayoutMap(mesh)
    lm["d.kernel"] = (None, "model")
    with lm.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, name="d")])
    optimizer = klm.optimizers.Adam(0.01, mesh=mesh)
    assert isinstance(optimizer, keras.optimizers.Adam)
    assert klm.fetch_layout(optimizer.iterations).mesh == mesh
    optimizer.build(model.trainable_variables)
    kernel = model.layers[0].kernel
    slots = [v for v in optimizer.variables if kernel.path.replace("/", "_") in v.path]
    assert len(slots) == 2  # momentum and velocity
    for slot in slots:
        assert klm.fetch_layout(slot) == klm.fetch_layout(kernel)
        assert [s.shape for s in klm.unpack(slot)] == on_each(mesh, (4, 4))
    # Gradients arrive laid out like their weights (as a tape gives them).
    grads = [klm.distribute(np.ones(v.shape, "float32"), klm.fetch_layout(v))
             for v in model.trainable_variables]
    optimizer.apply_gradients(zip(grads, model.trainable_variables))
    assert int(optimizer.iterations.numpy()) == 1
    assert klm.fetch_layout(kernel).axes == (None, "model")


def test_every_optimizer_takes_mesh(mesh):
    for name in klm.optimizers.__all__:
        cls = getattr(klm.optimizers, name)
        if name in ("LossScaleOptimizer", "MultiOptimizer"):
            continue  # wrappers: they take other optimizers, not a mesh
        optimizer = cls(mesh=mesh)
        assert optimizer.mesh == mesh, name
        assert klm.fetch_layout(optimizer.iterations).mesh == mesh, name


def test_metric_mesh(mesh):
    metric = keras.metrics.SparseCategoricalAccuracy(mesh=mesh)
    assert klm.metrics.SparseCategoricalAccuracy is (
        keras.metrics.SparseCategoricalAccuracy)
    for variable in metric.variables:
        assert klm.fetch_layout(variable).mesh == mesh
    y = klm.distribute(np.array([0, 1, 2, 3] * 2), klm.Layout(["batch"], mesh))
    logits = klm.distribute(np.eye(8, 4, dtype="float32"),
                            klm.Layout(["batch", None], mesh))
    metric.update_state(y, logits)
    # argmax of eye(8, 4): rows 0-3 right, rows 4-7 predict 0 (one right)
    assert float(metric.result()) == pytest.approx(5 / 8)

    class MyMetric(keras.metrics.Mean):
        def __init__(self, name="mine"):
            super().__init__(name=name)

    mine = MyMetric(mesh=mesh)
    assert all(klm.fetch_layout(v).mesh == mesh for v in mine.variables)


def test_layout_kwargs_place_weights_of_stock_layers(mesh):
    """kwargs on layers whose weights are not `kernel`/`bias`, and on
    composite layers (MultiHeadAttention passes them to its sublayers)."""
    model_axis = klm.Layout([None, "model"], mesh)
    cases = [
        (keras.layers.Embedding(16, 8, embeddings_layout=model_axis), (2, 3),
         {"embeddings": (None, "model")}),
        (keras.layers.Conv2D(4, 3, kernel_layout=(None, None, None, "model"),
                             bias_layout=("model",)), (2, 6, 6, 3),
         {"kernel": (None, None, None, "model"), "bias": ("model",)}),
        (keras.layers.BatchNormalization(gamma_layout=("model",),
                                         moving_mean_layout=("model",)), (2, 8),
         {"gamma": ("model",), "moving_mean": ("model",), "beta": (None,)}),
        (keras.layers.LayerNormalization(beta_layout=("model",)), (2, 8),
         {"beta": ("model",)}),
        (keras.layers.EinsumDense("ab,bc->ac", output_shape=8,
                                  kernel_layout=model_axis), (2, 4),
         {"kernel": (None, "model")}),
        (keras.layers.MultiHeadAttention(2, 4, kernel_layout=(None, "model", None)),
         None, {"kernel": (None, "model", None)}),
    ]
    with klm.DataParallel(mesh).scope():
        for layer, shape, expected in cases:
            if isinstance(layer, keras.layers.MultiHeadAttention):
                q = klm.copy_to_mesh(np.zeros((2, 3, 8), "float32"),
                                     klm.Layout.replicated(mesh, 3))
                layer(q, q)
            else:
                layer.build(shape)
            for variable in layer.weights:
                if variable.name in expected:
                    want = expected[variable.name]
                    assert klm.fetch_layout(variable).axes == want, variable.path


def test_rules_relayout_layer_outputs(mesh):
    """Keras asks the distribution for `<layer path>/output`; a rule for it
    reshards that layer's output."""
    lm = klm.LayoutMap(mesh)
    lm[r".*/d1/output"] = ("batch", "model")
    with lm.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, name="d1")])
        x = klm.distribute(np.ones((8, 4), "float32"),
                           klm.Layout.batch_sharded(mesh, "batch", 2))
        out = model.layers[0](x)
    assert klm.fetch_layout(out) == klm.Layout(["batch", "model"], mesh)
