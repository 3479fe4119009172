"""Tensor layouts: `Layout`, `UNSHARDED` and layout validation."""

import math
import re

import numpy as np
from keras import distribution as keras_distribution

from keras_layoutmap.mesh import Mesh, as_mesh

UNSHARDED = "unsharded"


class NotALayoutError(TypeError, ValueError):
    """A value that is not a layout where one is expected.

    A `TypeError` (the wrong kind of value) that is also a `ValueError`, the
    error TF-Keras 2's and Keras 3's `LayoutMap` raise for it, so code written
    against either catches it.
    """


def _normalize_spec(spec, where):
    if spec is None or spec == UNSHARDED:
        return None
    if isinstance(spec, str):
        return spec
    raise NotALayoutError(
        f"{where}: each sharding spec must be a mesh axis name, "
        f"`klm.UNSHARDED` or None. Received: {spec!r} of type "
        f"{type(spec).__name__}"
    )


def check_axes(axes, mesh, where="Layout"):
    """Raise if `axes` names an axis twice or one `mesh` does not have."""
    named = [a for a in axes if a is not None]
    for axis in named:
        if named.count(axis) > 1:
            raise ValueError(
                f"{where}: mesh axis {axis!r} is used for more than one "
                f"dimension in {list(axes)}; a mesh axis may shard one "
                "dimension only."
            )
    if mesh is not None:
        missing = [a for a in named if a not in mesh.axis_names]
        if missing:
            raise ValueError(
                f"{where}: axis {missing[0]!r} is not in the mesh. The mesh "
                f"axes are {dict(zip(mesh.axis_names, mesh.shape))}; "
                f"received sharding specs {list(axes)}."
            )


class Layout(keras_distribution.TensorLayout):
    """How a tensor is split over a mesh; a `keras.distribution.TensorLayout`.

    `sharding_specs` has one entry per tensor dimension: the mesh axis that
    splits it, or `klm.UNSHARDED` / `None` to keep it whole on every device.

    Example:

    >>> import keras_layoutmap as klm
    >>> mesh = klm.create_mesh([("batch", 1)],
    ...     devices=klm.list_devices()[:1])
    >>> klm.Layout(["batch", klm.UNSHARDED], mesh).sharding_specs
    ['batch', 'unsharded']
    >>> klm.Layout.replicated(mesh, rank=2) == klm.Layout([None, None], mesh)
    True
    """

    def __init__(self, sharding_specs, mesh=None):
        if isinstance(sharding_specs, str):
            raise TypeError(
                "`sharding_specs` must be a list with one entry per "
                f"dimension, not a string. Received: {sharding_specs!r}"
            )
        axes = tuple(
            _normalize_spec(s, "Layout") for s in list(sharding_specs)
        )
        mesh = as_mesh(mesh)
        check_axes(axes, mesh)
        super().__init__(axes, mesh)

    # TensorLayout calls this whenever the mesh is set.
    def _validate_axes(self):
        check_axes(self.axes, self.device_mesh)

    @classmethod
    def replicated(cls, mesh, rank):
        """A layout that keeps all `rank` dimensions whole on every device."""
        return cls([UNSHARDED] * _check_rank(rank, "Layout.replicated"), mesh)

    @classmethod
    def batch_sharded(cls, mesh, batch_dim, rank, axis=0):
        """A layout that splits dimension `axis` over mesh axis `batch_dim`."""
        rank = _check_rank(rank, "Layout.batch_sharded")
        if isinstance(axis, bool) or not isinstance(axis, int) or not (
            -rank <= axis < rank
        ):
            raise ValueError(
                f"Layout.batch_sharded: `axis` must be a dimension of a rank-"
                f"{rank} tensor, an int in [{-rank}, {rank - 1}]. Received: "
                f"axis={axis!r}"
            )
        specs = [UNSHARDED] * rank
        specs[axis] = batch_dim
        return cls(specs, mesh)

    @classmethod
    def inner_sharded(cls, mesh, dim, rank):
        """A layout that splits the last dimension over mesh axis `dim`."""
        rank = _check_rank(rank, "Layout.inner_sharded")
        if rank < 1:
            raise ValueError(
                "Layout.inner_sharded: a rank-0 tensor has no last dimension "
                "to shard; expected `rank` >= 1. Received: rank=0"
            )
        return cls.batch_sharded(mesh, dim, rank, axis=rank - 1)

    @classmethod
    def from_keras(cls, layout, mesh=None):
        """A `Layout` from a `keras.distribution.TensorLayout`."""
        if isinstance(layout, cls) and (mesh is None or layout.mesh == mesh):
            return layout
        return cls(layout.axes, layout.device_mesh or mesh)

    @property
    def sharding_specs(self):
        """One entry per dimension: a mesh axis name or `UNSHARDED`."""
        return [UNSHARDED if a is None else a for a in self.axes]

    @property
    def rank(self):
        return len(self.axes)

    @property
    def mesh(self):
        return self.device_mesh

    def is_fully_replicated(self):
        return all(a is None for a in self.axes)

    def delete(self, dims):
        """A layout with dimensions `dims` (indices) removed."""
        dims = {d % self.rank for d in dims}
        return Layout([a for i, a in enumerate(self.axes) if i not in dims],
                      self.mesh)

    def num_shards(self, dim):
        """How many pieces dimension `dim` is split into."""
        axis = self.axes[dim]
        return 1 if axis is None else self.mesh.dim_size(axis)

    def shard_shape(self, shape):
        """The per-device shape of a tensor of `shape` (ceil division)."""
        return tuple(
            math.ceil(int(n) / self.num_shards(i)) for i, n in enumerate(shape)
        )

    def get_config(self):
        config = {"sharding_specs": self.sharding_specs}
        if self.mesh is not None:
            config["mesh"] = self.mesh.get_config()
        return config

    @classmethod
    def from_config(cls, config, mesh=None):
        if mesh is None and config.get("mesh") is not None:
            mesh = Mesh.from_config(config["mesh"])
        return cls(config["sharding_specs"], mesh)

    def __eq__(self, other):
        if not isinstance(other, keras_distribution.TensorLayout):
            return NotImplemented
        return tuple(self.axes) == tuple(other.axes) and (
            self.device_mesh == other.device_mesh
        )

    def __hash__(self):
        return hash((tuple(self.axes), self.device_mesh))

    def __repr__(self):
        return f"Layout({self.sharding_specs}, {self.mesh!r})"


def _check_rank(rank, where):
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        raise ValueError(
            f"{where}: `rank` must be a non-negative int (the number of "
            f"dimensions). Received: rank={rank!r}"
        )
    return rank


def is_spec_sequence(value):
    """Whether `value` is one layout written as a tuple/list of axis names
    (every item a string or None), as opposed to a list of layouts."""
    return isinstance(value, (tuple, list)) and all(
        v is None or isinstance(v, str) for v in value
    )


def as_layout(value, mesh=None, where="Layout"):
    """Turn a `Layout`, a `TensorLayout` or a tuple of axis names into a
    `Layout`; raise `NotALayoutError` (a `TypeError` and a `ValueError`) for
    anything else. Errors start with `where` (e.g. the rule)."""
    if isinstance(value, keras_distribution.TensorLayout):
        check_axes(tuple(value.axes), as_mesh(value.device_mesh or mesh), where)
        return Layout.from_keras(value, mesh)
    if isinstance(value, str):
        raise NotALayoutError(
            f"{where}: a layout is a tuple with one mesh axis name (or None) "
            f"per dimension, not a string. Received: {value!r}; for a rank-1 "
            f"weight write ({value!r},)."
        )
    if isinstance(value, (tuple, list)):
        axes = tuple(_normalize_spec(s, where) for s in value)
        check_axes(axes, as_mesh(mesh), where)
        return Layout(axes, mesh)
    if isinstance(value, dict) and "sharding_specs" in value:
        return as_layout(value["sharding_specs"], _config_mesh(value, mesh), where)
    raise NotALayoutError(
        f"{where}: expected a `klm.Layout`, a `keras.distribution."
        "TensorLayout` or a tuple of mesh axis names. Received: "
        f"{value!r} of type {type(value).__name__}"
    )


def _config_mesh(config, mesh):
    if mesh is None and config.get("mesh") is not None:
        return Mesh.from_config(config["mesh"])
    return mesh


def fit_problem(layout, shape):
    """Why `layout` cannot hold a tensor of `shape` (a phrase), or None."""
    shape = tuple(int(d) for d in shape)
    if layout.rank != len(shape):
        return (
            f"it has rank {layout.rank} but the weight has rank {len(shape)}"
        )
    for dim, (axis, size) in enumerate(zip(layout.axes, shape)):
        if axis is None:
            continue
        n = layout.mesh.dim_size(axis)
        if size % n:
            return (
                f"mesh axis {axis!r} (size {n}) does not divide dimension "
                f"{dim} (size {size})"
            )
    return None


def check_fits(layout, shape, path, rule):
    """Raise `ValueError` unless `layout` can hold a tensor of `shape`.

    The message names the weight `path`, the `rule` that chose the layout, the
    axis and the sizes involved.
    """
    shape = tuple(int(d) for d in shape)
    source = f"rule {rule!r}" if rule is not None else "its layout"
    if layout.rank != len(shape):
        raise ValueError(
            f"Weight {path!r} has shape {shape} (rank {len(shape)}), but "
            f"{source} gives a layout of rank {layout.rank}: "
            f"{layout.sharding_specs}."
        )
    for dim, (axis, size) in enumerate(zip(layout.axes, shape)):
        if axis is None:
            continue
        n = layout.mesh.dim_size(axis)
        if size % n:
            raise ValueError(
                f"Weight {path!r} has shape {shape}; {source} shards "
                f"dimension {dim} (size {size}) over mesh axis {axis!r} "
                f"(size {n}), and {n} does not divide {size}."
            )


def layout_bytes_per_device(layout, shape, dtype):
    """Bytes one device holds for a tensor of `shape` under `layout`."""
    try:
        itemsize = np.dtype(str(dtype)).itemsize
    except TypeError:  # bfloat16, float8_*: numpy does not know them
        itemsize = max(1, int(re.search(r"\d+", str(dtype)).group()) // 8)
    shard = layout.shard_shape(shape) if layout is not None else shape
    return int(math.prod(shard)) * itemsize
