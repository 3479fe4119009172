"""Object paths of weights, in the TF-Keras convention.

A weight has two names a rule can match:

- its Keras 3 `variable.path` (`"sequential/d1/kernel"`), and
- its *object path*, the one TF-Keras' `LayoutMap` used: for a subclassed
  model the chain of attribute names (`"feature.kernel"`,
  `"blocks.0.dense.kernel"`); inside a Functional or Sequential model a layer
  is named by `layer.name` (`"d1.kernel"`).

`object_paths(model)` walks a model top-down. `object_path(layer, name)`
answers the same question bottom-up while a weight is being created, when the
model that will own the layer may not exist yet: it follows child -> parent
links, found by scanning only the layers that are new or were given a
layer-holding attribute since the last scan (so building a model stays
linear in its size).
"""

import weakref

from keras import layers as keras_layers
from keras import models as keras_models

from keras_layoutmap.keras_internals import Functional

# Child -> parent links, found by scanning layers that may have gained
# children since the last scan (new layers, and layers that were given a
# layer-holding attribute). Weak references only.
_parents = {}  # id(child) -> (weakref(child), weakref(parent), key)
_to_scan = {}  # id(layer) -> weakref(layer); ids, as a half-built layer
# may not be hashable yet

_SKIPPED_ATTRIBUTES = {"_layers", "_tracker", "_inbound_nodes",
                       "_outbound_nodes", "_operations", "_self_setattr_tracking"}


def register(layer):
    """Record that `layer` may have gained children: it is new (made after
    its sublayers), or was just given an attribute that may hold layers."""
    _to_scan[id(layer)] = weakref.ref(layer)


def _is_graph_model(layer):
    return isinstance(layer, (Functional, keras_models.Sequential))


def _is_transparent(parent, child):
    """A model used as a layer of a Functional or Sequential model (a
    backbone inside a task model) adds no key: its weights keep the paths
    they have in the model alone, so rules written for it still match, and
    the path does not depend on whether it was built before its wrapper."""
    return _is_graph_model(parent) and isinstance(child, keras_models.Model)


def children(layer):
    """`(key, child_layer)` pairs of `layer`'s direct sublayers, in order.

    Functional and Sequential models name their layers by `layer.name`;
    every other layer by attribute name, `name.i` for lists and tuples and
    `name.key` for dicts.
    """
    if _is_graph_model(layer):
        for child in layer.layers:
            if not isinstance(child, keras_layers.InputLayer):
                yield child.name, child
        return
    seen = set()
    for key, child in _attribute_children(vars(layer)):
        if id(child) not in seen:
            seen.add(id(child))
            yield key, child


def _attribute_children(attributes):
    for attr, value in list(attributes.items()):
        if attr == "_modules" and isinstance(value, dict):
            # torch.nn.Module keeps sublayer attributes here, not in vars().
            yield from _attribute_children(value)
            continue
        if attr in _SKIPPED_ATTRIBUTES:
            continue  # Keras' own tracking
        if isinstance(value, keras_layers.Layer):
            # A layer held directly is a child, whatever its attribute's
            # name: keras-hub keeps attention in `_self_attention_layer`.
            # Were it skipped, its weights would get one object path while
            # created (the attention layer taken for a root) and another, or
            # none, in `explain`: a rule applied and not reported.
            yield attr, value
        elif attr.startswith("_self_"):
            continue  # tf.Module's tracking containers on TensorFlow
        elif isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                if isinstance(item, keras_layers.Layer):
                    yield f"{attr}.{i}", item
        elif isinstance(value, dict):
            for key, item in value.items():
                if isinstance(item, keras_layers.Layer):
                    yield f"{attr}.{key}", item


def _own_variables(layer):
    return list(layer._trainable_variables) + list(
        layer._non_trainable_variables
    )


def object_paths(model, with_owner=False):
    """`{id(variable): object_path}` for every weight of `model`, top-down
    (`{id(variable): (object_path, owning_layer)}` with `with_owner`)."""
    paths = {}

    def visit(layer, prefix, seen):
        if id(layer) in seen:
            return
        seen.add(id(layer))
        for variable in _own_variables(layer):
            paths.setdefault(
                id(variable),
                (prefix + variable.name, layer) if with_owner
                else prefix + variable.name,
            )
        for key, child in children(layer):
            transparent = _is_transparent(layer, child)
            visit(child, prefix if transparent else f"{prefix}{key}.", seen)

    top = "" if isinstance(model, keras_models.Model) else f"{model.name}."
    visit(model, top, set())
    return paths


def _scan():
    parents = [ref() for ref in _to_scan.values()]
    _to_scan.clear()
    for parent in filter(None, parents):
        try:
            found = list(children(parent))
        except AttributeError:
            # A model still inside its constructor (e.g. a Functional whose
            # graph is not set yet): look again at the next scan.
            _to_scan[id(parent)] = weakref.ref(parent)
            continue
        for key, child in found:
            entry = _parents.get(id(child))
            if entry is None or entry[0]() is not child:
                _parents[id(child)] = (
                    weakref.ref(child), weakref.ref(parent), key
                )


def _lookup(layer):
    entry = _parents.get(id(layer))
    if entry is None or entry[0]() is not layer:
        return None, None  # unknown, or a dead layer's recycled id
    parent = entry[1]()
    return (parent, entry[2]) if parent is not None else (None, None)


def _parent_of(layer):
    """`(parent, key)` of `layer`, or `(None, None)` for a root."""
    parent, key = _lookup(layer)
    if parent is None and _to_scan:
        _scan()
        parent, key = _lookup(layer)
    return parent, key


def lineage(layer):
    """`layer`, then its parent, its parent's parent, ... up to the root
    (each once, even if the links loop)."""
    node, seen = layer, set()
    while node is not None and id(node) not in seen:
        seen.add(id(node))
        yield node
        node, _ = _parent_of(node)


def object_path(layer, weight_name):
    """The object path that weight `weight_name` of `layer` will have.

    Used while the weight is being created: climbs from `layer` to the
    outermost layer that holds it. A root that is a model contributes no
    name (a subclassed model's weights are named by attributes only); a root
    that is a plain layer is named by `layer.name`, as Functional and
    Sequential models name their layers.
    """
    keys, node, seen = [], layer, {id(layer)}
    while True:
        parent, key = _parent_of(node)
        if parent is None or id(parent) in seen:
            break
        seen.add(id(parent))
        if not _is_transparent(parent, node):
            keys.append(key)
        node = parent
    if not isinstance(node, keras_models.Model):
        keys.append(node.name)
    return ".".join([*reversed(keys), weight_name])


def reference_of(variable):
    """The model weight an optimizer slot was made for (None otherwise;
    `placement` records it when the slot is made)."""
    ref = getattr(variable, "_klm_reference", None)
    return None if ref is None else ref()
