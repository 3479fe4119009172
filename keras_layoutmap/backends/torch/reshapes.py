"""Reshapes and matmuls of DTensors that keep plain placements.

A reshape that merges a dimension split over a mesh axis into another
dimension, where the split one is not the outermost (`Flatten` of a
convolution's channels split over "model"; `torch.matmul` of a
(batch, sequence, features) input, which merges batch and sequence, with
the sequence split), gives a strided placement (`_StridedShard`). torch
2.13's DTensor plans every op on a strided operand by a search of every
redistribution, for every candidate strategy: 1.5 to 9 s for one `mm` on
a (batch 2, model 2) mesh, again for each new shape (a short last batch),
measured 2026-11-27, 4 processes on 2 cores; 62 s of the 575 s of the
test suite's 4-process run went there.

- `wrap_reshape`: where the reshape of a DTensor would be strided over a
  mesh axis, the input is gathered over that axis first (`redistribute`
  to `Replicate`, an all-gather), and the result is whole over it. Every
  other axis keeps its split.
- `wrap_matmul`: `matmul` of a DTensor of rank 3 or more by a matrix,
  where a leading dimension after the first is split (a sequence split
  over "model"), or where the matrix is split over an axis that splits
  the rows (a kernel of a 2-D plan, split over "batch" and "model"), is
  the einsum of the same letters (`einsums.py`), planned from its
  placements: no merged dimension, and the kernel gathered over the rows'
  axis (one all-gather) where DTensor's own plan moves the activations
  (an all-to-all, which gloo makes an all-gather and a chunk, then a
  reduce-scatter). A product left a pending sum (`Partial`) is summed at
  once, as the einsum's is.

The numbers are the same: only where each piece is held changes.
"""

import functools

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from keras_layoutmap.backends.torch.keras_internals import convert_to_tensor
from keras_layoutmap.backends.torch.placement import sums_taken

_LETTERS = "abcdefghijklmnopqrstuvwxyz"
# Keras computes a float16 matmul in float32 on a CPU, and integers as its
# own dtype rules say: those stay Keras' own.
_PLANNED_DTYPES = (torch.float32, torch.float64, torch.bfloat16)


def _strided_axes(x):
    return [m for m, place in enumerate(x.placements)
            if isinstance(place, _StridedShard)]


def wrap_reshape(original):
    @functools.wraps(original)
    def reshape(x, newshape):
        x = convert_to_tensor(x)
        out = original(x, newshape)
        if not isinstance(out, DTensor):
            return out
        axes = _strided_axes(out)
        if not axes:
            return out
        whole = [Replicate() if m in axes else place
                 for m, place in enumerate(x.placements)]
        return original(x.redistribute(x.device_mesh, whole), newshape)

    return reshape


def _merges_a_split(x):
    """Whether `torch.matmul`'s merge of `x`'s leading dimensions (all but
    the last) would be strided: one of them after the first is split (a
    strided `x` goes to DTensor's rule in einsums.py too, so it stays
    Keras' own here). Elsewhere DTensor's own plan of `matmul`
    (cached per shape) costs less a step than planning it here: a
    transformer block's model-parallel step, measured with
    benchmarks/torch_parallel.py, 52 ms over Keras' own with DTensor's
    plan, 66 ms with this one (2026-11-27, 2 processes)."""
    return any(type(place) is Shard and 0 < place.dim < x.ndim - 1
               for place in x.placements)


def _splits_a_kernel_by_rows(x1, x2):
    """Whether the matrix `x2` is split over a mesh axis that splits `x1`'s
    leading dimensions (its rows): a kernel split over the batch axis as
    well as the model axis (a 2-D plan's). DTensor's plan then moves the
    activations instead: an all-to-all (gloo has none: an all-gather and a
    chunk) and a reduce-scatter of the product, where the einsum's plan
    gathers the kernel over that axis, one all-gather."""
    return any(
        type(a) is Shard and a.dim < x1.ndim - 1 and type(b) is Shard
        for a, b in zip(x1.placements, x2.placements))


def wrap_matmul(original, einsum):
    """`original` (Keras' matmul); `einsum`, Keras' einsum as wrapped by
    einsums.py."""

    @functools.wraps(original)
    def matmul(x1, x2):
        x1, x2 = convert_to_tensor(x1), convert_to_tensor(x2)
        if (not isinstance(x1, DTensor) or x1.ndim < 3 or x2.ndim != 2
                or x1.dtype != x2.dtype or x1.dtype not in _PLANNED_DTYPES
                or not (_merges_a_split(x1) or (
                    isinstance(x2, DTensor)
                    and x2.device_mesh == x1.device_mesh
                    and _splits_a_kernel_by_rows(x1, x2)))):
            out = original(x1, x2)
            # a row-parallel product summed at once, as einsums.py does
            return sums_taken(out) if isinstance(out, DTensor) else out
        batch = _LETTERS[:x1.ndim - 2]
        i, j, k = _LETTERS[x1.ndim - 2:x1.ndim + 1]
        return einsum(f"{batch}{i}{j},{j}{k}->{batch}{i}{k}", x1, x2)

    return matmul

