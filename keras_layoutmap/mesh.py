"""Device meshes: `Mesh`, `create_mesh`, `list_devices`, virtual devices."""

import itertools
import math
import numbers

import numpy as np
from keras import distribution as keras_distribution

from keras_layoutmap import backends
from keras_layoutmap.processes import configure_devices


def configure_virtual_devices(n):
    """Make `n` logical CPU devices available to this process.

    Call it first, before anything touches a device. On JAX and TensorFlow the
    devices live in this process; on PyTorch a mesh spans processes, so this
    checks that the script was started with
    `python -m keras_layoutmap.launch -n N` and a world size of `n`, and
    joins them over gloo. The devices are CPUs on every backend, also where
    GPUs are seen (the demo path: on GPUs, leave it out, and on several
    processes call `klm.initialize()`).

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
    configure_devices(n)


def list_devices():
    """The devices a mesh may use, across all processes (e.g. `"cpu:3"`)."""
    return list(backends.get().list_devices())


class MeshShape(tuple):
    """A mesh's shape: a tuple, as Keras' `DeviceMesh.shape` property gives,
    that can also be called, as `dtensor.Mesh.shape()` is, returning a list.

    >>> from keras_layoutmap.mesh import MeshShape
    >>> shape = MeshShape((4, 2))
    >>> shape, shape(), shape == (4, 2)
    ((4, 2), [4, 2], True)
    """

    __slots__ = ()

    def __call__(self):
        return list(self)


def _sizes(shape, axis_names):
    """`shape` as ints, refusing what is not a positive whole number."""
    sizes = []
    for name, size in zip(axis_names, shape):
        if isinstance(size, bool) or not isinstance(size, numbers.Integral):
            raise ValueError(
                f"Mesh axis {name!r} has size {size!r} of type "
                f"{type(size).__name__}; a mesh axis size must be a positive "
                "integer."
            )
        if size < 1:
            raise ValueError(
                f"Mesh axis {name!r} has size {size}; a mesh axis size must "
                "be a positive integer."
            )
        sizes.append(int(size))
    return tuple(sizes)


def _check_devices(devices, dims):
    """Refuse a device named twice, or one this process cannot see."""
    seen = set()
    for device in devices:
        if device in seen:
            raise ValueError(
                f"A mesh of shape {dims} names device {device!r} more than "
                f"once (devices={[str(d) for d in devices]}); each device may "
                "hold one place in a mesh."
            )
        seen.add(device)
    if not backends.get().SHARDING:
        return  # nothing is placed on this backend: the names are labels
    available = list_devices()
    unknown = [d for d in devices if isinstance(d, str) and d not in available]
    if unknown:
        raise ValueError(
            f"A mesh of shape {dims} names device(s) {unknown} that do not "
            f"exist. The devices are {_summary(available)} (klm.list_devices()"
            "); call klm.configure_virtual_devices(n) first for more CPU "
            "devices."
        )


def _summary(devices):
    if len(devices) <= 4:
        return str(devices)
    return f"{len(devices)}: {devices[0]} ... {devices[-1]}"


class Mesh(keras_distribution.DeviceMesh):
    """A named grid of devices; a `keras.distribution.DeviceMesh`.

    Build one with `create_mesh`. Besides Keras' `shape`, `axis_names` and
    `devices`, it offers the `tf.experimental.dtensor.Mesh` vocabulary ported
    code calls (`dim_names`, `size`, `dim_size`, `num_local_devices`,
    `device_type()`, `local_devices()`, `local_device_ids()`,
    `global_device_ids()`, `host_mesh()`, `strides`, `unravel_index()`,
    `coords()`, `contains_dim()`), and compares by value, so that layouts on
    equal meshes are equal. `shape` serves both worlds: it is a tuple
    (Keras) and calling it, `mesh.shape()`, gives a list (DTensor).

    A mesh uses every device unless `devices=` names the ones it uses, as
    `dtensor.create_mesh` and `jax.make_mesh` require.

    Example:

    >>> import keras_layoutmap as klm
    >>> mesh = klm.create_mesh([("x", 2), ("y", 1)],
    ...                        devices=klm.list_devices()[:2])
    >>> mesh.shape, mesh.shape(), mesh.strides
    ((2, 1), [2, 1], [1, 1])
    >>> mesh.unravel_index()
    {0: {'x': 0, 'y': 0}, 1: {'x': 1, 'y': 0}}
    """

    def __init__(self, shape, axis_names, devices=None, *, _planning=False):
        axis_names = [str(a) for a in axis_names]
        if len(set(axis_names)) != len(axis_names):
            raise ValueError(
                f"Mesh axis names must be unique. Received: {axis_names}"
            )
        shape = _sizes(shape, axis_names)
        dims = dict(zip(axis_names, shape))
        size = math.prod(shape)
        if devices is None:
            available = list_devices()
            if size != len(available):
                fix = (
                    f"Call `klm.configure_virtual_devices({size})` first, or "
                    if size > len(available) else "To use some of them, "
                )
                raise ValueError(
                    f"A mesh of shape {dims} has {size} devices, but there are "
                    f"{len(available)} ({_summary(available)}). A mesh spans "
                    f"every device unless `devices=` names them. {fix}pass "
                    f"`devices=` (e.g. klm.list_devices()[:{size}])."
                )
            devices = available
        devices = np.vectorize(_device_name, otypes=[object])(
            np.asarray(devices, dtype=object))
        if not _planning:
            _check_devices(list(np.ravel(devices)), dims)
        super().__init__(MeshShape(shape), axis_names, devices=devices)

    @classmethod
    def for_planning(cls, mesh_dims):
        """A mesh of placeholder devices (`"cpu:0"`, `"cpu:1"`, ...), of any
        size, whatever this machine has: enough for rules, `explain` and
        `klm explain`, which never place a tensor. Nothing can be placed on
        it unless the devices exist.

        Example:

        >>> import keras_layoutmap as klm
        >>> klm.Mesh.for_planning([("batch", 16), ("model", 64)]).size
        1024
        """
        names, sizes = _dims(mesh_dims)
        return cls(sizes, names, [f"cpu:{i}" for i in range(math.prod(sizes))],
                   _planning=True)

    @property
    def shape(self):
        """The axis sizes: a tuple, also callable (`mesh.shape()`, a list,
        as `dtensor.Mesh.shape()`)."""
        return MeshShape(self._shape)

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

    def contains_dim(self, name):
        """Whether the mesh has an axis `name`."""
        return name in self.axis_names

    def num_local_devices(self):
        """How many of the mesh's devices belong to this process."""
        return backends.get().num_local_devices(self)

    def device_type(self):
        """`"CPU"`, `"GPU"` or `"TPU"`: the kind of the mesh's devices
        (torch's `"cuda:<rank>"` devices are GPUs)."""
        kinds = {str(d).split(":")[0].upper().replace("CUDA", "GPU")
                 for d in np.ravel(self.devices)}
        if len(kinds) != 1:
            raise ValueError(f"{self!r} mixes device kinds {sorted(kinds)}.")
        return kinds.pop()

    def global_device_ids(self):
        """The position of every device in the mesh, shaped like the mesh
        (row-major: `[[0, 1], [2, 3], ...]`)."""
        return np.arange(self.size, dtype=np.int64).reshape(self.shape)

    def local_device_ids(self):
        """The global ids of this process's devices, in mesh order."""
        if self.num_local_devices() == self.size:
            return list(range(self.size))
        local = set(backends.get().local_devices())
        return [i for i, d in enumerate(np.ravel(self.devices)) if str(d) in local]

    def local_devices(self):
        """This process's devices of the mesh, in mesh order (`"cpu:3"`)."""
        names = [str(d) for d in np.ravel(self.devices)]
        return [names[i] for i in self.local_device_ids()]

    def host_mesh(self):
        """The same mesh over CPU devices (itself when it is on CPUs)."""
        if self.device_type() == "CPU":
            return self
        cpus = [d for d in list_devices() if d.startswith("cpu:")]
        return Mesh(self.shape, self.axis_names, cpus[: self.size])

    @property
    def strides(self):
        """How far apart, in device ids, neighbours along each axis are: for
        shape `[a, b, c]`, `[b*c, c, 1]`."""
        return [math.prod(self.shape[i + 1:]) for i in range(len(self.shape))]

    def unravel_index(self):
        """`{device_id: {axis_name: index}}` for every device."""
        positions = itertools.product(*(range(s) for s in self.shape))
        return {i: dict(zip(self.axis_names, (int(p) for p in pos)))
                for i, pos in enumerate(positions)}

    def coords(self, device_idx):
        """The mesh coordinates of device `device_idx` (a numpy array)."""
        return (int(device_idx) // np.asarray(self.strides)) % np.asarray(
            self.shape)

    def get_config(self):
        """The mesh as JSON-ready data (axes and sizes; devices are local)."""
        return {"dims": [[a, s] for a, s in zip(self.axis_names, self.shape)]}

    @classmethod
    def from_config(cls, config):
        """A mesh of the config's axes over this process's first devices."""
        dims = [tuple(d) for d in config["dims"]]
        size = math.prod(int(s) for _, s in dims)
        available = list_devices()
        return create_mesh(
            dims, devices=available[:size] if size <= len(available) else None)

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
    """`"cpu:3"` for `"CPU:3"` (the DTensor tutorials' spelling),
    `"/job:localhost/replica:0/task:0/device:CPU:3"` or a device object with
    `platform` and `id` (JAX's), so that meshes over the same devices compare
    equal whichever way they were named."""
    if not isinstance(device, str):
        platform, index = getattr(device, "platform", None), getattr(
            device, "id", None)
        if isinstance(platform, str) and isinstance(index, int):
            return f"{platform}:{index}"
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


def live_mesh(mesh):
    """`as_mesh(mesh)`, made once per Keras `DeviceMesh` (the same `Mesh`
    each time, so layouts made from it compare as the same mesh) and made
    again if the Keras mesh's shape, axis names or devices change."""
    if mesh is None or isinstance(mesh, Mesh):
        return mesh
    key = (tuple(mesh.shape), tuple(mesh.axis_names),
           tuple(str(d) for d in np.ravel(mesh.devices)))
    cached = mesh.__dict__.get("_klm_mesh")
    if cached is None or cached[0] != key:
        cached = (key, as_mesh(mesh))
        mesh.__dict__["_klm_mesh"] = cached
    return cached[1]


def _dims(mesh_dims):
    """`(names, sizes)` of `[(axis_name, size), ...]`, checked."""
    try:
        names, sizes = zip(*[(str(n), s) for n, s in mesh_dims])
    except (TypeError, ValueError):
        raise ValueError(
            "`mesh_dims` must be a list of (axis_name, size) pairs, e.g. "
            f'[("batch", 4), ("model", 2)]. Received: {mesh_dims!r}'
        ) from None
    return names, _sizes(sizes, names)


def create_mesh(mesh_dims, devices=None):
    """Create a `Mesh` from `[(axis_name, size), ...]`.

    The mesh spans every device (`klm.list_devices()`) unless `devices=`
    names the ones it uses; a size that differs from the device count is an
    error, as in `dtensor.create_mesh` and `jax.make_mesh`.

    Example:

    >>> import keras_layoutmap as klm
    >>> mesh = klm.create_mesh([("batch", len(klm.list_devices()))])
    >>> mesh.dim_names, mesh.size == len(klm.list_devices())
    (['batch'], True)
    >>> klm.create_mesh([("batch", 1)], devices=klm.list_devices()[:1]).size
    1
    """
    names, sizes = _dims(mesh_dims)
    if devices is not None:
        devices = list(np.ravel(np.asarray(devices, dtype=object)))
        if len(devices) != math.prod(sizes):
            raise ValueError(
                f"A mesh of shape {dict(zip(names, sizes))} needs "
                f"{math.prod(sizes)} devices. Received {len(devices)}: "
                f"{devices}"
            )
    return Mesh(sizes, names, devices)
