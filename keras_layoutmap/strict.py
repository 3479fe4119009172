"""Strict mode: check a model's layout plan once it is built, before it
trains, evaluates or predicts.

`klm.LayoutMap(mesh, strict=True)` refuses a plan in which a rule matches no
weight (a renamed layer, a typo) or a weight larger than the map's
`max_replicated_bytes` is replicated because no rule chose it. The check
needs the whole model, so it runs when `fit`, `evaluate`, `predict` (or a
`*_on_batch` method) first runs under the map: at once if the model is
built, else from a callback's `on_*_begin`, after Keras has built the model
and before the first step. Call `layout_map.check(model)` to check any
time.

Example:

>>> import keras, keras_layoutmap as klm
>>> mesh = klm.create_mesh([("batch", 1)], devices=klm.list_devices()[:1])
>>> layout_map = klm.LayoutMap(mesh, strict=True)
>>> layout_map[r"dense\\.kernel"] = (None, "batch")  # the layer is "d1"
>>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2, name="d1")])
>>> layout_map.check(model)
Traceback (most recent call last):
...
keras_layoutmap.explain.StrictModeError: Strict mode: 1 problem(s) with the layout plan:
  - rule 'dense\\\\.kernel' matches no weight
"""

import inspect

from keras_layoutmap.explain import explain

_BEGIN = {"fit": "on_train_begin", "evaluate": "on_test_begin",
          "predict": "on_predict_begin"}
_CHECKED = (*_BEGIN, "train_on_batch", "test_on_batch", "predict_on_batch")


def _stamp(layout_map):
    return (id(layout_map), layout_map._version)


def check(model, layout_map):
    """Raise `StrictModeError` if `layout_map`'s plan for `model` has
    findings; remember a model that passed."""
    if getattr(model, "_klm_strict_ok", None) == _stamp(layout_map):
        return
    explain(model, layout_map).raise_for_strict()
    model._klm_strict_ok = _stamp(layout_map)


def run_checked(original, model, dist, args, kwargs):
    """Call `original(model, *args, **kwargs)`, checking `dist`'s layout map
    first when it is strict (from a callback if the model is not built)."""
    layout_map = getattr(dist, "layout_map", None)
    name = original.__name__
    if name not in _CHECKED or layout_map is None or not getattr(
        layout_map, "strict", False
    ) or (
        getattr(model, "_klm_strict_ok", None) == _stamp(layout_map)
    ):
        return original(model, *args, **kwargs)
    if model.built or name not in _BEGIN:
        if model.built:
            check(model, layout_map)
        return original(model, *args, **kwargs)
    bound = inspect.signature(original).bind(model, *args, **kwargs)
    callbacks = bound.arguments.get("callbacks")
    if callbacks is None:
        callbacks = []
    elif not isinstance(callbacks, list):
        callbacks = list(callbacks)
    bound.arguments["callbacks"] = [
        *callbacks, _check_callback(name, layout_map, _batch_spec(bound))
    ]
    return original(*bound.args, **bound.kwargs)


def _built(model):
    return all(layer.built for layer in model._flatten_layers())


def _batch_spec(bound):
    """What Keras' symbolic build needs of the data (shapes and dtypes):
    arrays as given, a `tf.data.Dataset`'s element spec; None for data that
    cannot be looked at without consuming it (generators)."""
    x = bound.arguments.get("x")
    spec = getattr(x, "element_spec", None)
    if spec is not None:
        return spec if isinstance(spec, tuple) else (spec,)

    def arraylike(v):
        if isinstance(v, (list, tuple)):
            return all(arraylike(i) for i in v)
        if isinstance(v, dict):
            return all(arraylike(i) for i in v.values())
        return hasattr(v, "shape") and hasattr(v, "dtype")

    if x is not None and arraylike(x):
        return (x, bound.arguments.get("y"), bound.arguments.get("sample_weight"))
    return None


def _check_callback(name, layout_map, batch_spec):
    import warnings

    import keras

    class StrictCheck(keras.callbacks.Callback):
        """Checks the plan once the model is built, before step 1."""

    def begin(self, logs=None):
        model = self.model
        if not _built(model) and batch_spec is not None:
            # TensorFlow builds a model inside its first step; build it
            # from the data's shapes now (as JAX and torch already did).
            model._symbolic_build(data_batch=batch_spec)
        if not _built(model):
            warnings.warn(
                f"Strict mode could not check {model.name!r} before its first "
                "step: it is not built yet and its data (a generator) cannot "
                "be looked at. Build the model first (call it on a batch) or "
                "call `layout_map.check(model)`.",
                stacklevel=2,
            )
            return
        check(model, layout_map)

    setattr(StrictCheck, _BEGIN[name], begin)
    return StrictCheck()
