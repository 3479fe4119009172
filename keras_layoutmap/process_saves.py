"""Keras' own saves across processes: `model.save_weights`, `model.save`
and `BackupAndRestore` write one file, from process 0, and every process
returns once it is complete.

Called on every process, a save streams each sharded value to process 0
(`one_writer`). Called on some processes only (`if rank == 0:`), a
handshake outside any collective (the backend's `enter_together`) tells:
a model this process holds whole is saved by it alone, a sharded one
raises at once, saying that the save is collective.
"""

import functools
import os
import tempfile

from keras_layoutmap import backends, one_writer


def _whole_here(model):
    """Whether this process holds every value of `model` whole (nothing
    sharded over processes): then it can save alone."""
    backend = backends.get()
    variables = list(model.variables)
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None and hasattr(optimizer, "variables"):
        variables += list(optimizer.variables)
    for v in variables:
        try:
            axes, _ = backend.fetch_layout(v)
        except (TypeError, ValueError):  # partial sums: not whole
            return False
        if any(a is not None for a in axes):
            return False
    return True


def _call_on_every_process(save, filepath):
    backend = backends.get()
    return RuntimeError(
        f"`{save.__name__}({str(filepath)!r})` was called on this process "
        f"(process {backend.process_index()}) but not on all "
        f"{backend.process_count()} processes of the run. The model holds "
        "variables sharded over processes, so saving gathers them from "
        "every process: call it on every process "
        "(`model.save_weights(path)`, not `if rank == 0: "
        "model.save_weights(path)`); process 0 alone writes the file. A model "
        "every process holds whole (replicated) may be saved on one process."
    )


def _one_writer(save):
    """`model.save_weights` / `model.save` called on every process write one
    file: process 0 writes it; the others send it their pieces of each
    sharded value, one value at a time (`one_writer`), and write a scratch
    file without values that is deleted; every process returns once the
    file is complete.

    Called on some processes only (`if rank == 0: model.save_weights(path)`),
    told by a handshake outside any collective (`enter_together`): a model
    this process holds whole is saved by it alone, with no collective; a
    sharded one raises at once, and the processes that did not call it
    started nothing."""

    @functools.wraps(save)
    def method(self, filepath, *args, **kwargs):
        backend = backends.get()
        if backend.process_count() == 1:
            return save(self, filepath, *args, **kwargs)
        if not backend.enter_together(
                f"{save.__name__}:{os.path.abspath(str(filepath))}"):
            if _whole_here(self):
                return save(self, filepath, *args, **kwargs)
            raise _call_on_every_process(save, filepath)
        if backend.process_index() == 0:
            with one_writer.writing(writer=True):
                result = save(self, filepath, *args, **kwargs)
        else:
            name = os.path.basename(str(filepath))
            with tempfile.TemporaryDirectory() as scratch, \
                    one_writer.writing(writer=False):
                result = save(self, os.path.join(scratch, name), *args, **kwargs)
        backend.barrier(f"klm_{save.__name__}")
        return result

    return method


def _backup_saved_once(save_model):
    """`BackupAndRestore` across processes: every process takes part in
    saving the weights (a collective), process 0 alone copies files and
    writes the epoch it reached, and all go on once that is done."""

    @functools.wraps(save_model)
    def _save_model(self):
        backend = backends.get()
        if backend.process_count() == 1:
            return save_model(self)
        if backend.process_index() == 0:
            save_model(self)
        else:
            self.model.save_weights(self._weights_path, overwrite=True)
        backend.barrier("klm_backup_saved")

    return _save_model


def _backup_restored_together(on_train_begin):
    """Every process reads the backup before any process writes the next
    one: process 0 alone writes it, at the end of the next epoch, and a
    process still reading it then read a file being rewritten (stale
    weights, or HDF5's 'unable to lock file'). Training steps keep the
    processes together on a mesh; a model on one device per process takes
    no collective until that write."""

    @functools.wraps(on_train_begin)
    def method(self, logs=None):
        result = on_train_begin(self, logs)
        backend = backends.get()
        if backend.process_count() > 1:
            backend.barrier("klm_backup_restored")
        return result

    return method


def _backup_deleted_once(on_train_end):
    @functools.wraps(on_train_end)
    def method(self, logs=None):
        backend = backends.get()
        if backend.process_count() == 1:
            return on_train_end(self, logs)
        backend.barrier("klm_backup_done")
        if backend.process_index() == 0:
            on_train_end(self, logs)
        backend.barrier("klm_backup_deleted")

    return method


_INSTALLED = False


def install():
    """Make `Model.save_weights`, `Model.save` and `BackupAndRestore` write
    once across processes, and `BackupAndRestore` read before anyone
    writes again (idempotent)."""
    global _INSTALLED
    if _INSTALLED:
        return
    from keras import callbacks as keras_callbacks
    from keras import models as keras_models

    for name in ("save_weights", "save"):
        setattr(keras_models.Model, name,
                _one_writer(getattr(keras_models.Model, name)))
    Backup = keras_callbacks.BackupAndRestore
    Backup._save_model = _backup_saved_once(Backup._save_model)
    Backup.on_train_begin = _backup_restored_together(Backup.on_train_begin)
    Backup.on_train_end = _backup_deleted_once(Backup.on_train_end)
    _INSTALLED = True
