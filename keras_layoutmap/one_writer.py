"""One file from a save called on every process, streamed to process 0.

`model.save_weights(path)` and `model.save(path)` across processes run
Keras' own save on every process (`process_saves`): Keras converts the
same values in the same order everywhere, one value at a time. While
`writing(...)` is active, a backend's host conversion of a value sharded
over processes (`convert_to_numpy`, `np.asarray(variable)`) brings that
value to process 0 alone, instead of gathering it whole on every process:

- process 0 (the writer) receives the pieces its own devices lack, one
  sender at a time, and gets the whole value, which Keras writes;
- every other process sends the pieces the writer lacks (`missing_pieces`
  says which) and gets `placeholder(shape, dtype)`: an array of the
  value's shape and dtype whose memory is never written. Its save goes to a
  scratch file, where `h5py` makes a dataset of that shape and dtype
  without writing values (HDF5 allocates a dataset's storage only when
  values are written).

So a save adds to process 0 about its largest value (Keras writes the
array the backend filled, with no copy) and a piece in transit, and to
every other process about one piece (what a transfer holds), whatever the
model's size; TensorFlow holds a few pieces more (benchmarks/README.md).
Without `writing` (one process, or a value every process holds whole),
conversions are as before.

    >>> import numpy as np
    >>> with writing(writer=False):
    ...     empty = placeholder((2, 3), np.float32)
    ...     print(is_placeholder(empty), empty.shape)
    True (2, 3)
    >>> is_placeholder(np.zeros((2, 3), np.float32))
    False
"""

import contextlib
import functools
import weakref

import numpy as np

_STATE = {"writer": None}  # True / False while a save runs, else None
# id -> a weak reference to a placeholder made during the current save
# (one that Keras has written and dropped is gone: its pages are given
# back, even reserved only)
_PLACEHOLDERS = {}


def active():
    """Whether a one-file save across processes runs on this process."""
    return _STATE["writer"] is not None


@contextlib.contextmanager
def writing(writer):
    """Run a save across processes: `writer` on the process that writes
    the file (process 0), not on the others."""
    if active():  # a save method that calls another
        yield
        return
    if not writer:
        _hold_values_out_of_datasets()
    _STATE["writer"] = bool(writer)
    try:
        yield
    finally:
        _STATE["writer"] = None
        _PLACEHOLDERS.clear()


def placeholder(shape, dtype):
    """An array of `shape` and `dtype` for a process that is not the
    writer: its memory is only reserved (`np.zeros` takes untouched zero
    pages), and a dataset made of it in the scratch file gets no values."""
    array = np.zeros(tuple(int(d) for d in shape), dtype)
    _PLACEHOLDERS[id(array)] = weakref.ref(array)
    return array


def is_placeholder(value):
    found = _PLACEHOLDERS.get(id(value))
    return found is not None and found() is value


def received(whole, shape, dtype):
    """What a conversion returns: the whole value on the writer, a
    placeholder elsewhere (`whole` is None there)."""
    return placeholder(shape, dtype) if whole is None else whole


def slices(piece):
    """A piece (start, stop per dimension) as the slices that index it."""
    return tuple(slice(start, stop) for start, stop in piece)


def missing_pieces(pieces, processes, writer=0):
    """Which pieces of a value the writer lacks, and where each is taken
    from.

    `pieces[i]` is the piece device i of the value's mesh holds (hashable:
    a tuple of (start, stop) per dimension), `processes[i]` that device's
    process. Returns `[(device position, piece)]`: each piece that no
    device of `writer` holds, once, from the first device that holds it.

    >>> missing_pieces([(0, 2), (2, 4), (0, 2), (2, 4)], [0, 0, 1, 1])
    []
    >>> missing_pieces([(0, 1), (1, 2), (2, 3), (3, 4)], [0, 0, 1, 1])
    [(2, (2, 3)), (3, (3, 4))]
    """
    held = {p for p, process in zip(pieces, processes) if process == writer}
    missing = []
    for position, (piece, process) in enumerate(zip(pieces, processes)):
        if process != writer and piece not in held:
            held.add(piece)
            missing.append((position, piece))
    return missing


def _hold_values_out_of_datasets():
    """Make `h5py` datasets of placeholders with their shape and dtype
    only (idempotent)."""
    try:
        import h5py
    except ImportError:  # Keras' HDF5 saves need it; nothing to do
        return
    create = h5py.Group.create_dataset
    if getattr(create, "_klm_placeholders", False):
        return

    @functools.wraps(create)
    def create_dataset(self, name, shape=None, dtype=None, data=None, **kwargs):
        if data is not None and is_placeholder(data):
            return create(self, name, shape=data.shape, dtype=data.dtype,
                          **kwargs)
        return create(self, name, shape=shape, dtype=dtype, data=data, **kwargs)

    create_dataset._klm_placeholders = True
    h5py.Group.create_dataset = create_dataset
