"""Device meshes: `Mesh`, `create_mesh`, `list_devices`, virtual devices."""

import math

import numpy as np
from keras import distribution as keras_distribution

from keras_layoutmap import backends


def configure_virtual_devices(n):
    """Make `n` logical CPU devices available to this process.

    Call it first, before anything touches a device. On JAX and TensorFlow the
    devices live in this process; on PyTorch a mesh spans processes, so this
    checks that the script was started with
    `python -m keras_layoutmap.launch -n N` and a world size of `n`.

    Example:

    >>> import keras_layoutmap as klm
    >>> klm.configure_virtual_devices(8)  # doctest: +SKIP
    >>> len(klm.list_devices())  # doctest: +SKIP
    8
    """
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(
            f"`n` must be a positive integer number of devices. Received: {n!r}"
        )
    from keras_layoutmap.processes import configure_devices

    configure_devices(n)


def list_devices():
    """The devices a mesh may use, across all processes (e.g. `"cpu:3"`)."""
    return list(backends.get().list_devices())


class Mesh(keras_distribution.DeviceMesh):
    """A named grid of devices; a `keras.distribution.DeviceMesh`.

    Build one with `create_mesh`. Besides Keras' `shape`, `axis_names` and
    `devices`, it offers the `tf.experimental.dtensor.Mesh` vocabulary
    (`dim_names`, `size`, `dim_size`, `num_local_devices`) and compares by
    value, so that layouts on equal meshes are equal.
    """

    def __init__(self, shape, axis_names, devices=None):
        shape = tuple(int(s) for s in shape)
        axis_names = [str(a) for a in axis_names]
        if len(set(axis_names)) != len(axis_names):
            raise ValueError(
                f"Mesh axis names must be unique. Received: {axis_names}"
            )
        if any(s < 1 for s in shape):
            raise ValueError(
                f"Mesh axis sizes must be positive. Received: "
                f"{dict(zip(axis_names, shape))}"
            )
        if devices is None:
            available = list_devices()
            if math.prod(shape) > len(available):
                raise ValueError(
                    f"A mesh of shape {dict(zip(axis_names, shape))} needs "
                    f"{math.prod(shape)} devices, but only {len(available)} "
                    f"are available ({available}). Call "
                    f"`klm.configure_virtual_devices({math.prod(shape)})` "
                    "first, or pass `devices=`."
                )
            devices = available[: math.prod(shape)]
        devices = np.vectorize(_device_name, otypes=[object])(np.asarray(devices))
        super().__init__(shape, axis_names, devices=devices)

    @property
    def dim_names(self):
        """The axis names, in order (`dtensor.Mesh.dim_names`)."""
        return list(self.axis_names)

    @property
    def size(self):
        """The number of devices in the mesh."""
        return math.prod(self.shape)

    def dim_size(self, name):
        """The number of devices along axis `name`."""
        if name not in self.axis_names:
            raise ValueError(
                f"Axis {name!r} is not in this mesh. Its axes are "
                f"{dict(zip(self.axis_names, self.shape))}."
            )
        return self.shape[list(self.axis_names).index(name)]

    def num_local_devices(self):
        """How many of the mesh's devices belong to this process."""
        return backends.get().num_local_devices(self)

    def get_config(self):
        """The mesh as JSON-ready data (axes and sizes; devices are local)."""
        return {"dims": [[a, s] for a, s in zip(self.axis_names, self.shape)]}

    @classmethod
    def from_config(cls, config):
        return create_mesh([tuple(d) for d in config["dims"]])

    def __eq__(self, other):
        if not isinstance(other, keras_distribution.DeviceMesh):
            return NotImplemented
        return _mesh_key(self) == _mesh_key(other)

    def __hash__(self):
        return hash(_mesh_key(self))

    def __repr__(self):
        dims = ", ".join(f"{a}={s}" for a, s in zip(self.axis_names, self.shape))
        return f"Mesh({dims})"


def _device_name(device):
    """`"cpu:3"` for `"CPU:3"` (the DTensor tutorials' spelling) or
    `"/job:localhost/replica:0/task:0/device:CPU:3"`, so that meshes over the
    same devices compare equal whichever way they were named."""
    if not isinstance(device, str):
        return device
    name = device.split("device:")[-1]
    kind, sep, index = name.rpartition(":")
    return f"{kind.lower()}:{index}" if sep and index.isdigit() else device


def _mesh_key(mesh):
    return (
        tuple(mesh.axis_names),
        tuple(mesh.shape),
        tuple(str(d) for d in np.ravel(mesh.devices)),
    )


def as_mesh(mesh):
    """A `Mesh` for any `keras.distribution.DeviceMesh` (or `None`)."""
    if mesh is None or isinstance(mesh, Mesh):
        return mesh
    if isinstance(mesh, keras_distribution.DeviceMesh):
        return Mesh(mesh.shape, mesh.axis_names, list(np.ravel(mesh.devices)))
    raise TypeError(
        "Expected a `klm.Mesh` or `keras.distribution.DeviceMesh`. "
        f"Received: {mesh!r} of type {type(mesh).__name__}"
    )


def create_mesh(mesh_dims, devices=None):
    """Create a `Mesh` from `[(axis_name, size), ...]`.

    Example:

    >>> import keras_layoutmap as klm
    >>> mesh = klm.create_mesh([("batch", 1)])
    >>> mesh.dim_names, mesh.size
    (['batch'], 1)
    """
    try:
        names, sizes = zip(*[(str(n), int(s)) for n, s in mesh_dims])
    except (TypeError, ValueError):
        raise ValueError(
            "`mesh_dims` must be a list of (axis_name, size) pairs, e.g. "
            f'[("batch", 4), ("model", 2)]. Received: {mesh_dims!r}'
        ) from None
    if devices is not None:
        devices = list(np.ravel(np.asarray(devices, dtype=object)))
        if len(devices) != math.prod(sizes):
            raise ValueError(
                f"A mesh of shape {dict(zip(names, sizes))} needs "
                f"{math.prod(sizes)} devices. Received {len(devices)}: "
                f"{devices}"
            )
    return Mesh(sizes, names, devices)
