"""Keras' backend ops, wrapped in place: shared by the backends whose
DTensor refuses some eager ops (TensorFlow's `eager_ops`, torch's
`whole_fallbacks`)."""

import inspect

# The core ops those backends wrap beside their `numpy`, `math`, `nn` and
# `linalg` modules.
CORE_OPS = ("scatter", "scatter_update")


def wrap_ops(wrap, modules, core, core_names=CORE_OPS):
    """Replace every public function defined in each of `modules` (not
    one they import) and `core_names` of `core` by `wrap(function)`, once:
    a function `wrap` made before (`_klm_wrapped_by` names it) is left."""
    tag = wrap.__qualname__ + "@" + wrap.__module__

    def wrapped(function):
        if getattr(function, "_klm_wrapped_by", None) == tag:
            return function
        new = wrap(function)
        new._klm_wrapped_by = tag
        return new

    for module in modules:
        for name, value in list(vars(module).items()):
            if (not name.startswith("_") and inspect.isfunction(value)
                    and value.__module__ == module.__name__):
                setattr(module, name, wrapped(value))
    for name in core_names:
        setattr(core, name, wrapped(getattr(core, name)))
