"""Weights born sharded: a weight made under a distribution is made on the
mesh shard by shard, never whole on one device first. On JAX and torch its
values equal a one-device init with the same seed; on TensorFlow DTensor
draws each shard from a seed of its own (docs/getting-started.md), so only
the layout, the range and the constant initializers are compared there."""

import keras
import numpy as np
import pytest
from helpers import mp_mesh

import keras_layoutmap as klm

pytestmark = pytest.mark.sharding

JAX = keras.backend.backend() == "jax"
# Backends whose born-sharded values equal one device's, bit for bit.
EXACT = keras.backend.backend() in ("jax", "torch")


@pytest.fixture(autouse=True)
def _every_weight_born_sharded(monkeypatch):
    # TensorFlow makes only weights of at least MIN_BYTES on the mesh (the
    # smaller keep one device's values); here every weight is.
    if keras.backend.backend() == "tensorflow":
        from keras_layoutmap.backends.tensorflow import initialization

        monkeypatch.setattr(initialization, "MIN_BYTES", 0)


@pytest.fixture
def mesh():
    return mp_mesh()  # (batch 4, model 2); (2, 2) on torch's 4 processes


def host(x):
    layout = klm.fetch_layout(x)
    whole = klm.distribute(x, klm.Layout.replicated(layout.mesh, layout.rank))
    return keras.ops.convert_to_numpy(klm.unpack(whole)[0])


# name -> (a fresh initializer, (low, high) bounds of its values or None)
INITIALIZERS = {
    "random_uniform": (lambda: keras.initializers.RandomUniform(
        -0.3, 0.7, seed=3), (-0.3, 0.7)),
    "random_normal": (lambda: keras.initializers.RandomNormal(
        0.1, 0.5, seed=4), None),
    "truncated_normal": (lambda: keras.initializers.TruncatedNormal(
        0.2, 2.0, seed=5), (0.2 - 4.0, 0.2 + 4.0)),
    "glorot_uniform": (lambda: keras.initializers.GlorotUniform(seed=6),
                       None),
    "glorot_normal": (lambda: keras.initializers.GlorotNormal(seed=7), None),
    "he_uniform": (lambda: keras.initializers.HeUniform(seed=8), None),
    "he_normal": (lambda: keras.initializers.HeNormal(seed=9), None),
    "lecun_normal": (lambda: keras.initializers.LecunNormal(seed=10), None),
    "variance_scaling": (lambda: keras.initializers.VarianceScaling(
        2.0, "fan_out", "untruncated_normal", seed=11), None),
    "zeros": (keras.initializers.Zeros, (0.0, 0.0)),
    "ones": (keras.initializers.Ones, (1.0, 1.0)),
    "constant": (lambda: keras.initializers.Constant(0.25), (0.25, 0.25)),
}
CONSTANT = {"zeros", "ones", "constant"}
# (shape, layout axes): rows, columns, both, and a 3-D kernel
SHAPES = [((24, 10), ["model", None]), ((6, 16), [None, "model"]),
          ((8, 6), ["batch", "model"]), ((3, 8, 10), [None, "batch", "model"])]


def _whole_draws(monkeypatch):
    """Record the shape of every random draw Keras makes concretely (a
    value held in memory, not a trace for a compiled per-shard program)."""
    from keras.src import backend

    made = []

    def spy(original):
        def draw(shape, *args, **kwargs):
            value = original(shape, *args, **kwargs)
            try:
                np.asarray(value)
            except Exception:  # a tracer or a graph tensor: not made here
                return value
            made.append(tuple(shape))
            return value

        return draw

    for kind in ("uniform", "normal", "truncated_normal"):
        monkeypatch.setattr(backend.random, kind,
                            spy(getattr(backend.random, kind)))
    return made


def _build(name, shape, axes, mesh, dtype="float32"):
    layout_map = klm.LayoutMap(mesh)
    layout_map[r"holder/w"] = tuple(axes)
    make, _ = INITIALIZERS[name]

    class Holder(keras.layers.Layer):
        def build(self, _):
            self.w = self.add_weight(shape=shape, initializer=make(),
                                     dtype=dtype, name="w")

    with layout_map.scope():
        layer = Holder(name="holder")
        layer.build(None)
    return layer.w


# Every initializer on two of the shapes, every shape under six
# initializers: the draws differ by initializer, the split by shape.
VALUE_CASES = [(name, *SHAPES[(i + k) % len(SHAPES)])
               for i, name in enumerate(sorted(INITIALIZERS)) for k in (0, 1)]


@pytest.mark.parametrize("name,shape,axes", VALUE_CASES, ids=str)
def test_values_and_layout(mesh, name, shape, axes, monkeypatch):
    whole = _whole_draws(monkeypatch)
    weight = _build(name, shape, axes, mesh)
    assert whole == []  # no draw of the weight made whole
    assert klm.fetch_layout(weight) == klm.Layout(axes, mesh)
    value = host(weight)
    one_device = np.asarray(INITIALIZERS[name][0]()(shape, "float32"))
    if EXACT or name in CONSTANT:
        np.testing.assert_array_equal(value, one_device)
    bounds = INITIALIZERS[name][1]
    if bounds is not None:
        assert bounds[0] <= value.min() and value.max() <= bounds[1]
    if name not in CONSTANT:
        assert np.unique(value).size > value.size // 2  # not one value


@pytest.mark.parametrize("name,dtype", [
    ("random_uniform", "bfloat16"), ("random_normal", "float16"),
    ("glorot_uniform", "float16"), ("truncated_normal", "bfloat16")])
def test_half_precision(mesh, name, dtype, monkeypatch):
    whole = _whole_draws(monkeypatch)
    weight = _build(name, (24, 10), ["model", None], mesh, dtype=dtype)
    assert whole == []
    assert keras.backend.standardize_dtype(weight.dtype) == dtype
    value = host(weight).astype("float32")
    one_device = keras.ops.convert_to_numpy(
        INITIALIZERS[name][0]()((24, 10), dtype)).astype("float32")
    if EXACT:
        np.testing.assert_array_equal(value, one_device)
    else:
        assert np.abs(value).max() < 10


@pytest.mark.skipif(not EXACT, reason="JAX and torch draw a shard in "
                    "blocks; TensorFlow's DTensor draws it whole")
# Each kind of draw once, each block size once: 5 divides some shards and
# not others, 7 none, 64 and 1 << 20 hold a shard in one block.
@pytest.mark.parametrize("name,block", [
    ("random_normal", 5), ("truncated_normal", 7), ("glorot_uniform", 64),
    ("random_uniform", 1 << 20)])
def test_blocks_that_do_and_do_not_divide_the_shard(mesh, name, block,
                                                    monkeypatch):
    if JAX:
        from keras_layoutmap.backends.jax import initialization
    else:
        from keras_layoutmap.backends.torch import initialization

    monkeypatch.setattr(initialization, "BLOCK_ELEMENTS", block)
    for shape, axes in SHAPES:
        weight = _build(name, shape, axes, mesh)
        np.testing.assert_array_equal(
            host(weight), np.asarray(INITIALIZERS[name][0]()(shape, "float32")))


def test_seed_generator_advances_as_on_one_device(mesh):
    def make():
        seed = keras.random.SeedGenerator(42)
        return seed, keras.initializers.RandomNormal(seed=seed)

    layout = klm.Layout(["model", None], mesh)
    seed, init = make()
    first = keras.Variable(init, shape=(8, 4), layout=layout)
    second = keras.Variable(init, shape=(8, 4), layout=layout)
    one_seed, one_init = make()
    one_first = np.asarray(one_init((8, 4)))
    one_second = np.asarray(one_init((8, 4)))
    np.testing.assert_array_equal(np.asarray(seed.state.value),
                                  np.asarray(one_seed.state.value))
    assert not np.array_equal(host(first), host(second))
    if EXACT:
        np.testing.assert_array_equal(host(first), one_first)
        np.testing.assert_array_equal(host(second), one_second)


def test_same_seed_same_values_on_the_same_layout(mesh):
    a = _build("glorot_uniform", (24, 10), ["model", None], mesh)
    b = _build("glorot_uniform", (24, 10), ["model", None], mesh)
    np.testing.assert_array_equal(host(a), host(b))


def test_layer_kwargs_and_set_distribution(mesh, monkeypatch):
    whole = _whole_draws(monkeypatch)
    kernel_layout = klm.Layout([None, "model"], mesh)
    init = keras.initializers.GlorotNormal(seed=1)
    dense = keras.layers.Dense(8, kernel_initializer=init,
                               kernel_layout=kernel_layout)
    dense.build((None, 12))
    assert klm.fetch_layout(dense.kernel) == kernel_layout

    layout_map = klm.LayoutMap(mesh)
    layout_map[r".*embeddings"] = ("model", None)
    klm.set_distribution(klm.ModelParallel(layout_map=layout_map,
                                           batch_dim_name="batch"))
    embedding = keras.layers.Embedding(
        16, 4, embeddings_initializer=keras.initializers.RandomUniform(
            seed=2))
    embedding.build((None,))
    klm.set_distribution(None)
    assert klm.fetch_layout(embedding.embeddings) == klm.Layout(
        ["model", None], mesh)
    assert whole == []
    if EXACT:
        np.testing.assert_array_equal(
            host(dense.kernel),
            np.asarray(keras.initializers.GlorotNormal(seed=1)((12, 8))))
        np.testing.assert_array_equal(
            host(embedding.embeddings),
            np.asarray(keras.initializers.RandomUniform(seed=2)((16, 4))))


def test_optimizer_slots_on_the_mesh(mesh):
    layout = klm.Layout(["model", None], mesh)
    weight = keras.Variable(keras.initializers.Ones(), shape=(8, 4),
                            layout=layout)
    optimizer = klm.optimizers.Adam(0.01, mesh=mesh)
    optimizer.build([weight])
    for slot in optimizer.variables:
        if tuple(slot.shape) == (8, 4):
            assert klm.fetch_layout(slot) == layout
            np.testing.assert_array_equal(host(slot), np.zeros((8, 4)))


def test_an_initializer_not_covered_is_made_whole_then_split(mesh):
    # Orthogonal needs the whole matrix (a QR factorisation): Keras' own
    # path, values equal to one device on every backend.
    weight = keras.Variable(keras.initializers.Orthogonal(seed=3),
                            shape=(8, 6),
                            layout=klm.Layout(["model", None], mesh))
    assert klm.fetch_layout(weight) == klm.Layout(["model", None], mesh)
    np.testing.assert_allclose(
        host(weight),
        np.asarray(keras.initializers.Orthogonal(seed=3)((8, 6))),
        rtol=1e-6, atol=1e-6)


@pytest.mark.skipif(keras.backend.backend() != "torch",
                    reason="torch walks the generator's stream in blocks of "
                    "plain torch draws; JAX's blocks are compiled, "
                    "TensorFlow's shards drawn by DTensor")
@pytest.mark.parametrize("name", ["random_uniform", "random_normal",
                                  "truncated_normal"])
def test_torch_draws_a_block_at_a_time(mesh, name, monkeypatch):
    import torch

    from keras_layoutmap.backends.initializer_draws import KINDS
    from keras_layoutmap.backends.torch import initialization

    monkeypatch.setattr(initialization, "BLOCK_ELEMENTS", 64)
    for kind in KINDS:  # the once-per-process check, made before counting
        assert initialization.stream_splits(kind, "float32")
    sizes = []

    def spy(original):
        def draw(*args, **kwargs):
            value = original(*args, **kwargs)
            sizes.append(value.numel())
            return value

        return draw

    for kind in ("rand", "normal"):
        monkeypatch.setattr(torch, kind, spy(getattr(torch, kind)))
    weight = _build(name, (64, 40), [None, "model"], mesh)
    monkeypatch.undo()
    # Every process walks the whole stream (its columns are in every row),
    # a block of 64 elements at a time (4 normals each for a truncated
    # normal): never the 2560 elements of the weight at once.
    per = 4 if name == "truncated_normal" else 1
    assert sizes and max(sizes) == 64 * per and sum(sizes) == 2560 * per
    assert tuple(weight.value.to_local().shape) == (64, 20)
    np.testing.assert_array_equal(
        host(weight), keras.ops.convert_to_numpy(
            INITIALIZERS[name][0]()((64, 40), "float32")))


@pytest.mark.skipif(keras.backend.backend() != "torch"
                    or len(klm.list_devices()) != 4,
                    reason="the example is written for torch's 4 processes")
def test_torch_docstring_example():
    import doctest

    from keras_layoutmap.backends.torch import initialization

    result = doctest.testmod(initialization, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0 and result.attempted > 0


@pytest.mark.skipif(keras.backend.backend() != "torch",
                    reason="torch's blocks follow ATen's use of its generator, "
                    "checked once per process")
def test_torch_falls_back_where_its_draws_do_not_split(mesh, monkeypatch):
    import torch

    from keras_layoutmap.backends.initializer_draws import KINDS
    from keras_layoutmap.backends.torch import initialization

    for kind in KINDS:
        for dtype in ("float32", "float64", "bfloat16", "float16"):
            assert initialization.stream_splits(kind, dtype), (kind, dtype)

    # A torch whose kernels took one more number per block than expected.
    stream = initialization._stream

    def another_stream(draw, generator):
        take, finish = stream(draw, generator)

        def take_one_more(n):
            torch.rand(1, generator=generator)
            return take(n)

        return take_one_more, finish

    monkeypatch.setattr(initialization, "_stream", another_stream)
    initialization.stream_splits.cache_clear()
    try:
        whole = _whole_draws(monkeypatch)
        with pytest.warns(UserWarning, match="made whole on each process"):
            weight = _build("random_normal", (24, 10), ["model", None], mesh)
        assert whole == [(24, 10)]  # Keras' own draw, then split
    finally:
        initialization.stream_splits.cache_clear()
    assert klm.fetch_layout(weight) == klm.Layout(["model", None], mesh)
    np.testing.assert_array_equal(
        host(weight),
        np.asarray(INITIALIZERS["random_normal"][0]()((24, 10), "float32")))
