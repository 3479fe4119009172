"""A DTensor sharded over processes brought to process 0 alone, for a
one-file save (`keras_layoutmap.one_writer`).

DTensor's multi-client collectives are all-gathers and all-reduces over a
mesh's devices, with no send to one process. So each piece process 0
lacks is sent as a sum over the processes' mesh (`processes.process_mesh`)
in which only the process holding it gives its bytes and every other
process zeros: one piece at a time (in chunks of `CHUNK_WORDS`), every
process receiving it and dropping it but process 0. Bytes are summed as
int32 words, so that every value (a negative zero, a NaN's payload)
arrives bit for bit.
"""

import numpy as np
import tensorflow as tf
from tensorflow.experimental import dtensor

from keras_layoutmap import one_writer
from keras_layoutmap.backends.tensorflow import processes

# A piece goes in sums of at most this many int32 words (2 MiB): TensorFlow's
# reads and DTensor's all-reduce hold several buffers of their operand on
# every process. benchmarks/checkpoint.py (1 GiB, 4 processes, 2026-11-27),
# the processes that do not write: 16 MiB sums 21 s and +266 to +399 MiB,
# 4 MiB 20 s and +133 MiB, 2 MiB 23 s and +57 MiB, 1 MiB 32 s and +30 MiB.
CHUNK_WORDS = 512 * 1024


def _pieces(layout, shape):
    """The piece (start, stop per dimension) each device of `layout`'s
    mesh holds, in the mesh's order of global ids, and their ids."""
    mesh = layout.mesh
    ids = np.asarray(mesh.global_device_ids())
    coords = np.unravel_index(np.arange(ids.size), ids.shape)
    names = list(mesh.dim_names)
    pieces = []
    for position in range(ids.size):
        piece = []
        for spec, length in zip(layout.sharding_specs, shape):
            if spec in (dtensor.UNSHARDED, dtensor.MATCH):
                piece.append((0, length))
                continue
            count = mesh.dim_size(spec)
            at = int(coords[names.index(spec)][position])
            piece.append((at * length // count, (at + 1) * length // count))
        pieces.append(tuple(piece))
    return pieces, [int(i) for i in ids.reshape(-1)]


def _words(piece, nbytes):
    """`piece`'s bytes as int32 words, shape (1, words): a bitcast of its
    own buffer where its items are 4 or 8 bytes (no copy), else padded."""
    if piece.dtype == tf.bool:
        piece = tf.cast(piece, tf.uint8)
    if piece.dtype.size in (4, 8):
        return tf.reshape(tf.bitcast(piece, tf.int32), (1, -1))
    data = tf.reshape(tf.bitcast(piece, tf.uint8), (-1,))
    data = tf.pad(data, [[0, -nbytes % 4]])
    return tf.reshape(tf.bitcast(tf.reshape(data, (-1, 4)), tf.int32), (1, -1))


def _from_process(words, count):
    """`words` (one process's piece as int32 words; None on the other
    processes) on every process: their sum over the processes' mesh."""
    if words is None:
        words = tf.zeros((1, count), tf.int32)
    mesh = processes.shared_process_mesh()
    layout = dtensor.Layout(["proc", dtensor.UNSHARDED], mesh)
    packed = dtensor.pack([words] * processes.local_device_count(), layout)
    del words
    summed = tf.reduce_sum(packed, axis=0)
    del packed
    return dtensor.unpack(summed)[0]


def send_to_writer(x, layout):
    """`x`, a DTensor sharded over processes by `layout`, whole on process
    0 as numpy; None on the other processes, which send the pieces
    process 0 lacks."""
    shape = tuple(int(d) for d in x.shape)
    dtype = np.dtype(x.dtype.as_numpy_dtype)
    per_process = processes.local_device_count()
    me = processes.process_index()
    pieces, ids = _pieces(layout, shape)
    owners = [i // per_process for i in ids]
    local = {int(i): c for i, c in zip(layout.mesh.local_device_ids(),
                                       dtensor.unpack(x))}
    whole = np.empty(shape, dtype) if me == 0 else None
    if me == 0:
        done = set()
        for position, device in enumerate(ids):
            if device in local and pieces[position] not in done:
                done.add(pieces[position])
                whole[one_writer.slices(pieces[position])] = local[device].numpy()
    for position, piece in one_writer.missing_pieces(pieces, owners):
        piece_shape = tuple(stop - start for start, stop in piece)
        nbytes = int(np.prod(piece_shape, dtype=np.int64)) * dtype.itemsize
        count = -(-nbytes // 4)
        words = _words(local[ids[position]], nbytes) \
            if owners[position] == me else None
        data = np.empty(count, np.int32) if me == 0 else None
        for start in range(0, count, CHUNK_WORDS):
            stop = min(start + CHUNK_WORDS, count)
            got = _from_process(
                None if words is None else words[:, start:stop], stop - start)
            if me == 0:
                data[start:stop] = got.numpy().reshape(-1)
            del got
        del words
        if me == 0:
            data = data.view(np.uint8)[:nbytes]
            whole[one_writer.slices(piece)] = data.view(dtype).reshape(piece_shape)
    return whole
