"""What `keras.distribution` asks of a backend, for torch (Keras 3.15 ships
none: `keras.distribution.list_devices()`, `DeviceMesh`, `TensorLayout`,
`distribute_tensor` and the layout rules for a layer's output fail on
torch). Installed as Keras' `distribution_lib` for the torch backend."""

from keras_layoutmap.backends.torch import devices, placement, processes
from keras_layoutmap.layout import as_layout
from keras_layoutmap.processes import initialize as klm_initialize


def list_devices(device_type=None):
    kind = {"gpu": "cuda"}.get(str(device_type).lower(), str(device_type).lower())
    if device_type is not None and kind != devices.kind():
        return []
    return processes.list_devices()


def get_device_count(device_type=None):
    return len(list_devices(device_type))


def initialize(job_addresses=None, num_processes=None, process_id=None):
    address = job_addresses.split(",")[0] if job_addresses else None
    klm_initialize(address, num_processes, process_id)


def num_processes():
    return processes.process_count()


def process_id():
    return processes.process_index()


def _to_backend_mesh(device_mesh):
    return placement.to_device_mesh(device_mesh)


def _to_backend_layout(tensor_layout):
    return placement.placements(as_layout(tensor_layout))


def distribute_tensor(tensor, layout):
    """`tensor` with `layout` (a layer's output laid out by a rule)."""
    layout = as_layout(layout)
    if layout.mesh.size <= 1:
        return tensor
    return placement.to_layout(tensor, layout)
