"""`klm.fsdp`: fully sharded data parallel (ZeRO-3 style) as a `LayoutMap`.

The policy itself (which weights are sharded, along which dimension) is
`rules.fsdp_policy`; this is the public constructor.
"""

from keras_layoutmap.layout_map import FSDPLayoutMap
from keras_layoutmap.rules.config import DEFAULT_MAX_REPLICATED_BYTES
from keras_layoutmap.rules.fsdp_policy import DEFAULT_MIN_BYTES


def fsdp(mesh=None, axis="batch", min_bytes=DEFAULT_MIN_BYTES, rules=None,
         strict=False, max_replicated_bytes=DEFAULT_MAX_REPLICATED_BYTES):
    """A `LayoutMap` that shards every large weight over the data axis.

    `mesh` is the `klm.Mesh` (None: the mesh of `rules`); `axis` the mesh
    axis to shard weights over, normally the one batches are split over;
    weights of fewer than `min_bytes` bytes (an int >= 0) are replicated.
    `rules`, an optional `klm.LayoutMap` (or `keras.distribution.LayoutMap`),
    is copied first: rules always win over FSDP, and more can be added to
    the returned map. `strict` and `max_replicated_bytes` are as for
    `klm.LayoutMap`.

    `explain()` reports the weights the policy placed with the rule
    `"fsdp(<axis>)"`.

    Example:

    >>> import keras, keras_layoutmap as klm
    >>> mesh = klm.create_mesh([("batch", len(klm.list_devices()))])
    >>> layout_map = klm.fsdp(mesh, axis="batch", min_bytes=64)
    >>> with layout_map.scope():
    ...     model = keras.Sequential([keras.Input((4,)),
    ...                               keras.layers.Dense(8, name="d1")])
    >>> klm.fetch_layout(model.layers[0].kernel).sharding_specs
    ['unsharded', 'batch']
    >>> klm.fetch_layout(model.layers[0].bias).sharding_specs
    ['unsharded']
    >>> layout_map.explain(model).rows[0].rule
    'fsdp(batch)'
    """
    return FSDPLayoutMap.build(
        mesh, axis=axis, min_bytes=min_bytes, rules=rules, strict=strict,
        max_replicated_bytes=max_replicated_bytes)
