"""A model remembers the distribution it was built under.

`fit`, `evaluate`, `predict`, the `*_on_batch` methods and
`save_weights` / `load_weights` run under that distribution even when they
are called outside its scope. Before they run, the model's state is moved to
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
    for name in _METHODS:
        setattr(keras_models.Model, name, _wrap(getattr(keras_models.Model, name)))
    _INSTALLED = True
