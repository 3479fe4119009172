"""Tensor parallelism on each process's own pieces (Megatron's column and
row pairs), in a model call that `local_pieces` runs on plain tensors.

A weight split over a mesh dim whose processes hold the same rows (the
`model` axis of a `(batch, model)` mesh) enters such a call as this
process's piece. Keras' layers then compute on pieces. A matmul or einsum
that keeps the split dim in its output (column parallel: `up.kernel`
`(None, "model")`, the query, key and value kernels split by heads) gives
this process's columns; one that sums over it (row parallel: `down.kernel`
`("model", None)`, the attention output over heads) gives a partial sum.
Two operators make that exact, Megatron-LM's f and g:

- **g**, after a product that sums over a split dim: the partial sums are
  all-reduced over that mesh dim; the gradient passes back as it is;
- **f**, on the other operands of a product that keeps it: they pass as
  they are; their gradients, partial over that mesh dim, are all-reduced.

Elementwise ops between them (an activation, a bias piece, attention over
this process's heads) run on the pieces as they are. Anything else that
reads across a split dim gives other numbers than DTensor's:
`local_pieces` compares the first local call, on every process, with the
same call on DTensors with the split weights gathered whole (to float
rounding), and keeps DTensors where they differ. What that comparison
cannot see, a gradient that would need an f this module does not place,
raises `NotLocal` at once, and the call runs on DTensors: any op on a
piece but a matmul or einsum it places, a read of its metadata, a cast,
and elementwise arithmetic whose other operands have the split dim (two
pieces in one product, a matmul on a piece of rank other than 2, an
einsum with an ellipsis, a permute or a convolution of a piece, an
operand broadcast along its split dim).
"""

import contextlib

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.overrides import TorchFunctionMode

from keras_layoutmap.backends.torch import einsums
from keras_layoutmap.keras_internals import input_specs_unchecked


@contextlib.contextmanager
def on_pieces(pieces):
    """A local call's block: `Pieces(pieces)` around its products, and the
    layers' input checks set aside (a layer gets its piece's shape)."""
    with Pieces(pieces), input_specs_unchecked():
        yield


class NotLocal(Exception):
    """A product on a weight's piece this module cannot place."""


def split_dim(value, mesh, places):
    """`(mesh dim, tensor dim)` of a weight split over exactly one mesh dim
    whose processes hold the same rows of a call on inputs split by
    `places` (`Replicate` there), and whole over the others; else None."""
    if not isinstance(value, DTensor) or value.device_mesh != mesh:
        return None
    found = None
    for mesh_dim, place in enumerate(value.placements):
        if isinstance(place, Replicate):
            continue
        if (found is not None or not isinstance(place, Shard)
                or not isinstance(places[mesh_dim], Replicate)):
            return None
        found = (mesh_dim, place.dim)
    return found


def grad_placements(value, places):
    """The placements of the gradient of a split weight's piece, computed
    from this process's rows: a partial sum over each mesh dim splitting
    the rows, this process's piece of the weight's gradient over the
    others."""
    return tuple(Partial() if isinstance(rows, Shard) else place
                 for rows, place in zip(places, value.placements))


class SumOverGroup(torch.autograd.Function):
    """g: all-reduced forward, the gradient as it is backward (also the
    vocabulary-parallel lookup's sum, `lookups`)."""

    @staticmethod
    def forward(ctx, x, group):
        total = x.contiguous().clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _SumGradientOverGroup(torch.autograd.Function):
    """f: as it is forward, the gradient all-reduced backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        total = grad.contiguous().clone()
        dist.all_reduce(total, group=ctx.group)
        return total, None


_MATMULS = frozenset((torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__,
                      torch.mm, torch.Tensor.mm))
# Elementwise arithmetic on a piece (a bias piece added to its columns, a
# quantized kernel's scale): run as it is, unless another operand is
# broadcast along the piece's split dim.
_ELEMENTWISE = frozenset((
    torch.add, torch.Tensor.add, torch.Tensor.__add__, torch.Tensor.__radd__,
    torch.sub, torch.subtract, torch.Tensor.sub, torch.Tensor.__sub__,
    torch.Tensor.__rsub__, torch.mul, torch.multiply, torch.Tensor.mul,
    torch.Tensor.__mul__, torch.Tensor.__rmul__, torch.div, torch.divide,
    torch.true_divide, torch.Tensor.div, torch.Tensor.__truediv__,
    torch.Tensor.__rtruediv__))
# Ops that give a piece's values again (a dtype cast under mixed
# precision, a view): the result is the same piece.
_SAME_PIECE = frozenset((torch.Tensor.to, torch.Tensor.type, torch.Tensor.float,
                         torch.Tensor.half, torch.Tensor.bfloat16,
                         torch.Tensor.contiguous, torch.Tensor.detach))


class Pieces(TorchFunctionMode):
    """The ops of a local call, with f and g around every product on a
    split weight's piece. `pieces`: {id(piece): (piece, tensor dim, the
    process group of its mesh dim)}."""

    def __init__(self, pieces):
        super().__init__()
        self.pieces = dict(pieces)
        self.whole = {}  # (id(x), group): (x, f(x))

    def _f(self, x, group):
        """f(x), one node for every product on `x` (the query, key and
        value of one input): their gradients are summed here first, then
        all-reduced once."""
        if not (isinstance(x, torch.Tensor) and x.requires_grad):
            return x
        found = self.whole.get((id(x), group))
        if found is None or found[0] is not x:
            found = self.whole[(id(x), group)] = (
                x, _SumGradientOverGroup.apply(x, group))
        return found[1]

    def _piece(self, x):
        found = self.pieces.get(id(x))
        return found if found is not None and found[0] is x else None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _MATMULS:
            return self._matmul(func, args, kwargs)
        if func is torch.einsum:
            return self._einsum(args, kwargs)
        self._check_other(func, args, kwargs)
        result = func(*args, **kwargs)
        if func in _SAME_PIECE and args:
            piece = self._piece(args[0])
            if piece is not None and isinstance(result, torch.Tensor):
                self.pieces[id(result)] = (result, *piece[1:])
        return result

    def _check_other(self, func, args, kwargs):
        """Raise `NotLocal` where `func` takes a piece and is neither a read
        of its metadata (`.shape`, `.dtype`), a cast, nor elementwise
        arithmetic whose other operands have the piece's split dim (one
        broadcast along it would have a partial gradient; a permute, a
        convolution or `F.linear` on a piece would need an f this module
        does not place)."""
        leaves = [*args, *kwargs.values()]
        found = [x for x in leaves if isinstance(x, torch.Tensor)
                 and self._piece(x) is not None]
        if not found or func in _SAME_PIECE or getattr(
                func, "__name__", None) == "__get__":
            return
        if func not in _ELEMENTWISE:
            raise NotLocal(f"{getattr(func, '__name__', func)} on a piece")
        tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
        for x in found:
            from_end = x.ndim - self._piece(x)[1]  # the split dim, from the end
            for other in tensors:
                if other is not x and (other.ndim < from_end or other.shape[
                        other.ndim - from_end] != x.shape[-from_end]):
                    raise NotLocal("an operand broadcast along a piece's "
                                   "split dim")

    def _matmul(self, func, args, kwargs):
        a, b = args[0], args[1]
        piece_a, piece_b = self._piece(a), self._piece(b)
        if piece_a is None and piece_b is None:
            return func(*args, **kwargs)
        if piece_a is not None and piece_b is not None:
            raise NotLocal("a product of two weights' pieces")
        piece, weight = (piece_b, b) if piece_b is not None else (piece_a, a)
        if weight.ndim != 2:
            raise NotLocal(f"a matmul on a weight piece of rank {weight.ndim}")
        _, dim, group = piece
        summed_dim = 0 if weight is b else 1
        if dim == summed_dim:  # row parallel: partial sums, all-reduced
            return SumOverGroup.apply(func(a, b, **kwargs), group)
        if weight is b:  # column parallel
            return func(self._f(a, group), b, **kwargs)
        return func(a, self._f(b, group), **kwargs)

    def _einsum(self, args, kwargs):
        subscripts, operands = args[0], list(args[1:])
        if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
            operands = list(operands[0])
        found = [(i, self._piece(x)) for i, x in enumerate(operands)]
        found = [(i, p) for i, p in found if p is not None]
        if not found:
            return torch.einsum(*args, **kwargs)
        if len(found) > 1:
            raise NotLocal("an einsum of two weights' pieces")
        parsed = einsums.parse(subscripts, [x.ndim for x in operands])
        if parsed is None:
            raise NotLocal(f"an einsum this plan does not read: {subscripts}")
        inputs, output = parsed
        index, (_, dim, group) = found[0]
        letter = inputs[index][dim]
        if letter not in output:  # row parallel
            return SumOverGroup.apply(
                torch.einsum(subscripts, *operands, **kwargs), group)
        # Column parallel: an operand without the letter is whole on every
        # process (its gradient partial); one with it is a piece already.
        operands = [self._f(x, group) if letter not in inputs[i] else x
                    for i, x in enumerate(operands)]
        return torch.einsum(subscripts, *operands, **kwargs)
