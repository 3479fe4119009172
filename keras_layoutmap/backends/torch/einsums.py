"""`ops.einsum` on DTensors, planned from its letters and computed per
process.

torch 2.13's DTensor runs an einsum as its decomposition: permutes,
reshapes that merge dimensions, then `bmm`. Where a merged dimension is
split over two mesh axes (the batch over one, the heads over the other:
every attention projection of keras-hub's recipes) the reshape gives a
strided placement, and DTensor plans each `bmm` over strided inputs by a
search of every redistribution, for every candidate strategy: 23 s of
a tiny Gemma's first training step on a (batch 2, model 2) mesh, the
same again for each new shape (2026-11-26, 4 processes on 2 cores).

An einsum's letters give its plan directly. For each mesh axis:

- a letter of the output that some operand splits over the axis stays
  split: every operand with that letter is split by it, the others are
  whole on that axis, and the output is split by it;
- else a summed letter that some operand splits over the axis stays
  split in every operand that has it (each process sums its part): the
  output is summed over the axis at once (one all-reduce, Megatron's
  row-parallel g). Left as a pending sum (`Partial`), as DTensor's own
  plan leaves it, it was summed again by each op that reads it: the
  query, key and value projections of one input three times, a norm by a
  reduce-scatter and an all-gather;
- else every operand is whole on that axis.

Each operand is brought to its plan (DTensor's `redistribute`: a gather,
or a local slice), each process computes the einsum of its pieces with
Keras' own kernel, and the result is its piece of the output. Gradients
follow from DTensor's own autograd: an operand kept whole on an axis that
splits the output gets a partial gradient there (`to_local`'s
`grad_placements`).

An operand that is a partial sum is reduced first. Equations this plan
does not cover (an ellipsis, a letter repeated in one operand, a letter of
size 1 in one operand broadcast against another) and operands with a
strided placement (a reshape's) go to DTensor's own rules.
"""

import functools

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from keras_layoutmap.backends.torch.keras_internals import convert_to_tensor
from keras_layoutmap.backends.torch.placement import (
    as_dtensor,
    contiguous_stride,
    local_piece,
    sums_taken,
)

PARTIAL = "partial"  # plan(): the output is a partial sum over that axis


def parse(subscripts, ranks):
    """`(inputs, output)`, the letters of each operand and of the result,
    or None where the plan does not apply (an ellipsis, a letter repeated
    within one operand, a rank that does not match)."""
    subscripts = subscripts.replace(" ", "")
    if "." in subscripts:
        return None
    if "->" in subscripts:
        given, output = subscripts.split("->")
    else:  # numpy's implicit output: the letters seen once, sorted
        given = subscripts
        letters = given.replace(",", "")
        output = "".join(sorted(c for c in set(letters) if letters.count(c) == 1))
    inputs = given.split(",")
    if len(inputs) != len(ranks) or any(
            len(term) != rank or len(set(term)) != len(term)
            for term, rank in zip(inputs, ranks)):
        return None
    if len(set(output)) != len(output) or not set(output) <= set("".join(inputs)):
        return None
    return inputs, output


def plan(inputs, output, split):
    """The per-process plan of an einsum, from letters alone.

    `split[i][m]` is the letter operand `i` splits over mesh axis `m`, or
    None. Returns `(targets, grads, result)`: `targets[i][m]` the letter
    operand `i` is split by over axis `m` for the computation (None: whole);
    `grads[i][m]` the same for its gradient, PARTIAL where the operand is
    whole but the work is split; `result[m]` the output's letter, PARTIAL,
    or None.

    A projection, the batch split over axis 0, the kernel's input
    dimension over axis 0 and its heads over axis 1: the kernel is gathered
    over axis 0, and the input is whole over axis 1 (its gradient partial):

    >>> plan(["btd", "ndh"], "btnh", [("b", None), ("d", "n")])
    ([['b', None], [None, 'n']], [['b', 'partial'], ['partial', 'n']], ['b', 'n'])
    """
    axes = len(split[0]) if split else 0
    targets = [[None] * axes for _ in inputs]
    grads = [[None] * axes for _ in inputs]
    result = [None] * axes
    for m in range(axes):
        letters = [split[i][m] for i in range(len(inputs)) if split[i][m]]
        kept = [c for c in letters if c in output] or letters
        if not kept:
            continue
        # the letter most operands already split (fewest gathers); ties:
        # the first operand's
        letter = max(dict.fromkeys(kept), key=kept.count)
        result[m] = letter if letter in output else PARTIAL
        for i, term in enumerate(inputs):
            if letter in term:
                targets[i][m] = grads[i][m] = letter
            else:
                grads[i][m] = PARTIAL
    return targets, grads, result


def _letters(x, term):
    """The letter `x` (a DTensor) splits over each mesh axis, or None
    where a placement is strided (not planned here)."""
    out = []
    for place in x.placements:
        if type(place) is Shard:
            out.append(term[place.dim])
        elif isinstance(place, Replicate):
            out.append(None)
        else:
            return None
    return out


def _placements(letters, term):
    return [Shard(term.index(c)) if c not in (None, PARTIAL)
            else Partial() if c == PARTIAL else Replicate() for c in letters]


class _ContiguousGradient(torch.autograd.Function):
    """The identity, whose gradient is made contiguous: torch's einsum
    gives permuted gradients, and the DTensor they go back into describes
    its pieces as laid out contiguously (a view of it would fail, or read
    the wrong elements)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


def wrap_einsum(original):
    @functools.wraps(original)
    def einsum(subscripts, *operands, **kwargs):
        # variables (EinsumDense's kernel) as their values, as Keras' does
        operands = [convert_to_tensor(x) for x in operands]
        meshes = {x.device_mesh for x in operands if isinstance(x, DTensor)}
        if len(meshes) != 1:
            return original(subscripts, *operands, **kwargs)
        parsed = parse(subscripts, [x.ndim for x in operands])
        if parsed is None:
            return original(subscripts, *operands, **kwargs)
        inputs, output = parsed
        mesh = meshes.pop()
        # partial sums (a row-parallel einsum's output) taken first, as
        # DTensor's own rules would
        operands = [sums_taken(as_dtensor(x, mesh)) for x in operands]
        split = [_letters(x, term) for x, term in zip(operands, inputs)]
        if any(s is None for s in split):
            return original(subscripts, *operands, **kwargs)
        sizes = {}
        for x, term in zip(operands, inputs):
            for c, n in zip(term, x.shape):
                if sizes.setdefault(c, n) != n:  # a broadcast letter (size 1)
                    return original(subscripts, *operands, **kwargs)
        shape = tuple(sizes[c] for c in output)
        targets, grads, result = plan(inputs, output, split)
        pieces = [
            _ContiguousGradient.apply(local_piece(
                x, _placements(target, term),
                grad_placements=_placements(grad, term)))
            for x, term, target, grad in zip(operands, inputs, targets, grads)]
        out = original(subscripts, *pieces, **kwargs)
        return sums_taken(DTensor.from_local(
            out.contiguous(), mesh, _placements(result, output),
            run_check=False, shape=shape, stride=contiguous_stride(shape)))

    return einsum
