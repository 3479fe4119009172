"""A save called on some processes only (`if rank == 0: model.save_weights`),
told apart before any collective: a handshake in a key-value store that
every process of the run reaches outside its collectives (JAX's and
TensorFlow's coordination service).

Each save name counts rounds on each process (those it entered with every
other process), and each round has attempts. In an attempt, each process
writes its arrival; the first process that sees every process arrive, or
that gives up waiting after `KLM_SAVE_HANDSHAKE_TIMEOUT` seconds (default
5), sets the attempt's decision, a key set once: every process of the
attempt follows it. A process that finds its attempt given up before its
own wait is over goes on to the next attempt, so that a later save on
every process meets in a new one; it gives up only when its own wait is
over. So the processes that enter, enter together: an attempt is entered
only once every process arrived in it.

A backend gives its store as a `Store` of two calls: `read(key)`, which
raises where the key is not set, and `write(key, value)`, which raises
where it is set already; and, where it has one, `delete(prefix)`, which
removes every key under `prefix`. With it, process 0 removes a round's
keys when it enters the next round of the same save: every process then
arrived in the new round, so none reads the old one any more, and a long
run's store holds two rounds a save, not one a save call.

    >>> def write(key, value):
    ...     if key in kept:
    ...         raise KeyError(key)
    ...     kept[key] = value
    >>> kept = {}
    >>> store = Store(kept.__getitem__, write)
    >>> enter_together(store, "save", world=1, rank=0)
    True
    >>> enter_together(store, "save", world=2, rank=0,
    ...                seconds=0.01)  # the other process never comes
    False

Two rounds of a save both processes reach (process 1's arrivals written
here for it), in a store that deletes:

    >>> def delete(prefix):
    ...     for key in [k for k in kept if k.startswith(prefix + "/")]:
    ...         del kept[key]
    >>> store = Store(kept.__getitem__, write, delete)
    >>> kept["klm_enter/doc/0/0/arrived/1"] = "1"
    >>> enter_together(store, "doc", world=2, rank=0)
    True
    >>> kept["klm_enter/doc/1/0/arrived/1"] = "1"
    >>> enter_together(store, "doc", world=2, rank=0)
    True
    >>> sorted(k[len("klm_enter/doc/"):] for k in kept
    ...        if k.startswith("klm_enter/doc/"))
    ['1/0/arrived/0', '1/0/arrived/1', '1/0/decision']
"""

import os
import time

DEFAULT_SAVE_HANDSHAKE_SECONDS = 5
_ENTERED = {}  # name -> rounds this process entered with every other one


class Store:
    """A key-value store every process reaches: `read(key)` and
    `write(key, value)` of a backend, each raising where the key is not
    set (read) or is set already (write)."""

    def __init__(self, read, write, delete=None):
        self.read, self.write, self.delete = read, write, delete

    def get(self, key):
        """The value of `key`, or None where it is not set."""
        try:
            return self.read(key)
        except Exception:  # not set (NOT_FOUND, DeadlineExceeded, KeyError)
            return None

    def set_once(self, key, value):
        """Whether this call set `key` (False where it was set already)."""
        try:
            self.write(key, value)
            return True
        except Exception:  # ALREADY_EXISTS
            return False

    def forget(self, prefix):
        """Remove every key under `prefix`, where the store can."""
        if self.delete is None:
            return
        try:
            self.delete(prefix)
        except Exception:  # gone already, or a store that cannot: kept
            pass


def handshake_seconds():
    return float(os.environ.get("KLM_SAVE_HANDSHAKE_TIMEOUT",
                                DEFAULT_SAVE_HANDSHAKE_SECONDS))


def enter_together(store, name, world, rank, seconds=None):
    """Whether all `world` processes enter `name` (a save) with this one
    (`rank`) within `seconds` (default `KLM_SAVE_HANDSHAKE_TIMEOUT`)."""
    if world == 1:
        return True
    seconds = handshake_seconds() if seconds is None else seconds
    entered = _ENTERED.get(name, 0)
    round_ = f"klm_enter/{name}/{entered}"
    deadline = time.monotonic() + seconds
    attempt = 0
    while True:
        key = f"{round_}/{attempt}"
        if store.get(f"{key}/decision") is None:
            store.set_once(f"{key}/arrived/{rank}", "1")
            if _decision(store, key, world, rank, deadline) == "enter":
                _ENTERED[name] = entered + 1
                if rank == 0 and entered:
                    # every process left the round before: none reads it
                    store.forget(f"klm_enter/{name}/{entered - 1}")
                return True
        if time.monotonic() > deadline:
            return False
        attempt += 1  # given up before this process's wait was over


def _decision(store, key, world, rank, deadline):
    """The decision of attempt `key`, which this process arrived in: the
    first one made, "enter" once every process arrived, "give up" once a
    process's wait is over."""
    waiting = set(range(world)) - {rank}
    while (decision := store.get(f"{key}/decision")) is None:
        waiting = {r for r in waiting
                   if store.get(f"{key}/arrived/{r}") is None}
        if not waiting:
            store.set_once(f"{key}/decision", "enter")
        elif time.monotonic() > deadline:
            store.set_once(f"{key}/decision", "give up")
        else:
            time.sleep(0.005)
    return decision
