"""keras-layoutmap: declarative sharding for every Keras 3 backend.

Importing it teaches stock Keras layers `<weight>_layout=` kwargs, metrics
`mesh=`, initializers `layout=`, and models to remember the distribution
they were built under.

Import design. `import keras_layoutmap` (in a script, `python -c`, pytest,
a notebook) imports Keras and the backend and installs everything above.
One case is different: `python -m keras_layoutmap.<tool>` (the launcher,
the `explain` command line) makes Python import this package *while it
locates* the tool, before the tool has parsed its arguments. Then (and only
then: `sys.argv[0] == "-m"` and the `-m` target is in this package) the
package stays light and imports no Keras or backend, so `--help` is instant
and the launcher runs where no backend is installed. The first use of any
public name (`klm.create_mesh`, `from keras_layoutmap import LayoutMap`)
completes the import, installs included, so a tool imports what it needs
after argparse, lazily.
"""

import sys as _sys


def _locating_own_tool():
    """True while `python -m keras_layoutmap[.tool]` locates its target."""
    if _sys.argv[:1] != ["-m"]:
        return False
    argv = list(getattr(_sys, "orig_argv", []))
    target = argv[argv.index("-m") + 1] if "-m" in argv[:-1] else ""
    return target.split(".")[0] == __name__


__version__ = "0.1.0"

__all__ = [
    "UNSHARDED",
    "DataParallel",
    "DeviceMemory",
    "Finding",
    "Layout",
    "LayoutMap",
    "Mesh",
    "ModelParallel",
    "NotALayoutError",
    "Report",
    "StrictModeError",
    "WeightRow",
    "auto_layout_map",
    "configure_virtual_devices",
    "copy_to_mesh",
    "create_mesh",
    "distribute",
    "distribution",
    "fetch_layout",
    "fsdp",
    "initialize",
    "layout_map_scope",
    "list_devices",
    "metrics",
    "optimizers",
    "pack",
    "process_count",
    "process_index",
    "set_distribution",
    "shard_optimizer_states",
    "unpack",
    "visualize",
]

# `_COMPLETE` survives the reload that completes a light import.
_LIGHT = not globals().get("_COMPLETE") and _locating_own_tool()

if not _LIGHT:
    # First: an unsupported Keras is one clear ImportError naming the range.
    from keras_layoutmap import keras_internals as _keras_internals  # noqa: F401, I001
    from keras_layoutmap import backends as _backends
    from keras_layoutmap import initializers as _initializers
    from keras_layoutmap import keras_classes as _keras_classes
    from keras_layoutmap import layer_kwargs as _layer_kwargs
    from keras_layoutmap import metrics, optimizers
    from keras_layoutmap import metrics as _metrics
    from keras_layoutmap import placement as _placement
    from keras_layoutmap import checkpoints as _checkpoints
    from keras_layoutmap import process_saves as _process_saves
    from keras_layoutmap import trainer as _trainer
    from keras_layoutmap.auto_plan import auto_layout_map
    from keras_layoutmap.data import (
        copy_to_mesh,
        distribute,
        fetch_layout,
        pack,
        unpack,
    )
    from keras_layoutmap.distributions import (
        DataParallel,
        ModelParallel,
        distribution,
        set_distribution,
    )
    from keras_layoutmap.explain import Finding, Report, StrictModeError, WeightRow
    from keras_layoutmap.fsdp import fsdp
    from keras_layoutmap.layout import UNSHARDED, Layout, NotALayoutError
    from keras_layoutmap.layout_map import LayoutMap, layout_map_scope
    from keras_layoutmap.memory import DeviceMemory
    from keras_layoutmap.mesh import (
        Mesh,
        configure_virtual_devices,
        create_mesh,
        list_devices,
    )
    from keras_layoutmap.processes import (
        initialize,
        process_count,
        process_index,
    )
    from keras_layoutmap.visualize import visualize
    from keras_layoutmap.zero import shard_optimizer_states

    _backends.get().install()  # first: the wrappers below call what it patched
    _layer_kwargs.install()
    _keras_classes.install()
    _initializers.install()
    _metrics.install()
    _placement.install()
    _process_saves.install()  # before the trainer wraps save_weights
    _checkpoints.install()
    _trainer.install()
else:

    def __getattr__(name):
        """Light import (see the module docstring): complete it on first use
        of a public name."""
        if name not in __all__:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        import importlib

        module = _sys.modules[__name__]
        module._COMPLETE = True
        del module.__getattr__
        importlib.reload(module)  # the full import, installs included
        return getattr(module, name)
