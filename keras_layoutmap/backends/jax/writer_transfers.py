"""A value sharded over processes brought to process 0 alone, for a
one-file save (`keras_layoutmap.one_writer`).

JAX offers no gather to one process, and `jax.device_put` does not move
an array between device sets across processes. So each piece process 0
lacks is moved by a `ppermute` from the device that holds it to one of
process 0's devices, inside `shard_map` over the value's own mesh: one
piece at a time, the other devices receiving nothing (a zero-filled
buffer of the piece's size, freed at once). Moving a piece compiles once
per (mesh, spec, source, shape): a save of the same model again compiles
nothing.
"""

import functools

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from keras_layoutmap import one_writer


def _piece(index, shape):
    """A device's index (slices) as a hashable tuple of (start, stop)."""
    return tuple(s.indices(n)[:2] for s, n in zip(index, shape))


@functools.lru_cache(maxsize=256)
def _move(mesh, spec, source, target):
    """A function moving the piece at mesh position `source` to position
    `target`, as a (devices, *piece) array over every axis of `mesh`."""
    axes = tuple(mesh.axis_names)

    def body(piece):
        return jax.lax.ppermute(piece, axes, [(source, target)])[None]

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec,
                                 out_specs=P(axes), check_vma=False))


def send_to_writer(array):
    """`array` (sharded over processes) whole on process 0, as numpy;
    None on the other processes, which send the pieces process 0 lacks."""
    writer = jax.process_index() == 0
    sharding = array.sharding
    if not isinstance(sharding, NamedSharding):
        whole = np.asarray(multihost_utils.process_allgather(array, tiled=True))
        return whole if writer else None
    mesh = sharding.mesh
    devices = list(mesh.devices.flat)
    indices = sharding.devices_indices_map(array.shape)
    pieces = [_piece(indices[d], array.shape) for d in devices]
    processes = [d.process_index for d in devices]
    whole = np.empty(array.shape, array.dtype) if writer else None
    if writer:
        done = set()
        for shard in array.addressable_shards:
            piece = _piece(shard.index, array.shape)
            if piece not in done:
                done.add(piece)
                whole[one_writer.slices(piece)] = np.asarray(shard.data)
    missing = one_writer.missing_pieces(pieces, processes)
    if missing:
        target = processes.index(0)
        for source, piece in missing:
            moved = _move(mesh, sharding.spec, source, target)(array)
            if writer:
                held = next(s for s in moved.addressable_shards
                            if s.device == devices[target])
                whole[one_writer.slices(piece)] = np.asarray(held.data)[0]
            del moved
    return whole
