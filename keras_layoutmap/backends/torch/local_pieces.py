"""Data parallelism on each process's own pieces: the torch fast path.

Where a model's weights are all replicated and its inputs are split over
batch rows only, what DTensor computes on each process is what the same
layers compute on that process's rows with plain tensors. DTensor still
decides it op by op, in Python, at many times the cost of a small op. So:

- **a model call** runs Keras' own layers on the local pieces, under a
  `keras.StatelessScope` that maps every variable to its local tensor; the
  outputs become DTensors again, split by rows as the inputs were, so the
  loss and metrics that follow still take their batch sums on DTensors. A
  weight's gradient arrives as partial sums over the axes that split the
  batch (as DTensor leaves it), and `gradients` sums all of them in one
  all-reduce, as DDP's buckets do.
- **weights split over the dims that split the rows** (FSDP's) are
  gathered whole, one all-gather each, and the call runs as above on the
  whole weights; their gradients come back summed over the processes into
  each one's piece (the gather's backward: one reduce-scatter each), as
  FSDP's do. A call with gradients gathers them as it starts (its
  backward keeps them anyway); one without gathers each where it is read
  and keeps none (`gathered_weights`).
- **weights split over a dim whose processes hold the same rows** (tensor
  parallelism's) are read as this process's piece, with Megatron's
  all-reduces around the products on them (`tensor_parallel`).
- **an optimizer update** runs on each process's pieces where that is the
  same arithmetic (`local_updates`).

In `fit`, where the loss is a mean over rows and the metrics are sums,
`local_step` goes further and runs Keras' whole training step on plain
tensors; it relies on this module's decision for the model call.

A call is local only where that gives DTensor's numbers. This is checked
once per model and input signature (shapes, dtypes, placements, flags) by a
trial call on DTensors (`local_trials`; the split weights gathered whole),
with no gradients and no state kept, under DTensor's strict redistribution
check:
the trial must need no redistribution and no communication, draw no
random numbers, assign no variable, add no loss, and return outputs split
by rows as its inputs. Batch normalization (batch statistics), dropout
(one device's random mask), a layer that indexes the batch or reduces over
it, a plain tensor among the inputs, a weight split over two mesh dims:
each keeps the DTensor path. The first local call must then give
this process's pieces of the trial's outputs exactly, on every process
(which catches a layer that reads the batch size as a number, or a variable
the model does not own); with tensor-parallel pieces, to float rounding
(the pieces sum in another order; an op that reads across a piece gives
other numbers).
A local call that assigns, draws or adds a loss anyway (the data took it
elsewhere) is dropped, the random generator restored, and the call made
on DTensors.

`KLM_TORCH_LOCAL_PIECES=0` turns the fast path off (every call on DTensors).
"""

import contextlib
import os
import weakref

import torch
from keras import tree
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from keras_layoutmap.backends.torch import (
    gathered_weights,
    local_trials,
    tensor_parallel,
)
from keras_layoutmap.backends.torch.placement import contiguous_stride
from keras_layoutmap.keras_internals import (
    StatelessScope,
    get_keras_mask,
    in_stateless_scope,
    set_keras_mask,
)

ENABLED = os.environ.get("KLM_TORCH_LOCAL_PIECES", "1") != "0"
NOT_LOCAL = object()  # what a `run_*` returns when the call is not local
# Input signatures tried per model; past them, new ones stay on DTensors.
MAX_SIGNATURES = 32

_PLANS = weakref.WeakKeyDictionary()  # model -> {signature: _Plan or None}
_SCALARS = (bool, int, float, str, type(None))


class _Plan:
    """How a model call with one input signature runs locally."""

    __slots__ = ("mesh", "placements", "grad_placements", "rows",
                 "variables", "values", "gathered", "split", "trial", "masked")

    def __init__(self, mesh, placements, rows, variables, gathered, split):
        self.mesh = mesh
        self.placements = placements
        # The gradient of a replicated weight from a process's rows: a
        # partial sum over each axis that splits the batch.
        self.grad_placements = tuple(
            Partial() if isinstance(p, Shard) else Replicate()
            for p in placements)
        self.rows = rows
        self.variables = variables
        self.values = tuple(v._value for v in variables)
        # Per variable: True where it is split (over mesh dims that split
        # the rows) and gathered whole for the call.
        self.gathered = tuple(gathered)
        # Per variable: (mesh dim, tensor dim) where it is split over a mesh
        # dim whose processes hold the same rows (tensor parallelism): the
        # call reads its piece (`tensor_parallel`); else None.
        self.split = tuple(split)
        # The trial's outputs (this process's pieces), which the first
        # local call must equal; None once it did.
        self.trial = None
        self.masked = False  # the outputs carry Keras masks

    @property
    def all_replicated(self):
        """No weight is gathered or read as a piece: each process's local
        tensors are the whole weights."""
        return not any(self.gathered) and not any(self.split)

    def still_holds(self):
        """The variables hold the values the plan was made for (a moved
        variable holds a new DTensor)."""
        return all(v._value is value
                   for v, value in zip(self.variables, self.values))


def _row_placements(x):
    """`x`'s placements if it is split over its rows (dimension 0) only, or
    whole on every process (a batch the batch axis does not divide)."""
    places = tuple(x.placements)
    if all(isinstance(p, Replicate) or (isinstance(p, Shard) and p.dim == 0)
           for p in places):
        return places
    return None


def dtensor_entry(x):
    """A DTensor's part of a call signature (None for another leaf)."""
    if isinstance(x, DTensor):
        return (tuple(x.shape), x.dtype, tuple(x.placements), id(x.device_mesh))
    return None


def signature(args, kwargs, entry=dtensor_entry):
    """What the decision depends on, hashable; None when a leaf is neither
    a tensor `entry` describes nor a plain Python value."""
    key = [len(args), tuple(sorted(kwargs))]
    found = False
    if all(entry(x) is not None for x in args) and all(
            isinstance(v, _SCALARS) for v in kwargs.values()):
        leaves = [*args, *(kwargs[k] for k in key[1])]  # as tree.flatten, faster
    else:
        leaves = tree.flatten((args, kwargs))
    for x in leaves:
        described = entry(x)
        if described is not None:
            key.append(described)
            found = True
        elif isinstance(x, _SCALARS):
            key.append((type(x), x))
        else:
            return None
    return tuple(key) if found else None


def _local_plan(model, original, args, kwargs):
    """A `_Plan` when the call's local pieces give DTensor's numbers."""
    inputs = [x for x in tree.flatten((args, kwargs)) if isinstance(x, DTensor)]
    first = inputs[0]
    places = _row_placements(first)
    if places is None or any(
            x.device_mesh != first.device_mesh or tuple(x.placements) != places
            or x.ndim == 0 or x.shape[0] != first.shape[0] for x in inputs):
        return None
    variables = [v for v in model.variables
                 if isinstance(getattr(v, "_value", None), torch.Tensor)]
    mesh, rows = first.device_mesh, first.shape[0]
    gathered = [gathered_weights.gathered(v._value, mesh, places)
                for v in variables]
    split = [tensor_parallel.split_dim(v._value, mesh, places) if g is None
             else None for v, g in zip(variables, gathered)]
    if any(g is None and s is None for g, s in zip(gathered, split)):
        return None
    # Whether the call is one per row, every split weight gathered whole:
    # what one device computes from these rows, which the first local call
    # must give (to float rounding with tensor-parallel pieces).
    whole = {id(v): v for v, g, s in zip(variables, gathered, split) if g or s}
    trial = local_trials.trial(model, original, args, kwargs, places, rows, whole)
    if trial is None:
        return None
    plan = _Plan(mesh, places, rows, variables, gathered, split)
    plan.trial, plan.masked = trial
    return plan


def _plan_for(model, original, args, kwargs):
    """The call's signature and its `_Plan` (None: not local)."""
    key = signature(args, kwargs)
    if key is None:
        return key, None
    plans = _PLANS.setdefault(model, {})
    plan = plans.get(key, NOT_LOCAL)
    if plan is NOT_LOCAL and len(plans) >= MAX_SIGNATURES:
        return key, None  # shapes that keep changing: a trial each costs more
    if plan is NOT_LOCAL or (plan is not None and not plan.still_holds()):
        plan = plans[key] = _local_plan(model, original, args, kwargs)
    return key, plan


def plan_of(model, key):
    """The `_Plan` made for the model's calls with signature `key`, if they
    run locally and the model's variables did not move since; else None."""
    plan = _PLANS.get(model, {}).get(key)
    return plan if plan is not None and plan.still_holds() else None


def has_local_plan(model):
    """Whether some call signature of the model runs locally."""
    return any(plan is not None for plan in _PLANS.get(model, {}).values())


def forget(model):
    """The model's variables moved: decide again at its next call."""
    _PLANS.pop(model, None)


def local_plans(model):
    """{input signature: True if its calls run locally} (for tests)."""
    return {key: plan is not None for key, plan in _PLANS.get(model, {}).items()}


def _to_local(x):
    if not isinstance(x, DTensor):
        return x
    local = x.to_local()
    mask = get_keras_mask(x)
    if mask is not None:
        set_keras_mask(local, _to_local(mask))
    return local


def run_model_call(model, original, args, kwargs):
    """`original(model, *args, **kwargs)` on the local pieces, or NOT_LOCAL."""
    if not ENABLED or in_stateless_scope() or not model.built:
        return NOT_LOCAL  # a first call builds the model, on DTensors
    key, plan = _plan_for(model, original, args, kwargs)
    if plan is None:
        return NOT_LOCAL
    grad = torch.is_grad_enabled()
    mapping, split, pieces = {}, {}, {}
    for variable, value, gathered, dims in zip(plan.variables, plan.values,
                                               plan.gathered, plan.split):
        if gathered and not grad:
            split[id(variable)] = value  # gathered where read
            continue
        if gathered:
            value = gathered_weights.whole(value, plan.mesh)
        grad_placements = (plan.grad_placements if dims is None else
                           tensor_parallel.grad_placements(value, plan.placements))
        local = mapping[id(variable)] = (
            value.to_local(grad_placements=grad_placements)
            if grad and value.requires_grad else value._local_tensor)
        if dims is not None and plan.mesh.size(dims[0]) > 1:
            pieces[id(local)] = (local, dims[1], plan.mesh.get_group(dims[0]))
    local_args, local_kwargs = tree.map_structure(_to_local, (args, kwargs))
    generator = torch.random.get_rng_state()
    scope = StatelessScope(collect_losses=True)
    scope.state_mapping = (
        gathered_weights.GatheredWhereRead(mapping, split, True) if split
        else dict(mapping))
    try:
        with scope, (tensor_parallel.on_pieces(pieces) if pieces
                     else contextlib.nullcontext()):
            outputs = original(model, *local_args, **local_kwargs)
    except Exception as error:  # noqa: BLE001 - raised again but for these
        # A product on a weight's piece that `tensor_parallel` cannot place,
        # or, in a plan's first call, an op a piece does not fit (a norm's
        # split scale against whole features): on DTensors. Every process
        # alike: the same layers on the same shapes.
        if not (isinstance(error, tensor_parallel.NotLocal)
                or (pieces and plan.trial is not None)):
            raise
        torch.random.set_rng_state(generator)
        _PLANS[model][key] = None
        return NOT_LOCAL
    if (scope.losses or len(scope.state_mapping) != len(mapping)
            or any(scope.state_mapping[k] is not t for k, t in mapping.items())
            or not torch.equal(generator, torch.random.get_rng_state())):
        # The data took the call somewhere the trial did not go.
        torch.random.set_rng_state(generator)
        _PLANS[model][key] = None
        return NOT_LOCAL
    if plan.trial is not None:
        # The first local call must give the trial's numbers (a layer that
        # reads the batch size as a number would not), on every process:
        # they must all take the same path. Exactly, but where pieces sum
        # in another order than DTensor's (tensor parallelism).
        found = local_trials.with_masks(outputs)
        same = len(found) == len(plan.trial) and all(
            isinstance(a, torch.Tensor) and not isinstance(a, DTensor)
            and a.shape == b.shape
            and local_trials.same(a.detach(), b, bool(pieces))
            for a, b in zip(found, plan.trial))
        if not local_trials.on_every_process(same, plan.mesh):
            _PLANS[model][key] = None
            return NOT_LOCAL
        plan.trial = None
    local_rows = next(x for x in tree.flatten(local_args)
                      if isinstance(x, torch.Tensor)).shape[0]

    def to_dtensor(x):
        mask = get_keras_mask(x)
        if mask is not None:  # (a sequence's padding) it goes with its rows
            set_keras_mask(x, None)
            x = to_dtensor(x)
            set_keras_mask(x, to_dtensor(mask))
            return x
        if not isinstance(x, torch.Tensor) or x.ndim == 0 or x.shape[0] != local_rows:
            raise RuntimeError(
                f"Model {model.name!r} returned {type(x).__name__} of shape "
                f"{tuple(getattr(x, 'shape', ()))} from this process's "
                f"{local_rows} rows: not one row per input row, unlike its "
                "trial call. Set KLM_TORCH_LOCAL_PIECES=0 and report it.")
        shape = (plan.rows, *x.shape[1:])
        return DTensor.from_local(x, plan.mesh, plan.placements, run_check=False,
                                  shape=shape, stride=contiguous_stride(shape))

    return tree.map_structure(
        lambda x: None if x is None else to_dtensor(x), outputs)
