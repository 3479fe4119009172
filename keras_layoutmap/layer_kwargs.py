"""`<weight>_layout=` keyword arguments for every Keras layer.

After `import keras_layoutmap`, any layer accepts a `<name>_layout=` kwarg for
each weight `<name>` it (or a sublayer) creates, e.g.
`Dense(kernel_layout=..., bias_layout=...)`,
`Embedding(embeddings_layout=...)`, `BatchNormalization(gamma_layout=...,
moving_mean_layout=...)`. Which names are valid is derived from the layer
itself: after the layer builds, a kwarg that named no weight it created is an
error that lists the weights it did create. The kwargs survive
`get_config()` / `from_config()` and `model.save()` / `load_model()`.

They are attributes too, as in TF-Keras 2: `Dense(kernel_layout=L).kernel_layout`
is `L`, and a layer given no `kernel_layout` has no such attribute
(`hasattr(Dense(2), "kernel_layout")` is False), until it is set: a custom
layer that sets `self.kernel_layout = L` before `add_weight(name="kernel")`
gets that layout (`self.kernel_layout = None` reads back None, and places
nothing).

Installing also teaches every layer two things a distribution needs: the
layer (and weight name) being created, for object paths, and the
distribution the layer was made under, so weights built later, outside the
scope, still get their layouts.
"""

import contextlib
import functools

from keras import distribution as keras_distribution
from keras import layers as keras_layers

from keras_layoutmap import paths, strict
from keras_layoutmap.distributions import replicated_on
from keras_layoutmap.layout import as_layout
from keras_layoutmap.rules.resolve import creating_weight, weight_layouts

_SUFFIX = "_layout"


def remembered_distribution(layer):
    """The distribution `layer` was made under (or its layouts imply)."""
    return layer.__dict__.get("_klm_distribution")


def inherited_distribution(layer):
    """The distribution `layer` or its nearest ancestor was made under: a
    sublayer made in its parent's `build()`, outside any scope, belongs to
    the parent's distribution."""
    for node in paths.lineage(layer):
        found = remembered_distribution(node)
        if found is not None:
            return found
    return None


def _set(layer, name, value):
    object.__setattr__(layer, name, value)


def _is_layout_value(value):
    """What `layer.<weight>_layout = value` treats as a layout."""
    return isinstance(value, keras_distribution.TensorLayout) or (
        isinstance(value, dict) and "sharding_specs" in value)


def _remember_mesh(layer, layouts):
    """With no distribution active, a layer given layouts is placed on their
    mesh (replicated where no layout says otherwise)."""
    if layer.__dict__.get("_klm_distribution") is not None:
        return
    current = keras_distribution.distribution()
    if current is None:
        meshes = [lay.mesh for lay in layouts.values() if lay.mesh]
        current = replicated_on(meshes[0]) if meshes else None
    _set(layer, "_klm_distribution", current)


def _pop_layout_kwargs(kwargs):
    layouts = {}
    for key in [k for k in kwargs if k.endswith(_SUFFIX)]:
        value = kwargs.pop(key)
        if value is None:
            continue
        layouts[key[: -len(_SUFFIX)]] = as_layout(value, where=f"`{key}`")
    return layouts


def _wrap_init(original):
    # Keyword-only, like `Layer.__init__`: Keras' auto-config reads this
    # signature with `getfullargspec`, which must find no `*args`.
    @functools.wraps(original)
    def __init__(self, **kwargs):
        layouts = _pop_layout_kwargs(kwargs)
        original(self, **kwargs)
        paths.register(self)
        # A subclass may have set `self.<weight>_layout` before calling us.
        layouts = {**weight_layouts(self), **layouts}
        for name in layouts:  # a `self.<name>_layout = None` made before
            self.__dict__.pop(f"{name}{_SUFFIX}", None)
        _set(self, "_klm_weight_layouts", layouts)
        _remember_mesh(self, layouts)
        strict.note_made(self)  # a strict scope checks the models made in it

    return __init__


def _wrap_get_config(original):
    @functools.wraps(original)
    def get_config(self):
        config = original(self)
        for name, layout in weight_layouts(self).items():
            config[f"{name}{_SUFFIX}"] = layout.get_config()
        return config

    return get_config


def _wrap_add_weight(original):
    @functools.wraps(original)
    def add_weight(self, *args, **kwargs):
        name = kwargs.get("name")
        scope = contextlib.nullcontext()
        if keras_distribution.distribution() is None:
            remembered = inherited_distribution(self)
            if remembered is not None:
                scope = remembered.scope()
        with creating_weight(self, name), scope:
            variable = original(self, *args, **kwargs)
            try:
                _resolve_deferred(variable)
            except strict.StrictModeError:
                strict.forget_weight(self, variable)  # it has no memory yet
                raise
        return variable

    return add_weight


def _resolve_deferred(variable):
    """Keras defers initialising a variable made while it traces (e.g. a
    subclassed model's first call); its layout would then be chosen later,
    outside `add_weight`, without the object path. Choose it now."""
    dist = keras_distribution.distribution()
    if (
        dist is not None
        and getattr(variable, "_layout", None) is None
        and getattr(variable, "_value", True) is None
    ):
        variable._layout = dist.get_variable_layout(variable)


def _wrap_post_build(original):
    @functools.wraps(original)
    def _post_build(self):
        original(self)
        wanted = weight_layouts(self)
        if not wanted:
            return
        created = {v.name for v in self.weights}
        unknown = sorted(set(wanted) - created)
        if unknown:
            raise ValueError(
                f"Layer {self.name!r} ({type(self).__name__}) received "
                f"{', '.join(f'`{n}{_SUFFIX}`' for n in unknown)}, but it "
                f"created no weight named {', '.join(map(repr, unknown))}. "
                f"Its weights are {sorted(created)}; use "
                f"{', '.join(f'`{n}{_SUFFIX}`' for n in sorted(created))}."
            )

    return _post_build


def _wrap_getattr(original):
    """`layer.<weight>_layout`: the layout given for weight `<weight>` (by
    kwarg or attribute); an `AttributeError` when none was (TF-Keras 2).
    Only reached when normal lookup fails; anything else goes to the
    original (torch's `nn.Module.__getattr__`)."""

    def __getattr__(self, name):
        if name.endswith(_SUFFIX) and not name.startswith("_"):
            layout = weight_layouts(self).get(name[: -len(_SUFFIX)])
            if layout is not None:
                return layout
        if original is not None:
            return original(self, name)
        raise AttributeError(
            f"{type(self).__name__!r} object has no attribute {name!r}")

    return __getattr__


def _set_weight_layout(layer, name, value):
    """`layer.<weight>_layout = value`: the TF-Keras 2 idiom of a custom
    layer naming the layout of a weight it is about to create. None places
    nothing and reads back None, as a plain attribute did in TF-Keras 2."""
    layouts = dict(weight_layouts(layer))
    weight = name[: -len(_SUFFIX)]
    if value is None:
        layouts.pop(weight, None)
    else:
        layouts[weight] = as_layout(value, where=f"`{name}`")
    _set(layer, "_klm_weight_layouts", layouts)
    if "_klm_distribution" in layer.__dict__:  # else __init__ decides
        _remember_mesh(layer, layouts)
    if value is None:
        _set(layer, name, None)
    else:
        layer.__dict__.pop(name, None)  # served by `_getattr`


def _wrap_setattr(original):
    @functools.wraps(original)
    def __setattr__(self, name, value):
        if (name.endswith(_SUFFIX) and not name.startswith("_")
                and (value is None or _is_layout_value(value))):
            return _set_weight_layout(self, name, value)
        original(self, name, value)
        if isinstance(value, (keras_layers.Layer, list, tuple, dict)):
            paths.register(self)

    return __setattr__


_INSTALLED = False


def install():
    """Patch `keras.layers.Layer` once (idempotent)."""
    global _INSTALLED
    if _INSTALLED:
        return
    Layer = keras_layers.Layer
    Layer.__init__ = _wrap_init(Layer.__init__)
    Layer.get_config = _wrap_get_config(Layer.get_config)
    Layer.add_weight = _wrap_add_weight(Layer.add_weight)
    Layer._post_build = _wrap_post_build(Layer._post_build)
    Layer.__setattr__ = _wrap_setattr(Layer.__setattr__)
    Layer.__getattr__ = _wrap_getattr(getattr(Layer, "__getattr__", None))
    _INSTALLED = True
