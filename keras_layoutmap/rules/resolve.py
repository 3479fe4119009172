"""Resolving one weight: which layout it gets, and from where.

A weight's layout comes, in order, from a `<name>_layout=` kwarg on its
layer (or a layer containing it), then the first rule of the map that
matches its keys (for a rule with fallbacks, its first layout that fits the
weight's shape), else it is replicated on the mesh. Distributions (when a
weight is created), `explain` (from shapes alone) and placement (when a
model moves) all ask `resolve_weight`.

A weight is named by two keys: its TF-Keras object path and its Keras 3
`variable.path`. The object path needs the layer being built, which
`creating_weight` records while `add_weight` runs.
"""

import contextlib
import contextvars

from keras_layoutmap import paths
from keras_layoutmap.keras_internals import SEED_STATE_NAME
from keras_layoutmap.layout import Layout, as_layout, check_fits
from keras_layoutmap.mesh import as_mesh
from keras_layoutmap.rules import quantized
from keras_layoutmap.rules.choice import Choice

# The layer (and weight name) whose `add_weight` is running: the one piece
# of context that lets a distribution name a weight by its object path.
_CREATING = contextvars.ContextVar("klm_creating_weight", default=None)


@contextlib.contextmanager
def creating_weight(layer, name):
    token = _CREATING.set((layer, name))
    try:
        yield
    finally:
        _CREATING.reset(token)


def creating_layer():
    """The layer whose `add_weight` is running (None outside one)."""
    creating = _CREATING.get()
    return None if creating is None else creating[0]


def weight_layouts(layer):
    """`{weight_name: layout}` from the layer's `<weight>_layout=` kwargs
    (stored by `layer_kwargs`)."""
    return layer.__dict__.get("_klm_weight_layouts", {})


def _kwarg_layout(layer, name):
    """The `<name>_layout=` given to `layer` or the nearest ancestor."""
    for node in paths.lineage(layer):
        layouts = weight_layouts(node)
        if name in layouts:
            return f"{node.name}.{name}_layout", layouts[name]
    return None, None


def weight_keys(variable):
    """`(object_path, variable.path)` of a weight being created."""
    creating = _CREATING.get()
    if creating is None:
        return None, variable.path
    layer, _ = creating
    return paths.object_path(layer, variable.name), variable.path


def resolve_weight(owner, name, shape, object_path, path, layout_map, mesh,
                   detail=False, dtype=None):
    """`(source, layout)` for weight `name` of layer `owner`.

    A `<name>_layout=` kwarg on the layer (or a layer containing it) wins;
    then the first matching rule of `layout_map` (for a rule with fallbacks,
    its first layout that fits `shape`); else replicated on `mesh`.
    `source` names the kwarg or the rule (None for the default). Raises
    `ValueError` if the chosen layout cannot hold a tensor of `shape`, or if
    a kwarg's layout is on another mesh than `mesh`. With `detail=True`,
    returns `(source, layout, choice)`, `choice` being the rule's
    `layout_map.Choice` (None for a kwarg or the default). `dtype` goes to
    the map's default policy (`klm.fsdp` sizes weights by it).

    A random layer's seed state (a `keras.random.SeedGenerator`'s) is
    always replicated: its two numbers are read whole by every draw, and no
    rule or policy may split them (`source` None).
    """
    if name == SEED_STATE_NAME:
        layout = Layout.replicated(mesh, len(shape))
        return (None, layout, None) if detail else (None, layout)
    follower = quantized.describe(owner, name, shape)
    if follower is not None:
        found = _follow(follower, owner, name, shape, object_path, path,
                        layout_map, mesh, dtype)
        if found is not None:
            return found if detail else found[:2]
    if owner is not None:
        source, layout = _kwarg_layout(owner, name)
        if layout is not None:
            layout = as_layout(layout, mesh, where=source)
            if mesh is not None and layout.mesh != as_mesh(mesh):
                raise ValueError(
                    f"Weight {object_path or path!r}: {source} is a layout on "
                    f"{layout.mesh!r}, but the distribution places the model "
                    f"on {as_mesh(mesh)!r}. One model lives on one mesh: make "
                    "the layout on the distribution's mesh."
                )
            check_fits(layout, shape, object_path or path, source)
            return (source, layout, None) if detail else (source, layout)
    if layout_map is not None:
        choice = layout_map.choose(shape, object_path, path, dtype=dtype)
        if choice.layout is not None:
            if detail:
                return choice.rule, choice.layout, choice
            return choice.rule, choice.layout
    layout = Layout.replicated(mesh, len(shape))
    return (None, layout, None) if detail else (None, layout)


def _follow(follower, owner, name, shape, object_path, path, layout_map,
            mesh, dtype):
    """`(source, layout, choice)` for a variable that quantization added
    (see `rules.quantized`), or None when a kwarg or a rule of its own
    (one that is not its kernel's) places it."""
    own_kwarg, _ = _kwarg_layout(owner, name)
    if own_kwarg is not None and follower.base != name:
        return None
    base_object_path, base_path = quantized.sibling_keys(
        object_path, path, name, follower.base)
    own_rule = None
    if layout_map is not None and follower.base != name:
        own_rule, _ = layout_map.match(object_path, path)
    source, base_layout, choice = resolve_weight(
        owner, follower.base, follower.base_shape, base_object_path,
        base_path, layout_map, mesh, detail=True, dtype=dtype)
    if own_rule is not None and own_rule != source:
        return None  # a rule written for this variable
    layout = quantized.follow(follower, base_layout, shape,
                              object_path or path, source)
    follows = None if follower.base == name else (
        base_object_path or base_path)
    index, count, refused = (None, 1, ()) if choice is None else (
        choice.index, choice.count, choice.refused)
    return source, layout, Choice(source, layout, index, count, refused,
                                  follows=follows)
