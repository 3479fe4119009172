"""Keras variables as DTensor parameters: made with their layout, moved,
assigned, read back to the host.

A Keras torch variable holds a `torch.nn.Parameter`; on a mesh that
parameter wraps a DTensor, so torch's own machinery (autograd, `zero_grad`,
`state_dict`, DCP) sees a sharded parameter.
"""

import numpy as np
import torch
from torch.distributed.tensor import DTensor

from keras_layoutmap import same_value
from keras_layoutmap.backends.torch import decoding, initialization, processes
from keras_layoutmap.backends.torch.keras_internals import convert_to_tensor
from keras_layoutmap.backends.torch.placement import (
    _placed,
    fetch_layout,
    to_host,
    to_layout,
)
from keras_layoutmap.layout import Layout, as_layout


def _parameter(variable, value):
    # Every placement of a variable comes here: keras-hub, once loaded, gets
    # its decoding wrap (a dict lookup until then).
    decoding.install_if_loaded()
    value = value.detach()
    trainable = variable.trainable and (value.is_floating_point()
                                        or value.is_complex())
    return torch.nn.Parameter(value, requires_grad=trainable)


def relayout_variable(variable, layout):
    layout = as_layout(layout)
    variable._layout = layout
    if not _placed(layout):
        return unplace_variable(variable, keep_layout=True)
    variable._value = _parameter(variable, to_layout(variable._value, layout))


def unplace_variable(variable, keep_layout=False):
    """Bring a variable back to one device: a plain parameter holding the
    whole value, as if made with no distribution."""
    value = to_host(variable._value.detach())
    variable._value = _parameter(variable, value.clone())
    if not keep_layout:
        variable._layout = None


def _layout_for(variable):
    from keras import distribution as keras_distribution
    if getattr(variable, "_layout", None) is None:
        dist = keras_distribution.distribution()
        if dist is not None:
            variable._layout = dist.get_variable_layout(variable)
    layout = getattr(variable, "_layout", None)
    return as_layout(layout) if layout is not None else None


def wrap_initialize(original):
    """Variables made under a distribution (or with a layout) become DTensor
    parameters with their layout; a value that is already a DTensor keeps
    its layout when no distribution says otherwise."""

    def _initialize(self, value):
        from keras import distribution as keras_distribution
        if isinstance(value, torch.nn.Parameter):
            return original(self, value)
        if (getattr(self, "_layout", None) is None
                and keras_distribution.distribution() is None
                and isinstance(value, DTensor)):
            axes, mesh = fetch_layout(value)
            self._layout = Layout(axes, mesh)
        if self._shape is None and not callable(value):
            self._shape = self._validate_shape(tuple(np.shape(value)))
        layout = _layout_for(self)
        if not _placed(layout):
            if isinstance(value, DTensor):
                value = to_host(value)
            return original(self, value)
        if callable(value):
            value = value()
        value = convert_to_tensor(value, dtype=self._dtype)
        self._value = _parameter(self, to_layout(value, layout))

    return _initialize


def wrap_direct_assign(original):
    def _direct_assign(self, value):
        current = self._value
        if not isinstance(current, DTensor):
            if isinstance(value, DTensor):
                value = to_host(value)
            return original(self, value)
        if not isinstance(value, DTensor):
            value = convert_to_tensor(value)
            _check_same_everywhere(self, value, current)
        value = to_layout(value, as_layout(self._layout)
                          if getattr(self, "_layout", None) is not None
                          else _layout_of(current))
        with torch.no_grad():
            current.to_local().copy_(value.to_local())

    return _direct_assign


def _check_same_everywhere(variable, value, current):
    """A host value assigned to a variable on a mesh over every process:
    the same on each (each keeps its own slice of it), else an error on
    every process naming the variable. (Training's own assignments are
    DTensors; a variable made on some processes only makes no check.)"""
    if current.device_mesh.size() != processes.world_size():
        return
    with same_value.naming(variable.path):
        processes.check_same_everywhere(value)


def _layout_of(value):
    axes, mesh = fetch_layout(value)
    return Layout(axes, mesh)


def wrap_initialize_with_initializer(original):
    """A variable whose layout splits it is made by `born_sharded` when its
    initializer is covered: each process makes only its shard."""

    def _initialize_with_initializer(self, initializer):
        layout = _layout_for(self)
        if _placed(layout):
            value = initialization.born_sharded(
                initializer, self._shape, self._dtype, layout)
            if value is not None:
                self._value = _parameter(self, value)
                return
        original(self, initializer)

    return _initialize_with_initializer


def keras_placement_off(self, value):
    """Keras 3.16's `Variable._initialize_distributed`, stood aside: it
    would place the variable by Keras' torch distribution_lib; here
    `_initialize` (above) places it, born sharded where it can be, as on
    Keras 3.15. None tells Keras to initialize it as a plain variable,
    which goes through `_initialize`."""
    return None
