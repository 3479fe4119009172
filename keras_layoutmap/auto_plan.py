"""`klm.auto_layout_map`: a tensor-parallel plan derived from a model.

The model's layers and the weights' shapes say what each weight is, not
its name: a `Dense` or `EinsumDense` kernel that reads the residual stream
is column-parallel and the one that writes back to it row-parallel (one
reduction per block); an `EinsumDense` kernel with several output
dimensions (q, k, v) is split by heads, one with several contracted
dimensions (the attention output) too; an `Embedding` over its vocabulary
(an untied output projection beside it follows); the weights of a layer
holding several tables with a common first dimension are experts; biases
follow their kernel; norms and other rank-1 weights are replicated. The
policy that turns these roles into layouts (divisibility, fallbacks, the
data axis when memory needs it) is `rules.auto`.

See docs/rules.md, "Automatic plans".
"""

import collections
import contextlib
import math
import re

import keras
import numpy as np

from keras_layoutmap import paths
from keras_layoutmap.keras_internals import BaseOptimizer, global_state
from keras_layoutmap.layout_map import LayoutMap
from keras_layoutmap.mesh import as_mesh
from keras_layoutmap.rules import auto


def auto_layout_map(model_or_builder, mesh, *, model_axis="model",
                    data_axis="batch", device_memory=None):
    """A `klm.LayoutMap` derived from a model's layers and weight shapes.

    Dense and EinsumDense kernels become column-parallel then row-parallel
    pairs (one reduction per block), attention is split by heads (key/value
    heads the model axis does not divide are split on their input
    features instead), embeddings over the vocabulary, mixture of
    experts weights over experts, biases follow their kernel and norms are
    replicated. Every layout divides its weight's shape. Each rule is the
    escaped object path of one weight, so the plan can be printed, edited
    and saved (`to_json()`); `plan.explain(model)` says why each weight got
    its layout.

    Without `device_memory`, every weight of rank 2 or more is also split
    over `data_axis` where its shape allows (the least memory per device, as
    keras-hub's `get_layout_map` recipes do). With it, weights are split
    over `data_axis` (FSDP) only as far as needed for the weights to fit,
    largest first.

    Args:
        model_or_builder (keras.Model | callable): a built `keras.Model`,
            or a function of no arguments that returns one: it is then
            built with shapes only (no weight gets memory; it may compile
            the model), and Keras' automatic layer names are left as they
            were, so the model built next under the plan gets the paths the
            plan names.
        mesh (klm.Mesh): a `klm.Mesh` (or `keras.distribution.DeviceMesh`)
            with the axes `model_axis` and `data_axis`.
        model_axis (str): the mesh axis tensor parallelism splits over.
        data_axis (str | None): the mesh axis batches are split over (None:
            weights are never split over it).
        device_memory (int | str | None): bytes for weights per device (an
            int, or text such as `"16GiB"`), or None.

    Returns:
        plan (klm.LayoutMap): a map on `mesh`, one exact rule per weight.

    Raises:
        ValueError: a mesh without the named axes, a model with no weights,
            or a `device_memory` that no plan meets (the message gives the
            bytes per device of the smallest plan).
        RuntimeError: the builder failed (the message says how).
        TypeError: `model_or_builder` is neither a model nor a builder.

    Example:

    >>> import keras, keras_layoutmap as klm
    >>> mesh = klm.Mesh.for_planning([("batch", 2), ("model", 2)])
    >>> def build():
    ...     inputs = keras.Input((8,))
    ...     x = keras.layers.Dense(16, name="up")(inputs)
    ...     return keras.Model(inputs, keras.layers.Dense(8, name="down")(x))
    >>> plan = klm.auto_layout_map(build, mesh)
    >>> plan[r"up\\.kernel"].sharding_specs
    ['batch', 'model']
    >>> plan[r"down\\.kernel"].sharding_specs
    ['model', 'batch']
    """
    mesh = _check_mesh(mesh, model_axis, data_axis)
    budget = _budget(device_memory)
    model = _model(model_or_builder)
    weights = describe(model, backend=keras.backend.backend())
    if not weights:
        raise ValueError(
            f"auto_layout_map: the model {model.name!r} has no weights to "
            "plan. Build it first (call it on an input, or give "
            "`keras.Input` shapes), or pass a function that builds it."
        )
    sizes = dict(zip(mesh.axis_names, (int(s) for s in mesh.shape)))
    placements = auto.plan(weights, sizes, model_axis=model_axis,
                           data_axis=data_axis, device_memory=budget)
    layout_map = LayoutMap(mesh)
    for p in placements:
        key = re.escape(p.path)
        layout_map[key] = p.specs
        layout_map.set_reason(key, p.reason)
    return layout_map


def _check_mesh(mesh, model_axis, data_axis):
    try:
        mesh = as_mesh(mesh)
    except (TypeError, ValueError) as e:
        raise TypeError(f"auto_layout_map: `mesh` must be a klm.Mesh: {e}") from None
    if mesh is None:
        raise TypeError("auto_layout_map: `mesh` must be a klm.Mesh. Received: None")
    names = list(mesh.axis_names)
    for what, axis in (("model_axis", model_axis), ("data_axis", data_axis)):
        if axis is None and what == "data_axis":
            continue
        if axis not in names:
            raise ValueError(
                f"auto_layout_map: {what}={axis!r} is not an axis of the mesh "
                f"{mesh!r} (axes {names}). Name one of its axes, e.g. "
                f"{what}={names[-1 if what == 'model_axis' else 0]!r}."
            )
    if model_axis == data_axis:
        raise ValueError(
            f"auto_layout_map: model_axis and data_axis are both {model_axis!r}; "
            "they must be two different axes of the mesh."
        )
    return mesh


def _budget(device_memory):
    if device_memory is None:
        return None
    from keras_layoutmap.memory import parse_bytes

    try:
        return parse_bytes(device_memory)
    except ValueError as e:
        raise ValueError(f"auto_layout_map: {e}") from None


def _model(model_or_builder):
    """The model to plan: itself, or what the builder returns, built with
    shapes only."""
    if isinstance(model_or_builder, keras.layers.Layer):
        return model_or_builder
    if not callable(model_or_builder):
        raise TypeError(
            "auto_layout_map expects a keras.Model or a function of no "
            f"arguments that returns one. Received: {model_or_builder!r} of "
            f"type {type(model_or_builder).__name__}"
        )
    name = getattr(model_or_builder, "__qualname__", repr(model_or_builder))
    try:
        model = build_shapes_only(model_or_builder)
    except Exception as e:
        hint = ""
        if "stateless scope" in str(e):
            hint = (" (the builder runs with shapes only, where variables "
                    "come from layers' `add_weight`: make other state after "
                    "it returns)")
        raise RuntimeError(
            f"auto_layout_map: the builder {name} failed while building the "
            f"model from shapes{hint}: {type(e).__name__}: {e}"
        ) from e
    if not isinstance(model, keras.layers.Layer):
        raise TypeError(
            f"auto_layout_map: the builder {name} returned "
            f"{type(model).__name__}, expected a keras.Model"
        )
    return model


def build_shapes_only(builder, keep_names=True):
    """`builder()` inside `keras.StatelessScope(initialize_variables=False)`:
    every weight gets its shape, dtype and path, none gets memory. With
    `keep_names`, Keras' automatic layer-name counters are put back after,
    so the next model built gets the names this one had.

    Example:

    >>> import keras
    >>> from keras_layoutmap.auto_plan import build_shapes_only
    >>> model = build_shapes_only(lambda: keras.Sequential(
    ...     [keras.Input((4,)), keras.layers.Dense(2)]))
    >>> tuple(model.weights[0].shape)
    (4, 2)
    """
    with contextlib.ExitStack() as stack:
        if keep_names:
            stack.enter_context(_names_kept())
        stack.enter_context(_optimizers_outside_the_scope())
        stack.enter_context(keras.StatelessScope(initialize_variables=False))
        return builder()


@contextlib.contextmanager
def _optimizers_outside_the_scope():
    """Let an optimizer made while a builder runs (`compile()`; keras-hub's
    task models compile as they are made) create its iteration counter, a
    scalar with a value, which a `StatelessScope` refuses."""
    original = BaseOptimizer.__init__

    def __init__(self, *args, **kwargs):
        scope = global_state.get_global_attribute("stateless_scope")
        global_state.set_global_attribute("stateless_scope", None)
        try:
            original(self, *args, **kwargs)
        finally:
            global_state.set_global_attribute("stateless_scope", scope)

    BaseOptimizer.__init__ = __init__
    try:
        yield
    finally:
        BaseOptimizer.__init__ = original


@contextlib.contextmanager
def _names_kept():
    """Put Keras' automatic-name counters back as they were on exit."""
    before = global_state.get_global_attribute("object_name_uids")
    saved = None if before is None else collections.defaultdict(int, before)
    try:
        yield
    finally:
        global_state.set_global_attribute(
            "object_name_uids",
            saved if saved is not None else collections.defaultdict(int))


# -- the walk: each weight's role ---------------------------------------------


_CONV = tuple(getattr(keras.layers, n) for n in ("Conv1D", "Conv2D", "Conv3D"))
_CONV_ANY = tuple(
    getattr(keras.layers, n) for n in (
        "Conv1D", "Conv2D", "Conv3D", "Conv1DTranspose", "Conv2DTranspose",
        "Conv3DTranspose", "DepthwiseConv1D", "DepthwiseConv2D",
        "SeparableConv1D", "SeparableConv2D")
    if hasattr(keras.layers, n))
_RNN_CELLS = tuple(getattr(keras.layers, n) for n in (
    "SimpleRNNCell", "LSTMCell", "GRUCell") if hasattr(keras.layers, n))


class _Projection:
    """A Dense or EinsumDense kernel: which of its dimensions are inputs
    (contracted) and which outputs."""

    def __init__(self, path, owner, parent, shape, ins, outs):
        self.path, self.owner, self.parent = path, owner, parent
        self.shape, self.ins, self.outs = shape, ins, outs
        self.role = None
        self.partners = []
        self.group = [self]  # the projections of the same parent layer

    @property
    def in_size(self):
        return math.prod(self.shape[d] for d in self.ins)

    @property
    def out_size(self):
        return math.prod(self.shape[d] for d in self.outs)


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


def _einsum_dims(equation, kernel_rank):
    """`(ins, outs, letters)` of an EinsumDense kernel: its dimensions the
    equation contracts with the input, those it keeps in the output, and
    each dimension's letter."""
    equation = equation.replace("...", "")
    left, out = equation.split("->")
    inputs, kernel = left.split(",")
    kernel = kernel.strip()
    if len(kernel) != kernel_rank:
        return None
    ins = tuple(i for i, c in enumerate(kernel) if c in inputs and c not in out)
    outs = tuple(i for i, c in enumerate(kernel) if c in out)
    return ins, outs, kernel


def describe(model, backend="jax"):
    """The planner's view of every weight of `model`: a list of
    `rules.auto.Weight`, kernels before the biases that follow them.

    Example:

    >>> import keras
    >>> from keras_layoutmap.auto_plan import describe
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
    projections = _projections(rows)
    width = _stream_width(rows)
    _assign_projection_roles(projections, width)
    experts = _expert_owners(rows)
    weights = []
    for variable, object_path, owner, _, shape in rows:
        weights.append(_weight(variable, object_path, owner, shape,
                               projections, experts, width, backend))
    return weights


def _itemsize(dtype):
    try:
        return np.dtype(str(dtype)).itemsize
    except TypeError:  # bfloat16, float8: numpy does not know them
        found = re.search(r"\d+", str(dtype))
        return max(1, int(found.group()) // 8) if found else 4


def _projections(rows):
    """`{object_path: _Projection}` for every Dense / EinsumDense kernel."""
    found = {}
    for variable, object_path, owner, parent, shape in rows:
        if variable.name != "kernel" or owner is None:
            continue
        if isinstance(owner, keras.layers.EinsumDense):
            dims = _einsum_dims(owner.equation, len(shape))
            if dims is None or not dims[0] or not dims[1]:
                continue
            ins, outs = dims[0], dims[1]
        elif isinstance(owner, keras.layers.Dense) and len(shape) == 2:
            ins, outs = (0,), (1,)
        else:
            continue
        found[object_path] = _Projection(object_path, owner, parent, shape,
                                         ins, outs)
    return found


def _stream_width(rows):
    """The residual stream's width: the feature size of the largest
    embedding table (None for a model without one)."""
    tables = [shape for _, _, owner, _, shape in rows
              if isinstance(owner, keras.layers.Embedding) and len(shape) == 2]
    if not tables:
        return None
    return max(tables, key=math.prod)[1]


def _assign_projection_roles(projections, width):
    """Column or row for each projection (heads for attention's), and the
    projections each pairs with. A projection that reads the residual
    stream (`width`) is column-parallel, one that writes it row-parallel;
    otherwise one fed by a column-parallel projection (through the graph of
    a Functional model, else the previous one in the same layer) is
    row-parallel, and any other column-parallel."""
    previous = {}  # id(parent) -> the last projection seen there
    by_layer = {id(p.owner): p for p in projections.values()}
    for proj in projections.values():
        if len(proj.outs) > 1 and len(proj.ins) == 1:
            proj.role = auto.HEADS
        elif len(proj.ins) > 1 and len(proj.outs) == 1:
            proj.role = auto.HEADS_OUT
        elif width is not None and proj.in_size == width != proj.out_size:
            proj.role = auto.COLUMN
        elif width is not None and proj.out_size == width != proj.in_size:
            proj.role = auto.ROW
        else:
            upstream = _upstream(proj, by_layer)
            if upstream is None:  # no graph: the previous one in its layer
                last = previous.get(id(proj.parent))
                upstream = [] if last is None else [last]
            follows_column = any(
                up.role == auto.COLUMN and up.out_size == proj.in_size
                for up in upstream)
            proj.role = auto.ROW if follows_column else auto.COLUMN
        previous[id(proj.parent)] = proj
    _pair(projections)


def _upstream(proj, by_layer):
    """The projections whose outputs reach `proj`'s layer through layers of
    one input (activations, dropout, norms), read from a Functional or
    Sequential model's graph; a merge (`Add`, `Concatenate`) or an input
    ends the search. None when the layer has no graph (inside a layer)."""
    nodes = getattr(proj.owner, "_inbound_nodes", None)
    if not nodes or not isinstance(proj.parent, keras.Model):
        return None
    found, stack, seen = [], list(nodes[0].parent_nodes), set()
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        layer = node.operation
        if id(layer) in by_layer:
            found.append(by_layer[id(layer)])
        elif len(node.parent_nodes) == 1:
            stack.extend(node.parent_nodes)
    return found


def _pair(projections):
    """Record, in each parent layer, which row projection each column one
    feeds (the next row reading as many features as it writes)."""
    by_parent = collections.defaultdict(list)
    for proj in projections.values():
        by_parent[id(proj.parent)].append(proj)
    for group in by_parent.values():
        for proj in group:
            proj.group = group
        for i, proj in enumerate(group):
            if proj.role not in (auto.COLUMN, auto.HEADS):
                continue
            wanted = auto.ROW if proj.role == auto.COLUMN else auto.HEADS_OUT
            for later in group[i + 1:]:
                if later.role == wanted and _feeds(proj, later):
                    proj.partners.append(later)
                    later.partners.append(proj)
                    break


def _feeds(first, second):
    if first.role == auto.HEADS:
        heads = tuple(first.shape[d] for d in first.outs)
        return heads == tuple(second.shape[d] for d in second.ins) or (
            heads[1:] == tuple(second.shape[d] for d in second.ins)[1:])
    return first.out_size == second.in_size


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
        dims = [(0, "experts")]
        if width is not None and shape[1] == width:
            dims.append((rank - 1, "outputs"))
        elif width is not None and shape[-1] == width:
            dims.append((1, "inputs"))
        return make(auto.EXPERTS, dims,
                    detail=f"layer {owner.name!r}")
    order = sorted(range(rank), key=lambda d: (-shape[d], d))
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
    else:  # HEADS_OUT
        detail = f"reads {names}" if names else _name(proj)
        dims = [(proj.ins[0], "heads"), (proj.outs[0], "outputs")]
    return make(proj.role, dims, detail)


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
            letters = _einsum_dims(owner.equation, len(proj.shape))[2]
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
