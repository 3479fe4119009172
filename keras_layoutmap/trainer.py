"""A model remembers the distribution it was built under.

`fit`, `evaluate`, `predict`, the `*_on_batch` methods and
`save_weights` / `load_weights` run under that distribution even when they
are called outside its scope. Before they run, any variable of the model that
is not yet on the mesh (built before the distribution existed) is moved onto
it, so one model never mixes single-device and mesh-placed state.
"""

import functools

from keras import distribution as keras_distribution
from keras import models as keras_models

from keras_layoutmap import backends, strict
from keras_layoutmap.layer_kwargs import remembered_distribution

_TRAINING_METHODS = (
    "fit",
    "evaluate",
    "predict",
    "train_on_batch",
    "test_on_batch",
    "predict_on_batch",
)
_METHODS = _TRAINING_METHODS + ("save_weights", "load_weights")


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


def place_on_mesh(model, dist):
    """Give every model variable that has no layout one from `dist`."""
    backend = backends.get()
    if not backend.SHARDING:
        return  # only one-device meshes get here: nothing to place
    variables = list(model.variables) + list(model.metrics_variables)
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None:
        variables += list(optimizer.variables)
    for variable in {id(v): v for v in variables}.values():
        if getattr(variable, "_layout", None) is None:
            backend.relayout_variable(variable, dist.get_variable_layout(variable))


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
                return original(self, *args, **kwargs)
            _check_backend_trains(name, dist)
            with dist.scope():
                place_on_mesh(self, dist)
                return strict.run_checked(original, self, dist, args, kwargs)
        _check_backend_trains(name, dist)
        place_on_mesh(self, dist)
        return strict.run_checked(original, self, dist, args, kwargs)

    method._klm_wrapped = True
    return method


_INSTALLED = False


def install():
    global _INSTALLED
    if _INSTALLED:
        return
    for name in _METHODS:
        setattr(keras_models.Model, name, _wrap(getattr(keras_models.Model, name)))
    _INSTALLED = True
