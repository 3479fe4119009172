"""Tensors on a mesh: `distribute`, `pack`, `unpack`, `copy_to_mesh`,
`fetch_layout`. Thin, checked front-ends to the backend."""

from keras_layoutmap import backends
from keras_layoutmap.layout import Layout, as_layout


def _shape(x):
    return tuple(int(d) for d in getattr(x, "shape", ()))


def _check_divisible(shape, layout, what):
    if len(shape) != layout.rank:
        raise ValueError(
            f"{what} has shape {shape} (rank {len(shape)}) but the layout "
            f"{layout.sharding_specs} has rank {layout.rank}."
        )
    for dim, (axis, size) in enumerate(zip(layout.axes, shape)):
        if axis is not None and size % layout.mesh.dim_size(axis):
            raise ValueError(
                f"{what} has shape {shape}: dimension {dim} (size {size}) "
                f"cannot be split over mesh axis {axis!r} (size "
                f"{layout.mesh.dim_size(axis)})."
            )


def _layout(layout):
    layout = as_layout(layout)
    if layout.mesh is None:
        raise ValueError(f"The layout {layout.sharding_specs} has no mesh.")
    return layout


def distribute(x, layout):
    """A host (global) array → one tensor sharded by `layout`.

    Any layout works, including spatial (feature-dimension) sharding.

    Example:

    >>> import numpy as np, keras_layoutmap as klm
    >>> mesh = klm.create_mesh([("batch", len(klm.list_devices()))])
    >>> x = klm.distribute(np.ones((8, 3)), klm.Layout(["batch", None], mesh))
    >>> klm.fetch_layout(x).sharding_specs
    ['batch', 'unsharded']
    """
    layout = _layout(layout)
    _check_divisible(_shape(x), layout, "The array")
    return backends.get().distribute(x, layout)


def copy_to_mesh(x, layout):
    """A replicated copy of `x` on the mesh of `layout` (which must be
    fully replicated, as for `dtensor.copy_to_mesh`)."""
    layout = _layout(layout)
    if not layout.is_fully_replicated():
        raise ValueError(
            f"copy_to_mesh needs a fully replicated layout; received "
            f"{layout.sharding_specs}. Use `klm.distribute` to shard."
        )
    return distribute(x, layout)


def pack(components, layout):
    """One sharded tensor from per-local-device `components`.

    `components[i]` is the piece for the i-th local device of the mesh, in
    mesh order (`dtensor.pack` semantics): sharded dimensions hold that
    device's slice, replicated dimensions the whole extent.
    """
    layout = _layout(layout)
    components = list(components)
    expected = layout.mesh.num_local_devices()
    if len(components) != expected:
        raise ValueError(
            f"pack needs one component per local device of {layout.mesh!r}: "
            f"{expected}. Received {len(components)}."
        )
    shapes = {_shape(c) for c in components}
    if len(shapes) != 1:
        raise ValueError(
            f"pack needs components of one shape. Received shapes "
            f"{sorted(shapes)}."
        )
    (shape,) = shapes
    if len(shape) != layout.rank:
        raise ValueError(
            f"pack: components have rank {len(shape)} but the layout "
            f"{layout.sharding_specs} has rank {layout.rank}."
        )
    return backends.get().pack(components, layout)


def unpack(x):
    """The per-local-device components of `x`, in mesh device order."""
    return list(backends.get().unpack(x))


def fetch_layout(x):
    """The layout `x` (a tensor or a `keras.Variable`) *actually* has, read
    from the backend's own sharding; a `klm.Layout`.

    An array that lives on one device reads back as replicated on a
    one-device mesh (axis `"device"`): on a one-device mesh JAX may keep a
    value single-device, which is physically the same placement.
    """
    axes, mesh = backends.get().fetch_layout(x)
    return Layout(axes, mesh)
