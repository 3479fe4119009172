"""The automatic plan's policy, from shapes and roles alone.

`klm.auto_layout_map` (top-level `auto_plan`) walks a model and describes
each weight as a `Weight`: its path, shape, item size and *role* (a
column-parallel kernel, a row-parallel one, attention heads, a vocabulary,
experts, a bias that follows its kernel, ...), with the dimensions the
model axis may split, in order of preference. This module turns those
descriptions into layouts (`plan`): every layout divides its weight's
shape (a dimension the axis does not divide falls back to the next one,
else the weight is replicated on that axis), each with the reason it was
chosen, and it fits the plan into a device's memory by also splitting large
weights over the data axis (FSDP). No Keras model and no backend here.

See docs/rules.md, "Automatic plans".
"""

import dataclasses
import math

# Roles a weight can have (the walker gives them; see `Weight`).
COLUMN = "column"  # a projection whose output features are split
ROW = "row"  # a projection whose input features are split
HEADS = "heads"  # q / k / v: split by heads
HEADS_OUT = "heads_out"  # attention output projection: split by heads
EMBEDDING = "embedding"  # a table over the vocabulary
REVERSE = "reverse"  # an untied output projection over the vocabulary
EXPERTS = "experts"  # mixture-of-experts weights, experts first
CONV = "conv"  # a convolution kernel: its output channels
FOLLOWS = "follows"  # a bias: the split of its kernel's output, or none
WHOLE = "whole"  # kept whole on every device (TensorFlow limits)
OTHER = "other"  # any other weight: its largest dimension


class PlanError(ValueError):
    """No plan meets the request (a device memory too small): the message
    gives the bytes per device of the smallest plan."""


@dataclasses.dataclass(frozen=True)
class Weight:
    """One weight as the planner sees it.

    `path` is the key its rule is written for; `shape` and `itemsize` (bytes
    per value) size it. `role` is one of the roles above; `model_dims`
    holds `(dim, label)` pairs, the dimensions the model axis may split in
    order of preference, each named for the reason (`"heads"`,
    `"vocabulary"`, `"outputs"`); `detail` completes the reason ("feeds
    ffw_linear"). For a bias (`FOLLOWS`), `kernel` is the path of its
    kernel and `kernel_dims` maps each kernel dimension to this weight's
    dimension of the same features. `data_ok` is False for a weight the
    data axis must not split (TensorFlow's whole conv kernels). `output`
    describes the output of a heads kernel's layer (`LayerOutput`), where
    its equation says which dimension is the batch.
    """

    path: str
    shape: tuple
    itemsize: int
    role: str
    model_dims: tuple = ()
    detail: str = ""
    kernel: str = None
    kernel_dims: tuple = ()  # ((kernel_dim, own_dim), ...)
    data_ok: bool = True
    output: "LayerOutput" = None  # attention heads: the layer's output

    @property
    def nbytes(self):
        return math.prod(self.shape) * self.itemsize


@dataclasses.dataclass(frozen=True)
class LayerOutput:
    """The output of the layer that holds an attention heads kernel:
    `key` is Keras' name for it (`"<layer path>/output"`), `rank` its rank,
    `batch_dim` its batch dimension, and `dims` maps each kernel dimension
    it keeps to its own: `((kernel_dim, output_dim), ...)`."""

    key: str
    rank: int
    batch_dim: int
    dims: tuple


@dataclasses.dataclass(frozen=True)
class Placement:
    """A weight's planned layout (`specs`: an axis name or None per
    dimension) and the reason for it, in words."""

    path: str
    shape: tuple
    specs: tuple
    reason: str
    itemsize: int = 4

    def bytes_per_device(self, sizes):
        """Bytes one device holds, `sizes` being `{axis: size}`."""
        shard = [d // sizes[a] if a else d for d, a in zip(self.shape, self.specs)]
        return math.prod(shard) * self.itemsize


def plan(weights, sizes, *, model_axis, data_axis=None, device_memory=None):
    """Layouts for `weights` (a list of `Weight`) on a mesh of `sizes`.

    Args:
        weights: the model's weights, kernels before the biases that follow
            them.
        sizes: `{axis_name: size}` of the mesh.
        model_axis: the axis tensor parallelism splits over.
        data_axis: the axis batches are split over, or None; weights are
            split over it too (FSDP) as memory asks.
        device_memory: bytes each device has for weights, or None. None:
            every weight of rank 2 or more is also split over `data_axis`
            (the smallest plan, as keras-hub's recipes do). Given: only the
            largest weights are, and only until the weights fit.

    Returns:
        A list of `Placement`, one per weight, in order.

    Raises:
        PlanError: when even the smallest plan needs more than
            `device_memory` per device.

    Example:

    >>> w = Weight("d1.kernel", (64, 32), 4, COLUMN, ((1, "outputs"),),
    ...            "feeds d2")
    >>> plan([w], {"batch": 4, "model": 2}, model_axis="model")[0].specs
    (None, 'model')
    """
    data = splitting_axis(data_axis, sizes)
    placed = {}
    model_only = []
    for w in weights:
        specs, reason = _model_split(w, sizes[model_axis], model_axis, placed)
        placed[w.path] = specs
        model_only.append(Placement(w.path, tuple(w.shape), specs, reason,
                                    w.itemsize))
    if data is None:
        _check_budget(model_only, sizes, device_memory, model_axis, data_axis)
        return model_only
    with_data = [_data_split(w, p, sizes[data], data, device_memory)
                 for w, p in zip(weights, model_only)]
    if device_memory is None:
        return with_data
    smallest = _total(with_data, sizes)
    if smallest > device_memory:
        _check_budget(with_data, sizes, device_memory, model_axis, data_axis)
    chosen = list(model_only)
    total = _total(chosen, sizes)
    order = sorted(range(len(weights)),
                   key=lambda i: -model_only[i].bytes_per_device(sizes))
    for i in order:
        if total <= device_memory:
            break
        if with_data[i].specs == model_only[i].specs:
            continue
        total += (with_data[i].bytes_per_device(sizes)
                  - model_only[i].bytes_per_device(sizes))
        chosen[i] = with_data[i]
    return chosen


def splitting_axis(axis, sizes):
    """`axis` where the mesh (`sizes`, `{axis: size}`) has it over more than
    one device, else None: an axis of one device splits nothing."""
    return axis if axis and sizes.get(axis, 1) > 1 else None


def output_layouts(weights, placements, *, model_axis, data_axis):
    """`[(key, specs, reason)]`: layouts for the outputs of attention's
    projections by heads (their queries, keys and values): the batch over
    `data_axis`, the heads as their kernel splits them over `model_axis`.

    In training the batch is split over `data_axis` anyway. While a model
    decodes token by token, JAX's compiler otherwise keeps the batch whole
    and splits the weights' data-axis dimension: the keys and values a
    decoding cache keeps would be split over the model axis alone, each
    device holding and rewriting a `model_axis`-th of the cache, where
    these layouts leave it one device's share. None without a data axis
    (nothing else would split the batch).

    Example:

    >>> out = LayerOutput("attn/key/output", 4, 0, ((1, 2), (2, 3)))
    >>> w = Weight("attn.key.kernel", (64, 8, 16), 4, HEADS, output=out)
    >>> p = Placement(w.path, w.shape, ("batch", "model", None), "heads")
    >>> output_layouts([w], [p], model_axis="model", data_axis="batch")[0][1]
    ('batch', None, 'model', None)
    """
    if not data_axis:
        return []
    found = []
    for w, p in zip(weights, placements):
        out = w.output
        if out is None or w.role != HEADS:
            continue
        specs = [None] * out.rank
        specs[out.batch_dim] = data_axis
        heads = ""
        for kernel_dim, dim in out.dims:
            if p.specs[kernel_dim] == model_axis:
                specs[dim] = model_axis
                heads = f", heads over {model_axis!r}"
        found.append((out.key, tuple(specs), (
            f"attention heads' output: batch over {data_axis!r}{heads} (a "
            "decoding cache of keys and values split over both axes)")))
    return found


def _total(placements, sizes):
    return sum(p.bytes_per_device(sizes) for p in placements)


def mib(n):
    """`n` bytes in words, e.g. `"410.0 MiB"`."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:,.1f} {unit}"
    return f"{n} B"


def _check_budget(placements, sizes, device_memory, model_axis, data_axis):
    """Raise `PlanError` when `placements` need more than `device_memory`."""
    if device_memory is None:
        return
    total = _total(placements, sizes)
    if total <= device_memory:
        return
    largest = sorted(placements, key=lambda p: -p.bytes_per_device(sizes))[:3]
    axes = f"model axis {model_axis!r} ({sizes[model_axis]})"
    if data_axis and data_axis in sizes:
        axes += f" and data axis {data_axis!r} ({sizes[data_axis]})"
    raise PlanError(
        f"No plan fits device_memory={device_memory:,} bytes "
        f"({mib(device_memory)}): the weights need at least {total:,} bytes "
        f"({mib(total)}) per device with every weight split over the {axes} "
        "as far as its shape allows. The largest per device: "
        + ", ".join(f"{p.path} {mib(p.bytes_per_device(sizes))}"
                    for p in largest)
        + ". Use a mesh of more devices, a smaller dtype, or more memory."
    )


def _model_split(w, m, axis, placed):
    """`(specs, reason)` for weight `w` over the model axis of size `m`."""
    rank = len(w.shape)
    none = (None,) * rank
    if w.role == FOLLOWS:
        return _follow(w, axis, placed)
    if w.role == WHOLE:
        return none, f"replicated: {w.detail}"
    if m == 1 or not w.model_dims:
        why = "model axis of size 1" if m == 1 else w.detail or "small weight"
        return none, f"replicated: {why}"
    refused = []
    for dim, label in w.model_dims:
        if w.shape[dim] % m == 0:
            specs = tuple(axis if d == dim else None for d in range(rank))
            return specs, _reason(w, label, dim, refused, m, axis)
        refused.append((dim, label))
    dim, label = w.model_dims[0]
    return none, (f"replicated: {_sized(label, w.shape[dim])}, model axis "
                  f"{axis!r} of {m}" + _context(w))


def _context(w):
    return f" ({_ROLE_WORDS[w.role]}{': ' + w.detail if w.detail else ''})"


_ROLE_WORDS = {
    COLUMN: "column-parallel", ROW: "row-parallel",
    HEADS: "attention heads", HEADS_OUT: "attention output by heads",
    EMBEDDING: "vocabulary-parallel", REVERSE: "output projection over the "
    "vocabulary", EXPERTS: "experts", CONV: "output channels",
    OTHER: "largest dimension", WHOLE: "replicated", FOLLOWS: "follows",
}


def _reason(w, label, dim, refused, m, axis):
    """The reason a model-axis split was chosen, in words."""
    head = _ROLE_WORDS[w.role]
    text = f"{head}: {w.detail}" if w.detail else head
    text += f" ({_sized(label, w.shape[dim])} over {axis!r})"
    if refused:
        first_dim, first = refused[0]
        text += (f"; {_sized(first, w.shape[first_dim])}, model axis {axis!r} "
                 f"of {m}: split {label} instead")
    return text


_COUNTED = ("heads", "tokens", "experts")  # "8 heads"; else "outputs 32"


def _sized(label, size):
    """`"8 key/value heads"` or `"head_dim 128"`."""
    if label.endswith(_COUNTED):
        return f"{size} {label}"
    return f"{label} {size}"


def _follow(w, axis, placed):
    """A bias: split as its kernel's output features, or replicated."""
    kernel = placed.get(w.kernel)
    rank = len(w.shape)
    if kernel is not None:
        for kdim, own in w.kernel_dims:
            if kdim < len(kernel) and kernel[kdim] == axis:
                specs = tuple(axis if d == own else None for d in range(rank))
                return specs, f"follows {w.kernel}: its outputs over {axis!r}"
    return (None,) * rank, f"replicated: follows {w.kernel}, whose outputs are whole"


def _data_split(w, p, n, axis, device_memory):
    """`p` with weight `w` also split over the data axis (size `n`) on its
    largest free dimension the axis divides; `p` itself when none is, or
    when the weight is of rank < 2 or must stay whole."""
    if len(w.shape) < 2 or not w.data_ok or w.role in (FOLLOWS, WHOLE):
        return p
    free = [d for d in range(len(w.shape)) if p.specs[d] is None
            and w.shape[d] % n == 0]
    if not free:
        return p
    dim = max(free, key=lambda d: (w.shape[d], -d))
    specs = tuple(axis if d == dim else s for d, s in enumerate(p.specs))
    if device_memory is None:
        why = f"FSDP: dimension {dim} ({w.shape[dim]}) over {axis!r}"
    else:
        why = (f"FSDP: {mib(w.nbytes)} over device_memory, dimension {dim} "
               f"({w.shape[dim]}) over {axis!r}")
    reason = p.reason
    if reason.startswith("replicated: "):
        reason = why + "; model axis: " + reason[len("replicated: "):]
    else:
        reason = f"{reason}; {why}"
    return dataclasses.replace(p, specs=specs, reason=reason)
