"""keras-hub's `generate()` on torch: the weights split over the prompts'
mesh dims are gathered once per call, not at every token.

keras-hub decodes on torch in Python, one token at a time, each token a
call of the backbone's layers on DTensors. A weight split over a mesh dim
that also splits the prompts' rows (`klm.fsdp`'s, and the data axis of a
2-D plan) is gathered by DTensor wherever it is read: at every token, one
all-gather per weight. On JAX, XLA takes these gathers out of the decoding
loop; here `generate()`'s function gathers them once as it starts (as
torch FSDP's `reshard_after_forward=False` does for a generation), holds
each weight gathered over those dims (still split over the others: a 2-D
plan's weight keeps its tensor-parallel piece) for the call, and gives the
variables their pieces back when it ends, returned or raised.

The gathered weights cost memory for the call: `extra_bytes` of them on
each device. They are gathered only where that fits in half of every
process's free device memory (an all-reduce decides, so that all take the
same path); else each weight is read as before, gathered where read.

`KLM_TORCH_DECODE_GATHERED=0` turns this off.

keras-hub is not imported here: its `CausalLM.make_generate_function` is
wrapped once keras-hub is loaded, when a variable is placed (or at
install, where keras-hub was imported first).
"""

import contextlib
import functools
import os

import torch
from keras import tree
from torch.distributed.tensor import DTensor, Replicate, Shard

from keras_layoutmap.backends.causal_lm import wrap_when_loaded
from keras_layoutmap.backends.torch.local_trials import on_every_process

ENABLED = os.environ.get("KLM_TORCH_DECODE_GATHERED", "1") != "0"
_WRAPPED = "_klm_gathered_once"


def prompt_dims(inputs):
    """(DeviceMesh, the mesh dims that split the rows) of the first DTensor
    among `inputs`, or (None, ()) where none is one."""
    for x in tree.flatten(inputs):
        if isinstance(x, DTensor):
            return x.device_mesh, tuple(
                dim for dim, p in enumerate(x.placements)
                if isinstance(p, Shard) and p.dim == 0)
    return None, ()


def gathered_placements(value, mesh, dims):
    """`value`'s placements with `dims` made whole, or None where it is not
    a DTensor on `mesh` split over one of them."""
    if not isinstance(value, DTensor) or value.device_mesh != mesh:
        return None
    places = list(value.placements)
    if not any(isinstance(places[dim], Shard) for dim in dims):
        return None
    for dim in dims:
        places[dim] = Replicate()
    return tuple(places)


def _piece_bytes(value, placements):
    """The bytes of a piece of `value` laid out by `placements`, as an even
    split: the same figure on every process (a last piece may be smaller),
    so that every process takes the same path in `gathered_once`."""
    count = value.numel()
    for dim, p in enumerate(placements):
        if isinstance(p, Shard):
            count //= value.device_mesh.size(dim)
    return count * value.element_size()


def extra_bytes(variables, mesh, dims):
    """The bytes each device holds beyond its pieces when `variables` are
    held gathered over `dims`."""
    total = 0
    for variable in variables:
        value = getattr(variable, "_value", None)
        places = gathered_placements(value, mesh, dims)
        if places is not None:
            total += (_piece_bytes(value, places)
                      - _piece_bytes(value, value.placements))
    return total


def free_bytes(device_type):
    """This process's free device memory (None where unknown)."""
    try:
        if device_type == "cuda":
            return torch.cuda.mem_get_info()[0]
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, OSError, RuntimeError, ValueError):
        return None


@contextlib.contextmanager
def gathered_once(variables, inputs):
    """`variables` held gathered over the mesh dims that split `inputs`'
    rows, where every process has the memory for it; as they were after."""
    mesh, dims = prompt_dims(inputs)
    if not ENABLED or mesh is None or not dims:
        yield
        return
    extra = extra_bytes(variables, mesh, dims)
    if extra == 0:
        yield
        return
    free = free_bytes(mesh.device_type)
    if not on_every_process(free is None or 2 * extra <= free, mesh):
        yield
        return
    held = []
    try:
        with torch.no_grad():
            for variable in variables:  # the same order on every process
                value = getattr(variable, "_value", None)
                places = gathered_placements(value, mesh, dims)
                if places is not None:
                    gathered = value.redistribute(mesh, places)
                    held.append((variable, value))
                    variable._value = gathered
        yield
    finally:
        for variable, value in held:
            variable._value = value


def wrap_make_generate_function(original):
    """keras-hub's generate function, each call with the model's weights
    gathered once over the prompts' mesh dims (`gathered_once`)."""

    @functools.wraps(original)
    def make_generate_function(self):
        function = original(self)
        if getattr(function, _WRAPPED, False):
            return function

        @functools.wraps(function)
        def generate_function(inputs, *args, **kwargs):
            with gathered_once(self.weights, inputs):
                return function(inputs, *args, **kwargs)

        setattr(generate_function, _WRAPPED, True)
        self.generate_function = generate_function
        return generate_function

    return make_generate_function


def install_if_loaded():
    """Wrap keras-hub's `CausalLM.make_generate_function` once keras-hub is
    loaded (called where variables are placed: cheap until then)."""
    wrap_when_loaded(wrap_make_generate_function)
