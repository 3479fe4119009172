"""A save called on some processes only, told apart before any collective
(`keras_layoutmap.save_handshake`), in the key-value store of the
coordination service that DTensor's multi-client runs start."""

from tensorflow.python.eager import context

from keras_layoutmap import save_handshake
from keras_layoutmap.backends.tensorflow import processes

GET_WAIT_MS = 100
_ENTERED = {}  # name -> rounds this process entered with every other one


class _Store:
    def __init__(self, tf_context):
        self.context = tf_context

    def get(self, key):
        # The store only waits for a key (a key set already comes back at
        # once): long enough that a busy coordinator still answers.
        try:
            return self.context.get_config_key_value(key, GET_WAIT_MS)
        except Exception:  # DeadlineExceeded: not set
            return None

    def set_once(self, key, value):
        try:
            self.context.set_config_key_value(key, value)
            return True
        except Exception:  # AlreadyExists
            return False


def enter_together(name):
    """Whether every process enters `name` (a save) with this one within
    `KLM_SAVE_HANDSHAKE_TIMEOUT` seconds (default 5)."""
    if processes.process_count() == 1:
        return True
    return save_handshake.enter_together(
        _Store(context.context()), name, processes.process_count(),
        processes.process_index(), _ENTERED)
