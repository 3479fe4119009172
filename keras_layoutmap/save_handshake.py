"""A save called on some processes only (`if rank == 0: model.save_weights`),
told apart before any collective: a handshake in a key-value store that
every process of the run reaches outside its collectives (JAX's and
TensorFlow's coordination service).

Each save name counts rounds on each process (those it entered with every
other process), and each round has attempts. In an attempt, each process
writes its arrival; the first process that sees every process arrive, or
that gives up waiting after `KLM_SAVE_HANDSHAKE_TIMEOUT` seconds (default
5), sets the attempt's decision, a key set once: every process of the
attempt follows it. A process whose decision was to give up closes the
attempt, so that a later save on every process meets in the next one.

A store needs two calls: `get(key)`, the value or None, and
`set_once(key, value)`, whether this call set it (False where the key
was set already).

    >>> class Store(dict):
    ...     def get(self, key):
    ...         return dict.get(self, key)
    ...     def set_once(self, key, value):
    ...         return self.setdefault(key, value) is value
    >>> store, entered = Store(), {}
    >>> enter_together(store, "save", world=1, rank=0, entered=entered)
    True
    >>> enter_together(store, "save", world=2, rank=0, entered=entered,
    ...                seconds=0.01)  # the other process never comes
    False
"""

import os
import time

DEFAULT_SAVE_HANDSHAKE_SECONDS = 5


def handshake_seconds():
    return float(os.environ.get("KLM_SAVE_HANDSHAKE_TIMEOUT",
                                DEFAULT_SAVE_HANDSHAKE_SECONDS))


def enter_together(store, name, world, rank, entered, seconds=None):
    """Whether all `world` processes enter `name` (a save) with this one
    (`rank`) within `seconds` (default `KLM_SAVE_HANDSHAKE_TIMEOUT`).
    `entered` counts, per name, the rounds this process entered."""
    if world == 1:
        return True
    seconds = handshake_seconds() if seconds is None else seconds
    round_ = f"klm_enter/{name}/{entered.get(name, 0)}"
    closed = 0
    while store.get(f"{round_}/closed/{closed}") is not None:
        closed += 1
    attempt = f"{round_}/{closed}"
    store.set_once(f"{attempt}/arrived/{rank}", "1")
    waiting = set(range(world)) - {rank}
    deadline = time.monotonic() + seconds
    while (decision := store.get(f"{attempt}/decision")) is None:
        waiting = {r for r in waiting
                   if store.get(f"{attempt}/arrived/{r}") is None}
        if not waiting:
            store.set_once(f"{attempt}/decision", "enter")
        elif time.monotonic() > deadline:
            if store.set_once(f"{attempt}/decision", "give up"):
                store.set_once(f"{round_}/closed/{closed}", "1")
        else:
            time.sleep(0.005)
    if decision == "enter":
        entered[name] = entered.get(name, 0) + 1
        return True
    return False
