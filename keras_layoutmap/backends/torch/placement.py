"""Meshes, layouts and tensors on them: `torch.distributed`'s `DeviceMesh`
and DTensor (`Shard` / `Replicate` placements) do the work.

A `klm.Mesh` of devices `"cpu:<rank>"` becomes a `DeviceMesh` over those
ranks (made once per mesh, on every process in the same order: making one is
a collective); a `klm.Layout` becomes one placement per mesh axis. A value
that every process knows whole (the contract of `klm.distribute` and of
`auto_shard_dataset=True`) is placed without communication: each process
keeps its own slice (`torch.chunk` semantics, so a dimension the axis does
not divide, like a short last batch, is split unevenly, as DTensor does).
"""

import functools

import numpy as np
import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from keras_layoutmap import one_writer
from keras_layoutmap.backends.torch import processes, writer_transfers
from keras_layoutmap.backends.torch.keras_internals import Variable, convert_to_tensor
from keras_layoutmap.mesh import Mesh

_MESHES = {}


def _rank_of(device):
    name = str(device)
    kind, _, index = name.rpartition(":")
    if kind not in ("cpu", "cuda") or not index.isdigit():
        raise ValueError(
            f"A torch mesh is made of devices 'cpu:<rank>' (or 'cuda:<rank>' "
            f"where torch sees GPUs), one per process. "
            f"Received: {name!r}"
        )
    return int(index)


def to_device_mesh(mesh):
    """The `DeviceMesh` of a `klm.Mesh` (cached: making one is a collective
    every process must take part in)."""
    found = getattr(mesh, "_klm_device_mesh", None)
    if found is not None:
        return found
    devices = tuple(str(d) for d in np.ravel(mesh.devices))
    key = (tuple(mesh.shape), tuple(mesh.axis_names), devices)
    found = _MESHES.get(key)
    if found is None:
        if not processes.is_joined():
            raise RuntimeError(
                f"A torch mesh of {mesh.size} devices spans {mesh.size} "
                "processes, but this process has joined no process group. "
                "Call klm.configure_virtual_devices(n) first, in a script "
                f"started with `python -m keras_layoutmap.launch -n "
                f"{mesh.size} script.py` (or torchrun)."
            )
        ranks = torch.tensor([_rank_of(d) for d in devices]).reshape(
            tuple(mesh.shape))
        kind = str(devices[0]).rpartition(":")[0]
        found = DeviceMesh(kind, ranks, mesh_dim_names=tuple(mesh.axis_names))
        _MESHES[key] = found
        _allow_plain_tensors()
    try:
        mesh._klm_device_mesh = found
    except AttributeError:
        pass
    return found


def _allow_plain_tensors():
    """Plain tensors meet DTensors as replicated values: Keras' ops make
    constants (`torch.as_tensor(0.5)`, masks, random draws) that are the
    same on every process. Turned on once the first mesh exists."""
    DTensor._op_dispatcher._allow_implicit_replication = True


def placements(layout):
    """One placement per mesh axis: `Shard(d)` where tensor dimension `d`
    is split over that axis, else `Replicate()`."""
    axes = [None if a in (None, "unsharded") else a for a in layout.axes]
    result = []
    for name in layout.mesh.axis_names:
        dims = [d for d, axis in enumerate(axes) if axis == name]
        result.append(Shard(dims[0]) if dims else Replicate())
    return tuple(result)


def describe_mesh(device_mesh):
    """`{'batch': 2, 'model': 2}` for a DeviceMesh."""
    names = device_mesh.mesh_dim_names or [
        f"axis{i}" for i in range(device_mesh.ndim)]
    return dict(zip(names, device_mesh.mesh.shape))


def _placed(layout):
    """Whether `layout` needs a DTensor (a mesh of more than one device)."""
    return layout is not None and layout.mesh.size > 1


def local_slices(shape, device_mesh, places, coordinate=None):
    """This process's slice of a tensor of `shape` under `places` (or the
    slice of the device at `coordinate` of `device_mesh`)."""
    index = [slice(None)] * len(shape)
    if coordinate is None:
        coordinate = device_mesh.get_coordinate()
    if coordinate is None:
        raise RuntimeError(
            f"This process (rank {processes.rank()}) is not a device of the "
            f"mesh {device_mesh}: a torch mesh must include every process "
            "that places tensors on it."
        )
    size = list(shape)
    start = [0] * len(shape)
    for mesh_dim, place in enumerate(places):
        if isinstance(place, Shard):
            d = place.dim
            parts = device_mesh.size(mesh_dim)
            chunk = -(-size[d] // parts)  # torch.chunk: ceil
            begin = min(coordinate[mesh_dim] * chunk, size[d])
            end = min(begin + chunk, size[d])
            start[d] += begin
            size[d] = end - begin
    for d in range(len(shape)):
        index[d] = slice(start[d], start[d] + size[d])
    return tuple(index)


def as_dtensor(x, device_mesh):
    """`x` if it is a DTensor, else a plain tensor that every process holds
    alike, as a replicated DTensor on `device_mesh` (no communication)."""
    if isinstance(x, DTensor):
        return x
    return DTensor.from_local(x, device_mesh, [Replicate()] * device_mesh.ndim,
                              run_check=False)


def summed(placements):
    """`placements` with every pending sum (`Partial`) taken."""
    return tuple(Replicate() if isinstance(p, Partial) else p for p in placements)


def sums_taken(x):
    """The DTensor `x` with its pending sums taken (a row-split einsum or
    last layer leaves `Partial` placements); `x` itself if it has none."""
    places = summed(x.placements)
    if places == tuple(x.placements):
        return x
    return x.redistribute(x.device_mesh, places)


def local_piece(x, places, grad_placements=None):
    """This process's piece of the DTensor `x` laid out as `places`
    (redistributed first if it is not); `grad_placements` as in
    `DTensor.to_local`."""
    if tuple(x.placements) != tuple(places):
        x = x.redistribute(x.device_mesh, places)
    return x.to_local(grad_placements=grad_placements)


def contiguous_stride(shape):
    stride, step = [], 1
    for n in reversed(shape):
        stride.append(step)
        step *= max(n, 1)
    return tuple(reversed(stride))


def from_global(value, layout, requires_grad=False):
    """A DTensor with `layout` from `value`, a tensor every process knows
    whole: each process keeps its own slice (no communication)."""
    device_mesh = to_device_mesh(layout.mesh)
    places = placements(layout)
    value = torch.as_tensor(value)
    local = value[local_slices(tuple(value.shape), device_mesh, places)]
    return DTensor.from_local(
        local.contiguous().clone(), device_mesh, places, run_check=False,
        shape=tuple(value.shape), stride=contiguous_stride(tuple(value.shape)),
    ).requires_grad_(requires_grad)


def to_host(value):
    """A plain tensor holding the whole value (every process takes part
    when a DTensor is sharded). During a one-file save across processes
    (`one_writer`), a sharded value goes to process 0 alone: numpy there,
    a placeholder on the other processes."""
    if isinstance(value, DTensor):
        if all(isinstance(p, Replicate) for p in value.placements):
            return value.to_local()
        if one_writer.active() and processes.world_size() > 1:
            return one_writer.received(  # to process 0 alone, as numpy
                writer_transfers.send_to_writer(value), tuple(value.shape),
                writer_transfers.numpy_dtype(value.dtype))
        return value.full_tensor()
    return value


def _torch_value(x):
    return x.value if isinstance(x, Variable) else x


def same_mesh(device_mesh, layout):
    return device_mesh == to_device_mesh(layout.mesh)


def to_layout(value, layout):
    """`value` (plain, numpy or DTensor) as a DTensor with `layout`."""
    value = _torch_value(value)
    if isinstance(value, DTensor):
        if same_mesh(value.device_mesh, layout):
            target = placements(layout)
            if tuple(value.placements) == target:
                return value
            return value.redistribute(value.device_mesh, target)
        value = to_host(value)  # from another mesh: through the whole value
    if isinstance(value, np.ndarray) or not torch.is_tensor(value):
        value = convert_to_tensor(value)
    return from_global(value.detach(), layout)


# -- the backend interface ------------------------------------------------


def distribute(x, layout):
    if not _placed(layout):
        return to_host(convert_to_tensor(_torch_value(x)))
    return to_layout(x, layout)


def pack(components, layout):
    """This process's component (one device per process) as its piece of a
    DTensor with `layout`."""
    if not _placed(layout):
        return torch.as_tensor(np.asarray(components[0]))
    device_mesh = to_device_mesh(layout.mesh)
    places = placements(layout)
    (component,) = components
    local = torch.as_tensor(np.asarray(component)
                            if not torch.is_tensor(component) else component)
    _check_same_shape_everywhere(tuple(local.shape))
    shape = list(local.shape)
    for mesh_dim, place in enumerate(places):
        if isinstance(place, Shard):
            shape[place.dim] *= device_mesh.size(mesh_dim)
    return DTensor.from_local(local, device_mesh, places, run_check=False,
                              shape=tuple(shape),
                              stride=contiguous_stride(tuple(shape)))


def _check_same_shape_everywhere(shape):
    """Each process packs its own component: they must agree in shape, or
    the tensor they make is not one tensor (checked on every process)."""
    import torch.distributed as dist

    if not processes.is_joined() or dist.get_world_size() == 1:
        return
    shapes = [None] * dist.get_world_size()
    dist.all_gather_object(shapes, shape)
    if len(set(shapes)) > 1:
        raise ValueError(
            "pack needs components of one shape on every process. Received, "
            "by process: " + ", ".join(
                f"{r}: {s}" for r, s in enumerate(shapes)) + "."
        )


def unpack(x):
    value = _torch_value(x)
    piece = value.to_local() if isinstance(value, DTensor) else value
    if value is not x:
        # A variable's piece is a reading of it, not a leaf of autograd:
        # `np.asarray` takes it, as on JAX and TensorFlow.
        piece = piece.detach()
    return [piece]


def fetch_layout(x):
    """`(axes, mesh)` read from the DTensor's own mesh and placements."""
    value = _torch_value(x)
    if not torch.is_tensor(value):
        raise TypeError(
            f"Expected a torch tensor or keras.Variable. Received: "
            f"{type(x).__name__}"
        )
    if not isinstance(value, DTensor):
        return [None] * value.ndim, Mesh(
            (1,), ["device"], [processes.local_devices()[0]])
    device_mesh = value.device_mesh
    names = list(device_mesh.mesh_dim_names or
                 [f"axis{i}" for i in range(device_mesh.ndim)])
    mesh = Mesh(tuple(device_mesh.mesh.shape), names,
                [f"{device_mesh.device_type}:{r}"
                 for r in device_mesh.mesh.flatten().tolist()])
    axes = [None] * value.ndim
    for mesh_dim, place in enumerate(value.placements):
        if isinstance(place, Partial):
            raise ValueError(
                f"The tensor holds partial sums over mesh axis "
                f"{names[mesh_dim]!r} (a pending reduction), which no "
                "klm.Layout expresses."
            )
        if isinstance(place, Shard):
            if axes[place.dim] is not None:
                raise ValueError(
                    f"Dimension {place.dim} is sharded over several mesh "
                    f"axes ({axes[place.dim]!r}, {names[mesh_dim]!r}), which "
                    "no klm.Layout expresses."
                )
            axes[place.dim] = names[mesh_dim]
    return axes, mesh


def is_on_mesh(x):
    """Whether `x` (a tensor or a variable) is a DTensor on a mesh."""
    return isinstance(_torch_value(x), DTensor)


def device_bytes(x):
    """`{device: bytes}` of the piece of `x` this process holds."""
    value = _torch_value(x)
    piece = value.to_local() if isinstance(value, DTensor) else value
    return {processes.local_devices()[0]: piece.numel() * piece.element_size()}


def wrap_convert_to_numpy(original):
    @functools.wraps(original)
    def convert_to_numpy(x):
        x = _torch_value(x)
        if isinstance(x, (list, tuple)):
            x = type(x)(to_host(_torch_value(e)) for e in x)
        host = to_host(x)
        if isinstance(host, np.ndarray) and host is not x:
            return host  # a one-file save's: Keras' copy would be a second
        return original(host)

    return convert_to_numpy
