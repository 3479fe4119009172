"""Keras' own training step on each process's rows, with plain tensors.

Where a data-parallel step qualifies (`local_step_conditions`), `fit` runs
Keras' own `train_step` (and `evaluate` its `test_step`) on this process's
pieces of the batch, under a `keras.StatelessScope` that maps every model,
optimizer and metric variable to a plain local tensor: the forward pass,
the loss, the backward pass and the optimizer's update are torch's own
ops, with no DTensor in between.
Then, as `DistributedDataParallel` does:

- **gradients**: each process's gradient of its rows' loss, scaled by its
  share of the rows (the loss is, in the optimizer's `scale_loss`), is
  summed over the processes that split the batch in one all-reduce per
  dtype (`reduce_gradients`, from `optimizer.apply`), in a flat buffer kept
  between steps, before the optimizer's update, which every process then
  makes alike;
- **metrics**: every metric variable starts the step at zero, so what the
  step leaves in it is this process's increment; the increments are summed
  over the same processes and added to the variables, in the gradients'
  all-reduce: the loss tracker's (updated before the optimizer's update)
  and the compiled metrics', which Keras updates after it from the step's
  targets and predictions. Those do not change with the update, so the
  compiled metrics are updated from them just before the sum
  (`compute_loss` kept them) and Keras' own `compute_metrics` after the
  update leaves them be: a training step takes one collective. (An
  evaluation step sums its metrics' increments in one all-reduce after.)

This gives one device's numbers only where the loss is a mean over rows
and the metrics are sums over rows: any other step runs on DTensors as
before (`training.wrap_make_function`).

`KLM_TORCH_LOCAL_PIECES=0` turns this off with the rest of the fast path.
"""

import functools
import weakref

import torch
from keras import tree
from keras.utils import unpack_x_y_sample_weight
from torch.distributed.tensor import Shard

from keras_layoutmap.backends.torch import bucketed_sums, local_pieces
from keras_layoutmap.backends.torch import local_step_conditions as conditions
from keras_layoutmap.keras_internals import StatelessScope

_STEPPING = [None]  # the _Step that runs now: gradients are reduced by it
# model -> {(training, plan key): local steps run} (for tests)
_STEPS = weakref.WeakKeyDictionary()
# model -> the flat buffers its steps sum in, kept between steps
# (`bucketed_sums.sum_over`)
_BUFFERS = weakref.WeakKeyDictionary()


class _Step:
    """How one local step sums over processes."""

    __slots__ = ("model", "training", "groups", "scale", "metric_variables",
                 "scope", "summed", "targets", "metrics_updated",
                 "loss_scaled", "buffers")

    def __init__(self, model, training, groups, scale, metric_variables):
        self.model = model
        self.training = training  # a train_step, else a test_step
        self.groups = groups  # process groups of the mesh dims that split rows
        self.scale = scale  # this process's rows / the global batch's rows
        self.metric_variables = metric_variables
        self.scope = None  # the step's StatelessScope, once it runs
        # {id(metric variable): (its increment, summed)} summed with the
        # gradients
        self.summed = {}
        # (y, y_pred, sample_weight) of the model's loss, for its compiled
        # metrics; whether they were updated from them before the sum
        self.targets = None
        self.metrics_updated = False
        # whether the loss was multiplied by `scale` (`scale_loss`), so
        # that the gradients come scaled
        self.loss_scaled = False
        self.buffers = _BUFFERS.setdefault(model, {})


class Piece:
    """One tensor of a batch as a local step takes it: this process's rows
    (`local`, a plain tensor) and the whole batch's shape, dtype and
    placements on `device_mesh` (what its DTensor would have)."""

    __slots__ = ("local", "shape", "dtype", "placements", "device_mesh")

    def __init__(self, local, shape, dtype, placements, device_mesh):
        self.local = local
        self.shape = shape
        self.dtype = dtype
        self.placements = placements
        self.device_mesh = device_mesh

    @classmethod
    def of(cls, x):
        """A DTensor's piece on this process."""
        return cls(x._local_tensor, tuple(x.shape), x.dtype, tuple(x.placements),
                   x.device_mesh)

    def entry(self):
        return (self.shape, self.dtype, self.placements, id(self.device_mesh))


def _flat_pieces(structure):
    """Whether `structure` is a tuple of Pieces and Nones, nothing nested."""
    return type(structure) is tuple and all(
        x is None or isinstance(x, Piece) for x in structure)


def _leaves(structure):
    """`tree.flatten(structure)`, faster where it is a Piece, None or a
    tuple of them."""
    if structure is None or isinstance(structure, Piece):
        return [structure]
    if _flat_pieces(structure):
        return list(structure)
    return tree.flatten(structure)


def _entry(x):
    return x.entry() if isinstance(x, Piece) else None


def prepare(model, batch, training=True):
    """A `_Step` when this batch's training step (`training`) or evaluation
    step may run locally, else None; `conditions.may_run` said it may at
    all.

    `batch`: Keras' (x, y, sample_weight) with every tensor a `Piece`. The
    model call for its inputs must have run locally before (in an earlier
    step, which built the compiled loss and metrics)."""
    x, y, sample_weight = unpack_x_y_sample_weight(batch)
    kwargs = {"training": training} if model._call_has_training_arg else {}
    key = local_pieces.signature((x,), kwargs, entry=_entry)
    if key is None:
        return None
    plan = local_pieces.plan_of(model, key)
    # (The step maps every variable to its local piece: the whole weight
    # only where all are replicated.)
    if (plan is None or plan.trial is not None or plan.masked
            or not plan.all_replicated):
        return None
    for leaf in _leaves((y, sample_weight)):
        if leaf is None:
            continue
        if not (isinstance(leaf, Piece) and leaf.device_mesh == plan.mesh
                and leaf.placements == plan.placements
                and len(leaf.shape) > 0 and leaf.shape[0] == plan.rows):
            return None
    if not conditions.smallest_piece(plan.rows, plan.placements, plan.mesh):
        return None
    metric_variables = conditions.metric_variables(model, plan, training)
    if metric_variables is None:
        return None
    groups = bucketed_sums.groups_of(plan.mesh, [
        dim for dim, p in enumerate(plan.placements) if isinstance(p, Shard)])
    local_rows = next(leaf for leaf in _leaves(x)
                      if isinstance(leaf, Piece)).local.shape[0]
    steps = _STEPS.setdefault(model, {})
    steps[training, key] = steps.get((training, key), 0) + 1
    return _Step(model, training, groups, local_rows / plan.rows,
                 metric_variables)


def _local(x):
    return x.local if isinstance(x, Piece) else x


def stepping():
    """True while a local step's optimizer update is to come."""
    return _STEPPING[0] is not None


def reduce_gradients(grads):
    """This process's gradients (of its rows' mean loss) as the global
    batch's: scaled by its share of the rows, summed over the processes.

    The metric increments are summed in the same all-reduce where their
    dtype is the gradients': the loss tracker's, and the compiled
    metrics', updated here (once a step) from the targets and predictions
    `compute_loss` kept."""
    step = _STEPPING[0]
    compiled = step.model._compile_metrics
    if (step.targets is not None and compiled is not None
            and not step.metrics_updated):
        # Keras would update them after the optimizer's update, from these
        # same values: now, so that their increments join the sum.
        compiled.update_state(*step.targets)
        step.metrics_updated = True
    values = step.scope.state_mapping
    scale = 1.0 if step.loss_scaled else step.scale
    result = list(grads)
    by_dtype = {}
    for i, g in enumerate(grads):
        if g is not None:
            by_dtype.setdefault(g.dtype, []).append(i)
    for dtype, indices in by_dtype.items():
        counted = [v for v in step.metric_variables
                   if values[id(v)].dtype == dtype and id(v) not in step.summed]
        increments = [values[id(v)] for v in counted]
        summed = bucketed_sums.sum_over(
            [grads[i].detach() for i in indices] + increments, step.groups,
            scale, len(indices), step.buffers, "gradients")
        for i, g in zip(indices, summed):
            result[i] = g
        for variable, increment, total in zip(
                counted, increments, summed[len(indices):]):
            step.summed[id(variable)] = (increment, total)
    return result


def _metric_sums(step):
    """{id(variable): this step's increment summed over the processes} for
    every metric variable: the ones summed with the gradients, where the
    step did not change them after, and the others in one all-reduce per
    dtype."""
    found, rest = {}, []
    for variable in step.metric_variables:
        current = step.scope.state_mapping[id(variable)]
        increment, total = step.summed.get(id(variable), (None, None))
        if increment is current:
            found[id(variable)] = total
        else:
            rest.append((variable, current))
    by_dtype = {}
    for variable, current in rest:
        by_dtype.setdefault(current.dtype, []).append((variable, current))
    for pairs in by_dtype.values():
        totals = bucketed_sums.sum_over([c for _, c in pairs], step.groups,
                                        buffers=step.buffers, purpose="metrics")
        found.update((id(v), t) for (v, _), t in zip(pairs, totals))
    return found


def run(model, step, batch):
    """Keras' `train_step` (or `test_step`) on this process's rows
    (`prepare` said it may); returns the logs of the global batch."""
    metrics = step.metric_variables
    counted = {id(v) for v in metrics}
    updated = model.optimizer.variables if step.training else ()
    trainable = ({id(v) for v in model.trainable_variables} if step.training
                 else ())
    mapping, state = {}, []
    for variable in (*model.variables, *updated):
        key = id(variable)
        if key in counted:
            continue
        local = variable._value._local_tensor
        if key in trainable:
            local = local.detach().requires_grad_(True)
        mapping[key] = local
        state.append((key, variable, local))
    for variable in metrics:
        mapping[id(variable)] = torch.zeros_like(variable._value._local_tensor)
    scope = step.scope = StatelessScope()
    scope.state_mapping = mapping
    if _flat_pieces(batch):
        local_batch = tuple(_local(x) for x in batch)  # as tree.map_structure
    else:
        local_batch = tree.map_structure(_local, batch)
    _STEPPING[0] = step
    try:
        with scope:
            if step.training:
                model.train_step(local_batch)
            else:
                model.test_step(local_batch)
    finally:
        _STEPPING[0] = None
    with torch.no_grad():
        totals = _metric_sums(step)
        for variable in metrics:
            variable._value._local_tensor.add_(totals[id(variable)])
        after = scope.state_mapping
        for key, variable, local in state:
            new = after[key]
            if new is not local:
                variable._value._local_tensor.copy_(new)
    # The logs, read from the metrics' (replicated) local tensors.
    reading = StatelessScope()
    reading.state_mapping = {id(v): v._value._local_tensor for v in metrics}
    with reading:
        return model.get_metrics_result()


def wrap_compute_loss(original):
    """`compute_loss`: in a local training step, the model's targets,
    predictions and sample weights are kept for its compiled metrics."""

    @functools.wraps(original)
    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None,
                     training=True):
        step = _STEPPING[0]
        if (step is not None and step.training and self is step.model
                and step.targets is None):
            step.targets = (y, y_pred, sample_weight)
        return original(self, x, y, y_pred, sample_weight, training=training)

    return compute_loss


def wrap_scale_loss(original):
    """The optimizer's `scale_loss`: in a local training step, the loss is
    also multiplied by this process's share of the rows, so that its
    gradients come scaled as the global batch's (exactly where the share
    is a power of two, as with 2 or 4 processes on an even batch) and
    their sum need not scale them again. An optimizer with a `scale_loss`
    of its own that does not call this one (`LossScaleOptimizer`) leaves
    the scaling to `reduce_gradients`."""

    @functools.wraps(original)
    def scale_loss(self, loss):
        loss = original(self, loss)
        step = _STEPPING[0]
        if (step is not None and step.training and not step.loss_scaled
                and self is step.model.optimizer):
            step.loss_scaled = True
            if step.scale != 1.0:
                loss = loss * step.scale
        return loss

    return scale_loss


def wrap_compute_metrics(original):
    """`compute_metrics`: in a local training step whose compiled metrics
    were updated before the gradients' sum, nothing more (the logs are read
    once the sums are in)."""

    @functools.wraps(original)
    def compute_metrics(self, x, y, y_pred, sample_weight=None):
        step = _STEPPING[0]
        if step is not None and step.metrics_updated and self is step.model:
            return {}
        return original(self, x, y, y_pred, sample_weight=sample_weight)

    return compute_metrics


def wrap_get_metrics_result(original):
    """Inside a local step, Keras' `compute_metrics` would read this
    process's increments: nothing is read there (`run` reads the logs
    once the increments are summed)."""

    @functools.wraps(original)
    def get_metrics_result(self):
        if _STEPPING[0] is not None:
            return {}
        return original(self)

    return get_metrics_result


def local_steps(model, training=True):
    """{input signature: training (or evaluation) steps run locally} (for
    tests)."""
    return {key: count for (trains, key), count in _STEPS.get(model, {}).items()
            if trains == training}
