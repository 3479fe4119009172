"""The PyTorch backend. A torch mesh spans processes (gloo); placement of
tensors and variables on it is not built yet."""

import os

from keras_layoutmap.backends._unsupported import not_built, not_built_message

SHARDING = False
TRAINING = False

NOT_BUILT = not_built_message("torch", "the torch backend, not yet filed")
_unbuilt = not_built(NOT_BUILT)
fetch_layout = distribute = pack = unpack = _unbuilt
relayout_variable = unplace_variable = _unbuilt


def _world_size():
    return int(os.environ.get("WORLD_SIZE", "1"))


# A torch mesh spans processes, one device each; no process group is made
# yet, so every process still computes alone.
MULTI_PROCESS = True


def join(cluster, total_devices=None):
    if total_devices is not None:
        configure_virtual_devices(total_devices)


def process_count():
    return 1


def process_index():
    return 0


def barrier(name):
    pass


def configure_virtual_devices(n):
    world = _world_size()
    if n != 1 and world != n:
        raise RuntimeError(
            f"On the torch backend a mesh of {n} devices spans {n} processes, "
            f"but this process runs in a world of {world}. Start the script "
            f"with `python -m keras_layoutmap.launch -n {n} script.py` (or "
            f"`torchrun --nproc-per-node {n} script.py`)."
        )


def list_devices():
    return [f"cpu:{i}" for i in range(_world_size())]


def num_local_devices(mesh):
    return 1 if _world_size() > 1 else mesh.size


def install():
    pass


def local_devices():
    """This process's device: one per process in a launched world."""
    if _world_size() > 1:
        return [f"cpu:{os.environ.get('RANK', '0')}"]
    return list_devices()
