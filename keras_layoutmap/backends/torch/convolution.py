"""Keras' convolutions on DTensors, computed per process.

torch 2.13's DTensor rule for `aten.convolution` gives the output its
input's placements whatever the kernel's: with a kernel split over its
output channels, each process computes its own channels while the output
claims them all, and the step fails further on with a shape error (JAX
splits the channels; TensorFlow's DTensor refuses such a kernel). So a
convolution on a mesh runs here on each process's pieces, with the
gradients' placements given by hand:

- the input keeps its split over batch rows; any other split (channels,
  space) is gathered;
- `conv`'s kernel keeps a split over its output channels (its last
  dimension in Keras) on a mesh axis that does not split the batch; every
  other kernel (depthwise, separable, transposed) is whole;
- each process convolves its rows with its kernel piece, and the output is
  split as both were: rows over the batch axes, channels over the kernel's;
- the kernel's gradient from a process's rows is a pending sum over the
  batch axes, and the input's gradient from a process's channels a pending
  sum over the kernel's axes; DTensor takes those sums.
"""

import functools

from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from keras_layoutmap.backends.torch.keras_internals import convert_to_tensor
from keras_layoutmap.backends.torch.placement import (
    as_dtensor,
    contiguous_stride,
    local_piece,
)
from keras_layoutmap.keras_internals import standardize_data_format


def _channels_last(kwargs, args, position):
    fmt = kwargs.get("data_format", args[position] if len(args) > position else None)
    return standardize_data_format(fmt) == "channels_last"


def wrap_convolution(original, kernels=1, split_output_channels=False,
                     data_format_position=None):
    """`original(inputs, *kernels, ...)` (a Keras torch convolution op) run
    per process when any of its tensors is a DTensor. `kernels`: how many
    kernel arguments follow the input; `split_output_channels`: keep a
    first kernel split over its last dimension (`conv`);
    `data_format_position`: where `data_format` stands among the
    arguments after the kernels."""

    @functools.wraps(original)
    def convolution(inputs, *args, **kwargs):
        # Kernels come as Keras variables; their values may be DTensors.
        tensors = [convert_to_tensor(x) for x in (inputs, *args[:kernels])]
        rest = args[kernels:]
        found = next((x for x in tensors if isinstance(x, DTensor)), None)
        if found is None:
            return original(*tensors, *rest, **kwargs)
        mesh = found.device_mesh
        inputs = as_dtensor(tensors[0], mesh)
        kernel_list = [as_dtensor(k, mesh) for k in tensors[1:]]

        batch_dims = {d for d, p in enumerate(inputs.placements)
                      if isinstance(p, Shard) and p.dim == 0}
        first = kernel_list[0]
        channel_dims = set()
        if split_output_channels:
            channel_dims = {d for d, p in enumerate(first.placements)
                            if isinstance(p, Shard) and p.dim == first.ndim - 1
                            and d not in batch_dims}

        input_target = [Shard(0) if d in batch_dims else Replicate()
                        for d in range(mesh.ndim)]
        input_grad = [Partial() if d in channel_dims else p
                      for d, p in enumerate(input_target)]
        local_inputs = local_piece(inputs, input_target, input_grad)
        local_kernels = []
        for index, kernel in enumerate(kernel_list):
            target = [Shard(kernel.ndim - 1) if index == 0 and d in channel_dims
                      else Replicate() for d in range(mesh.ndim)]
            grad = [Partial() if d in batch_dims else p
                    for d, p in enumerate(target)]
            local_kernels.append(local_piece(kernel, target, grad))

        out = original(local_inputs, *local_kernels, *rest, **kwargs)
        channels_last = (data_format_position is None
                         or _channels_last(kwargs, rest, data_format_position))
        channel_axis = out.ndim - 1 if channels_last else 1
        placements = []
        for d in range(mesh.ndim):
            if d in batch_dims:
                placements.append(Shard(0))
            elif d in channel_dims:
                placements.append(Shard(channel_axis))
            else:
                placements.append(Replicate())
        shape = list(out.shape)
        shape[0] = inputs.shape[0]
        if channel_dims:
            shape[channel_axis] = first.shape[-1]
        shape = tuple(shape)
        return DTensor.from_local(out.contiguous(), mesh, placements,
                                  run_check=False, shape=shape,
                                  stride=contiguous_stride(shape))

    return convolution
