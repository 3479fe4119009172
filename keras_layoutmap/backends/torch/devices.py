"""Which device a torch process takes: its own GPU (`cuda:LOCAL_RANK`,
collectives over NCCL) where torch sees GPUs, else the CPU (gloo); the
CPU always once `klm.configure_virtual_devices` asked for CPU devices (as
on JAX and TensorFlow, whose virtual devices are CPUs).

`choose` is the whole decision, pure, given what the device query
returns; `current` asks torch.
"""

import os

import torch

from keras_layoutmap.backends.torch import keras_internals as keras_torch

# Set by `configure_virtual_devices`: every process takes the CPU.
VIRTUAL_CPUS = [False]


def choose(cuda_count, local_rank=0, virtual_cpus=False):
    """(device kind, process-group backend, this process's device) for a
    process with local rank `local_rank` on a host where torch sees
    `cuda_count` GPUs, `virtual_cpus` when CPU devices were asked for.

    >>> choose(0, 3)
    ('cpu', 'gloo', 'cpu')
    >>> choose(8, 3)
    ('cuda', 'nccl', 'cuda:3')
    >>> choose(8, 3, virtual_cpus=True)
    ('cpu', 'gloo', 'cpu')
    """
    if cuda_count <= 0 or virtual_cpus:
        return "cpu", "gloo", "cpu"
    if not 0 <= local_rank < cuda_count:
        raise RuntimeError(
            f"This process has local rank {local_rank}, but torch sees "
            f"{cuda_count} GPU(s) on this host: start at most one process "
            f"per GPU (e.g. `torchrun --nproc-per-node {cuda_count}`), or "
            "hide the GPUs (CUDA_VISIBLE_DEVICES=) to run on CPUs.")
    return "cuda", "nccl", f"cuda:{local_rank}"


def cuda_count():
    """The GPUs torch sees on this host (0 for a CPU build)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


# This process's rank on its host, once a join read it from its cluster
# (a scheduler's variables name it otherwise than LOCAL_RANK).
LOCAL_RANK = [None]


def local_rank():
    if LOCAL_RANK[0] is not None:
        return LOCAL_RANK[0]
    return int(os.environ.get("LOCAL_RANK", "0"))


def current():
    """`choose` for this process."""
    return choose(cuda_count(), local_rank(), VIRTUAL_CPUS[0])


def kind():
    """`"cuda"` or `"cpu"`: the kind of device every process of a mesh
    takes (the processes of one run see alike hosts)."""
    return choose(cuda_count(), 0, VIRTUAL_CPUS[0])[0]


def use_cpus():
    """CPU devices from now on, whatever GPUs torch sees: the mesh's (gloo
    between processes) and Keras' own, where it makes tensors (Keras picks
    `"cuda"` at import where torch sees a GPU: its tensors would not be on
    the mesh's devices)."""
    VIRTUAL_CPUS[0] = True
    keras_torch.core.DEFAULT_DEVICE = "cpu"
