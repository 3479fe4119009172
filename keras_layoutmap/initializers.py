"""`layout=` on every `keras.initializers` call, as in TF-Keras 2.

After `import keras_layoutmap`, `initializer(shape, dtype, layout=L)` returns
a tensor placed with layout `L` (a `klm.Layout` or a
`keras.distribution.TensorLayout`): the values are the initializer's own,
for the same seed, and `klm.fetch_layout` reads `L` back. Without `layout=`
(or with `layout=None`) nothing changes. Every stock initializer is taught,
and so is any subclass of `keras.initializers.Initializer` defined later.

Example:

>>> import keras, keras_layoutmap as klm
>>> mesh = klm.create_mesh([("batch", len(klm.list_devices()))])
>>> x = keras.initializers.Ones()((8, 3), "float32",
...                               layout=klm.Layout(["batch", None], mesh))
>>> klm.fetch_layout(x).sharding_specs
['batch', 'unsharded']
"""

import functools
import inspect

from keras import initializers as keras_initializers

from keras_layoutmap.data import distribute
from keras_layoutmap.layout import as_layout

_MARK = "_klm_takes_layout"


def _takes_layout(call):
    return getattr(call, _MARK, False) or "layout" in inspect.signature(
        call).parameters


def _wrap_call(original):
    # functools.wraps keeps the original signature visible to `inspect`, so
    # Keras' own variable creation, which looks for a `layout` parameter,
    # goes on as before.
    @functools.wraps(original)
    def __call__(self, shape, dtype=None, *args, layout=None, **kwargs):
        value = original(self, shape, dtype, *args, **kwargs)
        if layout is None:
            return value
        layout = as_layout(layout, where=f"{type(self).__name__}(layout=)")
        return distribute(value, layout)

    setattr(__call__, _MARK, True)
    return __call__


def _teach(cls):
    call = cls.__dict__.get("__call__")
    if call is not None and not _takes_layout(call):
        cls.__call__ = _wrap_call(call)


def _subclasses(cls):
    for sub in cls.__subclasses__():
        yield sub
        yield from _subclasses(sub)


_INSTALLED = False


def install():
    """Teach `layout=` to every initializer class, now and later
    (idempotent)."""
    global _INSTALLED
    if _INSTALLED:
        return
    base = keras_initializers.Initializer
    for cls in [base, *_subclasses(base)]:
        _teach(cls)
    previous = base.__dict__.get("__init_subclass__")

    @classmethod
    def __init_subclass__(cls, **kwargs):
        if previous is not None:
            previous.__func__(cls, **kwargs)
        else:
            super(base, cls).__init_subclass__(**kwargs)
        _teach(cls)

    base.__init_subclass__ = __init_subclass__
    _INSTALLED = True
