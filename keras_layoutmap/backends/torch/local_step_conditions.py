"""When a data-parallel torch step may run on plain tensors (`local_step`).

Keras' own step on each process's rows gives one device's numbers (to
float rounding: sums taken in another order) only where the loss is a mean
over rows and the metrics are sums over rows. So a step is local only when
all of this holds, else it runs on DTensors as before
(`training.wrap_make_function`):

- the model's `train_step` (`test_step`), `compute_loss`, `compute_metrics` and
  `get_metrics_result` are Keras' own, and it is not `jit_compile`d;
- the model call for the batch's inputs runs locally (`local_pieces`: all
  weights replicated, no batch statistics, no random draws, no added loss)
  and returns no mask, decided at an earlier call with these inputs, and
  the optimizer, the compiled loss and the compiled metrics are built (so
  the first step of each batch shape runs on DTensors);
- every compiled loss is one of Keras' own with a mean over the batch
  (`sum_over_batch_size`); the model adds no loss (`model.losses` empty);
- every compiled metric is one of Keras' own classes (a function metric:
  one of Keras' own functions), each a sum over rows;
- the optimizer's `apply` is Keras' own (which sums the gradients first),
  and the optimizer's and the metrics' variables are replicated on the
  mesh;
- x, y and sample weights are split by rows alike, and every process has
  at least one row.

`KLM_TORCH_LOCAL_PIECES=0` turns this off with the rest of the fast path.
"""

import math
import weakref

from torch.distributed.tensor import Shard

from keras_layoutmap.backends.torch import local_pieces
from keras_layoutmap.backends.torch.gathered_weights import is_replicated
from keras_layoutmap.backends.torch.keras_internals import (
    OUTER_OPTIMIZERS,
    TorchOptimizer,
    Trainer,
)

_KERAS_METHODS = ("compute_loss", "_compute_loss", "compute_metrics",
                  "get_metrics_result")
_MEAN_REDUCTIONS = ("sum_over_batch_size", "mean")
# model -> {training: (token, metric variables)}
_CHECKED = weakref.WeakKeyDictionary()


def _keras_own(obj):
    return type(obj).__module__.startswith("keras.src.")


def _keras_function(fn):
    return getattr(fn, "__module__", "").startswith("keras.src.")


def _mean_loss(loss):
    """A compiled loss that is one of Keras' own means over the batch."""
    if not _keras_own(loss) or getattr(loss, "reduction", None) not in _MEAN_REDUCTIONS:
        return False
    fn = getattr(loss, "fn", None)
    return fn is None or _keras_function(fn)


def _losses_are_row_means(model):
    compiled = getattr(model, "_compile_loss", None)
    if compiled is None or not getattr(compiled, "built", False):
        return False
    flat = getattr(compiled, "_flat_losses", None)
    if not flat:
        return False
    return all(_mean_loss(entry[1]) for entry in flat)


def _metrics_are_row_sums(model):
    compiled = getattr(model, "_compile_metrics", None)
    if compiled is None:
        return True
    if not getattr(compiled, "built", False):
        return False
    for metric in compiled.metrics:
        if not _keras_own(metric):
            return False
        fn = getattr(metric, "_fn", None)
        if fn is not None and not _keras_function(fn):
            return False
    return True


def _is_replicated_on(value, mesh):
    return is_replicated(value) and value.device_mesh == mesh


def smallest_piece(rows, placements, mesh):
    """The fewest rows any process holds of `rows` split by `placements`
    (None: split over more than one mesh dim)."""
    sizes = [mesh.size(dim) for dim, p in enumerate(placements)
             if isinstance(p, Shard)]
    if not sizes:
        return rows
    if len(sizes) > 1:
        return None
    # torch's Shard: pieces of ceil(rows / n) rows, the last ones shorter.
    n = sizes[0]
    chunk = math.ceil(rows / n)
    return max(0, rows - (n - 1) * chunk)


def metric_variables(model, plan, training):
    """The metric variables when what a step does besides the model call
    allows a local step (the losses, the metrics, where the variables
    live), else None; kept per model until the plan, the compiled loss and
    metrics or the optimizer change."""
    updated = model.optimizer.variables if training else ()
    token = (plan, id(model._compile_loss), id(model._compile_metrics),
             id(model.optimizer), tuple(id(v._value) for v in updated))
    found = _CHECKED.setdefault(model, {})
    if training in found and found[training][0] == token:
        return found[training][1]
    metric_variables = None
    if ((model.trainable_variables or not training) and not model.losses
            and _losses_are_row_means(model) and _metrics_are_row_sums(model)):
        metric_variables = [v for m in model.metrics for v in m.variables]
        if not all(_is_replicated_on(v._value, plan.mesh)
                   for v in (*updated, *metric_variables)):
            metric_variables = None
    found[training] = (token, metric_variables)
    return metric_variables


def _sums_gradients_first(optimizer):
    """The optimizer's `apply` is Keras' own, which takes the gradients'
    sum over the processes before anything else (`gradients.wrap_apply`,
    `wrap_outer_apply`):
    an `apply` of a subclass's own could look at one process's gradients
    first (clip them, test them), which is not one device's step."""
    owner = next(cls for cls in type(optimizer).__mro__ if "apply" in vars(cls))
    return owner is TorchOptimizer or owner in OUTER_OPTIMIZERS


def may_run(model, training=True):
    """Whether the model's training (or evaluation) steps may run locally
    at all: the checks that need no batch."""
    if not local_pieces.ENABLED or getattr(model, "jit_compile", False) is True:
        return False
    method = "train_step" if training else "test_step"
    if any(getattr(type(model), name, None) is not getattr(Trainer, name, None)
           for name in (method, *_KERAS_METHODS)):
        return False
    optimizer = getattr(model, "optimizer", None)
    if training and (optimizer is None or not optimizer.built
                     or not _sums_gradients_first(optimizer)):
        return False
    return local_pieces.has_local_plan(model)
