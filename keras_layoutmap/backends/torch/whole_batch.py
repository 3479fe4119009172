"""A batch the batch axis does not divide, through kernels split over it.

Such a batch is replicated: computed whole on every device, as on one. But a
weight that the rules split over the batch axis too (keras-hub's
`get_layout_map` recipes split the hidden dimension of the attention and MLP
kernels over `batch`) lets DTensor's sharding propagation choose to split
the product's rows over that axis instead: a reduce-scatter of 3 rows over
2 devices, uneven, which the next reshape refuses ("Cannot flatten unevenly
sharded tensor", inside keras-hub's attention, `generate()` with 3
prompts). So for the span of a `Dense` or `EinsumDense` call whose input is
whole over the batch axis and whose kernel is split over it, each read of
a weight split over that axis is gathered over it (`redistribute`, which
autograd carries back to the stored shards); the weights stay split.
"""

import contextvars
import functools

from keras import distribution as keras_distribution
from torch.distributed.tensor import DTensor, Replicate, Shard

# The mesh dimension (index) to gather weights over during a layer call.
_GATHER_DIM = contextvars.ContextVar("klm_torch_whole_batch_dim", default=None)


def _batch_mesh_dim(value):
    """The index of the active distribution's batch axis in `value`'s mesh,
    or None."""
    dist = keras_distribution.distribution()
    name = getattr(dist, "batch_dim_name", None)
    names = value.device_mesh.mesh_dim_names or ()
    return names.index(name) if name in names else None


def _first_dtensor(inputs):
    while isinstance(inputs, (list, tuple)) and inputs:
        inputs = inputs[0]
    return inputs if isinstance(inputs, DTensor) else None


def wrap_layer_call(original):
    """`Dense.call` / `EinsumDense.call`, gathering weights split over the
    batch axis when the input is whole over it (see above)."""

    @functools.wraps(original)
    def call(self, inputs, *args, **kwargs):
        kernel = getattr(getattr(self, "_kernel", None), "_value", None)
        x = _first_dtensor(inputs)
        if (_GATHER_DIM.get() is not None or not isinstance(kernel, DTensor)
                or x is None or x.device_mesh != kernel.device_mesh):
            return original(self, inputs, *args, **kwargs)
        dim = _batch_mesh_dim(kernel)
        if (dim is None or not isinstance(kernel.placements[dim], Shard)
                or not isinstance(x.placements[dim], Replicate)):
            return original(self, inputs, *args, **kwargs)
        token = _GATHER_DIM.set(dim)
        try:
            return original(self, inputs, *args, **kwargs)
        finally:
            _GATHER_DIM.reset(token)

    return call


def wrap_value(prop):
    """`Variable.value`, gathered over the batch axis during such a call."""

    @property
    @functools.wraps(prop.fget)
    def value(self):
        value = prop.fget(self)
        dim = _GATHER_DIM.get()
        if (dim is None or not isinstance(value, DTensor)
                or not isinstance(value.placements[dim], Shard)):
            return value
        placements = list(value.placements)
        placements[dim] = Replicate()
        return value.redistribute(value.device_mesh, placements)

    return value
