"""Keras ops that DTensor has no rule for run on whole tensors.

torch 2.13's DTensor refuses some ops on split tensors: no sharding
strategy (`ops.segment_sum`'s `scatter_reduce`, `ops.searchsorted`,
`ops.bincount`), or an in-place op on a value whose placement would change
(`ops.rms_normalization` over a split axis, which Keras runs as torch's
`F.rms_norm`, and so `keras.layers.RMSNormalization`; `ops.argpartition`'s
`index_put_`). Those failed with DTensor's raw error. Here a Keras op that
DTensor refuses runs again on whole tensors: each DTensor operand is
gathered (every process takes part, in the same op, as every process runs
the same code), the op runs on plain tensors, and each tensor it returns
is a DTensor whole on every process of the operands' mesh. The numbers are
one device's; the gather's cost is that of the op's inputs. An op that
runs costs nothing more.
"""

import functools

import torch
from keras import tree
from torch.distributed.tensor import DTensor, Replicate

from keras_layoutmap.backends.keras_ops import wrap_ops
from keras_layoutmap.backends.torch.placement import to_host

# The words of DTensor's refusals of an op's placements.
REFUSALS = ("sharding strategy", "Sharding propagation failed",
            "placement changes")


def _refused(error):
    return isinstance(error, (NotImplementedError, RuntimeError)) and any(
        word in str(error) for word in REFUSALS)


def _mesh(args, kwargs):
    """The device mesh of the first DTensor among the operands (the items
    of argument lists too), else None."""
    for value in tree.flatten((args, kwargs)):
        value = getattr(value, "value", value)  # a Keras variable's
        if isinstance(value, DTensor):
            return value.device_mesh
    return None


def _whole(value):
    if isinstance(value, DTensor):
        return to_host(value)
    inner = getattr(value, "value", None)  # a Keras variable
    return to_host(inner) if isinstance(inner, DTensor) else value


def wrap_op(original):
    """`original` (a Keras backend op) which, when DTensor refuses it, runs
    again on whole tensors and returns whole DTensors."""

    @functools.wraps(original)
    def op(*args, **kwargs):
        try:
            return original(*args, **kwargs)
        except (NotImplementedError, RuntimeError) as e:
            mesh = _mesh(args, kwargs) if _refused(e) else None
            if mesh is None:
                raise
        out = original(*tree.map_structure(_whole, args),
                       **tree.map_structure(_whole, kwargs))
        return tree.map_structure(
            lambda t: DTensor.from_local(
                t, mesh, [Replicate()] * mesh.ndim, run_check=False)
            if torch.is_tensor(t) and not isinstance(t, DTensor) else t, out)

    return op


def install(modules, core):
    """Wrap every public function defined in each of `modules` (Keras'
    torch `numpy`, `math`, `nn`, `linalg` ops) and core's `scatter` ops."""
    wrap_ops(wrap_op, modules, core)
