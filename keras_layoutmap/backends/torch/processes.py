"""torch across processes: a process group, one device per process.

A torch mesh spans processes, one device each: `"cuda:<rank>"` over NCCL
where torch sees GPUs (each process takes `cuda:LOCAL_RANK`), else, or
after `klm.configure_virtual_devices`, `"cpu:<rank>"` over gloo
(`devices.choose`):
`python -m keras_layoutmap.launch -n 4 script.py` (or `torchrun
--nproc-per-node 4 script.py`) starts them, and `klm.configure_virtual_devices(4)`
(or `klm.initialize()`) joins them into the default process group. Outside a
launched world there is one process and one device.

Collectives time out after `KLM_COLLECTIVE_TIMEOUT` seconds (default 60): a
process whose peer died raises instead of waiting forever. The launcher ends
the others as soon as one fails, so a timeout is the last resort.
"""

import atexit
import datetime
import os
import time

import numpy as np
import torch
import torch.distributed as dist

from keras_layoutmap import join_deadline, same_value
from keras_layoutmap.backends.torch import devices
from keras_layoutmap.processes import cluster_from_environment

MULTI_PROCESS = True
DEFAULT_TIMEOUT_SECONDS = 60


def _leave():
    if dist.is_initialized():
        dist.destroy_process_group()


def _timeout():
    seconds = float(os.environ.get("KLM_COLLECTIVE_TIMEOUT", DEFAULT_TIMEOUT_SECONDS))
    return datetime.timedelta(seconds=seconds)


def _environment():
    """The cluster the environment describes (the launcher's, torchrun's,
    Keras' or a scheduler's variables), or None."""
    return cluster_from_environment()


def launched_world_size():
    """How many processes the launcher (torchrun, a scheduler) started; 1
    outside one."""
    cluster = _environment()
    return 1 if cluster is None else cluster.num_processes


def is_joined():
    return dist.is_available() and dist.is_initialized()


def world_size():
    return dist.get_world_size() if is_joined() else launched_world_size()


def rank():
    if is_joined():
        return dist.get_rank()
    cluster = _environment()
    return 0 if cluster is None else cluster.process_id


def _how_to_launch(n):
    return (f"Start the script with `python -m keras_layoutmap.launch -n {n} "
            f"script.py` (or `torchrun --nproc-per-node {n} script.py`).")


def join(cluster, total_devices=None, timeout=None):
    """Join `cluster`'s process group (once): NCCL with this process on
    `cuda:<local rank>` where torch sees GPUs, else gloo. With
    `total_devices` (CPU devices asked for: `configure_virtual_devices`, the
    launcher's `--devices-per-process`) every process takes its CPU, over
    gloo, as JAX's join makes CPU devices then; on torch every process
    holds one device, so it must equal the number of processes. The join
    ends within `timeout` seconds (`join_deadline`); collectives after it
    within `KLM_COLLECTIVE_TIMEOUT`."""
    if total_devices is not None and total_devices != cluster.num_processes:
        raise RuntimeError(
            f"On the torch backend a mesh of {total_devices} devices spans "
            f"{total_devices} processes (one device each), but this run has "
            f"{cluster.num_processes}. {_how_to_launch(total_devices)}"
        )
    if total_devices is not None and not is_joined():
        devices.use_cpus()
    if is_joined():
        if dist.get_world_size() != cluster.num_processes:
            raise RuntimeError(
                f"torch.distributed already runs a world of "
                f"{dist.get_world_size()} processes; this run asks for "
                f"{cluster.num_processes}."
            )
        return
    host, _, port = cluster.coordinator_address.rpartition(":")
    if cluster.local_rank is not None:
        devices.LOCAL_RANK[0] = cluster.local_rank
    kind, backend, device = devices.current()
    if kind == "cuda":
        torch.cuda.set_device(device)
    timeout = join_deadline.seconds() if timeout is None else timeout
    with join_deadline.deadline(cluster, timeout):
        dist.init_process_group(
            backend,
            init_method=f"tcp://{host or '127.0.0.1'}:{port}",
            world_size=cluster.num_processes,
            rank=cluster.process_id,
            timeout=_timeout(),
        )
    # A normal exit takes the group down first: left to the interpreter's
    # shutdown, gloo's threads may abort the process (status 134). (An
    # uncaught error exits at once instead: keras_layoutmap.processes.)
    atexit.register(_leave)
    # Every process takes process 0's torch generator, as the generic join
    # does for Python's and NumPy's (keras_layoutmap.processes): unseeded
    # dropout draws its whole mask from it on every process.
    generator = torch.random.get_rng_state().to(device)
    dist.broadcast(generator, src=0)
    torch.random.set_rng_state(generator.cpu())


def configure_virtual_devices(n):
    """`n` CPU devices in all, one per process of a launched world of `n`
    (gloo), also where torch sees GPUs."""
    world = launched_world_size()
    if world != n:
        if world == 1 and n == 1:
            devices.use_cpus()
            return
        raise RuntimeError(
            f"On the torch backend a mesh of {n} devices spans {n} processes "
            f"(one CPU device each), but this process runs in a world of "
            f"{world}. {_how_to_launch(n)}"
        )
    if n == 1:
        devices.use_cpus()
        return
    join(cluster_from_environment(), total_devices=n)


def process_count():
    return world_size() if is_joined() else 1


def process_index():
    return rank() if is_joined() else 0


def barrier(name):
    """Wait until every process gets here."""
    if is_joined() and dist.get_world_size() > 1:
        dist.barrier()


def list_devices():
    return [f"{devices.kind()}:{i}" for i in range(world_size())]


def local_devices():
    """This process's device: one per process in a launched world."""
    if world_size() > 1:
        return [f"{devices.kind()}:{rank()}"]
    return list_devices()


def num_local_devices(mesh):
    mine = set(local_devices())
    return sum(str(d) in mine for d in mesh.devices.ravel())


def gather_process_batches(local):
    """`all_gather_rows` of a numpy array, as numpy (the backend interface)."""
    return all_gather_rows(torch.from_numpy(np.ascontiguousarray(local))).numpy()


def all_gather_rows(local):
    """Every process's `local` tensor (rows may differ in number: a short
    last batch), concatenated along dimension 0 in rank order, on every
    process."""
    local = torch.as_tensor(local)
    if not is_joined() or dist.get_world_size() == 1:
        return local
    # NCCL takes only GPU tensors: the collectives run on this process's
    # device (`devices.current`), the result comes back where `local` was.
    home, local = local.device, local.to(devices.current()[2])
    count = torch.tensor([local.shape[0]], dtype=torch.int64,
                         device=local.device)
    counts = [torch.zeros_like(count) for _ in range(dist.get_world_size())]
    dist.all_gather(counts, count)
    counts = [int(c) for c in counts]
    longest = max(counts)
    padded = local.new_zeros((longest, *local.shape[1:]))
    padded[: local.shape[0]] = local
    pieces = [torch.empty_like(padded) for _ in counts]
    dist.all_gather(pieces, padded.contiguous())
    return torch.cat([p[:n] for p, n in zip(pieces, counts)], dim=0).to(home)


def all_gather_ints(values):
    """Every process's `values` (a tuple of ints, as many on each), in
    rank order: one small all-gather."""
    if not is_joined() or dist.get_world_size() == 1:
        return [tuple(values)]
    local = torch.tensor(list(values), dtype=torch.int64,
                         device=devices.current()[2])
    gathered = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, local)
    return [tuple(int(v) for v in g.tolist()) for g in gathered]


def check_same_everywhere(value):
    """Raise `same_value.ValueDiffersAcrossProcesses` on every process
    where `value`, a host tensor every process places on a mesh over all
    of them, is not the same on every process (each keeps its own slice of
    what it holds): a CRC-32 of each process's bytes, gathered."""
    if not is_joined() or dist.get_world_size() == 1:
        return
    host = value.detach().cpu().contiguous()
    mine = torch.from_numpy(same_value.digest(
        host.reshape(-1).view(torch.uint8).numpy(), host.shape, host.dtype))
    mine = mine.to(devices.current()[2])  # NCCL takes GPU tensors only
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    same_value.check_same([e.cpu().numpy() for e in every], dist.get_rank(),
                          tuple(host.shape), host.dtype)


# -- saves called on some processes only ----------------------------------

DEFAULT_SAVE_HANDSHAKE_SECONDS = 5
_ENTERED = {}  # name -> how often this process entered it together


def _store():
    return dist.distributed_c10d._get_default_store()


def _handshake_seconds():
    return float(os.environ.get("KLM_SAVE_HANDSHAKE_TIMEOUT",
                                DEFAULT_SAVE_HANDSHAKE_SECONDS))


def enter_together(name):
    """Whether every process enters `name` (a save) with this one, within
    `KLM_SAVE_HANDSHAKE_TIMEOUT` seconds (default 5). Counted in the
    rendezvous store, outside any collective: a process that gives up
    takes its arrival back (atomically: if the last one came in the
    meantime, all went in after all), so the others never start a collective
    without it, and a later save on every process pairs up again."""
    if not is_joined() or dist.get_world_size() == 1:
        return True
    store, world = _store(), dist.get_world_size()
    n = _ENTERED.get(name, 0) + 1
    key = f"klm_enter/{name}"
    count = store.add(key, 1)
    deadline = time.monotonic() + _handshake_seconds()
    while count < n * world:
        if time.monotonic() > deadline:
            now = store.compare_set(key, str(count), str(count - 1))
            if int(now) == count - 1:
                return False
            count = int(now)  # someone came in meanwhile: look again
            continue
        time.sleep(0.005)
        count = store.add(key, 0)
    _ENTERED[name] = n
    return True
