import os

import pytest

import keras_layoutmap as klm
from keras_layoutmap import backends

# The first call after import, as a user script does. `sharding` tests need a
# backend that places tensors on a mesh (JAX, TensorFlow); `training` tests
# need `model.fit` on a mesh (JAX). nox deselects what a backend cannot do.
SHARDING = backends.get().SHARDING
TRAINING = backends.get().TRAINING
if SHARDING:
    klm.configure_virtual_devices(8)

import keras  # noqa: E402


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


def pytest_collection_modifyitems(config, items):
    backend = os.environ.get("KERAS_BACKEND")
    for item in items:
        if "sharding" in item.keywords and not SHARDING:
            item.add_marker(pytest.mark.skip(
                reason=f"needs a backend that places tensors on a mesh; the "
                f"{backend} backend cannot yet"))
        elif "training" in item.keywords and not TRAINING:
            item.add_marker(pytest.mark.skip(
                reason=f"needs model.fit on a mesh; not built yet for the "
                f"{backend} backend"))
