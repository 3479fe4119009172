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
- a grouped convolution (`Conv*(groups=g)`) with its output channels split
  convolves each process's channels with the input channels of their own
  groups (Keras reads the groups from the input's and the kernel's channel
  counts, so the whole input against a piece of the kernel would pair the
  channels with the wrong groups): the piece is cut at the groups' edges,
  at most three convolutions (a part of a group at each end, the whole
  groups between), their outputs concatenated;
- the kernel's gradient from a process's rows is a pending sum over the
  batch axes, and the input's gradient from a process's channels a pending
  sum over the kernel's axes; DTensor takes those sums.
"""

import functools

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from keras_layoutmap.backends.torch.keras_internals import convert_to_tensor
from keras_layoutmap.backends.torch.placement import (
    as_dtensor,
    contiguous_stride,
    local_piece,
    local_slices,
)
from keras_layoutmap.keras_internals import standardize_data_format


def _channels_last(kwargs, args, position):
    fmt = kwargs.get("data_format", args[position] if len(args) > position else None)
    return standardize_data_format(fmt) == "channels_last"


def _channel_slice(x, axis, begin, end):
    index = [slice(None)] * x.ndim
    index[axis] = slice(begin, end)
    return x[tuple(index)]


def _grouped_on_channels(convolve, inputs, kernel, begin, end, out_channels,
                         in_axis):
    """`convolve(inputs, kernel)` for a kernel piece holding the output
    channels `begin:end` of the `out_channels` of the whole kernel of
    a grouped convolution of the whole `inputs` (channels on `in_axis`):
    each run of the piece's channels within the groups is convolved with
    its groups' input channels, and the outputs are concatenated along the
    channels. The groups: the input's channels over the kernel's input
    channels, as Keras counts them."""
    per_group_in = kernel.shape[-2]
    groups = inputs.shape[in_axis] // per_group_in
    per_group_out = out_channels // groups
    cuts = sorted({begin, end} | {
        g * per_group_out for g in range(groups + 1)
        if begin < g * per_group_out < end})
    runs = [] if end > begin else [[begin, begin + per_group_out, False]]
    for a, b in zip(cuts, cuts[1:]):
        whole_groups = a % per_group_out == 0 and b % per_group_out == 0
        if runs and whole_groups and runs[-1][2]:
            runs[-1][1] = b  # consecutive whole groups: one convolution
        else:
            runs.append([a, b, whole_groups])
    outputs = []
    for a, b, _ in runs:  # (an empty piece: no channel, one group's input)
        low, high = a // per_group_out, (b - 1) // per_group_out + 1
        outputs.append(convolve(
            _channel_slice(inputs, in_axis, low * per_group_in,
                           high * per_group_in),
            kernel[..., a - begin:min(b, end) - begin]))
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs, in_axis)


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

        channels_last = (data_format_position is None
                         or _channels_last(kwargs, rest, data_format_position))
        channel_axis = inputs.ndim - 1 if channels_last else 1
        if channel_dims and inputs.shape[channel_axis] != first.shape[-2]:
            # grouped: each channel with the input channels of its group
            piece = local_slices(first.shape, mesh, [
                Shard(first.ndim - 1) if d in channel_dims else Replicate()
                for d in range(mesh.ndim)])[-1]
            out = _grouped_on_channels(
                lambda x, k: original(x, k, *rest, **kwargs), local_inputs,
                local_kernels[0], piece.start, piece.stop, first.shape[-1],
                channel_axis)
        else:
            out = original(local_inputs, *local_kernels, *rest, **kwargs)
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


def wrap_pooling(original, data_format_position):
    """`original(inputs, ...)` (a Keras torch pooling op: `max_pool`,
    `average_pool`, the adaptive ones) run per process when its input is a
    DTensor. Pooling reads each example's channels one by one, so the input
    keeps its split over batch rows and over channels, and any split of
    space is gathered; the output is split as the input was, and the
    gradient arrives as the input's pieces. (torch 2.13's DTensor has no
    rule for `max_pool3d_with_indices_backward`, so a `MaxPooling3D` on a
    mesh failed in the backward pass.) `data_format_position`: where
    `data_format` stands among the arguments after the input."""

    @functools.wraps(original)
    def pooling(inputs, *args, **kwargs):
        inputs = convert_to_tensor(inputs)
        if not isinstance(inputs, DTensor):
            return original(inputs, *args, **kwargs)
        mesh = inputs.device_mesh
        channel_axis = (inputs.ndim - 1
                        if _channels_last(kwargs, args, data_format_position)
                        else 1)
        target = [p if isinstance(p, Shard) and p.dim in (0, channel_axis)
                  else Replicate() for p in inputs.placements]
        out = original(local_piece(inputs, target, target), *args, **kwargs)
        shape = list(out.shape)
        for d in (0, channel_axis):
            shape[d] = inputs.shape[d]
        shape = tuple(shape)
        return DTensor.from_local(out.contiguous(), mesh, target,
                                  run_check=False, shape=shape,
                                  stride=contiguous_stride(shape))

    return pooling
