"""Whether a model call may run on each process's own pieces
(`local_pieces`): trial calls on DTensors, with nothing kept, and the check
of a plan's first local call against them, on every process.

A trial notes every collective its ops take (`Collectives`, which tests
and benchmarks count with too), every random draw, assignment and added
loss, and refuses any redistribution (DTensor's strict
`ExplicitRedistributionContext`): a call that passes looks at no other
rows than its own.
"""

import contextlib

import torch
from keras import tree
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from keras_layoutmap.backends.torch import gathered_weights
from keras_layoutmap.keras_internals import StatelessScope, get_keras_mask


class Collectives(TorchDispatchMode):
    """Notes every collective the ops under it take (DTensor's own and
    explicit ones)."""

    def __init__(self):
        super().__init__()
        self.seen = []
        self.paused = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if (func.namespace in ("c10d", "_c10d_functional", "c10d_functional")
                and not self.paused):
            self.seen.append(func)
        return func(*args, **(kwargs or {}))


def trial(model, original, args, kwargs, places, rows, gathered):
    """Call the model on DTensors with nothing kept (no gradients, no
    assignments, the random generator restored), each weight of
    `gathered` ({id: variable}) gathered whole where it is read (the
    gathers set aside from the checks). When nothing in the call looked
    across rows or changed state: this process's pieces of its outputs
    (and their masks), and whether there were masks; else None."""
    try:
        from torch.distributed.tensor._utils import ExplicitRedistributionContext
    except ImportError:  # another torch: no check, so no fast path
        return None
    generator = torch.random.get_rng_state()
    scope = StatelessScope(collect_losses=True)
    collectives = Collectives()

    @contextlib.contextmanager
    def aside():  # a gather is the plan's, not the call's
        collectives.paused = True
        try:
            with ExplicitRedistributionContext(enable=False):
                yield
        finally:
            collectives.paused = False

    scope.state_mapping = gathered_weights.GatheredWhereRead(
        {}, {key: v._value for key, v in gathered.items()}, False, aside)
    try:
        with (torch.no_grad(), scope,
              ExplicitRedistributionContext(strict=True, mode="raise"),
              collectives):
            outputs = original(model, *args, **kwargs)
    except Exception:  # noqa: BLE001 - the DTensor call will say what it is
        return None
    finally:
        drew = not torch.equal(generator, torch.random.get_rng_state())
        torch.random.set_rng_state(generator)
    assigned = len(scope.state_mapping) > 0
    if drew or scope.losses or assigned or collectives.seen:
        return None
    leaves = with_masks(outputs)
    if leaves and all(isinstance(x, DTensor) and tuple(x.placements) == places
                      and x.ndim > 0 and x.shape[0] == rows for x in leaves):
        masked = len(leaves) != len([x for x in tree.flatten(outputs)
                                     if x is not None])
        return [x.to_local() for x in leaves], masked
    return None


def same(a, b, rounding):
    """`a` equals `b`, to float rounding (a few units of the dtype's last
    place, against the largest number) where `rounding`: a sum missing
    from a piece is off by a whole term."""
    if not rounding or not a.dtype.is_floating_point or b.numel() == 0:
        return torch.equal(a, b)
    scale = b.abs().max().item()
    tolerance = 16 * torch.finfo(b.dtype).eps * max(scale, 1e-30)
    return a.dtype == b.dtype and bool((a - b).abs().max() <= tolerance)


def on_every_process(ok, device_mesh):
    """True where `ok` holds on every process of the mesh."""
    flag = torch.tensor([1 if ok else 0], device=device_mesh.device_type)
    for dim in range(device_mesh.ndim):
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN,
                                     group=device_mesh.get_group(dim))
    return bool(flag.item())


def with_masks(outputs):
    """The tensors of `outputs`, each followed by its Keras mask if any."""
    found = []
    for x in tree.flatten(outputs):
        if x is not None:
            mask = get_keras_mask(x)
            found += [x] if mask is None else [x, mask]
    return found
