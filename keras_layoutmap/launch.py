"""Start a script once per device: `python -m keras_layoutmap.launch -n N
script.py [args...]` (or `-m module [args...]`, as `python -m` does).

Each process gets `RANK`, `LOCAL_RANK`, `WORLD_SIZE`, `MASTER_ADDR` (loopback)
and `MASTER_PORT`, the environment torch's gloo process groups read (and
keras-layoutmap reads to join JAX's or DTensor's runtime), and
`KERAS_DISTRIBUTION_JOB_ADDRESSES`, a free loopback port per process. The launcher never
hangs: as soon as one process fails, it stops the others (SIGTERM, then
SIGKILL after a grace period) and exits with the failing process's status;
Ctrl-C stops them all. With `--log-dir DIR`, processes 1 to N-1 write their
output to `DIR/rank<r>.log` (process 0 keeps the terminal), and the end of a
failing process's log is printed when it fails.

It imports no Keras and no backend (see `keras_layoutmap/__init__.py`), so
`--help` is instant and it runs wherever Python does; each process imports
what its script needs.
"""

import argparse
import os
import signal
import socket
import subprocess
import sys
import time

GRACE_SECONDS = 10  # after SIGTERM, before SIGKILL


def _free_ports(count):
    """`count` distinct loopback ports that are free now."""
    sockets = []
    try:
        for _ in range(count):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m keras_layoutmap.launch",
        description=__doc__.split("\n\n")[0].replace("\n", " "),
        epilog="Example: python -m keras_layoutmap.launch -n 8 train.py "
        "--epochs 3 (a script that calls klm.configure_virtual_devices(8)).",
    )
    parser.add_argument(
        "-n", "--nproc", type=int, required=True, metavar="N",
        help="how many processes to start (RANK 0..N-1, WORLD_SIZE=N); "
        "klm.configure_virtual_devices(n) spreads n devices over them (torch: "
        "one device per process)")
    parser.add_argument(
        "--devices-per-process", type=int, metavar="K",
        help="CPU devices each process makes (KLM_DEVICES_PER_PROCESS=K): "
        "klm.initialize() then makes K virtual devices per process, and "
        "klm.configure_virtual_devices(n) checks that n = N x K")
    parser.add_argument(
        "--log-dir", metavar="DIR",
        help="write the output of processes 1..N-1 to DIR/rank<r>.log (process "
        "0 keeps the terminal); a failing process's last lines are printed")
    parser.add_argument(
        "-m", dest="module", action="store_true",
        help="run the target as a module, as `python -m TARGET` does (e.g. "
        "`-m pytest tests`)")
    parser.add_argument("script", metavar="target",
                        help="the Python script each process runs (with -m, "
                        "a module)")
    parser.add_argument(
        "args", nargs=argparse.REMAINDER, metavar="...",
        help="arguments passed on to the script unchanged")
    opts = parser.parse_args(argv)
    if opts.nproc < 1:
        parser.error("-n must be at least 1")
    if opts.devices_per_process is not None and opts.devices_per_process < 1:
        parser.error("--devices-per-process must be at least 1")
    ports = _free_ports(opts.nproc)
    port = str(ports[0])
    # A port per process too, for runtimes whose processes each listen
    # (DTensor's clients); Keras' own variable, read by keras.distribution.
    extra = {"KERAS_DISTRIBUTION_JOB_ADDRESSES": ",".join(
        f"127.0.0.1:{p}" for p in ports)}
    if opts.devices_per_process is not None:
        extra["KLM_DEVICES_PER_PROCESS"] = str(opts.devices_per_process)
    target = ["-m", opts.script] if opts.module else [opts.script]
    logs = {}
    if opts.log_dir:
        os.makedirs(opts.log_dir, exist_ok=True)
    procs = []
    for rank in range(opts.nproc):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank),
                   WORLD_SIZE=str(opts.nproc), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=port, **extra)
        output = None
        if opts.log_dir and rank > 0:
            logs[rank] = os.path.join(opts.log_dir, f"rank{rank}.log")
            output = open(logs[rank], "w")
        procs.append(subprocess.Popen(
            [sys.executable, *target, *opts.args], env=env, stdout=output,
            stderr=subprocess.STDOUT if output else None))
        if output:
            output.close()
    try:
        code, failed = _wait(procs)
    except KeyboardInterrupt:
        _stop(procs)
        return 130
    if failed is not None and failed in logs:
        _print_tail(logs[failed], failed)
    return code


def _print_tail(path, rank, lines=60):
    with open(path, errors="replace") as f:
        tail = f.readlines()[-lines:]
    print(f"--- the last {len(tail)} lines of process {rank} ({path}) ---",
          file=sys.stderr)
    sys.stderr.writelines(tail)


def _wait(procs):
    """Wait for every process, in the order they end; on the first failure
    stop the others. Returns `(status, rank)`: the first failing process's
    status (as a shell reports it) and rank, or `(0, None)` when all
    succeed. (The first to end, not the lowest rank: when one process dies,
    the others fail next, in the collective it left.)"""
    ranks = {p.pid: r for r, p in enumerate(procs)}
    running = set(ranks)
    while running:
        pid, status = os.waitpid(-1, 0)
        if pid not in running:
            continue
        running.discard(pid)
        rank = ranks[pid]
        code = os.waitstatus_to_exitcode(status)
        procs[rank].returncode = code
        if code != 0:
            _stop(procs)
            return (code if code > 0 else 128 - code), rank
    return 0, None


def _stop(procs):
    running = [p for p in procs if p.poll() is None]
    for p in running:
        p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + GRACE_SECONDS
    for p in running:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


if __name__ == "__main__":
    sys.exit(main())
