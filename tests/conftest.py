import hashlib
import os
import pathlib
import re
import tempfile

import numpy as np
import pytest

import keras_layoutmap as klm
from keras_layoutmap import backends

# The first call after import, as a user script does. `sharding` tests need a
# backend that places tensors on a mesh; `training` tests need `model.fit` on
# a mesh. On JAX and TensorFlow the run makes 8 devices in this process. On
# torch a mesh spans processes, one device each: the run has as many devices
# as the launcher started processes (`python -m keras_layoutmap.launch -n 4
# -m pytest`, as `nox -s tests-torch` does), every rank running the same
# session and each test collectively.
BACKEND = backends.name()
SHARDING = backends.get().SHARDING
TRAINING = backends.get().TRAINING
if BACKEND == "torch":
    DEVICES = int(os.environ.get("WORLD_SIZE", "1"))
    if DEVICES > 1:
        klm.configure_virtual_devices(DEVICES)
else:
    # KLM_TEST_DEVICES (default 8) checks the suite at another count, e.g.
    # 4 as a torch run has.
    DEVICES = int(os.environ.get("KLM_TEST_DEVICES", "8"))
    if SHARDING:
        klm.configure_virtual_devices(DEVICES)

# True where each process holds one device of a mesh spanning several.
SPANS_PROCESSES = BACKEND == "torch" and DEVICES > 1

import keras  # noqa: E402


def device_names(n):
    """The names of the run's first `n` devices (`"cpu:0"`, ...)."""
    return [f"cpu:{i}" for i in range(n)]


def dp_mesh():
    """A data-parallel mesh over every device of the run."""
    return klm.create_mesh([("batch", DEVICES)])


def mp_mesh(axis="model"):
    """A (batch, `axis`) mesh over every device of the run, `axis` 2 wide:
    (4, 2) on 8 devices, (2, 2) on 4."""
    return klm.create_mesh([("batch", DEVICES // 2), (axis, 2)])


def local_shards(value, layout):
    """What `klm.unpack` of `value` laid out as `layout` gives in this
    process: the piece each of its devices holds, in mesh order, cut here
    from the whole numpy `value`."""
    mesh = layout.mesh
    names = list(mesh.axis_names)
    pieces = []
    for device in mesh.local_device_ids():
        position = np.unravel_index(device, tuple(mesh.shape))
        index = []
        for size, axis in zip(value.shape, layout.axes):
            if axis is None:
                index.append(slice(None))
                continue
            parts = mesh.dim_size(axis)
            step = size // parts
            start = step * int(position[names.index(axis)])
            index.append(slice(start, start + step))
        pieces.append(value[tuple(index)])
    return pieces


def fake_mesh(dims):
    """A mesh over named (not real) devices: enough for rules, layouts and
    explain, which never place a tensor."""
    return klm.Mesh.for_planning(dims)


@pytest.fixture
def mesh_2d():
    return fake_mesh([("batch", 4), ("model", 2)])


@pytest.fixture(autouse=True)
def _clean_state():
    keras.backend.clear_session()
    klm.set_distribution(None)
    yield
    klm.set_distribution(None)


def _collective(item):
    return "sharding" in item.keywords or "training" in item.keywords


if SPANS_PROCESSES:
    @pytest.fixture
    def tmp_path(request, tmp_path_factory):
        """pytest's `tmp_path`, except in a test that every rank executes
        together (`sharding`, `training`): there all ranks get the same
        folder, as a user's script saves and loads one checkpoint path on
        every rank."""
        name = re.sub(r"[\W]", "_", request.node.name)[:30]
        if not _collective(request.node):
            return tmp_path_factory.mktemp(name, numbered=True)
        # The ranks' common parent is the launcher; with its port it names
        # the run.
        run = f"klm-pytest-{os.getppid()}-{os.environ.get('MASTER_PORT', '0')}"
        test = hashlib.sha1(request.node.nodeid.encode()).hexdigest()[:10]
        path = pathlib.Path(tempfile.gettempdir(), run, f"{name}-{test}")
        path.mkdir(parents=True, exist_ok=True)
        return path


_ONE_PROCESS_PER_DEVICE = (
    "needs a mesh of several devices; on torch one device per process: run "
    "under `python -m keras_layoutmap.launch -n 4 -m pytest` (nox -s "
    "tests-torch does)")


def pytest_collection_modifyitems(config, items):
    for item in items:
        processes = "processes" in item.keywords
        if processes and SPANS_PROCESSES:
            item.add_marker(pytest.mark.skip(
                reason="starts its own processes; every rank of this run would "
                "start them: run it from one process"))
        elif (BACKEND == "torch" and DEVICES < 4 and _collective(item)
                and not processes):
            item.add_marker(pytest.mark.skip(reason=_ONE_PROCESS_PER_DEVICE))
        elif "sharding" in item.keywords and not SHARDING:
            item.add_marker(pytest.mark.skip(
                reason=f"needs a backend that places tensors on a mesh; the "
                f"{BACKEND} backend cannot yet"))
        elif "training" in item.keywords and not TRAINING:
            item.add_marker(pytest.mark.skip(
                reason=f"needs model.fit on a mesh; not built yet for the "
                f"{BACKEND} backend"))
