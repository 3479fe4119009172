"""A save called on one process only (`if rank == 0: model.save_weights`):
saved by it alone when it holds the model whole, else an error at once
that says to call it on every process; nothing hangs."""

import time

import keras
import numpy as np
import pytest
from helpers import SPANS_PROCESSES, dp_mesh, mp_mesh

import keras_layoutmap as klm
from keras_layoutmap import backends

pytestmark = [pytest.mark.sharding, pytest.mark.training]

needs_processes = pytest.mark.skipif(
    not SPANS_PROCESSES, reason="needs a mesh that spans processes (the "
    "launcher's); one process holds every device elsewhere")


@pytest.fixture(autouse=True)
def _short_handshake(monkeypatch):
    # The processes meet at a barrier before each save of these tests: 2 s
    # is plenty, and a save on process 0 only waits that long.
    monkeypatch.setenv("KLM_SAVE_HANDSHAKE_TIMEOUT", "2")


def build(seed=0):
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((8,)),
                              keras.layers.Dense(16, name="d1"),
                              keras.layers.Dense(4, name="d2")])
    return model


def sharded_map(mesh):
    lm = klm.LayoutMap(mesh)
    lm[r"d1.kernel"] = (None, "model")
    lm[r"d2.kernel"] = ("model", None)
    return lm


def assert_loads_equal(path, model):
    fresh = build(seed=7)
    fresh.load_weights(path)
    for a, b in zip(fresh.get_weights(), model.get_weights()):
        np.testing.assert_array_equal(a, b)


@needs_processes
def test_sharded_save_on_process_0_only_fails_at_once(tmp_path):
    with sharded_map(mp_mesh()).scope():
        model = build()
    assert not klm.fetch_layout(model.get_layer("d1").kernel).is_fully_replicated()
    path = str(tmp_path / "sharded.weights.h5")
    if klm.process_index() == 0:
        start = time.monotonic()
        with pytest.raises(RuntimeError, match="call it on every process"):
            model.save_weights(path)
        assert time.monotonic() - start < 10
    # The others started nothing: they wait here, not in a gather.
    backends.get().barrier("after_failed_save")
    # Called on every process, it pairs up again and saves.
    model.save_weights(path)
    assert_loads_equal(path, model)


@needs_processes
def test_orbax_checkpoint_on_process_0_only_fails_at_once(tmp_path):
    if klm.process_index() == 0:
        start = time.monotonic()
        with pytest.raises(RuntimeError, match="on every process"):
            keras.callbacks.OrbaxCheckpoint(str(tmp_path / "ckpt"))
        assert time.monotonic() - start < 10
    backends.get().barrier("after_failed_orbax_checkpoint")


@needs_processes
def test_replicated_save_on_process_0_only_works(tmp_path):
    with klm.DataParallel(dp_mesh()).scope():
        model = build()
    path = str(tmp_path / "replicated.weights.h5")
    if klm.process_index() == 0:
        model.save_weights(path)
    backends.get().barrier("after_save")
    assert_loads_equal(path, model)


def test_save_inside_process_0_works_where_one_process_holds_the_mesh(tmp_path):
    if SPANS_PROCESSES:
        pytest.skip("one process holds every device only on JAX and TF, or "
                    "torch without the launcher")
    with sharded_map(mp_mesh()).scope():
        model = build()
    assert not klm.fetch_layout(model.get_layer("d1").kernel).is_fully_replicated()
    path = str(tmp_path / "one.weights.h5")
    assert klm.process_index() == 0
    start = time.monotonic()
    model.save_weights(path)
    assert time.monotonic() - start < 10
    assert_loads_equal(path, model)


@pytest.mark.skipif(backends.name() != "torch", reason="torch's own pieces")
@pytest.mark.parametrize("placements", [("shard0", "shard1"),
                                        ("shard1", "shard1"),
                                        ("replicate", "shard0")])
def test_the_pieces_a_one_file_save_sends_are_torchs_own(placements):
    """The piece each device holds, as a one-file save computes it for a
    device of another process (`writer_transfers._piece`), is the one
    torch's `Shard` makes: `torch.chunk` mesh dimension after mesh
    dimension, uneven and empty pieces included (7 rows over 2 then 3)."""
    import torch
    from torch.distributed.tensor import Replicate, Shard

    from keras_layoutmap.backends.torch import writer_transfers

    made = {"shard0": Shard(0), "shard1": Shard(1), "replicate": Replicate()}
    placements = [made[p] for p in placements]
    whole = torch.arange(5 * 7).reshape(5, 7)
    mesh_shape = (2, 3)
    for coordinate in np.ndindex(*mesh_shape):
        piece = whole
        for mesh_dim, placement in enumerate(placements):
            if isinstance(placement, Shard):
                chunks = piece.chunk(mesh_shape[mesh_dim], placement.dim)
                at = coordinate[mesh_dim]
                piece = chunks[at] if at < len(chunks) else piece.narrow(
                    placement.dim, 0, 0)
        found = writer_transfers._piece((5, 7), mesh_shape, coordinate,
                                        placements)
        slices = tuple(slice(a, b) for a, b in found)
        assert torch.equal(whole[slices], piece), (coordinate, found)
