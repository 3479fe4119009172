"""A save called on some processes only (`if rank == 0: model.save_weights`),
told apart before any collective: a handshake in the key-value store of
JAX's coordination service (`jax.distributed`), outside every collective.

Each save name counts rounds on each process (those it entered with every
other process), and each round counts attempts in the store. In an
attempt, a process adds its arrival to a counter; the first process that
sees every process arrive, or that gives up waiting after
`KLM_SAVE_HANDSHAKE_TIMEOUT` seconds (default 5), sets the attempt's
decision, a key that is set once (`allow_overwrite=False`): every process
of the attempt follows it. A process whose decision was to give up opens
the round's next attempt, so a later save on every process pairs up again.
"""

import os
import time

import jax

DEFAULT_SAVE_HANDSHAKE_SECONDS = 5
_ENTERED = {}  # name -> rounds this process entered with every other one


def _client():
    from jax._src import distributed

    return distributed.global_state.client


def _handshake_seconds():
    return float(os.environ.get("KLM_SAVE_HANDSHAKE_TIMEOUT",
                                DEFAULT_SAVE_HANDSHAKE_SECONDS))


def _decided(client, key):
    try:
        return client.key_value_try_get(key)
    except Exception:  # not set yet (the store raises NOT_FOUND)
        return None


def _decide(client, key, decision):
    """Set `key` to `decision` unless some process set it first; whether
    this process did."""
    try:
        client.key_value_set(key, decision, allow_overwrite=False)
        return True
    except Exception:  # ALREADY_EXISTS: another process decided
        return False


def enter_together(name):
    """Whether every process enters `name` (a save) with this one within
    `KLM_SAVE_HANDSHAKE_TIMEOUT` seconds (default 5)."""
    client = _client()
    world = jax.process_count()
    if world == 1 or client is None:
        return True
    round_ = f"klm_enter/{name}/{_ENTERED.get(name, 0)}"
    attempt = f"{round_}/{client.key_value_increment(f'{round_}/attempts', 0)}"
    arrived = client.key_value_increment(f"{attempt}/arrived", 1)
    deadline = time.monotonic() + _handshake_seconds()
    while (decision := _decided(client, f"{attempt}/decision")) is None:
        if arrived >= world:
            _decide(client, f"{attempt}/decision", "enter")
        elif time.monotonic() > deadline:
            if _decide(client, f"{attempt}/decision", "give up"):
                client.key_value_increment(f"{round_}/attempts", 1)
        else:
            time.sleep(0.005)
            arrived = client.key_value_increment(f"{attempt}/arrived", 0)
    if decision == "enter":
        _ENTERED[name] = _ENTERED.get(name, 0) + 1
        return True
    return False
