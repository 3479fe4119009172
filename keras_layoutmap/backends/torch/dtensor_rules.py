"""Sharding rules of torch's DTensor that give wrong numbers, corrected.

DTensor runs an op on each process's local pieces as its sharding rule
(a "strategy") says, after redistributing the operands to what the rule
asks. Where a rule asks too little, the op runs on pieces it cannot run on
and the result is wrong, with no error. Here such a rule is read with its
arguments put right, so that DTensor redistributes the operands to what is
correct before the op, for every caller: Keras' ops, the layers, a user's
torch code, autograd's backward ops.

- The scans (`aten.cumsum`, `aten.cumprod`, `aten.logcumsumexp`; torch
  2.13's `scan_strategy`) read the scanned dim as it is given: a negative
  one (Keras' `ops.cumsum(x, axis=-1)`) matches no `Shard`'s dim, so a
  tensor split along it was scanned piece by piece, each piece from 0 (a
  custom layer's cumulative sum over a split axis: a wrong forward pass).
  The rule reads the dim made non-negative, so the split along it is
  gathered first, as for a positive dim (`cummax` and `cummin`, `sort`,
  `softmax` and the reductions normalize theirs already).

- A view (`aten.view`, `aten._unsafe_view`) that unflattens a dim split
  unevenly over a mesh axis (a flattened (rows, 36) split over "model" in
  two pieces of 18, viewed as (rows, 3, 3, 4): 3 rows of the first dim do
  not halve) is refused, "Cannot unflatten unevenly sharded tensor". A
  view's rule refuses what would need a redistribution; `Flatten`'s
  backward, whose gradient comes split by the next layer's kernel, hit
  it (a `Conv*` or pooling under `klm.fsdp(axis="model")`). There the
  rule of the same view as a copy (`aten.view_copy`) is read instead: the
  split that does not divide is gathered over that mesh axis first, the
  rest keeps its split. The numbers are the same.

- `aten.unbind` along a split dim is refused ("Attempted to unbind along
  the sharded dimension"): Keras' recurrent loop makes its list of outputs
  with `list(output)` of the first step's output, an unbind along the
  batch rows, so `SimpleRNN`, `LSTM`, `GRU` (masked or not) failed on
  batch-split inputs under `DataParallel`. The rule is read with that
  dim whole: the split along it is gathered first, the others keep
  theirs.

A rule that torch registers otherwise (another torch) is left as it is;
`tests/test_torch_layer_ops.py` checks the results against one device.
"""

import functools

import torch
from torch.distributed.tensor import DTensor

aten = torch.ops.aten

# op -> the position of its dim argument, which the rule reads unnormalized
_DIM_AT = {
    aten.cumsum.default: 1,
    aten.cumprod.default: 1,
    aten.logcumsumexp.default: 1,
}


def _with_dim_normalized(rule, position):
    """`rule` (a DTensor strategy function of an `OpSchema`) reading the
    argument at `position`, a dim, as a non-negative one."""
    from torch.distributed.tensor._op_schema import OpSchema

    @functools.wraps(rule)
    def strategy(op_schema):
        args = op_schema.args_schema
        dim = args[position] if len(args) > position else None
        ndim = getattr(args[0], "ndim", None) if args else None
        if isinstance(dim, int) and dim < 0 and isinstance(ndim, int):
            op_schema = OpSchema(
                op=op_schema.op,
                args_schema=(*args[:position], dim + max(ndim, 1),
                             *args[position + 1:]),
                kwargs_schema=op_schema.kwargs_schema,
                schema_info=op_schema.schema_info)
        return rule(op_schema)

    strategy._klm_wrapped = True
    return strategy


_VIEWS = (aten.view.default, aten._unsafe_view.default)
_UNEVEN_VIEW = "Cannot unflatten unevenly sharded tensor"


def _on_refusal(rule, refusal, fallback):
    """`rule` (a DTensor strategy function of an `OpSchema`); where it
    refuses with an error saying `refusal`, `fallback(op_schema)`'s plan."""

    @functools.wraps(rule)
    def strategy(op_schema):
        try:
            return rule(op_schema)
        except RuntimeError as error:
            if refusal not in str(error):
                raise
        return fallback(op_schema)

    strategy._klm_wrapped = True
    return strategy


def _gathering_where_uneven(rule, copy_rule):
    """`rule` (a view's); where it refuses an uneven unflatten,
    `copy_rule`'s plan (the same view as a copy, which asks for the
    split that does not divide to be gathered)."""
    return _on_refusal(rule, _UNEVEN_VIEW, copy_rule)


_UNBIND_REFUSED = "Attempted to unbind along the sharded dimension"


def _whole_along(op_schema, dim):
    """`op_schema` with its first operand's placements made whole
    (`Replicate`) on every mesh dim that splits its tensor dim `dim`."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor._dtensor_spec import DTensorSpec
    from torch.distributed.tensor._op_schema import (
        OpSchema,
        OpSpec,
        OpStrategy,
    )

    first, *rest = op_schema.args_schema
    specs = []
    for strategy in first.strategies:
        spec = strategy.output_spec
        places = tuple(Replicate() if getattr(p, "dim", None) == dim
                       and p.is_shard() else p for p in spec.placements)
        specs.append(OpSpec(DTensorSpec(spec.mesh, places,
                                        tensor_meta=spec.tensor_meta)))
    return OpSchema(op=op_schema.op,
                    args_schema=(OpStrategy(specs), *rest),
                    kwargs_schema=op_schema.kwargs_schema,
                    schema_info=op_schema.schema_info)


def _unbinding_whole(rule):
    """`rule` (unbind's); where it refuses a split unbind dim, its plan
    for that dim whole."""

    def whole(op_schema):
        args = op_schema.args_schema
        dim = args[1] if len(args) > 1 else 0
        return rule(_whole_along(op_schema, dim % max(args[0].ndim, 1)))

    return _on_refusal(rule, _UNBIND_REFUSED, whole)


def install():
    propagator = getattr(getattr(DTensor, "_op_dispatcher", None),
                         "sharding_propagator", None)
    rules = getattr(propagator, "op_strategy_funcs", None)
    if not isinstance(rules, dict):
        return
    for op, position in _DIM_AT.items():
        rule = rules.get(op)
        if rule is not None and not getattr(rule, "_klm_wrapped", False):
            rules[op] = _with_dim_normalized(rule, position)
    copy_rule = rules.get(aten.view_copy.default)
    for op in _VIEWS:
        rule = rules.get(op)
        if (rule is not None and copy_rule is not None
                and not getattr(rule, "_klm_wrapped", False)):
            rules[op] = _gathering_where_uneven(rule, copy_rule)
    rule = rules.get(aten.unbind.int)
    if rule is not None and not getattr(rule, "_klm_wrapped", False):
        rules[aten.unbind.int] = _unbinding_whole(rule)
    cache = getattr(propagator, "propagate_op_sharding", None)
    if hasattr(cache, "cache_clear"):  # rules read before: read again
        cache.cache_clear()
