"""One value on every process: the contract of a host value placed on a
mesh that spans processes.

Each process places its own devices' pieces of the value it holds (no
communication of the value itself), so every process must hold the same
one: the same file, the same seed. A backend checks it by gathering a
CRC-32 of each process's bytes (with the shape and dtype), a few bytes a
process: `digest` makes it, `check_same` compares what the backend
gathered and raises `ValueDiffersAcrossProcesses` on every process where
they differ.

    >>> import numpy as np
    >>> def of(host):
    ...     return digest(host.view(np.uint8), host.shape, host.dtype)
    >>> mine = of(np.arange(4, dtype="float32"))
    >>> check_same([mine, mine], 0, (4,), "float32")
    >>> try:
    ...     check_same([mine, of(np.zeros(4, "float32"))], 0, (4,),
    ...                "float32")
    ... except ValueDiffersAcrossProcesses as e:
    ...     print(str(e)[:61])
    A value of shape (4,) and dtype float32 placed on a mesh that
"""

import contextlib
import zlib

import numpy as np


class ValueDiffersAcrossProcesses(ValueError):
    """A value placed on a mesh that spans processes is not the same on
    every process."""


def digest(data, shape, dtype):
    """Two int32 of a value: the CRC-32 of `data`, its bytes in C order (a
    buffer: a numpy view as uint8, `bytes`), and of its `shape` and `dtype`
    (int32: JAX's default integers)."""
    kind = repr((tuple(shape), str(dtype))).encode()
    return np.asarray([zlib.crc32(data), zlib.crc32(kind)],
                      np.uint32).view(np.int32)


def check_same(every, index, shape, dtype):
    """Raise `ValueDiffersAcrossProcesses` where `every` (each process's
    `digest`, in process order) differs from `every[index]`, this
    process's."""
    mine = np.asarray(every[index])
    differ = [i for i, d in enumerate(every) if not np.array_equal(d, mine)]
    if differ:
        raise ValueDiffersAcrossProcesses(
            f"A value of shape {tuple(shape)} and dtype {dtype} placed on a "
            f"mesh that spans {len(every)} processes is not the same on every "
            f"process: process {index}'s differs from process(es) {differ}'s. "
            "Each process places its own pieces of the value it holds, so "
            "every process must pass the same one (the same file, the same "
            "seed).")


@contextlib.contextmanager
def naming(path):
    """Within it, a `ValueDiffersAcrossProcesses` names the variable at
    `path` (an assignment's check, from any backend)."""
    try:
        yield
    except ValueDiffersAcrossProcesses as e:
        raise ValueDiffersAcrossProcesses(f"Variable {path!r}: {e}") from None
