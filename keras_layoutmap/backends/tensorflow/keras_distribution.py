"""What `keras.distribution` asks of the TensorFlow backend's
`distribution_lib`, answered for every process of a run.

Keras' own module ("DO NOT USE") lists `tf.config.list_logical_devices()`,
whose names are per process: under DTensor multi-client, two processes of
four CPUs each both say `cpu:0 ... cpu:3`, and the Keras distribution
guide's `DeviceMesh(shape, axis_names,
devices=keras.distribution.list_devices())` is refused for naming a device
twice. It has no `get_device_count`, `initialize`, `num_processes` or
`process_id` either (`keras.distribution.get_device_count()` and
`keras.distribution.initialize()` raise `AttributeError`). These replace
them in Keras' module (`install`): the devices a mesh may use are
`klm.list_devices()`'s, global ids over all processes.
"""

import os

from keras_layoutmap.backends.tensorflow import devices, placement, processes
from keras_layoutmap.processes import initialize as klm_initialize

_ORIGINAL = {}


def _kind(device_type):
    """`device_type` as TensorFlow's device type (`"CPU"`, `"GPU"`, ...),
    or None."""
    if device_type is None:
        return None
    kind = str(device_type).strip().upper()
    return {"CUDA": "GPU"}.get(kind, kind)


def list_devices(device_type=None):
    """Every device of every process, once (`klm.list_devices()`), when
    `device_type` is None (the devices meshes use: GPUs where TensorFlow sees
    them, logical CPUs after `klm.configure_virtual_devices`) or names their
    type. Another type, as Keras documents, lists the devices of that type
    only, never a mix: in one process those TensorFlow sees (a one-process
    mesh may use them), across processes none (DTensor multi-client meshes
    hold the run's own device type only)."""
    kind = _kind(device_type)
    if kind is None or kind == devices.kind():
        return placement.list_devices()
    if processes.process_count() > 1:
        return []
    original = _ORIGINAL.get("list_devices")
    return list(original(kind.lower())) if original is not None else []


def get_device_count(device_type=None):
    return len(list_devices(device_type))


def initialize(job_addresses=None, num_processes=None, process_id=None):
    """`keras.distribution.initialize`: join the run as `klm.initialize`
    does. On TensorFlow, Keras' `job_addresses` names every process (the
    DTensor jobs, the first also the coordinator). A process that already
    joined (`klm.configure_virtual_devices` under the launcher, or
    `klm.initialize`) stays in its run."""
    if processes.process_count() > 1:
        joined = (processes.process_count(), processes.process_index())
        asked = (num_processes, process_id)
        if any(a is not None and int(a) != j for a, j in zip(asked, joined)):
            raise ValueError(
                f"keras.distribution.initialize(num_processes={num_processes}, "
                f"process_id={process_id}): this process already joined a run "
                f"of {joined[0]} processes as process {joined[1]}.")
        return
    addresses = [a.strip() for a in (job_addresses or "").split(",") if a.strip()]
    if len(addresses) > 1:
        os.environ.setdefault("DTENSOR_JOBS", ",".join(addresses))
        if num_processes is None:
            num_processes = len(addresses)
    klm_initialize(addresses[0] if addresses else None, num_processes,
                   process_id)


def num_processes():
    return processes.process_count()


def process_id():
    return processes.process_index()


def install(module):
    """Put these functions in Keras' TensorFlow `distribution_lib` (once:
    the original `list_devices` is kept for other device types)."""
    if "list_devices" not in _ORIGINAL:
        original = module.__dict__.get("_klm_original_list_devices",
                                       module.list_devices)
        module._klm_original_list_devices = original
        _ORIGINAL["list_devices"] = original
    for function in (list_devices, get_device_count, initialize,
                     num_processes, process_id):
        setattr(module, function.__name__, function)
