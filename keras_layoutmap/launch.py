"""Start a script once per device: `python -m keras_layoutmap.launch -n N
script.py [args...]`.

Each process gets `RANK`, `LOCAL_RANK`, `WORLD_SIZE`, `MASTER_ADDR` (loopback)
and `MASTER_PORT`, the environment torch's gloo process groups read. The
launcher waits for all of them and exits with the first non-zero status.

It imports no Keras and no backend (see `keras_layoutmap/__init__.py`), so
`--help` is instant and it runs wherever Python does; each process imports
what its script needs.
"""

import argparse
import os
import socket
import subprocess
import sys


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m keras_layoutmap.launch",
        description=__doc__.split("\n\n")[0].replace("\n", " "),
        epilog="Example: python -m keras_layoutmap.launch -n 8 train.py "
        "--epochs 3 (a script that calls klm.configure_virtual_devices(8)).",
    )
    parser.add_argument(
        "-n", "--nproc", type=int, required=True, metavar="N",
        help="how many processes to start, one per device (RANK 0..N-1, "
        "WORLD_SIZE=N)")
    parser.add_argument("script", help="the Python script each process runs")
    parser.add_argument(
        "args", nargs=argparse.REMAINDER, metavar="...",
        help="arguments passed on to the script unchanged")
    opts = parser.parse_args(argv)
    if opts.nproc < 1:
        parser.error("-n must be at least 1")
    port = str(_free_port())
    procs = []
    for rank in range(opts.nproc):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank),
                   WORLD_SIZE=str(opts.nproc), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=port)
        procs.append(subprocess.Popen(
            [sys.executable, opts.script, *opts.args], env=env))
    codes = [p.wait() for p in procs]
    return next((c for c in codes if c), 0)


if __name__ == "__main__":
    sys.exit(main())
