"""The variables `model.quantize(mode)` adds, and the layouts they get.

Keras' `quantize("int8" | "int4" | "float8")` replaces a layer's kernel (or
embeddings) with an int8 variable, and adds variables beside it: scales,
zero points, group indices, float8's scales and amax histories; LoRA on a
quantized layer adds its two matrices. They are made after the model was
placed, and their names start like the kernel's, so a rule written for the
kernel may match them too (a Keras map matches anywhere in a path: rule
`d1/kernel` matches `d1/kernel_scale`).

The plan here, for every such variable:

- the quantized kernel takes the layout its rule gives the float kernel. An
  int4 kernel is stored packed, two values a byte along one axis (and an
  `EinsumDense` kernel of rank > 2 flattened to 2 dimensions first): the
  rule's split of that axis carries over where the mesh axis divides the
  packed size, else it is a `ValueError` naming the weight, the rule, the
  axis and the sizes;
- every other variable *follows* the kernel: each of its dimensions that is
  one of the kernel's (per layer type, from Keras' own shapes) and has that
  dimension's size takes the mesh axis the kernel's layout splits it over;
  every other dimension (a reduced axis kept as 1, a group count, a LoRA
  rank, an amax history) is replicated;
- a rule that matches the variable itself and is *not* the kernel's rule
  (written for it) is used as written.

`describe(layer, name, shape)` says which of a layer's weights a variable
follows and how its dimensions line up (a `Follower`, or None for any other
weight); `follow(...)` turns the kernel's layout into the variable's. Both
are pure: they read shapes and a layer's attributes, and change nothing.
`rules.resolve.resolve_weight` uses them, and so do `explain` and placement.
"""

import dataclasses
import math

from keras_layoutmap.layout import Layout

# An int4 kernel's zero points: Keras 3.15 names them `kernel_zero`, Keras
# 3.16 (its int4 projection mode) `zero_point`.
_KERNEL_ZERO = ("kernel_zero", "zero_point")
# float8's per-tensor state: a scalar scale and an amax history per tensor.
_FLOAT8 = ("inputs_scale", "inputs_amax_history", "kernel_amax_history",
           "outputs_grad_scale", "outputs_grad_amax_history")


@dataclasses.dataclass(frozen=True)
class Follower:
    """How a variable that quantization (or LoRA on a quantized layer) adds
    lines up with the weight it follows.

    `base` is that weight's name on the layer ("kernel", "embeddings",
    "reverse_embeddings") and `base_shape` its float shape, the shape its
    rule is written for. `logical` is the shape the variable's `axes` refer
    to: `base_shape`, or for an int4 `EinsumDense` the kernel flattened to
    (reduced dims, other dims), as Keras reshapes it. `axes[j]` is the
    dimension of `logical` that dimension `j` of the variable is (None: no
    dimension of the kernel). `packed` is the variable's dimension that
    holds two int4 values a byte (the stored int4 kernel), else None.
    """

    base: str
    base_shape: tuple
    logical: tuple
    axes: tuple
    packed: object = None
    mode: str = None


def _shape(value):
    return tuple(int(d) for d in value)


def _kernel_shape(layer):
    kernel = layer.__dict__.get("_kernel")
    return None if kernel is None else _shape(kernel.shape)


def _quantized(layer):
    return bool(getattr(layer, "_is_quantized", False)) or (
        getattr(getattr(layer, "dtype_policy", None), "quantization_mode", None)
        is not None)


def _lora(name, stem, base_shape, shape, rank_axes):
    """LoRA's two matrices: `a` keeps the kernel's leading dims and ends in
    the LoRA rank; `b` starts with the rank and ends in its last dim."""
    if name == f"lora_{stem}_a":
        axes = tuple(range(len(shape) - 1)) + (None,)
    else:
        axes = (None, rank_axes - 1)
    return Follower(stem, base_shape, base_shape, axes, mode="lora")


def _scalars(shape):
    return (None,) * len(shape)


def _dense(layer, name, shape):
    units = int(layer.units)
    if name == "kernel":
        if len(shape) == 2 and shape[1] != units and shape[1] == (units + 1) // 2:
            base = (shape[0], units)
            return Follower("kernel", base, base, (0, 1), packed=1, mode="int4")
        return None
    in_dim = getattr(layer, "_orig_input_dim", None)
    if in_dim is None:
        kernel = _kernel_shape(layer)
        in_dim = None if kernel is None else kernel[0]
    if name in ("g_idx", "lora_kernel_a"):
        in_dim = shape[0]
    if in_dim is None:
        return None
    base = (int(in_dim), units)
    if name == "kernel_scale" or name in _KERNEL_ZERO:
        axes = {0: (), 1: (1,), 2: (None, 1)}.get(len(shape))
        return None if axes is None else Follower("kernel", base, base, axes)
    if name == "g_idx":
        return Follower("kernel", base, base, (0,), mode="int4")
    if name in _FLOAT8:
        return Follower("kernel", base, base, _scalars(shape), mode="float8")
    if name in ("lora_kernel_a", "lora_kernel_b") and _quantized(layer):
        return _lora(name, "kernel", base, shape, 2)
    return None


def _einsum_scale_axes(layer, kernel_shape):
    """Keras' int8 `kernel_scale` shape for an `EinsumDense` kernel, and
    which kernel dimension each of its dims is (`_get_kernel_scale_shape`,
    with the dimension indices carried along)."""
    reduced = set(layer._kernel_reduced_axes)
    dims = [(1, None) if i in reduced else (d, i)
            for i, d in enumerate(kernel_shape)]
    dims = [dims[i] for i in layer._kernel_transpose_axes]
    for a in sorted(layer._kernel_expand_axes):
        dims.insert(a, (1, None))
    for a in sorted(layer._kernel_squeeze_axes, reverse=True):
        dims.pop(a)
    return tuple(d for d, _ in dims), tuple(i for _, i in dims)


def _einsum_flat(layer, kernel_shape):
    """(rows, columns): the kernel flattened as Keras' int4 path does."""
    reduced = set(layer._kernel_reduced_axes)
    rows = math.prod(d for i, d in enumerate(kernel_shape) if i in reduced)
    cols = math.prod(d for i, d in enumerate(kernel_shape) if i not in reduced)
    return rows, cols


def _float_kernel_shape(layer):
    """The float kernel's shape: Keras 3.15 keeps it as
    `original_kernel_shape` on a quantized `EinsumDense`, keras-nightly as
    `kernel_shape` (set at build, where the stored int4 kernel is packed);
    else the kernel variable's own shape."""
    for attribute in ("original_kernel_shape", "kernel_shape"):
        value = layer.__dict__.get(attribute)
        if value is not None:
            return _shape(value)
    return _kernel_shape(layer)


def _einsum(layer, name, shape):
    base = _float_kernel_shape(layer)
    if name == "kernel":
        if base is None or shape == base or not hasattr(
                layer, "_kernel_reduced_axes"):
            return None
        rows, cols = _einsum_flat(layer, base)
        if shape == (rows, (cols + 1) // 2):
            return Follower("kernel", base, (rows, cols), (0, 1), packed=1,
                            mode="int4")
        return None
    if base is None:
        return None
    if name in _FLOAT8:
        return Follower("kernel", base, base, _scalars(shape), mode="float8")
    if name in ("lora_kernel_a", "lora_kernel_b"):
        if not _quantized(layer):
            return None
        return _lora(name, "kernel", base, shape, len(base))
    if name == "kernel_scale" and len(shape) == 0:
        return Follower("kernel", base, base, (), mode="float8")
    if not hasattr(layer, "_kernel_reduced_axes"):
        return None
    if name == "kernel_scale":
        int8_shape, axes = _einsum_scale_axes(layer, base)
        if shape == int8_shape:
            return Follower("kernel", base, base, axes, mode="int8")
    rows, cols = _einsum_flat(layer, base)
    if name == "kernel_scale" or name in _KERNEL_ZERO:
        if shape == (cols,):
            return Follower("kernel", base, (rows, cols), (1,), mode="int4")
        if len(shape) == 2 and shape[1] == cols:
            return Follower("kernel", base, (rows, cols), (None, 1), mode="int4")
    if name == "g_idx" and shape == (rows,):
        return Follower("kernel", base, (rows, cols), (0,), mode="int4")
    return None


def _embedding(layer, name, shape):
    vocab, dim = int(layer.input_dim), int(layer.output_dim)
    base = (vocab, dim)
    if name == "embeddings":
        if shape != base and shape == (vocab, (dim + 1) // 2):
            return Follower("embeddings", base, base, (0, 1), packed=1,
                            mode="int4")
        return None
    if name in ("embeddings_scale", "embeddings_zero"):
        axes = {1: (0,), 2: (0, None)}.get(len(shape))
        return None if axes is None else Follower("embeddings", base, base, axes)
    if name == "g_idx":
        return Follower("embeddings", base, base, (1,), mode="int4")
    if name in ("lora_embeddings_a", "lora_embeddings_b") and _quantized(layer):
        return _lora(name, "embeddings", base, shape, 2)
    if not hasattr(layer, "tie_weights"):
        return None
    # A ReversibleEmbedding's own output projection, (dim, vocab).
    reverse = (dim, vocab)
    if name == "reverse_embeddings":
        if shape != reverse and shape == ((dim + 1) // 2, vocab):
            return Follower("reverse_embeddings", reverse, reverse, (0, 1),
                            packed=0, mode="int4")
        return None
    if name in ("reverse_embeddings_scale", "reverse_embeddings_zero"):
        axes = {1: (1,), 2: (None, 1)}.get(len(shape))
        return None if axes is None else Follower(
            "reverse_embeddings", reverse, reverse, axes)
    return None


def describe(layer, name, shape):
    """The `Follower` for weight `name` of `shape` on `layer`, or None when
    it is no variable that quantization adds (nor a stored int4 kernel).

    Knows Keras' `Dense`, `EinsumDense`, `Embedding` and
    `ReversibleEmbedding` (and their subclasses, keras-hub's included).
    """
    if layer is None:
        return None
    from keras import layers

    shape = _shape(shape)
    try:
        if isinstance(layer, layers.EinsumDense):
            return _einsum(layer, name, shape)
        if isinstance(layer, layers.Dense):
            return _dense(layer, name, shape)
        if isinstance(layer, layers.Embedding):
            return _embedding(layer, name, shape)
    except (AttributeError, TypeError, ValueError):
        return None  # a layer whose state is not Keras' own: no guess
    return None


def sibling_keys(object_path, path, name, base):
    """The keys of weight `base` of the layer whose weight `name` has keys
    `(object_path, path)`."""
    def swap(key, sep):
        if not key:
            return key
        head, _, last = key.rpartition(sep)
        if last != name:
            return None
        return f"{head}{sep}{base}" if head else base
    return swap(object_path, "."), swap(path, "/")


def reshape_specs(specs, old, new, mesh):
    """The sharding specs for a plain (row-major) reshape of a tensor of
    shape `old`, split by `specs`, to shape `new`: a new dimension that
    starts where an old one starts (same product of the dimensions before
    it) keeps that dimension's mesh axis when the axis divides it (then the
    two split the elements the same way); any other dimension is not
    split."""
    starts = {}
    outer = 1
    for spec, size in zip(specs, old):
        if spec is not None:
            starts.setdefault(outer, spec)
        outer *= size
    out, outer, used = [], 1, set()
    for size in new:
        spec = starts.get(outer)
        if spec is not None and spec not in used and size % mesh.dim_size(spec) == 0:
            out.append(spec)
            used.add(spec)
        else:
            out.append(None)
        outer *= size
    return tuple(out)


def follow(follower, base_layout, shape, where, rule):
    """The layout of a variable of `shape` described by `follower`, given
    `base_layout`, the layout the base weight's rule gives its float shape.

    Raises `ValueError` naming the weight (`where`), `rule`, the mesh axis
    and the sizes when the stored int4 kernel's packed axis is split by a
    mesh axis that does not divide it.
    """
    mesh = base_layout.mesh
    specs = tuple(base_layout.sharding_specs)
    specs = tuple(None if s in (None, "unsharded") else s for s in specs)
    if follower.logical != follower.base_shape:
        specs = reshape_specs(specs, follower.base_shape, follower.logical, mesh)
    out = []
    for j, axis in enumerate(follower.axes):
        size = shape[j]
        spec = None if axis is None else specs[axis]
        if spec is None:
            out.append(None)
            continue
        n = mesh.dim_size(spec)
        if j == follower.packed:
            if size % n:
                raise ValueError(
                    f"Weight {where!r}: int4 stores two values a byte along "
                    f"dimension {j}, so the quantized kernel has shape "
                    f"{tuple(shape)} (the float one {follower.logical}); "
                    f"{'rule ' + repr(rule) if rule else 'its layout'} splits "
                    f"that dimension over mesh axis {spec!r} (size {n}), and "
                    f"{n} does not divide {size}. Split another dimension, "
                    "or quantize to int8."
                )
            out.append(spec)
        elif size == follower.logical[axis]:
            out.append(spec)
        else:
            out.append(None)
    return Layout(out, mesh)
