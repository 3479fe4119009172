"""A save called on some processes only, told apart before any collective
(`keras_layoutmap.save_handshake`), in the key-value store of the
coordination service that DTensor's multi-client runs start."""

from tensorflow.python.eager import context

from keras_layoutmap import save_handshake
from keras_layoutmap.backends.tensorflow import processes

# The store only waits for a key (a key set already comes back at once):
# long enough that a busy coordinator still answers. A 1 ms wait missed
# keys that were set, under load.
GET_WAIT_MS = 100


def enter_together(name):
    """Whether every process enters `name` (a save) with this one within
    `KLM_SAVE_HANDSHAKE_TIMEOUT` seconds (default 5)."""
    if processes.process_count() == 1:
        return True
    tf_context = context.context()
    store = save_handshake.Store(
        lambda key: tf_context.get_config_key_value(key, GET_WAIT_MS),
        tf_context.set_config_key_value,  # refuses a key set already
        tf_context.delete_config_key_value)  # a directory: every key under it
    return save_handshake.enter_together(
        store, name, processes.process_count(), processes.process_index())
