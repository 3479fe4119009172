"""`mesh=` for every Keras metric.

After `import keras_layoutmap`, `keras.metrics.SparseCategoricalAccuracy(
mesh=mesh)` (and every other metric, including subclasses defined later)
creates its state variables replicated on `mesh`, as TF-Keras' DTensor
metrics did. `klm.metrics.<Name>` is the same class.

Example:

>>> import keras, keras_layoutmap as klm
>>> mesh = klm.create_mesh([("batch", len(klm.list_devices()))])
>>> metric = keras.metrics.SparseCategoricalAccuracy(mesh=mesh)
>>> klm.fetch_layout(metric.variables[0]).mesh == mesh
True
"""

import functools
import inspect

import keras

from keras_layoutmap.distributions import mesh_scope
from keras_layoutmap.mesh import as_mesh


def _accept_mesh(cls):
    original = cls.__dict__.get("__init__")
    if original is None or getattr(original, "_klm_wrapped", False):
        return

    @functools.wraps(original)
    def __init__(self, *args, mesh=None, **kwargs):
        if mesh is None:
            return original(self, *args, **kwargs)
        mesh = as_mesh(mesh)
        with mesh_scope(mesh):
            original(self, *args, **kwargs)
        object.__setattr__(self, "_klm_mesh", mesh)

    __init__._klm_wrapped = True
    cls.__init__ = __init__


def _all_subclasses(cls):
    for sub in cls.__subclasses__():
        yield sub
        yield from _all_subclasses(sub)


_INSTALLED = False


def install():
    global _INSTALLED
    if _INSTALLED:
        return
    Metric = keras.metrics.Metric
    _accept_mesh(Metric)
    for sub in list(_all_subclasses(Metric)):
        _accept_mesh(sub)

    previous = Metric.__dict__.get("__init_subclass__")

    @classmethod
    def __init_subclass__(cls, **kwargs):
        if previous is not None:
            previous.__func__(cls, **kwargs)
        else:
            super(Metric, cls).__init_subclass__(**kwargs)
        _accept_mesh(cls)

    Metric.__init_subclass__ = __init_subclass__
    _INSTALLED = True


__all__ = []
for _name, _obj in vars(keras.metrics).items():
    if inspect.isclass(_obj) and issubclass(_obj, keras.metrics.Metric):
        globals()[_name] = _obj
        __all__.append(_name)
