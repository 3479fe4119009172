"""What an initializer makes, found without making it: shared by the
backends that make weights born sharded with one device's values (JAX,
torch).

A covered initializer either fills a scalar (`Zeros`, `Ones`, a scalar
`Constant`: `constant_of`) or returns one `keras.random` draw untouched
(`RandomUniform`, `RandomNormal`, `TruncatedNormal`, `VarianceScaling` and
the Glorot / He / LeCun initializers built on it: `record_draw`). A backend
then makes each shard of that draw itself, as the whole draw would have
made it.
"""

import contextlib
import inspect
import threading

import numpy as np

from keras_layoutmap.keras_internals import floatx, standardize_dtype
from keras_layoutmap.keras_internals import initializers as keras_initializers

KINDS = ("uniform", "normal", "truncated_normal")
_PARAMS = {"uniform": ("minval", "maxval"),
           "normal": ("mean", "stddev"),
           "truncated_normal": ("mean", "stddev")}
_REPLACING = threading.Lock()


class Draw:
    """One `keras.random` draw an initializer made: its kind (one of
    `KINDS`), shape, dtype (standardized), the parameters after the shape,
    its seed, and the placeholder it returned."""

    def __init__(self, kind, shape, dtype, params, seed, placeholder):
        self.kind = kind
        self.shape = shape
        self.dtype = dtype
        self.params = params
        self.seed = seed
        self.placeholder = placeholder

    def bounds(self):
        """`(a, b)`: `(minval, maxval)` of a uniform draw, else `(mean,
        stddev)`, with Keras' defaults."""
        if self.kind == "uniform":
            return self.params.get("minval", 0.0), self.params.get(
                "maxval", 1.0)
        return self.params.get("mean", 0.0), self.params.get("stddev", 1.0)


def is_number(x):
    return type(x) in (int, float)


@contextlib.contextmanager
def draws_replaced(random_module, functions):
    """Inside, `random_module`'s draws are `functions` (`{kind:
    function}`); one thread at a time."""
    with _REPLACING:
        saved = {kind: getattr(random_module, kind) for kind in functions}
        try:
            for kind, function in functions.items():
                setattr(random_module, kind, function)
            yield
        finally:
            for kind, function in saved.items():
                setattr(random_module, kind, function)


def record_draw(initializer, shape, dtype, random_module, placeholder,
                run=None):
    """The single draw `initializer(shape, dtype)` returns untouched; None
    for anything else. The backend's `random_module` (Keras' own, e.g.
    `keras.src.backend.torch.random`) has its draw functions replaced by
    recorders while `run(call)` (default: `call()`; JAX traces it
    abstractly) calls the initializer; each recorder returns
    `placeholder(shape, dtype)`, a value that holds no memory. No seed is
    drawn: a `SeedGenerator` advances once, when the backend makes the
    shard."""
    draws = []

    def recorder(kind):
        def draw(shape, *args, dtype=None, seed=None, **kwargs):
            params = dict(zip(_PARAMS[kind], args))
            params.update(kwargs)
            dtype = standardize_dtype(dtype or floatx())
            value = placeholder(tuple(shape), dtype)
            draws.append(Draw(kind, tuple(shape), dtype, params, seed, value))
            return value

        return draw

    pure = []

    def call():
        value = initializer(shape, dtype=dtype)
        pure.append(len(draws) == 1 and value is draws[0].placeholder)
        return value

    try:
        with draws_replaced(random_module,
                            {kind: recorder(kind) for kind in KINDS}):
            (run or (lambda f: f()))(call)
    except Exception:  # an initializer that needs real numbers
        return None
    if not (pure and pure[0]):
        return None
    draw = draws[0]
    if draw.shape != tuple(shape) or not all(
            is_number(v) for v in draw.params.values()):
        return None
    return draw


def constant_of(initializer):
    """The scalar a `Zeros`, `Ones` or scalar `Constant` fills with; None
    for any other initializer."""
    kind = type(initializer)
    if kind in (keras_initializers.Zeros, keras_initializers.Ones):
        return 0 if kind is keras_initializers.Zeros else 1
    if kind is keras_initializers.Constant:
        value = initializer.value
        if is_number(value) or (isinstance(value, np.ndarray)
                                and value.ndim == 0):
            return value
    return None


def places_itself(initializer):
    """Whether `initializer` takes `layout=` (it places its own output:
    a backend must not make it shard by shard)."""
    try:
        return "layout" in inspect.signature(initializer).parameters
    except (TypeError, ValueError):
        return True
