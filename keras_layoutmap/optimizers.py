"""Every `keras.optimizers` class, taking `mesh=`.

`klm.optimizers.Adam(0.01, mesh=mesh)` is a `keras.optimizers.Adam` whose
state lives on `mesh`: the iteration count and learning rate replicated,
each slot (momentum, velocity, ...) with the layout of its weight. That lets
a custom training loop apply gradients outside any distribution scope, as
`tf.keras.dtensor.experimental.optimizers` did. State made later with
`add_variable(...)` lands on the mesh too, and
`add_variable_from_reference(ref)` takes the layout `ref` really has.

Example:

>>> import keras_layoutmap as klm
>>> mesh = klm.create_mesh([("batch", len(klm.list_devices()))])
>>> optimizer = klm.optimizers.Adam(0.01, mesh=mesh)
>>> klm.fetch_layout(optimizer.iterations).mesh == mesh
True
"""

import inspect

import keras

from keras_layoutmap.data import fetch_layout
from keras_layoutmap.distributions import mesh_scope
from keras_layoutmap.mesh import as_mesh


def _know_layout(variable, mesh):
    """Keras gives a slot its reference's `_layout`; a reference placed on
    `mesh` without one (made from a value already on the mesh, say) gets the
    layout it really has, so its slots match it."""
    if mesh is None or getattr(variable, "_layout", None) is not None:
        return
    try:
        layout = fetch_layout(variable)
    except (TypeError, ValueError, NotImplementedError):
        return
    if layout.mesh == mesh:
        variable._layout = layout


def _mesh_aware(base):
    def __init__(self, *args, mesh=None, **kwargs):
        object.__setattr__(self, "_klm_mesh", as_mesh(mesh))
        with mesh_scope(self._klm_mesh):
            base.__init__(self, *args, **kwargs)

    def build(self, variables):
        with mesh_scope(self._klm_mesh):
            return base.build(self, variables)

    def add_variable(self, *args, **kwargs):
        with mesh_scope(self._klm_mesh):
            return base.add_variable(self, *args, **kwargs)

    def add_variable_from_reference(self, reference_variable, *args, **kwargs):
        _know_layout(reference_variable, self._klm_mesh)
        with mesh_scope(self._klm_mesh):
            return base.add_variable_from_reference(
                self, reference_variable, *args, **kwargs)

    @property
    def mesh(self):
        """The mesh this optimizer keeps its state on (None: follow the
        active distribution)."""
        return self._klm_mesh

    cls = type(
        base.__name__,
        (base,),
        {
            "__init__": __init__,
            "build": build,
            "add_variable": add_variable,
            "add_variable_from_reference": add_variable_from_reference,
            "mesh": mesh,
            "__doc__": f"`keras.optimizers.{base.__name__}` that keeps its "
            "state on `mesh` (see the module docstring); every other "
            f"argument is `keras.optimizers.{base.__name__}`'s.",
            "__module__": __name__,
        },
    )
    return keras.saving.register_keras_serializable("keras_layoutmap")(cls)


__all__ = []
for _name, _obj in vars(keras.optimizers).items():
    if (
        inspect.isclass(_obj)
        and issubclass(_obj, keras.optimizers.Optimizer)
        and _obj is not keras.optimizers.Optimizer
        and _name[0].isupper()
    ):
        globals()[_name] = _mesh_aware(_obj)
        __all__.append(_name)
