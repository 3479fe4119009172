"""Random draws on DTensors, equal to one device's.

Keras' unseeded dropout calls `torch.nn.functional.dropout`; on a DTensor
that becomes DTensor's own random op, which on a CPU mesh draws each
process's piece from its own generator: a mask that differs from one
device's. Every process draws the whole mask from the global generator
instead (each draws the same numbers: same seed, same sequence), exactly as
one device's `dropout` does, and keeps its own part.

`random.categorical` (keras-hub's seeded samplers) calls `torch.multinomial`
with a generator seeded from the Keras seed; on DTensor logits DTensor's own
random op ignores that generator's stream for one device's. Every process
draws from the whole logits with the same generator instead, and keeps its
rows: one device's samples.
"""

import functools

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard


def wrap_dropout(original):
    @functools.wraps(original)
    def dropout(inputs, rate, noise_shape=None, seed=None):
        unseeded = seed is None or getattr(seed, "_initial_seed", 0) is None
        if (not isinstance(inputs, DTensor) or noise_shape is not None
                or not unseeded or rate in (0.0, 1.0)):
            return original(inputs, rate, noise_shape=noise_shape, seed=seed)
        # ATen's CPU dropout: noise = bernoulli(1 - p) / (1 - p); x * noise.
        noise = torch.empty(tuple(inputs.shape), dtype=inputs.dtype)
        noise.bernoulli_(1 - rate)
        noise.div_(1 - rate)
        return inputs * noise

    return dropout


def wrap_categorical(original):
    @functools.wraps(original)
    def categorical(logits, num_samples, dtype="int32", seed=None):
        if not isinstance(logits, DTensor):
            return original(logits, num_samples, dtype=dtype, seed=seed)
        mesh = logits.device_mesh
        whole = original(logits.full_tensor(), num_samples, dtype=dtype,
                         seed=seed)
        rows = [Shard(0) if isinstance(p, Shard) and p.dim == 0
                else Replicate() for p in logits.placements]
        out = DTensor.from_local(whole, mesh, [Replicate()] * mesh.ndim,
                                 run_check=False)
        return out.redistribute(mesh, rows)  # a local slice: no communication

    return categorical
