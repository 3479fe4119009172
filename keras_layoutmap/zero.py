"""`klm.shard_optimizer_states`: optimizer state split over the data axis
(ZeRO-1).

Adam keeps two slots per weight, each the size of the weight: under a
data-parallel (or model-parallel) plan every device of the data axis holds
a full copy of them. The plan this returns keeps every weight where its map
puts it and also splits each slot of a large weight over the data axis,
along the largest dimension of the slot that the weight's layout leaves
whole and the axis divides. Each device then updates its part of the
slots; the backend gathers what the weight update needs (JAX: the compiler;
TensorFlow: DTensor's relayout; torch: DTensor's redistribute), so the
numbers are those of one device. A slot that cannot be split (its weight
is already split over the axis, or no whole dimension is divisible) keeps
its weight's layout, and `explain(model, optimizer=...)` says why.
"""

import math

import numpy as np
from keras import distribution as keras_distribution

from keras_layoutmap.layout import Layout, as_layout
from keras_layoutmap.layout_map import as_layout_map

DEFAULT_MIN_BYTES = 1 << 16  # 64 KiB: slots of biases and norms stay whole


class ZeroSlots:
    """Mixed into a `LayoutMap` class by `shard_optimizer_states`: where an
    optimizer slot of a weight goes (`slot_layout`)."""

    zero_axis = "batch"
    zero_min_bytes = DEFAULT_MIN_BYTES

    def slot_layout(self, weight_layout, shape, dtype=None):
        """`(layout, why_not)`: the layout of an optimizer slot of `shape`
        whose weight has `weight_layout`; `why_not` says why a large slot
        keeps the weight's layout (None when it is split, or too small)."""
        import keras

        shape = tuple(int(d) for d in shape)
        itemsize = np.dtype(keras.backend.standardize_dtype(
            dtype or "float32")).itemsize
        if weight_layout is None or (
                math.prod(shape) * itemsize < self.zero_min_bytes):
            return weight_layout, None
        axis = self.zero_axis
        n = weight_layout.mesh.dim_size(axis)
        if axis in weight_layout.axes:
            return weight_layout, (
                f"its weight is already split over {axis!r}")
        fits = [d for d, (a, size) in enumerate(zip(weight_layout.axes, shape))
                if a is None and size % n == 0 and size >= n]
        if not fits:
            return weight_layout, (
                f"no dimension of {shape} left whole by the weight's layout "
                f"{weight_layout.sharding_specs} is divisible by {axis!r} "
                f"(size {n})")
        dim = max(fits, key=lambda d: (shape[d], -d))
        axes = list(weight_layout.axes)
        axes[dim] = axis
        return Layout(axes, weight_layout.mesh), None

    def __repr__(self):
        return (super().__repr__()[:-1] + f", shard_optimizer_states("
                f"axis={self.zero_axis!r}, min_bytes={self.zero_min_bytes}))")


_CLASSES = {}


def _zero_class(base):
    if issubclass(base, ZeroSlots):
        return base
    if base not in _CLASSES:
        _CLASSES[base] = type(f"Zero{base.__name__}", (ZeroSlots, base), {})
    return _CLASSES[base]


def shard_optimizer_states(layout_map, axis="batch",
                           min_bytes=DEFAULT_MIN_BYTES):
    """A plan like `layout_map` whose large optimizer slots are also split
    over the data axis `axis` (ZeRO-1).

    `layout_map` is a `klm.LayoutMap` (a `klm.fsdp` map, or a
    `keras.distribution.LayoutMap`) and is not changed: the returned map
    holds a copy of its rules. Every weight keeps the layout the map gives
    it; a slot the optimizer makes for a weight of at least `min_bytes`
    bytes (an int >= 0) is split over `axis` along its largest dimension
    the weight's layout leaves whole and the axis divides. Slots that
    cannot be split keep the weight's layout; `explain(model,
    optimizer=...)` counts the state as placed and says why. The plan's
    `to_json()` / `get_config()` hold its rules (and an FSDP policy), not
    the split: apply `shard_optimizer_states` again to a loaded map.

    Example:

    >>> import keras, keras_layoutmap as klm
    >>> mesh = klm.create_mesh([("batch", len(klm.list_devices()))])
    >>> plan = klm.shard_optimizer_states(klm.LayoutMap(mesh), min_bytes=64)
    >>> with plan.scope():
    ...     model = keras.Sequential([keras.Input((4,)),
    ...                               keras.layers.Dense(8, name="d1")])
    ...     model.compile(klm.optimizers.Adam(), "mse")
    ...     model.optimizer.build(model.trainable_variables)
    >>> klm.fetch_layout(model.layers[0].kernel).sharding_specs
    ['unsharded', 'unsharded']
    >>> klm.fetch_layout(model.optimizer.variables[2]).sharding_specs
    ['unsharded', 'batch']
    """
    layout_map = as_layout_map(
        layout_map, "shard_optimizer_states: `layout_map` must be")
    mesh = layout_map.device_mesh
    if mesh is None:
        raise ValueError(
            "shard_optimizer_states: the LayoutMap has no mesh; make it with "
            "klm.LayoutMap(mesh).")
    if not isinstance(axis, str) or axis not in mesh.axis_names:
        raise ValueError(
            f"shard_optimizer_states: `axis` must be an axis of the mesh, one "
            f"of {list(mesh.axis_names)}. Received: axis={axis!r}")
    if isinstance(min_bytes, bool) or not isinstance(
            min_bytes, (int, np.integer)) or min_bytes < 0:
        raise ValueError(
            "shard_optimizer_states: `min_bytes` must be an int >= 0 (a "
            f"number of bytes). Received: min_bytes={min_bytes!r}")
    copy = type(layout_map).from_config(layout_map.get_config(), mesh=mesh)
    plan = object.__new__(_zero_class(type(copy)))
    plan.__dict__.update(copy.__dict__)
    plan.zero_axis = axis
    plan.zero_min_bytes = int(min_bytes)
    return plan


def slot_layout_for(reference, layout):
    """The layout an optimizer slot of `reference` (a weight with `layout`)
    takes under the active distribution: split by its plan's
    `slot_layout`, else `layout`."""
    plan = getattr(keras_distribution.distribution(), "layout_map", None)
    if layout is None or not isinstance(plan, ZeroSlots):
        return layout
    try:
        layout = as_layout(layout)
    except (TypeError, ValueError):
        return layout
    if layout.mesh is None or layout.mesh != plan.device_mesh:
        return layout
    return plan.slot_layout(layout, reference.shape, reference.dtype)[0]
