"""A save called on some processes only, told apart before any collective
(`keras_layoutmap.save_handshake`), in the key-value store of JAX's
coordination service (`jax.distributed`)."""

import jax

from keras_layoutmap import save_handshake


def enter_together(name):
    """Whether every process enters `name` (a save) with this one within
    `KLM_SAVE_HANDSHAKE_TIMEOUT` seconds (default 5)."""
    from jax._src import distributed

    client = distributed.global_state.client
    if jax.process_count() == 1 or client is None:
        return True
    store = save_handshake.Store(
        client.key_value_try_get,
        lambda key, value: client.key_value_set(key, value,
                                                allow_overwrite=False),
        client.key_value_delete)  # a directory: every key under it
    return save_handshake.enter_together(
        store, name, jax.process_count(), jax.process_index())
