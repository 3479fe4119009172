"""A DTensor sharded over processes brought to process 0 alone, for a
one-file save (`keras_layoutmap.one_writer`): each piece process 0 lacks
is sent to it by the process that holds it (`torch.distributed.send` /
`recv`), one piece at a time; the processes with nothing to send go on.
"""

import math

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.tensor import Replicate, Shard

from keras_layoutmap import one_writer
from keras_layoutmap.backends.torch import devices

WRITER = 0  # the rank that writes the file


def _piece(shape, mesh_shape, coordinate, placements):
    """The piece (start, stop per dimension) the device at `coordinate`
    holds: torch's `Shard` cuts `torch.chunk`'s pieces (ceil-sized, the
    last ones shorter or empty), mesh dimension after mesh dimension."""
    piece = [[0, length] for length in shape]
    for mesh_dim, placement in enumerate(placements):
        if isinstance(placement, Shard):
            start, stop = piece[placement.dim]
            count = mesh_shape[mesh_dim]
            chunk = math.ceil((stop - start) / count)
            at = coordinate[mesh_dim]
            piece[placement.dim] = [min(start + at * chunk, stop),
                                    min(start + (at + 1) * chunk, stop)]
    return tuple(tuple(p) for p in piece)


def numpy_dtype(dtype):
    """The numpy dtype Keras' `convert_to_numpy` gives a torch `dtype`."""
    if dtype == torch.bfloat16:
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return torch.empty(0, dtype=dtype).numpy().dtype


def _plain_placements(value):
    return all(type(p) in (Shard, Replicate) for p in value.placements)


def send_to_writer(value):
    """`value`, a DTensor sharded over processes, whole on process 0 (numpy;
    a CPU tensor for bfloat16, which numpy lacks); None on the other
    processes, which send the pieces process 0 lacks."""
    me = dist.get_rank()
    if not _plain_placements(value):  # partial sums, strided shards
        whole = value.full_tensor()
        return whole.detach().cpu() if me == WRITER else None
    mesh = value.device_mesh
    ranks = mesh.mesh.reshape(-1).tolist()
    shape, mesh_shape = tuple(value.shape), tuple(mesh.mesh.shape)
    pieces = [_piece(shape, mesh_shape, np.unravel_index(i, mesh_shape),
                     value.placements) for i in range(len(ranks))]
    local = value.to_local()
    whole = None
    if me == WRITER:
        whole = torch.empty(shape, dtype=value.dtype)
        whole[one_writer.slices(pieces[ranks.index(me)])] = local.detach().cpu()
    device = devices.current()[2]
    for position, piece in one_writer.missing_pieces(pieces, ranks, WRITER):
        if any(start == stop for start, stop in piece):
            continue  # an empty piece of an uneven split
        sender = ranks[position]
        if me == sender:
            dist.send(local.detach().contiguous().to(device), dst=WRITER)
        elif me == WRITER:
            received = torch.empty(tuple(b - a for a, b in piece),
                                   dtype=value.dtype, device=device)
            dist.recv(received, src=sender)
            whole[one_writer.slices(piece)] = received.cpu()
            del received
    if whole is not None and whole.dtype != torch.bfloat16:
        return whole.numpy()  # what Keras' convert_to_numpy would copy it to
    return whole
