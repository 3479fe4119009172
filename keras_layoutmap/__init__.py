"""keras-layoutmap: declarative sharding for every Keras 3 backend.

Importing it teaches stock Keras layers `<weight>_layout=` kwargs, metrics
`mesh=`, and models to remember the distribution they were built under.
"""

from keras_layoutmap import backends as _backends
from keras_layoutmap import initializers as _initializers
from keras_layoutmap import layer_kwargs as _layer_kwargs
from keras_layoutmap import metrics, optimizers
from keras_layoutmap import metrics as _metrics
from keras_layoutmap import trainer as _trainer
from keras_layoutmap.data import copy_to_mesh, distribute, fetch_layout, pack, unpack
from keras_layoutmap.distributions import (
    DataParallel,
    ModelParallel,
    distribution,
    set_distribution,
)
from keras_layoutmap.explain import Report, WeightRow
from keras_layoutmap.layout import UNSHARDED, Layout
from keras_layoutmap.layout_map import LayoutMap, layout_map_scope
from keras_layoutmap.mesh import (
    Mesh,
    configure_virtual_devices,
    create_mesh,
    list_devices,
)

__version__ = "0.1.0"

__all__ = [
    "UNSHARDED",
    "DataParallel",
    "Layout",
    "LayoutMap",
    "Mesh",
    "ModelParallel",
    "Report",
    "WeightRow",
    "configure_virtual_devices",
    "copy_to_mesh",
    "create_mesh",
    "distribute",
    "distribution",
    "fetch_layout",
    "layout_map_scope",
    "list_devices",
    "metrics",
    "optimizers",
    "pack",
    "set_distribution",
    "unpack",
]

_backends.get().install()  # first: the wrappers below call what it patched
_layer_kwargs.install()
_initializers.install()
_metrics.install()
_trainer.install()
