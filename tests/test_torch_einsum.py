"""`ops.einsum` on DTensors (`backends/torch/einsums.py`): the plan read
from the equation's letters, then each process's einsum of its pieces.
The plan's own tests need no mesh; the computations run under `python -m
keras_layoutmap.launch -n 4 -m pytest` (nox -s tests-torch) on a (batch 2,
model 2) mesh, each output and gradient compared with torch's einsum of
the whole tensors, and the output's placements read from the DTensor."""

import numpy as np
import pytest
from helpers import counted_collectives, mp_mesh

from keras_layoutmap import backends

pytestmark = pytest.mark.skipif(backends.name() != "torch",
                                reason="the torch backend's einsum")


def einsums():
    from keras_layoutmap.backends.torch import einsums

    return einsums


# -- the plan, from letters ---------------------------------------------------


@pytest.mark.parametrize("subscripts, ranks, expected", [
    ("btd,ndh->btnh", [3, 3], (["btd", "ndh"], "btnh")),
    ("ij, jk", [2, 2], (["ij", "jk"], "ik")),  # numpy's implicit output
    ("...d,dh->...h", [3, 2], None),  # an ellipsis: DTensor's own rule
    ("ii->i", [2], None),  # a diagonal
    ("ij,jk->ik", [2, 3], None),  # a rank the equation does not give
])
def test_parse(subscripts, ranks, expected):
    assert einsums().parse(subscripts, ranks) == expected


def test_an_output_letter_stays_split_and_the_others_are_gathered():
    # Gemma's query projection under keras-hub's recipe: rows over
    # "batch", the kernel's input dimension over "batch" and its heads over
    # "model". The kernel is gathered over "batch", the rows whole over
    # "model" (their gradient there is a partial sum).
    e = einsums()
    targets, grads, result = e.plan(["btd", "ndh"], "btnh",
                                    [["b", None], ["d", "n"]])
    assert targets == [["b", None], [None, "n"]]
    assert grads == [["b", e.PARTIAL], [e.PARTIAL, "n"]]
    assert result == ["b", "n"]


def test_a_summed_letter_split_alike_gives_a_partial_sum():
    # A row-parallel projection: the summed dimension over "model" in both.
    e = einsums()
    targets, grads, result = e.plan(["btf", "fd"], "btd",
                                    [["b", "f"], [None, "f"]])
    assert targets == [["b", "f"], [None, "f"]]
    assert grads == [["b", "f"], [e.PARTIAL, "f"]]
    assert result == ["b", e.PARTIAL]


def test_the_letter_most_operands_split_wins():
    e = einsums()
    _, _, result = e.plan(["ij", "jk", "ik"], "ik",
                          [["k"], [None], ["i"]])
    assert result == ["k"]  # "k" and "i" once each: the first operand's
    _, _, result = e.plan(["ij", "ik", "ik"], "ik", [["i"], ["k"], ["k"]])
    assert result == ["k"]


def test_nothing_split_leaves_every_operand_whole():
    assert einsums().plan(["ij", "jk"], "ik", [[None, None], [None, None]]) == (
        [[None, None], [None, None]], [[None, None], [None, None]],
        [None, None])


# -- on a mesh ----------------------------------------------------------------

CASES = {
    # (equation, shapes, the letter each operand splits over (batch, model)
    # or None for a plain tensor, the output's placements: S<dim>, Partial,
    # Replicate)
    "projection": ("btd,ndh->btnh", [(4, 3, 8), (4, 8, 2)],
                   [("b", None), ("d", "n")], ["S0", "S2"]),
    # summed over "model" at once, not left a pending sum that each op
    # reading it would sum again
    "row-parallel": ("btf,fd->btd", [(4, 3, 6), (6, 5)],
                     [("b", "f"), (None, "f")], ["S0", "R"]),
    "attention": ("btkgh,bskh->bkgts", [(2, 3, 2, 2, 4), (2, 5, 2, 4)],
                  [("b", "k"), ("b", "k")], ["S0", "S1"]),
    "uneven": ("ij,jk->ik", [(5, 3), (3, 7)], [("i", None), (None, "k")],
               ["S0", "S1"]),
    "plain-operand": ("ij,jk->ik", [(4, 3), (3, 2)], [("i", None), None],
                      ["S0", "R"]),
}


def _describe(place):
    from torch.distributed.tensor import Partial, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    if isinstance(place, _StridedShard):  # not a Shard in torch 2.13
        return f"strided S{place.dim}"
    if isinstance(place, Shard):
        return f"S{place.dim}"
    return "P" if isinstance(place, Partial) else "R"


@pytest.mark.sharding
@pytest.mark.training
@pytest.mark.parametrize("case", sorted(CASES))
def test_einsum_and_its_gradients_equal_the_whole_tensors(case):
    import keras
    import torch
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from keras_layoutmap.backends.torch.placement import to_device_mesh

    subscripts, shapes, splits, expected = CASES[case]
    mesh = to_device_mesh(mp_mesh())
    terms = subscripts.split("->")[0].split(",")
    rng = np.random.default_rng(0)
    wholes = [torch.tensor(rng.normal(size=s), dtype=torch.float32)
              for s in shapes]
    operands = []
    for whole, term, split in zip(wholes, terms, splits):
        if split is None:  # a plain tensor every process holds
            operands.append(whole.clone().requires_grad_())
            continue
        places = [Shard(term.index(c)) if c else Replicate() for c in split]
        operands.append(distribute_tensor(whole.clone(), mesh, places)
                        .requires_grad_())
    out = keras.ops.einsum(subscripts, *operands)
    assert [_describe(p) for p in out.placements] == expected
    assert_equals_whole(out, operands, wholes,
                        lambda *xs: torch.einsum(subscripts, *xs), rng)


def assert_equals_whole(out, operands, wholes, function, rng):
    """`out`, `function` of `operands` on the mesh, equals `function` of
    the whole tensors, and so do the gradients of a random weighting of it
    (an operand may be a plain tensor every process holds)."""
    import torch

    weights = torch.tensor(rng.normal(size=out.shape), dtype=torch.float32)
    (out.full_tensor() * weights).sum().backward()
    references = [w.clone().requires_grad_() for w in wholes]
    reference = function(*references)
    (reference * weights).sum().backward()
    np.testing.assert_allclose(out.full_tensor().detach().numpy(),
                               reference.detach().numpy(), rtol=1e-5, atol=1e-6)
    for operand, whole in zip(operands, references):
        grad = operand.grad
        grad = grad.full_tensor() if hasattr(grad, "full_tensor") else grad
        np.testing.assert_allclose(grad.numpy(), whole.grad.numpy(),
                                   rtol=1e-5, atol=1e-6)


# -- reshapes and matmuls that would be strided (backends/torch/reshapes.py) --

PLAIN_CASES = {
    # (op, shapes, the dimension each operand splits over (batch, model),
    # the output's placements)
    # Flatten of a convolution's output, its channels over "model": the
    # channels are gathered, the rows stay split.
    "flatten": ("reshape", [(4, 2, 2, 4)], [(0, 3)], ["S0", "R"]),
    # A Dense on a sequence split over "model": no merge of batch and
    # sequence, each stays split.
    "matmul": ("matmul", [(4, 6, 8), (8, 6)], [(0, 1), (None, 1)],
               ["S0", "S1"]),
    # 2-D plans' kernels, split over "batch" as well, larger than the
    # activations (one token per row, as `generate()` decodes): gathered
    # over "batch" (one all-gather), the activations left where they are.
    "matmul-kernel-over-batch": ("matmul", [(4, 1, 8), (8, 32)],
                                 [(0, None), (0, 1)], ["S0", "S2"]),
    # ... a row-parallel one, its output features over "batch": and summed
    # over "model" (DTensor's plan moved the activations instead).
    "matmul-row-parallel-over-batch": ("matmul", [(4, 1, 32), (32, 8)],
                                       [(0, 2), (1, 0)], ["S0", "R"]),
    # Row parallel (DTensor's own plan): summed over "model" at once.
    "matmul-row-parallel": ("matmul", [(4, 3, 6), (6, 5)],
                            [(0, 2), (None, 0)], ["S0", "R"]),
}
# The collectives each forward takes (torch's functional collectives,
# which DTensor's redistributions call).
PLAIN_COLLECTIVES = {"flatten": {"all_gather_into_tensor": 1},
                     "matmul": {"all_gather_into_tensor": 1},
                     "matmul-kernel-over-batch": {"all_gather_into_tensor": 1},
                     "matmul-row-parallel-over-batch": {
                         "all_gather_into_tensor": 1, "all_reduce": 1},
                     "matmul-row-parallel": {"all_reduce": 1}}


@pytest.mark.sharding
@pytest.mark.training
@pytest.mark.parametrize("case", sorted(PLAIN_CASES))
def test_reshape_and_matmul_keep_plain_placements(case):
    import keras
    import torch
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from keras_layoutmap.backends.torch.placement import to_device_mesh

    op, shapes, splits, expected = PLAIN_CASES[case]
    mesh = to_device_mesh(mp_mesh())
    rng = np.random.default_rng(0)
    wholes = [torch.tensor(rng.normal(size=s), dtype=torch.float32)
              for s in shapes]
    operands = [distribute_tensor(
        whole.clone(), mesh,
        [Shard(d) if d is not None else Replicate() for d in split],
    ).requires_grad_() for whole, split in zip(wholes, splits)]

    def run(*xs):
        if op == "reshape":
            return keras.ops.reshape(xs[0], (xs[0].shape[0], -1))
        return keras.ops.matmul(*xs)

    with counted_collectives() as collectives:
        out = run(*operands)
    assert collectives == PLAIN_COLLECTIVES[case]
    # read from the DTensor: plain placements, none strided
    assert [_describe(p) for p in out.placements] == expected, out.placements
    assert_equals_whole(out, operands, wholes, run, rng)
