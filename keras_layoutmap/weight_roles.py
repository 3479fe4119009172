"""Each weight's role in a model, read from its layers and shapes: the
walk `klm.auto_layout_map` plans from.

A `Dense` or `EinsumDense` kernel that reads the residual stream is
column-parallel and the one that writes back to it row-parallel
(`projection_roles`: where the shapes cannot tell, the tensors the
projections read decide, `projection_inputs`). An
`EinsumDense` kernel with several output dimensions (q, k, v) is split by
heads, one with several contracted dimensions (the attention output) too;
an `Embedding` over its vocabulary (an untied output projection beside it
follows); the weights of a layer holding several tables with a common first
dimension are experts; biases follow their kernel; norms and other rank-1
weights are replicated. `rules.auto` turns these roles into layouts.
"""

import collections
import math
import re

import keras
import numpy as np

from keras_layoutmap import paths
from keras_layoutmap.projection_roles import (
    assign_roles,
    einsum_dims,
    projections_of,
)
from keras_layoutmap.rules import auto

_CONV = tuple(getattr(keras.layers, n) for n in ("Conv1D", "Conv2D", "Conv3D"))
_CONV_ANY = tuple(
    getattr(keras.layers, n) for n in (
        "Conv1D", "Conv2D", "Conv3D", "Conv1DTranspose", "Conv2DTranspose",
        "Conv3DTranspose", "DepthwiseConv1D", "DepthwiseConv2D",
        "SeparableConv1D", "SeparableConv2D")
    if hasattr(keras.layers, n))
ROUTER = "router"  # a mixture of experts' router: kept whole
_RNN_CELLS = tuple(getattr(keras.layers, n) for n in (
    "SimpleRNNCell", "LSTMCell", "GRUCell") if hasattr(keras.layers, n))


def _owners_and_parents(model):
    """`{id(variable): (object_path, owner, parent_of_owner)}`: the layer
    that holds each weight and the layer that holds that one (Keras' own
    tracking, which sees every sublayer), named by its object path (else
    its `variable.path`)."""
    object_paths = paths.object_paths(model)
    found = {}
    seen = set()
    stack = [(model, None)]
    while stack:
        layer, parent = stack.pop()
        if id(layer) in seen:
            continue
        seen.add(id(layer))
        for variable in (list(layer._trainable_variables)
                         + list(layer._non_trainable_variables)):
            found.setdefault(id(variable), (
                object_paths.get(id(variable), variable.path), layer, parent))
        children = layer._flatten_layers(include_self=False, recursive=False)
        stack.extend((child, layer) for child in reversed(list(children)))
    return found


def describe(model, backend="jax"):
    """The planner's view of every weight of `model`: a list of
    `rules.auto.Weight`, kernels before the biases that follow them.

    Example:

    >>> import keras
    >>> from keras_layoutmap.weight_roles import describe
    >>> model = keras.Sequential([keras.Input((8,)),
    ...     keras.layers.Dense(16, name="up"), keras.layers.Dense(8, name="down")])
    >>> [(w.path, w.role) for w in describe(model)]  # doctest: +NORMALIZE_WHITESPACE
    [('up.kernel', 'column'), ('up.bias', 'follows'),
     ('down.kernel', 'row'), ('down.bias', 'follows')]
    """
    owners = _owners_and_parents(model)
    rows = []
    for variable in model.weights:
        object_path, owner, parent = owners.get(
            id(variable), (variable.path, None, None))
        shape = tuple(int(d) for d in variable.shape)
        rows.append((variable, object_path, owner, parent, shape))
    projections = projections_of(rows)
    width = _stream_width(rows)
    assign_roles(projections, width, model)
    experts = _expert_owners(rows)
    _mark_routers(projections, rows, experts)
    weights = []
    for variable, object_path, owner, _, shape in rows:
        weights.append(_weight(variable, object_path, owner, shape,
                               projections, experts, width, backend))
    return weights


def _mark_routers(projections, rows, experts):
    """A projection beside a bank of experts (the same parent layer) that
    writes one value per expert, and pairs with nothing, is the router:
    small, and its logits choose experts, so it is kept whole (DTensor's
    TopK cannot choose over a split experts dimension)."""
    banks = {}  # id(parent of an expert bank) -> its number of experts
    for _, _, owner, parent, _ in rows:
        if owner is not None and id(owner) in experts and parent is not None:
            banks[id(parent)] = experts[id(owner)]
    for proj in projections.values():
        if (proj.role == auto.COLUMN and not proj.partners
                and banks.get(id(proj.parent)) == proj.out_size):
            proj.role = ROUTER


def _itemsize(dtype):
    try:
        return np.dtype(str(dtype)).itemsize
    except TypeError:  # bfloat16, float8: numpy does not know them
        found = re.search(r"\d+", str(dtype))
        return max(1, int(found.group()) // 8) if found else 4


def _stream_width(rows):
    """The residual stream's width: the feature size of the largest
    embedding table (None for a model without one)."""
    tables = [shape for _, _, owner, _, shape in rows
              if isinstance(owner, keras.layers.Embedding) and len(shape) == 2]
    if not tables:
        return None
    return max(tables, key=math.prod)[1]


def _expert_owners(rows):
    """Layers (not Dense / EinsumDense) holding two or more weights of rank
    3 or more with the same first dimension: their experts. `{id(layer):
    number_of_experts}`."""
    firsts = collections.defaultdict(list)
    for _, _, owner, _, shape in rows:
        if owner is None or len(shape) < 3 or isinstance(
                owner, (keras.layers.Dense, keras.layers.EinsumDense) + _CONV_ANY):
            continue
        firsts[id(owner)].append(shape[0])
    return {key: dims[0] for key, dims in firsts.items()
            if len(dims) >= 2 and len(set(dims)) == 1 and dims[0] > 1}


def _name(proj):
    return proj.owner.name


def _weight(variable, path, owner, shape, projections, experts, width,
            backend):
    """The `rules.auto.Weight` of one variable."""
    itemsize = _itemsize(variable.dtype)
    rank = len(shape)

    def make(role, model_dims=(), detail="", **kwargs):
        return auto.Weight(path, shape, itemsize, role, tuple(model_dims),
                           detail, **kwargs)

    if rank == 0:
        return make(auto.WHOLE, detail="a scalar")
    proj = projections.get(path)
    if proj is not None and proj.role == ROUTER:
        return make(auto.WHOLE, detail=f"{_name(proj)}, the experts' router")
    if proj is not None:
        return _projection_weight(proj, make)
    kernel = _kernel_of(owner, variable, path, projections)
    if kernel is not None:
        return kernel(make)
    tf = backend == "tensorflow"
    if owner is not None and isinstance(owner, _CONV_ANY):
        if tf:
            return make(auto.WHOLE, data_ok=False, detail=(
                "TensorFlow's DTensor runs convolutions only with whole "
                "kernels"))
        if isinstance(owner, _CONV) and variable.name == "kernel":
            return make(auto.CONV, [(rank - 1, "output channels")])
        return make(auto.WHOLE, data_ok=rank >= 2,
                    detail="a convolution weight kept whole")
    if tf and owner is not None and isinstance(owner, _RNN_CELLS):
        return make(auto.WHOLE, data_ok=False, detail=(
            "TensorFlow's DTensor cannot split a recurrent cell's gates"))
    if rank == 1:
        return make(auto.WHOLE, detail=f"{shape[0]} values (a norm, bias or "
                    "scale)")
    if owner is not None and isinstance(owner, keras.layers.Embedding):
        vocab = int(owner.input_dim)
        if variable.name == "embeddings":
            return make(auto.EMBEDDING, [(0, "tokens"), (1, "features")])
        vocab_dims = [d for d in range(rank) if shape[d] == vocab]
        if vocab_dims:
            other = [d for d in range(rank) if d not in vocab_dims]
            return make(auto.REVERSE, [(vocab_dims[0], "tokens")]
                        + [(d, "features") for d in other],
                        detail=f"beside {owner.name}'s embeddings")
    if owner is not None and id(owner) in experts and rank >= 3:
        # TensorFlow: DTensor's OneHot cannot make the routing's experts
        # dimension split, so each expert is split inside instead.
        dims = [] if tf else [(0, "experts")]
        if width is not None and shape[1] == width:
            dims.append((rank - 1, "outputs"))
        elif width is not None and shape[-1] == width:
            dims.append((1, "inputs"))
        return make(auto.EXPERTS, dims, detail=f"layer {owner.name!r}" + (
            " (TensorFlow's DTensor cannot route tokens to split experts)"
            if tf else ""))
    order = sorted(range(rank), key=lambda d: (-shape[d], d))
    if tf:
        # A table read by slicing its rows (positions): DTensor cannot
        # slice, nor take the gradient of a slice, along a split dimension.
        return make(auto.OTHER, [(d, f"dimension {d}") for d in order if d],
                    data_ok=False, detail=(
                        f"{owner.name if owner is not None else path}; "
                        "TensorFlow: its first dimension whole"))
    return make(auto.OTHER, [(d, f"dimension {d}") for d in order],
                detail=f"{owner.name if owner is not None else path}")


def _projection_weight(proj, make):
    names = ", ".join(_name(p) for p in proj.partners)
    if proj.role == auto.COLUMN:
        detail = f"feeds {names}" if names else f"{_name(proj)}"
        dims = [(proj.outs[0], "outputs"), (proj.ins[0], "inputs")]
    elif proj.role == auto.ROW:
        detail = f"reads {names}" if names else f"{_name(proj)}"
        dims = [(proj.ins[0], "inputs"), (proj.outs[0], "outputs")]
    elif proj.role == auto.HEADS:
        label = "heads"
        siblings = [p for p in proj.group if p.role == auto.HEADS
                    and p.in_size == proj.in_size]
        most = max(p.shape[p.outs[0]] for p in siblings)
        if proj.shape[proj.outs[0]] < most:
            label = "key/value heads"
        detail = f"{_name(proj)}, feeds {names}" if names else _name(proj)
        # Heads the axis does not divide: split the input features (a
        # partial sum, as row-parallel), which every backend runs
        # (TensorFlow's DTensor refuses a split head_dim).
        dims = [(proj.outs[0], label), (proj.ins[0], "inputs")]
        return make(proj.role, dims, detail, output=_heads_output(proj))
    else:  # HEADS_OUT
        detail = f"reads {names}" if names else _name(proj)
        dims = [(proj.ins[0], "heads"), (proj.outs[0], "outputs")]
    return make(proj.role, dims, detail)


def _heads_output(proj):
    """The `rules.auto.LayerOutput` of a heads projection (an
    `EinsumDense`): its batch is the first letter of both its input and
    its output; None where the equation does not say (`...`)."""
    owner = proj.owner
    equation = getattr(owner, "equation", "")
    path = getattr(owner, "path", None)
    if "..." in equation or "->" not in equation or not path:
        return None
    left, out = equation.split("->")
    inputs, kernel = left.split(",")
    if not inputs or inputs[0] != out[0] or inputs[0] in kernel:
        return None
    dims = tuple((i, out.index(c)) for i, c in enumerate(kernel) if c in out)
    return auto.LayerOutput(f"{path}/output", len(out), 0, dims)


def _kernel_of(owner, variable, path, projections):
    """For the bias of a Dense / EinsumDense / Conv layer: a maker of the
    `Weight` that follows its kernel; None for any other weight."""
    if owner is None or variable.name != "bias":
        return None
    kernel_path = path[: -len("bias")] + "kernel"
    proj = projections.get(kernel_path)
    shape = tuple(int(d) for d in variable.shape)
    if proj is not None:
        if isinstance(owner, keras.layers.EinsumDense):
            letters = einsum_dims(owner.equation, len(proj.shape))[2]
            bias_letters = _bias_letters(owner, len(shape))
            pairs = tuple((letters.index(c), i) for i, c in enumerate(bias_letters)
                          if c in letters)
        else:
            pairs = ((1, 0),)
    elif isinstance(owner, _CONV):
        pairs = ((len(owner.kernel.shape) - 1, 0),)
    else:
        return None

    def make(make_weight):
        return make_weight(auto.FOLLOWS, kernel=kernel_path, kernel_dims=pairs)

    return make


def _bias_letters(owner, rank):
    """The output letters an EinsumDense bias of `rank` spans (its last)."""
    output = owner.equation.split("->")[1].replace("...", "")
    return output[-rank:] if rank else ""
