"""Keras' own distribution classes, run as klm's.

Code written for the Keras distribution guide or keras-hub's recipes holds
Keras' classes: `keras.distribution.DataParallel`, `ModelParallel` (with a
`keras.distribution.LayoutMap`). After `import keras_layoutmap`, making one
current (`keras.distribution.set_distribution(d)` or `with d.scope():`)
makes current the klm distribution with the same mesh, batch axis, dataset
sharding and rules instead, so there is one code path whichever class a
user holds: exact short batches, per-process data, every backend. A Keras
`LayoutMap` keeps Keras' meaning: a rule matches anywhere in a weight's
path (`re.search`), an exact key first.

Example:

>>> import keras, keras_layoutmap as klm
>>> mesh = keras.distribution.DeviceMesh((1,), ["batch"],
...     devices=klm.list_devices()[:1])
>>> with keras.distribution.DataParallel(device_mesh=mesh).scope():
...     isinstance(keras.distribution.distribution(), klm.DataParallel)
True
"""

import keras
from keras import distribution as keras_distribution

from keras_layoutmap.distributions import DataParallel, ModelParallel, _Resolving
from keras_layoutmap.keras_internals import (
    distribution_module as distribution_lib,
)
from keras_layoutmap.keras_internals import (
    distribution_package as keras_distribution_package,
)
from keras_layoutmap.rules.rule_map import RuleMap


def _rules_key(layout_map):
    return tuple((k, tuple(v.axes)) for k, v in layout_map._layout_map.items())


def as_klm(value):
    """The klm distribution that runs `value` (a Keras distribution); a klm
    distribution or None as it is. Raises `TypeError` for anything else."""
    if value is None or isinstance(value, _Resolving):
        return value
    if not isinstance(value, distribution_lib.Distribution):
        hint = (" To apply a LayoutMap, pass `layout_map.distribution()` or "
                "use `with layout_map.scope():`." if isinstance(
                    value, keras_distribution.LayoutMap) else "")
        raise TypeError(
            "set_distribution() and scope() take a Keras distribution "
            "(`klm.DataParallel`, `klm.ModelParallel`, "
            "`keras.distribution.DataParallel`, ...) or None. Received: "
            f"{value!r} of type {type(value).__name__}.{hint}"
        )
    if isinstance(value, keras_distribution.ModelParallel):
        key = ("mp", _rules_key(value._layout_map))
    elif isinstance(value, keras_distribution.DataParallel):
        key = ("dp",)
    else:
        return value  # a distribution of the user's own: as it is
    cached = value.__dict__.get("_klm_as")
    if cached is not None and cached[0] == key:
        return cached[1]  # the same one each time: models remember it
    if key[0] == "mp":
        converted = ModelParallel(
            layout_map=RuleMap.from_keras(value._layout_map, value.device_mesh),
            batch_dim_name=value.batch_dim_name,
            auto_shard_dataset=value.auto_shard_dataset,
        )
    else:
        converted = DataParallel(
            device_mesh=value.device_mesh,
            batch_dim_name=value.batch_dim_name,
            auto_shard_dataset=value.auto_shard_dataset,
        )
    value.__dict__["_klm_as"] = (key, converted)
    return converted


def install():
    """Make `keras.distribution.set_distribution` (and so every
    `Distribution.scope()`, which calls it) go through `as_klm`."""
    original = distribution_lib.__dict__.get("_klm_original_set_distribution")
    if original is None:
        original = distribution_lib.set_distribution
        distribution_lib._klm_original_set_distribution = original

    def set_distribution(value):
        """Set the global distribution (a Keras class runs as klm's)."""
        original(as_klm(value))

    for module in (distribution_lib, keras_distribution,
                   keras_distribution_package, keras.distribution):
        module.set_distribution = set_distribution
