"""Joining a run of several processes ends within a deadline, with an error
that says why, on every process: never a hang, never a raw runtime abort.

`deadline(cluster, seconds)` wraps the backend runtime's own join (JAX's
`jax.distributed.initialize`, DTensor's `initialize_accelerator_system`,
torch's `init_process_group`). An error the runtime raises becomes a
`JoinError` naming the run and where it was read from; a runtime still
waiting at the deadline (a task that never started, a coordinator no one
can reach) has the process ended (SIGTERM) after that message, by a small
watcher process: a join blocked in C++ cannot be interrupted, and may hold
the interpreter's lock. (Left alone, JAX aborts with a stack trace at its
own timeout, and DTensor keeps waiting.) Backends give their runtime a
longer timeout than ours, so that ours speaks first.

`KLM_JOIN_TIMEOUT` sets the deadline in seconds (default 300, JAX's own).

>>> from keras_layoutmap.cluster import Cluster
>>> from keras_layoutmap.join_deadline import deadline
>>> with deadline(Cluster("127.0.0.1:1234", 2, 1), 60):
...     raise OSError("connection refused")
Traceback (most recent call last):
...
keras_layoutmap.join_deadline.JoinError: Process 1 of 2 could not join its run ...
"""

import contextlib
import os
import subprocess
import sys
import time

DEFAULT_SECONDS = 300


class JoinError(RuntimeError):
    """The processes of a run did not all join."""


def seconds():
    """The deadline, from `KLM_JOIN_TIMEOUT` (default 300 seconds)."""
    value = os.environ.get("KLM_JOIN_TIMEOUT")
    if value is None:
        return DEFAULT_SECONDS
    try:
        limit = float(value)
    except ValueError:
        limit = -1.0
    if limit <= 0:
        raise ValueError(f"KLM_JOIN_TIMEOUT must be a positive number of "
                         f"seconds. Received: {value!r}")
    return limit


def message(cluster, elapsed, error=None):
    why = (f"the runtime said: {type(error).__name__}: {error}" if error
           is not None else "it was still waiting for the others")
    return (
        f"Process {cluster.process_id} of {cluster.num_processes} could not "
        f"join its run after {elapsed:.0f} s: {why}. The run's coordinator "
        f"is {cluster.coordinator_address}, read from {cluster.source}. Check "
        f"that all {cluster.num_processes} processes started, with the same "
        "variables, and that process 0's host and port are reachable from "
        "this one. KLM_JOIN_TIMEOUT sets how long to wait (now "
        f"{seconds():g} s).")


# The watcher: a process of its own, since a runtime's join may hold the
# interpreter's lock (DTensor's does) and no thread of ours would run. It
# waits `limit` seconds for its stdin to close (the join returned, or this
# process ended); then it prints the message and ends this process.
_WATCHER = """
import os, select, signal, sys, time
parent, limit = int(sys.argv[1]), float(sys.argv[2])
message = sys.stdin.buffer.readline()
ready, _, _ = select.select([sys.stdin], [], [], limit)
if not ready:
    sys.stderr.buffer.write(message)
    sys.stderr.flush()
    try:
        os.kill(parent, signal.SIGTERM)
        time.sleep(5)
        os.kill(parent, signal.SIGKILL)
    except ProcessLookupError:
        pass
"""


@contextlib.contextmanager
def deadline(cluster, limit):
    """Run the block (a runtime's join) within `limit` seconds (see the
    module docstring): an error it raises becomes a `JoinError`; still
    running at the deadline, this process is ended (SIGTERM) after the
    message."""
    start = time.monotonic()
    try:
        watcher = subprocess.Popen(
            [sys.executable, "-I", "-c", _WATCHER, str(os.getpid()), str(limit)],
            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL)
        watcher.stdin.write(f"JoinError: {message(cluster, limit)}\n".encode())
        watcher.stdin.flush()
    except OSError:  # no interpreter to start (an embedded Python): the
        watcher = None  # runtime's own timeout is the limit
    try:
        yield
    except Exception as error:
        raise JoinError(message(cluster, time.monotonic() - start, error)) from error
    finally:
        if watcher is not None:
            watcher.stdin.close()
            watcher.wait()
