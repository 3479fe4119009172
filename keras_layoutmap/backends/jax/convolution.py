"""Convolutions on a mesh, computed device by device.

XLA's SPMD partitioner computes convolutions wrongly on a mesh of several
axes (jax 0.10.2, Shardy and GSPMD alike):
- a grouped convolution's kernel gradient (a convolution with
  `batch_group_count`) when the rows are split over one axis and
  replicated over another: Keras' `Conv*D(groups>1)`, `DepthwiseConv*D`
  and `SeparableConv*D`, which plain Keras' `ModelParallel` trains wrongly
  even with the kernel replicated;
- any convolution's kernel gradient when a spatial dimension is split over
  one axis and replicated over another, and its output as well when the
  kernel's output channels are split too (the propagation chooses such a
  split for a causal, dilated `Conv1D`).

So on a mesh of more than one device every convolution Keras' JAX backend
computes (`conv`, `depthwise_conv`, which `separable_conv` calls, and
`conv_transpose`) runs under `shard_map`: each device convolves its own
rows with the whole kernel, and XLA partitions nothing inside. The rows are
split over every mesh axis that divides them (all of them when they can
be: then no collective, only a local slice of a batch already split over
some axes); the kernel is gathered whole (a convolution's kernel is small);
its gradient is summed over the devices that split the rows, by
`shard_map`'s transpose. The measurements:
[docs/backends.md](../../../docs/backends.md#convolutions-on-jax).

Example (on one device nothing changes):

>>> import numpy as np, keras
>>> x = np.ones((2, 5, 4), "float32")
>>> k = np.ones((3, 2, 4), "float32")  # 2 input channels a group: 2 groups
>>> keras.ops.conv(x, k).shape
(2, 3, 4)
"""

import functools

import jax
import numpy as np
from jax.sharding import PartitionSpec
from keras import distribution as keras_distribution

# Keras' JAX functions wrapped, by name: each takes `(inputs, kernel, ...)`
# with the rows first, whatever its data format.
CONVOLUTIONS = ("conv", "depthwise_conv", "conv_transpose")


def _mesh():
    """The current distribution's `jax.sharding.Mesh`, when it has more
    than one device."""
    distribution = keras_distribution.distribution()
    if distribution is None:
        return None
    mesh = distribution.device_mesh
    return mesh.backend_mesh if int(np.prod(mesh.shape)) > 1 else None


def row_axes(mesh, rows):
    """The mesh axes a batch of `rows` is split over inside: every axis
    when their product divides `rows`, else the largest axes that do, one
    by one; `()` keeps the rows whole on each device."""
    names = list(mesh.axis_names)
    if rows is not None and rows % int(np.prod(mesh.devices.shape)) == 0:
        return tuple(names)
    chosen, product = set(), 1
    for name in sorted(names, key=lambda n: -mesh.shape[n]):
        if rows is not None and rows % (product * mesh.shape[name]) == 0:
            chosen.add(name)
            product *= mesh.shape[name]
    return tuple(n for n in names if n in chosen)


def per_device(function, mesh, inputs, kernel):
    """`function(inputs, kernel)` under `shard_map` on `mesh`: the rows of
    `inputs` split over `row_axes`, the kernel whole."""
    inputs, kernel = jax.numpy.asarray(inputs), jax.numpy.asarray(kernel)
    axes = row_axes(mesh, inputs.shape[0])
    rows = PartitionSpec(axes if axes else None)
    mapped = jax.shard_map(function, mesh=mesh,
                           in_specs=(rows, PartitionSpec()), out_specs=rows)
    return mapped(inputs, kernel)


def wrap(convolution):
    """Keras' JAX `convolution(inputs, kernel, *options)`, run
    `per_device` under a distribution of more than one device."""
    @functools.wraps(convolution)
    def wrapped(inputs, kernel, *args, **kwargs):
        mesh = _mesh()
        if mesh is None:
            return convolution(inputs, kernel, *args, **kwargs)
        return per_device(
            lambda x, k: convolution(x, k, *args, **kwargs), mesh, inputs,
            kernel)
    wrapped._klm_wrapped = True
    return wrapped


def install(nn):
    """Wrap `CONVOLUTIONS` of Keras' JAX `nn` module in place, once."""
    for name in CONVOLUTIONS:
        original = getattr(nn, name)
        if not getattr(original, "_klm_wrapped", False):
            setattr(nn, name, wrap(original))
