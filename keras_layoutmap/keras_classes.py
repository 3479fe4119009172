"""Keras' own distribution classes, run as klm's.

Code written for the Keras distribution guide or keras-hub's recipes holds
Keras' classes: `keras.distribution.DataParallel`, `ModelParallel` (with a
`keras.distribution.LayoutMap`). After `import keras_layoutmap`, making one
current (`keras.distribution.set_distribution(d)` or `with d.scope():`)
makes current a klm distribution that reads the Keras object's mesh, batch
axis, dataset sharding and rules live instead, so there is one code path
whichever class a user holds: exact short batches, per-process data, every
backend. A Keras `LayoutMap`'s rule matches anywhere in a weight's path
(`re.search`), an exact key first, the first match winning; plain Keras
fullmatches and refuses two matches (docs/keras-distribution.md says why
klm differs).

Example:

>>> import keras, keras_layoutmap as klm
>>> devices = klm.list_devices()
>>> mesh = keras.distribution.DeviceMesh((len(devices),), ["batch"],
...     devices=devices)
>>> with keras.distribution.DataParallel(device_mesh=mesh).scope():
...     isinstance(keras.distribution.distribution(), klm.DataParallel)
True
"""

import keras
from keras import distribution as keras_distribution

from keras_layoutmap.distributions import DataParallel, ModelParallel, _Resolving
from keras_layoutmap.keras_internals import KerasDistribution as _KerasDistribution
from keras_layoutmap.keras_internals import TFDatasetAdapter, global_state
from keras_layoutmap.keras_internals import (
    distribution_module as distribution_lib,
)
from keras_layoutmap.keras_internals import (
    distribution_package as keras_distribution_package,
)
from keras_layoutmap.keras_internals import tf_dataset_split as _tf_dataset_split
from keras_layoutmap.layout import Layout
from keras_layoutmap.mesh import live_mesh
from keras_layoutmap.rules.config import synced_from_keras
from keras_layoutmap.rules.rule_map import RuleMap


class _Live:
    """An attribute of a klm distribution that runs a Keras one, read from
    (and written to) the Keras object each time: the Keras object is the
    truth. `convert` maps what the Keras object holds to what klm uses."""

    def __init__(self, name, convert=None):
        self.name, self.convert = name, convert

    def __get__(self, view, owner=None):
        if view is None:
            return self
        value = getattr(view.__dict__["_klm_keras"], self.name)
        return value if self.convert is None else self.convert(value)

    def __set__(self, view, value):
        setattr(view.__dict__["_klm_keras"], self.name, value)


class _KerasView:
    """A klm distribution running a Keras `DataParallel` or `ModelParallel`
    (`_klm_keras`): its mesh, batch axis and `auto_shard_dataset` are the
    Keras object's, read live, so a setting changed after first use (as
    Keras' own error for per-process numpy prescribes:
    `distribution.auto_shard_dataset = False`) takes effect at the next use.
    One view a Keras object, so models that remember it see the change."""

    _device_mesh = _Live("_device_mesh", live_mesh)
    _batch_dim_name = _Live("_batch_dim_name")
    _auto_shard_dataset = _Live("_auto_shard_dataset")

    def __init__(self, keras_distribution_object):
        self.__dict__["_klm_keras"] = keras_distribution_object
        source = keras_distribution_object
        # Keras' own `Distribution.__init__` (process count and id); the
        # three attributes it sets write through to the Keras object.
        _KerasDistribution.__init__(self, source.device_mesh,
                                    source.batch_dim_name,
                                    source.auto_shard_dataset)


class _KerasDataParallel(_KerasView, DataParallel):
    """`keras.distribution.DataParallel` as klm's, read live."""


class _KerasModelParallel(_KerasView, ModelParallel):
    """`keras.distribution.ModelParallel` as klm's: its `LayoutMap`'s rules
    converted to klm's (`RuleMap.from_keras`, matching anywhere in a
    path), converted again whenever a rule, a rule's layout or a mesh
    changes (an entry added or deleted after first use applies to the
    next weight placed)."""

    def __init__(self, keras_distribution_object):
        super().__init__(keras_distribution_object)
        _ = self.layout_map  # a rule that is not a regex: refused now

    @property
    def layout_map(self):
        return synced_from_keras(RuleMap, self,
                                 self.__dict__["_klm_keras"]._layout_map,
                                 self.device_mesh)

    _layout_map = layout_map


# Errors and reprs name the class the user holds.
for _view, _name in ((_KerasDataParallel, "DataParallel"),
                     (_KerasModelParallel, "ModelParallel")):
    _view.__name__ = _view.__qualname__ = _name


def as_klm(value):
    """The klm distribution that runs `value` (a Keras distribution); a klm
    distribution or None as it is. Raises `TypeError` for anything else.
    A Keras `DataParallel` or `ModelParallel` runs as one view of it,
    the same each time, that reads the Keras object live (`_KerasView`)."""
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
        view = _KerasModelParallel
    elif isinstance(value, keras_distribution.DataParallel):
        view = _KerasDataParallel
    else:
        return value  # a distribution of the user's own: as it is
    converted = value.__dict__.get("_klm_as")
    if converted is None:
        converted = view(value)
        value.__dict__["_klm_as"] = converted
    return converted


def _checked(value):
    value = as_klm(value)
    if isinstance(value, _Resolving):
        value.check_mesh()
    return value


def install():
    """Make `keras.distribution.set_distribution` (and so every
    `Distribution.scope()`, which calls it) go through `as_klm`; so does
    the global state it writes to and reads from, for a `set_distribution`
    a script took before `import keras_layoutmap` (`from keras.distribution
    import set_distribution`), and a distribution already set then."""
    name = getattr(distribution_lib, "GLOBAL_ATTRIBUTE_NAME", "distribution")
    store = global_state.__dict__.get("_klm_original_set_global_attribute")
    if store is None:
        store = global_state.set_global_attribute
        global_state._klm_original_set_global_attribute = store

    def set_global_attribute(key, value):
        """Keras' global attribute `key` (a distribution runs as klm's)."""
        store(key, _checked(value) if key == name else value)

    global_state.set_global_attribute = set_global_attribute
    # One set before the import is converted where Keras (and klm) read it,
    # once the devices exist (`klm.configure_virtual_devices` comes after).
    read = global_state.__dict__.get("_klm_original_get_global_attribute")
    if read is None:
        read = global_state.get_global_attribute
        global_state._klm_original_get_global_attribute = read
    keras_classes = (keras_distribution.DataParallel,
                     keras_distribution.ModelParallel)

    def get_global_attribute(key, default=None, set_to_default=False):
        """Keras' global attribute `key` (a distribution runs as klm's)."""
        value = read(key, default, set_to_default)
        if key == name and isinstance(value, keras_classes) and not isinstance(
                value, _Resolving):
            value = _checked(value)
            store(key, value)
        return value

    global_state.get_global_attribute = get_global_attribute
    original = distribution_lib.__dict__.get("_klm_original_set_distribution")
    if original is None:
        original = distribution_lib.set_distribution
        distribution_lib._klm_original_set_distribution = original

    def set_distribution(value):
        """Set the global distribution (a Keras class runs as klm's)."""
        original(_checked(value))

    for module in (distribution_lib, keras_distribution,
                   keras_distribution_package, keras.distribution):
        module.set_distribution = set_distribution

    # `Layer.__call__` lays a layer's output out by the layout the
    # distribution gives `"<layer path>/output"`; klm's carry the path and
    # rule, fitted here to the output's shape on every backend.
    distribute = distribution_lib.__dict__.get("_klm_original_distribute_tensor")
    if distribute is None:
        distribute = distribution_lib.distribute_tensor
        distribution_lib._klm_original_distribute_tensor = distribute

    def distribute_tensor(tensor, layout):
        """`tensor` laid out as `layout` (Keras' `distribute_tensor`)."""
        if getattr(layout, "_klm_output", None) is not None:
            return _distribute_output(distribute, tensor, layout)
        return distribute(tensor, layout)

    distribution_lib.distribute_tensor = distribute_tensor

    # Keras 3.16's tf.data adapter splits a dataset over processes by its
    # own rule (and refuses keras-hub's pipelines, whose batch size tf.data
    # cannot compute); a klm distribution feeds each process itself, as
    # Keras 3.15 asked it to.
    split = _tf_dataset_split
    if split is not None and not getattr(split, "_klm_wrapped", False):
        def _distribute_dataset(self, dataset, distribution):
            if isinstance(distribution, _Resolving):
                return distribution.distribute_dataset(dataset)
            return split(self, dataset, distribution)

        _distribute_dataset._klm_wrapped = True
        TFDatasetAdapter._distribute_dataset = _distribute_dataset


def fit_output_layout(shape, layout, path, rule, batch_axis):
    """`layout` (given by `rule` to the output `path`) for an output of
    `shape`: a batch the batch axis does not divide (a short last batch, a
    `predict` of 3 rows on 8 devices) is replicated, as the data is; a rank
    that differs, or another axis that does not divide its dimension, is a
    `ValueError` naming the layer path, the rule and the sizes."""
    specs = list(layout.sharding_specs)
    where = (f"Layer output {path!r} has shape {tuple(shape)}, but rule "
             f"{rule!r} lays it out as {specs}")
    if len(shape) != len(specs):
        raise ValueError(
            f"{where}: the rule has rank {len(specs)}, the output rank "
            f"{len(shape)}. Give the rule {len(shape)} axis names (None "
            "for a dimension not split), or make its regex miss this path."
        )
    changed = False
    unknown = []  # batch dimensions of unknown size (a traced step)
    for i, (size, axis) in enumerate(zip(shape, layout.axes)):
        if axis is None:
            continue
        if size is None:
            if axis == batch_axis:
                unknown.append(i)
            continue
        parts = layout.mesh.dim_size(axis)
        if int(size) % parts == 0:
            continue
        if axis != batch_axis:
            raise ValueError(
                f"{where}: mesh axis {axis!r} ({parts} devices) does not "
                f"divide dimension {i} (size {int(size)}). Use a size it "
                "divides, or leave that dimension unsplit (None)."
            )
        specs[i] = None  # exact, as a short batch of data is
        changed = True
    if not (changed or unknown):
        return layout
    fitted = Layout(specs, layout.mesh)
    # A step traced once for every batch size (TensorFlow's) cannot know
    # whether this batch is split: these dimensions keep the split the
    # computation gives them (the data's: split, or whole when short).
    fitted._klm_match_dims = tuple(unknown)
    return fitted


def _distribute_output(original, tensor, layout):
    path, rule, batch_axis = layout._klm_output

    def one(x):
        if x is None or isinstance(x, keras.KerasTensor) or not hasattr(
                x, "shape"):
            return x  # symbolic (a Functional model being built): as Keras
        shape = tuple(None if d is None else int(d) for d in x.shape)
        return original(x, fit_output_layout(shape, layout, path, rule,
                                             batch_axis))

    return keras.tree.map_structure(one, tensor)
