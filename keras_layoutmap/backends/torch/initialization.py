"""Weights born sharded on torch: each process makes only its own shard,
and the values equal a one-device draw with the same seed.

Keras' torch initializers draw from a fresh `torch.Generator` seeded from
the initializer's seed: a Mersenne Twister, whose numbers come one after
another and cannot be jumped over. ATen's CPU kernels consume that stream
element by element (`rand`: one draw per element; `normal`: one per
element, turned into normals 16 at a time, the last 16 redrawn when the
size is not a multiple of 16), so a draw made in consecutive blocks, each
a multiple of 16 elements and the last at least 16, gives the very numbers
of one whole draw. Each process here walks the stream in blocks of
`BLOCK_ELEMENTS`, up to the last element it owns, and keeps the elements
of its shard (they come in the shard's own row-major order): the working
memory is one block besides the shard, whatever the weight's size. The time
is that of drawing the weight whole, at most. That this torch's kernels
take the stream so is checked once per process, kind and dtype, on a small
draw against Keras' own (`stream_splits`); where it fails, weights are made
whole, then split, with a warning.

Covered: a variable whose initializer is a single `keras.random` draw
(`RandomUniform`, `RandomNormal`, `TruncatedNormal`, `VarianceScaling` and
the Glorot / He / LeCun initializers built on it, or any initializer that
returns one `keras.random.uniform`, `normal` or `truncated_normal`
untouched), and `Zeros`, `Ones` or a scalar `Constant` (filled shard by
shard). Any other initializer (`Orthogonal`, `Identity`, your own that
transforms a draw) takes the old path: made whole, then split.

Example (in each of the 4 processes of `python -m keras_layoutmap.launch
-n 4`):

>>> import keras, numpy as np, keras_layoutmap as klm
>>> from keras_layoutmap.backends.torch.initialization import born_sharded
>>> layout = klm.Layout(["model", None], klm.create_mesh([("model", 4)]))
>>> init = keras.initializers.GlorotUniform(seed=7)
>>> value = born_sharded(init, (8, 3), "float32", layout)
>>> value.to_local().shape  # this process's 2 rows
torch.Size([2, 3])
>>> bool(np.array_equal(value.full_tensor(), init((8, 3), "float32")))
True
"""

import functools
import math
import warnings

import numpy as np
import torch
from torch.distributed.tensor import DTensor, Shard

from keras_layoutmap.backends import initializer_draws
from keras_layoutmap.backends.torch import keras_internals as keras_torch
from keras_layoutmap.backends.torch.placement import (
    contiguous_stride,
    local_slices,
    placements,
    to_device_mesh,
)
from keras_layoutmap.keras_internals import standardize_dtype

# Elements drawn at once: the working memory beside the shard is a few
# times this, in bytes.
BLOCK_ELEMENTS = 1 << 20
# Normals ATen makes per element of each kind: a truncated normal picks
# from 4. A block of normals is a multiple of 16, the last at least 16.
_NORMALS_PER_ELEMENT = {"uniform": 0, "normal": 1, "truncated_normal": 4}


def record_draw(initializer, shape, dtype):
    """The single draw `initializer(shape, dtype)` returns untouched, found
    by calling it with Keras' torch draws returning an empty tensor on the
    meta device (no memory); None for anything else."""
    return initializer_draws.record_draw(
        initializer, shape, dtype, keras_torch.random,
        lambda shape, dtype: torch.empty(
            shape, dtype=keras_torch.to_torch_dtype(dtype),
            device="meta"))


# -- the stream, block by block --


def _stream(draw, generator):
    """`(take, finish)`: `take(n)` draws the next `n` elements' raw numbers
    from `generator`, as the whole draw takes them; `finish(raw, into)`
    writes Keras' values of those kept into the tensor `into`
    (`keras.src.backend.torch.random`'s arithmetic, element by element, so
    it may run on the kept ones only)."""
    dtype = keras_torch.to_torch_dtype(draw.dtype)
    a, b = draw.bounds()
    if draw.kind == "uniform":
        low, high = a, b

        def take(n):
            return torch.rand(n, generator=generator, dtype=dtype)

        def finish(raw, into):
            torch.mul(raw, high - low, out=into).add_(low)
    elif draw.kind == "normal":
        mean, stddev = a, b

        def take(n):
            return torch.normal(mean, stddev, size=(n,), generator=generator,
                                dtype=dtype)

        def finish(raw, into):
            into.copy_(raw)
    else:
        mean, stddev = a, b

        def take(n):
            return torch.normal(0, 1, size=(n, 4), generator=generator,
                                dtype=dtype)

        def finish(raw, into):
            valid = (raw > -2) & (raw < 2)
            indexes = valid.max(-1, keepdim=True)[1]
            into.copy_(raw.gather(-1, indexes).squeeze(-1))
            into.mul_(stddev).add_(mean)

    return take, finish


def owned_runs(shape, box):
    """`(starts, length)`: the flat (row-major) offsets where this process's
    runs of consecutive elements begin, ascending, and their common length,
    for the shard `box` (a slice per dimension) of a tensor of `shape`."""
    sizes = [s.stop - s.start for s in box]
    if 0 in sizes:
        return np.zeros(0, np.int64), 0
    cut = [d for d, (n, size) in enumerate(zip(shape, sizes)) if size != n]
    if not cut:
        return np.zeros(1, np.int64), math.prod(shape)
    last = cut[-1]
    strides = contiguous_stride(tuple(shape))
    starts = np.array(box[last].start * strides[last], np.int64)
    for d in range(last):  # row-major over the dimensions before `last`
        starts = np.add.outer(starts, (box[d].start + np.arange(
            sizes[d], dtype=np.int64)) * strides[d])
    return np.ravel(starts), sizes[last] * strides[last]


def _kept(starts, ends, p, q):
    """The offsets within `[p, q)` of the owned elements there (the runs
    `[starts[i], ends[i])`), in order: a slice when one run covers them,
    else an index tensor."""
    first = np.searchsorted(ends, p, side="right")
    end = np.searchsorted(starts, q, side="left")
    if end <= first:
        return None
    lo = np.maximum(starts[first:end], p) - p
    hi = np.minimum(ends[first:end], q) - p
    if end - first == 1:
        return slice(int(lo[0]), int(hi[0]))
    counts = hi - lo
    index = np.arange(int(counts.sum()), dtype=np.int64) + np.repeat(
        lo - (np.cumsum(counts) - counts), counts)
    return torch.from_numpy(index)


def draw_shard(draw, generator, shape, box, block_elements=None):
    """This process's shard (`box`) of Keras' whole draw of `shape`, made by
    walking the generator's stream in blocks of about `block_elements`
    (default `BLOCK_ELEMENTS`)."""
    starts, length = owned_runs(shape, box)
    local_shape = tuple(s.stop - s.start for s in box)
    dtype = keras_torch.to_torch_dtype(draw.dtype)
    out = torch.empty(math.prod(local_shape), dtype=dtype)
    if starts.size == 0:
        return out.reshape(local_shape)
    total = math.prod(shape)
    per = _NORMALS_PER_ELEMENT[draw.kind]
    align = 16 // per if per else 1
    block = block_elements or BLOCK_ELEMENTS
    block = max(align, block // align * align)
    ends = starts + length
    end = int(ends[-1])
    take, finish = _stream(draw, generator)
    p = cursor = 0
    while p < end:
        q = min(p + block, total)
        if per and q < total and (total - q) * per < 16:
            q = total  # the last block holds the last 16 normals
        raw = take(q - p)
        kept = _kept(starts, ends, p, q)
        if kept is not None:
            piece = raw[kept]
            finish(piece, out[cursor:cursor + piece.shape[0]])
            cursor += piece.shape[0]
        p = q
    return out.reshape(local_shape)


# Keras' own draws, kept at import: `stream_splits` compares against them.
_KERAS_DRAWS = {kind: getattr(keras_torch.random, kind)
                for kind in initializer_draws.KINDS}


@functools.lru_cache(maxsize=None)
def stream_splits(kind, dtype):
    """Whether this torch's draws of `kind` and `dtype` split into blocks
    as the module docstring says: pieces of a small draw (203 elements,
    not a multiple of 16, in blocks of 48) made here must equal Keras' own
    whole draw, bit for bit. Checked once per process, kind and dtype;
    where it fails (a torch whose kernels take the stream otherwise),
    weights are made whole, then split, with a warning."""
    shape, seed = (29, 7), 1234
    params = ({"minval": -0.5, "maxval": 1.5} if kind == "uniform"
              else {"mean": -0.5, "stddev": 1.5})
    # Keras' own draw, as made when nothing watches or replaces it (its
    # truncated normal calls the module's `normal`).
    with initializer_draws.draws_replaced(keras_torch.random, _KERAS_DRAWS):
        whole = _KERAS_DRAWS[kind](shape, *params.values(), dtype=dtype,
                                   seed=seed)
    draw = initializer_draws.Draw(kind, shape, dtype, params, seed, None)
    for box in ((slice(0, 29), slice(0, 7)), (slice(10, 20), slice(0, 7)),
                (slice(0, 29), slice(3, 5)), (slice(15, 29), slice(5, 7))):
        generator = keras_torch.random.torch_seed_generator(seed)
        if not torch.equal(draw_shard(draw, generator, shape, box, 48),
                           whole[box]):
            warnings.warn(
                f"keras-layoutmap: torch {torch.__version__} draws "
                f"{kind} {dtype} numbers in blocks other than this "
                "backend expects (it is tested with torch 2.13.0): weights "
                "with such initializers are made whole on each process, "
                "then split (same values, more memory while building).",
                stacklevel=2)
            return False
    return True


def born_sharded(initializer, shape, dtype, layout):
    """`initializer(shape, dtype)` as a DTensor with `layout` (a
    `klm.Layout` that splits some dimension), each process making only its
    shard; None when the initializer is not covered (see the module
    docstring) or the weight is not split: the caller then makes it whole."""
    shape = tuple(int(n) for n in shape)
    dtype = standardize_dtype(dtype)
    torch_dtype = keras_torch.to_torch_dtype(dtype)
    places = placements(layout)
    if (not shape or not torch_dtype.is_floating_point
            or not any(isinstance(p, Shard) for p in places)
            or str(keras_torch.get_device()) != "cpu"):
        return None
    constant = initializer_draws.constant_of(initializer)
    draw = None
    if constant is None:
        if initializer_draws.places_itself(initializer):
            return None
        draw = record_draw(initializer, shape, dtype)
        if (draw is None or draw.dtype != dtype
                or not stream_splits(draw.kind, dtype)):
            return None
    device_mesh = to_device_mesh(layout.mesh)
    box = local_slices(shape, device_mesh, places)
    if constant is not None:
        local = torch.full(tuple(s.stop - s.start for s in box), constant,
                           dtype=torch_dtype)
    else:
        # Keras' own seeding: a SeedGenerator advances here, once.
        generator = keras_torch.random.torch_seed_generator(draw.seed)
        local = draw_shard(draw, generator, shape, box)
    return DTensor.from_local(local, device_mesh, places, run_check=False,
                              shape=shape, stride=contiguous_stride(shape))
