"""The torch born-sharded draw (`backends/torch/initialization.py`) as a
pure function: every piece of every split, made by walking Keras' random
stream in blocks, equals that piece of Keras' own whole draw, bit for bit.
One process, no mesh."""

import itertools

import keras
import numpy as np
import pytest

from keras_layoutmap import backends

pytestmark = pytest.mark.skipif(
    backends.name() != "torch", reason="the torch backend's draw")

INITIALIZERS = {
    "uniform": lambda: keras.initializers.RandomUniform(-0.3, 0.7, seed=3),
    "normal": lambda: keras.initializers.RandomNormal(0.1, 0.5, seed=4),
    "truncated_normal": lambda: keras.initializers.TruncatedNormal(
        0.2, 2.0, seed=5),
    "glorot_uniform": lambda: keras.initializers.GlorotUniform(seed=6),
    "variance_scaling": lambda: keras.initializers.VarianceScaling(
        2.0, "fan_out", "untruncated_normal", seed=11),
}


def _boxes(shape):
    """Every piece of every split of `shape` into 1, 2 or 3 parts per
    dimension, as `torch.chunk` splits (the last part may be smaller)."""
    for parts in itertools.product(*[(1, 2, 3)] * len(shape)):
        for coord in itertools.product(*[range(p) for p in parts]):
            box = []
            for size, p, c in zip(shape, parts, coord):
                chunk = -(-size // p)
                begin = min(c * chunk, size)
                box.append(slice(begin, min(begin + chunk, size)))
            yield tuple(box)


# Every initializer on every shape, each in both dtypes; the block sizes
# (5 and 16 divide no piece evenly or some, 64 and 1 << 20 hold a piece
# whole) alternate between them, each on every initializer.
DRAW_CASES = [
    (name, shape, dtype, block)
    for i, (name, shape) in enumerate(itertools.product(
        sorted(INITIALIZERS), [(13, 17), (5, 7, 3), (100,)]))
    for dtype, block in (("float32", (5, 16)[i % 2]),
                         ("bfloat16", (64, 1 << 20)[i % 2]))]


@pytest.mark.parametrize("name,shape,dtype,block", DRAW_CASES, ids=str)
def test_every_piece_equals_the_whole_draw(name, shape, dtype, block):
    from keras.src.backend.torch import random as keras_torch_random

    from keras_layoutmap.backends.torch import initialization

    whole = INITIALIZERS[name]()(shape, dtype)
    checked = 0
    for box in _boxes(shape):
        draw = initialization.record_draw(INITIALIZERS[name](), shape, dtype)
        generator = keras_torch_random.torch_seed_generator(draw.seed)
        piece = initialization.draw_shard(draw, generator, shape, box, block)
        assert piece.dtype == whole.dtype
        assert piece.shape == whole[box].shape
        np.testing.assert_array_equal(
            keras.ops.convert_to_numpy(piece),
            keras.ops.convert_to_numpy(whole[box]), err_msg=str(box))
        checked += 1
    assert checked == sum(1 for _ in _boxes(shape)) > 1


@pytest.mark.parametrize("shape,box,runs", [
    ((6, 4), (slice(2, 4), slice(0, 4)), ([8], 8)),  # rows: one run
    ((6, 4), (slice(0, 6), slice(2, 4)), ([2, 6, 10, 14, 18, 22], 2)),
    ((2, 3, 4), (slice(1, 2), slice(0, 3), slice(0, 2)), ([12, 16, 20], 2)),
    ((6, 4), (slice(0, 6), slice(0, 4)), ([0], 24)),  # not split
    ((6, 4), (slice(6, 6), slice(0, 4)), ([], 0)),  # an empty piece
], ids=["rows", "columns", "3-D", "whole", "empty"])
def test_owned_runs(shape, box, runs):
    from keras_layoutmap.backends.torch import initialization

    starts, length = initialization.owned_runs(shape, box)
    assert (starts.tolist(), length) == runs
