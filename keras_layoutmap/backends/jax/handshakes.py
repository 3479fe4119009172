"""A save called on some processes only, told apart before any collective
(`keras_layoutmap.save_handshake`), in the key-value store of JAX's
coordination service (`jax.distributed`)."""

import jax

from keras_layoutmap import save_handshake

_ENTERED = {}  # name -> rounds this process entered with every other one


class _Store:
    def __init__(self, client):
        self.client = client

    def get(self, key):
        try:
            return self.client.key_value_try_get(key)
        except Exception:  # NOT_FOUND
            return None

    def set_once(self, key, value):
        try:
            self.client.key_value_set(key, value, allow_overwrite=False)
            return True
        except Exception:  # ALREADY_EXISTS
            return False


def enter_together(name):
    """Whether every process enters `name` (a save) with this one within
    `KLM_SAVE_HANDSHAKE_TIMEOUT` seconds (default 5)."""
    from jax._src import distributed

    client = distributed.global_state.client
    if jax.process_count() == 1 or client is None:
        return True
    return save_handshake.enter_together(
        _Store(client), name, jax.process_count(), jax.process_index(),
        _ENTERED)
