"""A model remembers the distribution it was built under.

`fit`, `evaluate`, `predict`, the `*_on_batch` methods,
`save_weights` / `load_weights`, and a model class's own `generate`
(keras-hub's `CausalLM.generate`) run under that distribution even when
they are called outside its scope. Before they run, the model's state is moved to
where that distribution (or, with none, one device) wants it
(`placement.place_model`), so one model never mixes placements and can move
freely between no distribution, one mesh and another.
"""

import functools

from keras import distribution as keras_distribution
from keras import models as keras_models

from keras_layoutmap import backends, strict
from keras_layoutmap.layer_kwargs import remembered_distribution
from keras_layoutmap.placement import place_model

_TRAINING_METHODS = (
    "fit",
    "evaluate",
    "predict",
    "train_on_batch",
    "test_on_batch",
    "predict_on_batch",
)
_METHODS = _TRAINING_METHODS + ("save_weights", "load_weights")
# Methods a Model subclass defines itself, wrapped where it defines them
# (keras-hub's `CausalLM.generate`, defined before or after this import).
_SUBCLASS_METHODS = ("generate",)


def model_distribution(model):
    """The distribution `model` runs under when none is active: the one it
    was made under, else the first one any of its layers was made under."""
    found = remembered_distribution(model)
    if found is not None:
        return found
    for layer in model._flatten_layers(include_self=False):
        found = remembered_distribution(layer)
        if found is not None:
            return found
    return None


def _check_backend_trains(name, dist):
    backend = backends.get()
    if name in _TRAINING_METHODS and not backend.TRAINING and (
        dist.device_mesh is not None and dist.device_mesh.size > 1
    ):
        raise NotImplementedError(backend.NOT_BUILT)


def _wrap(original):
    name = original.__name__

    @functools.wraps(original)
    def method(self, *args, **kwargs):
        dist = keras_distribution.distribution()
        if dist is None:
            dist = model_distribution(self)
            if dist is None:
                place_model(self, None)
                return original(self, *args, **kwargs)
            _check_backend_trains(name, dist)
            with dist.scope():
                place_model(self, dist)
                return strict.run_checked(original, self, dist, args, kwargs)
        _check_backend_trains(name, dist)
        place_model(self, dist)
        return strict.run_checked(original, self, dist, args, kwargs)

    method._klm_wrapped = True
    return method


_INSTALLED = False


def install():
    global _INSTALLED
    if _INSTALLED:
        return
    Model = keras_models.Model
    for name in _METHODS:
        setattr(Model, name, _wrap(getattr(Model, name)))
    # A subclass's own methods: those of the classes defined already, and
    # of every class defined from now on.
    pending = list(Model.__subclasses__())
    while pending:
        cls = pending.pop()
        _wrap_subclass_methods(cls)
        pending.extend(cls.__subclasses__())
    hook = Model.__dict__.get("__init_subclass__")

    def __init_subclass__(cls, **kwargs):
        if hook is not None:
            hook.__func__(cls, **kwargs)
        else:
            super(Model, cls).__init_subclass__(**kwargs)
        _wrap_subclass_methods(cls)

    Model.__init_subclass__ = classmethod(__init_subclass__)
    _INSTALLED = True


def _wrap_subclass_methods(cls):
    for name in _SUBCLASS_METHODS:
        method = cls.__dict__.get(name)
        if callable(method) and not getattr(method, "_klm_wrapped", False):
            setattr(cls, name, _wrap(method))
