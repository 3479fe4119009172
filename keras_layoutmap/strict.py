"""Strict mode: refuse a layout plan that would spend memory it should not,
as early as it can be seen.

`klm.LayoutMap(mesh, strict=True)` refuses two things:

- a weight larger than the map's `max_replicated_bytes` that no rule (and no
  `<weight>_layout=` kwarg) places, so that it would be replicated whole on
  every device: refused *at its creation*, when the distribution chooses its
  layout, before its initializer runs or any memory is allocated for it
  (`refuse_at_creation`). The error names the weight's paths, its shape and
  bytes, the mesh and the rules closest to its name (none of which matched);
- a rule that matches no weight (a renamed layer, a typo): an error when a
  scope of the map exits with the models made inside it built
  (`checked_scope`), else when `fit`, `evaluate`, `predict` (or a
  `*_on_batch` method) first runs under the map: at once if the model is
  built, else from a callback's `on_*_begin`, after Keras has built the
  model and before the first step.

`layout_map.check(model)` checks any time; `layout_map.explain(model)` and
`klm explain --strict` report the same findings, with the same messages.

Example:

>>> import keras, keras_layoutmap as klm
>>> mesh = klm.create_mesh([("batch", 1)], devices=klm.list_devices()[:1])
>>> layout_map = klm.LayoutMap(mesh, strict=True)
>>> layout_map[r"dense\\.kernel"] = (None, "batch")  # the layer is "d1"
>>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2, name="d1")])
>>> try:
...     layout_map.check(model)
... except klm.StrictModeError as e:
...     print(e)
Strict mode: 1 problem(s) with the layout plan:
  - rule 'dense\\\\.kernel' matches no weight
"""

import contextlib
import contextvars
import inspect
import weakref

from keras_layoutmap.explain import explain
from keras_layoutmap.findings import StrictModeError, replicated_weight
from keras_layoutmap.keras_internals import global_state
from keras_layoutmap.layout import layout_bytes_per_device

_BEGIN = {"fit": "on_train_begin", "evaluate": "on_test_begin",
          "predict": "on_predict_begin"}
_CHECKED = (*_BEGIN, "train_on_batch", "test_on_batch", "predict_on_batch")


def refuse_at_creation(layout_map, variable, layout, object_path):
    """Raise `StrictModeError` if `layout_map` is strict and `variable`, a
    weight a layer is creating that no rule or kwarg places (so `layout`
    replicates it), is above the map's `max_replicated_bytes`.

    Called by the distribution while it chooses the weight's layout: before
    the weight's initializer runs and before any memory is allocated."""
    if layout_map is None or not getattr(layout_map, "strict", False):
        return
    shape = tuple(int(d) for d in variable.shape)
    nbytes = layout_bytes_per_device(layout, shape, variable.dtype)
    if nbytes <= layout_map.max_replicated_bytes:
        return
    finding = replicated_weight(layout_map, object_path, variable.path, shape,
                                nbytes)
    raise StrictModeError(
        f"Strict mode refused to create weight {object_path or variable.path!r}"
        " (nothing was allocated for it):\n"
        f"  - {finding.message}",
        [finding],
    )


def forget_weight(layer, variable):
    """Undo what Keras did for a variable refused after its creation was
    deferred (made in a `StatelessScope`, it holds no memory yet): untrack
    it from `layer` and drop it from the variables Keras initialises when
    the scope ends."""
    layer._untrack_variable(variable)
    pending = global_state.get_global_attribute("uninitialized_variables")
    if pending:
        pending[:] = [v for v in pending if v is not variable]


# -- a scope's exit ---------------------------------------------------------

# The models made under the innermost checked scope (weak references).
_MADE = contextvars.ContextVar("klm_strict_models", default=None)


def note_made(layer):
    """Remember `layer` if it is a model made under a checked scope."""
    from keras import Model

    made = _MADE.get()
    if made is not None and isinstance(layer, Model):
        made.append(weakref.ref(layer))


def checked_scope(layout_map, scope):
    """`scope` (a distribution's context manager); with a strict
    `layout_map`, its normal exit checks the models made inside it that are
    built (`check_models`)."""
    if layout_map is None or not getattr(layout_map, "strict", False):
        return scope
    return _checked_scope(layout_map, scope)


@contextlib.contextmanager
def _checked_scope(layout_map, scope):
    made = []
    outer = _MADE.get()
    token = _MADE.set(made)
    try:
        with scope:
            yield
    finally:
        _MADE.reset(token)
        if outer is not None:
            outer.extend(made)
    check_models(layout_map, [ref() for ref in made])


def check_models(layout_map, models):
    """Raise `StrictModeError` for `layout_map`'s plan over the built ones of
    `models` (made under one scope of the map): a rule is unused when it
    matches no weight of any of them, nor placed a weight of another model
    built under the map. Models that pass are remembered."""
    models = _outermost([m for m in models if m is not None and _built(m)])
    if not models:
        return
    reports = [explain(m, layout_map) for m in models]
    placed = layout_map.placed_rules()
    findings = {}
    for report in reports:
        for f in report.findings:
            if f.kind != "unused_rule" or (f.subject not in placed and all(
                    f.subject in r.unused_rules for r in reports)):
                findings.setdefault((f.kind, f.subject), f)
    if findings:
        raise StrictModeError(
            f"Strict mode: {len(findings)} problem(s) with the layout plan of "
            f"{', '.join(repr(m.name) for m in models)}, found as the scope "
            "of the LayoutMap exited:\n"
            + "\n".join(f"  - {f.message}" for f in findings.values()),
            list(findings.values()),
        )
    for model, report in zip(models, reports):
        if not _less_placed(report.findings, layout_map):
            model._klm_strict_ok = _stamp(layout_map)


def _stamp(layout_map):
    return (id(layout_map), layout_map._version)


def check(model, layout_map):
    """Raise `StrictModeError` if `layout_map`'s plan for `model` has
    findings; remember a model that passed."""
    if getattr(model, "_klm_strict_ok", None) == _stamp(layout_map):
        return
    report = explain(model, layout_map)
    findings = _less_placed(report.findings, layout_map)
    if findings:
        raise StrictModeError(
            f"Strict mode: {len(findings)} problem(s) with the layout plan of "
            f"{model.name!r}:\n"
            + "\n".join(f"  - {f.message}" for f in findings),
            findings,
        )
    model._klm_strict_ok = _stamp(layout_map)


def _less_placed(findings, layout_map):
    """`findings` less the unused rules that placed a weight of another
    model built under `layout_map`: one map may build several models (an
    encoder and a decoder, a model and its copy), each using some rules."""
    placed = layout_map.placed_rules()
    return [f for f in findings
            if f.kind != "unused_rule" or f.subject not in placed]


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


def _outermost(models):
    """`models` less those inside another of them (a nested model, the
    Functional a Sequential keeps)."""
    inner = set()
    for model in models:
        inner.update(id(m) for m in model._flatten_layers(include_self=False))
        functional = getattr(model, "_functional", None)
        if functional is not None:
            inner.add(id(functional))
    return [m for m in models if id(m) not in inner]


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
