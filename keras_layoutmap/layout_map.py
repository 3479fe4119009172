"""`LayoutMap`: ordered regex rules from weight paths to layouts."""

import contextlib
import dataclasses
import json
import re

from keras import distribution as keras_distribution

from keras_layoutmap.layout import (
    UNSHARDED,
    Layout,
    NotALayoutError,
    as_layout,
    check_fits,
    fit_problem,
    is_spec_sequence,
)
from keras_layoutmap.matching import _Matcher, literal_prefix  # noqa: F401
from keras_layoutmap.mesh import Mesh, as_mesh


@dataclasses.dataclass(frozen=True)
class Choice:
    """How a rule placed one weight.

    `rule` is the rule that matched (None: no rule, replicated); `layout`
    the layout given; for a rule with fallbacks, `index` is which of its
    `count` layouts (0-based) placed the weight and `refused` holds
    `(layout, reason)` for each earlier one. `index` is None for a rule
    with one layout.
    """

    rule: object
    layout: object
    index: object = None
    count: int = 1
    refused: tuple = ()


class LayoutMap(keras_distribution.LayoutMap):
    """Ordered rules mapping weight paths (regexes) to layouts.

    A weight is looked up by its TF-Keras *object path* (`"feature.kernel"`,
    `"d1.kernel"`) and by its Keras 3 `variable.path`
    (`"sequential/d1/kernel"`). An exact key wins; otherwise the first rule,
    in insertion order, whose regex `fullmatch`es either key. A weight that
    matches nothing is replicated on the map's mesh.

    It is a `keras.distribution.LayoutMap`, so it can be handed to
    `keras.distribution.ModelParallel` as well.

    With `strict=True`, a model built under the map is checked before it
    first trains, evaluates or predicts: a rule that matches no weight, or a
    weight above `max_replicated_bytes` (default 1 MiB) that no rule places
    (so it is replicated on every device), is an error (see `check`).

    Example:

    >>> import keras_layoutmap as klm
    >>> mesh = klm.create_mesh([("batch", 1), ("model", 1)],
    ...     devices=klm.list_devices()[:1])
    >>> layout_map = klm.LayoutMap(mesh)
    >>> layout_map[r".*dense.*kernel"] = (None, "model")
    >>> layout_map[r".*dense.*bias"] = ("model",)
    >>> layout_map["dense_1.kernel"]
    Layout(['unsharded', 'model'], Mesh(batch=1, model=1))
    >>> layout_map["d1.gamma"] is None
    True
    """

    def __init__(self, mesh=None, strict=False, max_replicated_bytes=1 << 20):
        super().__init__(as_mesh(mesh))
        if not isinstance(strict, bool):
            raise TypeError(
                f"`strict` must be True or False. Received: {strict!r}"
            )
        if isinstance(max_replicated_bytes, bool) or not isinstance(
            max_replicated_bytes, int
        ) or max_replicated_bytes < 0:
            raise ValueError(
                "`max_replicated_bytes` must be a non-negative int (bytes). "
                f"Received: {max_replicated_bytes!r}"
            )
        self.strict = strict
        self.max_replicated_bytes = max_replicated_bytes
        self._alternatives = {}  # rule -> (Layout, ...): its layouts in order
        self._patterns = {}  # rule -> compiled regex
        self._matcher = None
        self._distribution = None
        self._version = 0  # bumped on every change: strict checks re-run

    # -- the mapping -------------------------------------------------------

    def get_default_mesh(self):
        """The mesh of this map: unmatched weights are replicated on it."""
        return self._device_mesh

    def __setitem__(self, key, layout):
        """Add rule `key` (a regex) with a layout, or with an ordered list of
        layouts (fallbacks: the first that fits a weight's shape wins).

        A tuple or list whose items are all axis names (or None) is one
        layout; a list or tuple whose items are layouts, tuples or lists is a
        fallback list. Nothing changes when the rule is refused.
        """
        if not isinstance(key, str):
            raise TypeError(
                f"LayoutMap keys are regex strings. Received: {key!r} of type "
                f"{type(key).__name__}"
            )
        try:
            pattern = re.compile(key)
        except re.error as e:
            raise ValueError(f"Rule {key!r} is not a valid regex: {e}") from None
        if key in self._layout_map:
            raise ValueError(
                f"Rule {key!r} already exists in the LayoutMap with layout "
                f"{self._describe(key)}; delete it first "
                "(`del layout_map[key]`) to replace it."
            )
        layouts, mesh = self._layouts_of(key, layout)
        if self._device_mesh is None:
            self._device_mesh = mesh
        self._layout_map[key] = layouts[0]
        self._alternatives[key] = layouts
        self._patterns[key] = pattern
        self._changed()

    def _layouts_of(self, key, value):
        """`(layouts, mesh)` for the value given to rule `key`; raises
        naming the rule, what was received and what was expected."""
        where = f"Rule {key!r}"
        if isinstance(value, list) and not value:
            raise ValueError(
                f"{where}: received an empty list of layouts; expected a "
                "layout, or a non-empty list of layouts to try in order. (A "
                "rank-0 layout is written `()`.)"
            )
        if not _is_fallback_list(value):
            items, wheres = [value], [where]
        else:
            items = list(value)
            bad = [v for v in items if v is None or isinstance(v, str)]
            if bad:
                raise NotALayoutError(
                    f"{where}: {value!r} mixes axis names and layouts. "
                    "Expected either one layout (a tuple of axis names) or a "
                    "list of layouts (fallbacks), e.g. "
                    "[(None, 'model'), (None, None)]."
                )
            wheres = [
                f"{where}, alternative {i + 1} of {len(items)}"
                for i in range(len(items))
            ]
        meshes = {}
        for item, item_where in zip(items, wheres):
            own = getattr(item, "device_mesh", None)
            if own is None and isinstance(item, dict) and item.get("mesh"):
                own = item["mesh"]
            if own is not None:
                meshes.setdefault(item_where, as_mesh(own) if not isinstance(
                    own, dict) else Mesh.from_config(own))
        distinct = list(dict.fromkeys(meshes.values()))
        if len(distinct) > 1:
            raise ValueError(
                f"{where}: its layouts are on different meshes ("
                + ", ".join(f"{w.split(', ')[-1]}: {m!r}" for w, m in meshes.items())
                + "); all layouts of a rule, and all rules of a map, share "
                "one mesh."
            )
        mesh = self._device_mesh
        if mesh is None and distinct:
            mesh = distinct[0]
        if mesh is None:
            raise ValueError(
                f"{where}: the layout {value!r} has no mesh and neither has "
                "the LayoutMap. Pass `mesh=` to LayoutMap() or give the "
                "layout a mesh."
            )
        if distinct and distinct[0] != mesh:
            raise ValueError(
                f"{where}: its layout is on {distinct[0]!r} but the "
                f"LayoutMap's mesh is {mesh!r}; all rules of a map share one "
                "mesh."
            )
        layouts = tuple(
            as_layout(item, mesh, where=item_where)
            for item, item_where in zip(items, wheres)
        )
        return layouts, mesh

    def __delitem__(self, key):
        del self._layout_map[key]
        self._alternatives.pop(key, None)
        self._patterns.pop(key, None)
        self._changed()

    def __getitem__(self, key):
        """The layout for `key`: an exact key, else the first matching rule,
        else None (Keras' `LayoutMap` contract).

        For a rule with fallbacks this is its first (preferred) layout: a
        key carries no shape to choose by. `resolve(shape, key)` chooses
        the layout that fits; `alternatives(key)` gives them all.
        """
        return self.match(key)[1]

    def alternatives(self, *keys):
        """Every layout, in order, of the rule that matches `keys` (a
        one-item tuple for a rule with one layout; `()` when none matches)."""
        rule, _ = self.match(*keys)
        return () if rule is None else self._alternatives[rule]

    def _describe(self, rule):
        layouts = self._alternatives[rule]
        if len(layouts) == 1:
            return str(layouts[0].sharding_specs)
        return "[" + ", ".join(str(lt.sharding_specs) for lt in layouts) + "]"

    def _changed(self):
        self._version += 1
        self._matcher = None
        self._distribution = None

    def _get_matcher(self):
        if self._matcher is None:
            self._matcher = _Matcher(self._layout_map, self._patterns)
        return self._matcher

    def match(self, *keys):
        """`(rule, layout)` for the first of `keys`' matches, or `(None, None)`.

        An exact key wins over regexes; among regexes the first rule in
        insertion order that fullmatches any of `keys` wins. For a rule with
        fallbacks, `layout` is its first layout.
        """
        for key in keys:
            if key is not None and key in self._layout_map:
                return key, self._layout_map[key]
        matcher = self._get_matcher()
        hits = [matcher.first(k) for k in keys if k is not None]
        hits = [h for h in hits if h is not None]
        if not hits:
            return None, None
        rule = matcher.rules[min(hits)]
        return rule, self._layout_map[rule]

    def matching_rules(self, *keys):
        """Every rule (exact key or regex) that matches any of `keys`."""
        matcher = self._get_matcher()
        found = {k for k in keys if k is not None and k in self._layout_map}
        for key in keys:
            if key is not None:
                found.update(matcher.rules[i] for i in matcher.all(key))
        return found

    def resolve(self, shape, *keys):
        """`(rule, layout)` for a weight of `shape` named by `keys`.

        Unmatched weights get a replicated layout on the map's mesh (rule
        None). A rule with fallbacks gives its first layout that fits
        `shape`. Raises `ValueError` naming the weight, the rule, the axis
        and the sizes when no layout of the rule can hold the weight.
        """
        choice = self.choose(shape, *keys)
        return choice.rule, choice.layout

    def choose(self, shape, *keys, dtype=None):
        """Like `resolve`, as a `Choice`: also which alternative of the rule
        placed the weight and why the earlier ones were refused. `dtype`
        (the weight's, when known) is for maps with a size-based default
        policy (`klm.fsdp`); rules ignore it."""
        rule, _ = self.match(*keys)
        if rule is None:
            if self._device_mesh is None:
                return Choice(None, None)
            return Choice(None, Layout.replicated(self._device_mesh, len(shape)))
        path = " / ".join(k for k in keys if k)
        layouts = self._alternatives[rule]
        if len(layouts) == 1:
            check_fits(layouts[0], shape, path, rule)
            return Choice(rule, layouts[0])
        refused = []
        for i, layout in enumerate(layouts):
            problem = fit_problem(layout, shape)
            if problem is None:
                return Choice(rule, layout, i, len(layouts), tuple(refused))
            refused.append((layout, problem))
        reasons = "; ".join(
            f"alternative {i + 1} {lt.sharding_specs}: {why}"
            for i, (lt, why) in enumerate(refused)
        )
        raise ValueError(
            f"Weight {path!r} has shape {tuple(int(d) for d in shape)}, and "
            f"none of the {len(layouts)} layouts of rule {rule!r} fits it: "
            f"{reasons}. Add a layout that fits (e.g. a replicated one, "
            f"{[UNSHARDED] * len(shape)}) as the last alternative."
        )

    # -- using it ------------------------------------------------------------

    def distribution(self, batch_dim_name=None):
        """The `klm.ModelParallel` distribution that applies this map."""
        from keras_layoutmap.distributions import ModelParallel

        if self._distribution is None or batch_dim_name is not None:
            dist = ModelParallel(layout_map=self, batch_dim_name=batch_dim_name)
            if batch_dim_name is not None:
                return dist
            self._distribution = dist
        return self._distribution

    @contextlib.contextmanager
    def scope(self):
        """Create every weight built under (or by layers made under) this
        scope with its layout; see `klm.ModelParallel`.

        Example:

        >>> import keras, keras_layoutmap as klm
        >>> mesh = klm.create_mesh([("batch", len(klm.list_devices()))])
        >>> layout_map = klm.LayoutMap(mesh)
        >>> layout_map["d1.kernel"] = ("unsharded", "batch")
        >>> with layout_map.scope():
        ...     model = keras.Sequential([keras.Input((4,)),
        ...                               keras.layers.Dense(8, name="d1")])
        >>> klm.fetch_layout(model.layers[0].kernel).sharding_specs
        ['unsharded', 'batch']
        """
        if self._device_mesh is None:
            raise ValueError(
                "LayoutMap.scope() needs a mesh: pass `mesh=` to LayoutMap() "
                "or add a rule whose layout has one."
            )
        dist = self.distribution()
        with dist.scope():
            yield dist

    def explain(self, model, optimizer=None, device_memory=None):
        """A report of which rule gives each weight of `model` its layout,
        and the memory each device holds (`report.memory`): weights, and
        with `optimizer` (a `keras.optimizers.Optimizer` or its name, e.g.
        `"adam"`) gradients and optimizer state too; `device_memory` (bytes,
        or text such as `"16GiB"`) marks devices over budget, a strict-mode
        finding."""
        from keras_layoutmap.explain import explain

        return explain(model, self, optimizer=optimizer,
                       device_memory=device_memory)

    def check(self, model):
        """Check this map's plan for the built `model` as strict mode does
        (whether or not the map is strict): raise `StrictModeError` (a
        `ValueError`) naming every rule that matches no weight and every
        weight above `max_replicated_bytes` that no rule places. Returns the
        explain report when the plan passes."""
        report = self.explain(model)
        report.raise_for_strict()
        return report

    # -- rules as data -------------------------------------------------------

    def get_config(self):
        """The rules as JSON-ready data: `{"mesh": {"dims": ...}, "rules":
        [[regex, specs], ...]}`, where `specs` is a list of axis names, or
        a list of such lists for a rule with fallbacks. `strict` and
        `max_replicated_bytes` appear when they are not the defaults."""
        mesh = self._device_mesh
        config = {
            "mesh": None if mesh is None else as_mesh(mesh).get_config(),
            "rules": [
                [key, layouts[0].sharding_specs] if len(layouts) == 1
                else [key, [lt.sharding_specs for lt in layouts]]
                for key, layouts in self._alternatives.items()
            ],
        }
        if self.strict:
            config["strict"] = True
        if self.max_replicated_bytes != 1 << 20:
            config["max_replicated_bytes"] = self.max_replicated_bytes
        return config

    @classmethod
    def from_config(cls, config, mesh=None):
        """Rebuild a map; `mesh` (if given) replaces the stored one, which
        lets the same rules run on a mesh of another shape.

        Each rule is a `[regex, specs]` pair or a `{"rule": regex, "layout":
        specs}` table; `specs` is a list of axis names (`[]`: rank 0), or a
        list of such lists (fallbacks).
        """
        if isinstance(config, dict) and "fsdp" in config and cls is LayoutMap:
            from keras_layoutmap.fsdp import FSDPLayoutMap  # a `klm.fsdp` map

            return FSDPLayoutMap.from_config(config, mesh=mesh)
        if not isinstance(config, dict) or "rules" not in config:
            raise ValueError(
                "A LayoutMap config is a dict with a 'rules' list of "
                f"[regex, sharding_specs] pairs. Received: {config!r}"
            )
        unknown = set(config) - {"mesh", "rules", "strict",
                                 "max_replicated_bytes"}
        if unknown:
            raise ValueError(
                "A LayoutMap config has the keys 'mesh', 'rules', 'strict' "
                "and 'max_replicated_bytes'. Received unknown keys "
                f"{sorted(unknown)}."
            )
        if mesh is None and config.get("mesh") is not None:
            dims = config["mesh"]
            if not isinstance(dims, dict) or not isinstance(dims.get("dims"), list):
                raise ValueError(
                    "The 'mesh' of a LayoutMap config is {'dims': [[axis, "
                    f"size], ...]}}. Received: {dims!r}"
                )
            mesh = Mesh.from_config(dims)
        layout_map = cls(
            mesh,
            strict=config.get("strict", False),
            max_replicated_bytes=config.get("max_replicated_bytes", 1 << 20),
        )
        rules = config["rules"]
        if isinstance(rules, dict):
            rules = list(rules.items())
        if not isinstance(rules, list):
            raise ValueError(
                "'rules' is a list of [regex, sharding_specs] pairs. "
                f"Received: {rules!r} of type {type(rules).__name__}"
            )
        for n, entry in enumerate(rules):
            key, specs = _rule_entry(n, entry)
            layout_map[key] = _specs_value(specs)
        return layout_map

    @classmethod
    def from_keras(cls, layout_map, mesh=None):
        """A `klm.LayoutMap` with the rules of a `keras.distribution.LayoutMap`
        (e.g. from a keras-hub backbone's `get_layout_map()`)."""
        mesh = as_mesh(mesh or layout_map.device_mesh)
        result = cls(mesh)
        for key in layout_map:
            layouts = getattr(layout_map, "_alternatives", {}).get(key)
            if layouts and len(layouts) > 1:
                result[key] = [tuple(lt.axes) for lt in layouts]
            else:
                result[key] = tuple(layout_map._layout_map[key].axes)
        return result

    def to_json(self, **kwargs):
        """The rules and mesh axes as JSON text."""
        return json.dumps(self.get_config(), **kwargs)

    @classmethod
    def from_json(cls, text, mesh=None):
        return cls.from_config(json.loads(text), mesh=mesh)

    @classmethod
    def from_file(cls, path, mesh=None):
        """Load rules from a `.json`, `.yaml`/`.yml` or `.toml` file.

        Every format holds the `get_config()` structure (here in YAML):

            mesh:
              dims: [[batch, 4], [model, 2]]
            rules:
              - [".*dense.*kernel", [unsharded, model]]
              - [".*dense.*bias", [model]]
        """
        path = str(path)
        kinds = {".json": "JSON", ".yaml": "YAML", ".yml": "YAML",
                 ".toml": "TOML"}
        kind = next((k for s, k in kinds.items() if path.endswith(s)), None)
        if kind is None:
            raise ValueError(
                f"Unknown rules file type {path!r}: expected .json, .yaml, "
                ".yml or .toml"
            )
        with open(path, "rb") as f:
            data = f.read()
        try:
            if kind == "YAML":
                import yaml

                config = yaml.safe_load(data)
            elif kind == "TOML":
                try:
                    import tomllib
                except ImportError:  # Python 3.10
                    import tomli as tomllib

                config = tomllib.loads(data.decode())
            else:
                config = json.loads(data)
        except Exception as e:  # each parser has its own error type
            raise ValueError(f"{path}: not valid {kind}: {e}") from None
        try:
            return cls.from_config(config, mesh=mesh)
        except (ValueError, TypeError) as e:
            raise type(e)(f"{path}: {e}") from None

    def __repr__(self):
        rules = ", ".join(f"{k!r}: {self._describe(k)}" for k in self._layout_map)
        return f"LayoutMap({self._device_mesh!r}, {{{rules}}})"


def _is_fallback_list(value):
    """A list or tuple holding layouts (or tuples/lists/configs of axis
    names) is a fallback list; one of axis names only is one layout."""
    return isinstance(value, (list, tuple)) and any(
        isinstance(v, (list, tuple, dict, keras_distribution.TensorLayout))
        for v in value
    )


def _rule_entry(n, entry):
    """`(regex, specs)` of entry `n` of a config's rules, or a ValueError
    that says what an entry looks like."""
    if isinstance(entry, dict):
        if set(entry) == {"rule", "layout"} and isinstance(entry["rule"], str):
            return entry["rule"], entry["layout"]
        missing = sorted({"rule", "layout"} - set(entry))
        raise ValueError(
            f"Rule entry {n} is a table {entry!r}; expected exactly the keys "
            "'rule' (a regex string) and 'layout' (a list of axis names)"
            + (f", missing {missing}." if missing else ".")
        )
    if (isinstance(entry, (list, tuple)) and len(entry) == 2
            and isinstance(entry[0], str)):
        return entry[0], entry[1]
    raise ValueError(
        f"Rule entry {n} is {entry!r}; expected a [regex, sharding_specs] "
        "pair such as ['.*kernel', [null, 'model']], or a table with 'rule' "
        "and 'layout'."
    )


def _specs_value(specs):
    """A rules file's specs as a `__setitem__` value: a list of axis names
    is one layout (`[]`: rank 0); a list of lists is a fallback list."""
    if isinstance(specs, list) and is_spec_sequence(specs):
        return tuple(specs)
    if isinstance(specs, list):
        return [tuple(s) if isinstance(s, list) and is_spec_sequence(s) else s
                for s in specs]
    return specs


def layout_map_scope(layout_map):
    """`layout_map.scope()` under TF-Keras 2.9-2.12's name
    (`tf.keras.dtensor.experimental.layout_map_scope`), for ported code.

    Example:

    >>> import keras, keras_layoutmap as klm
    >>> mesh = klm.create_mesh([("batch", len(klm.list_devices()))])
    >>> layout_map = klm.LayoutMap(mesh)
    >>> layout_map["d1.kernel"] = ("unsharded", "batch")
    >>> with klm.layout_map_scope(layout_map):
    ...     model = keras.Sequential([keras.Input((4,)),
    ...                               keras.layers.Dense(8, name="d1")])
    >>> klm.fetch_layout(model.layers[0].kernel).sharding_specs
    ['unsharded', 'batch']
    """
    if isinstance(layout_map, keras_distribution.LayoutMap) and not isinstance(
            layout_map, LayoutMap):
        layout_map = LayoutMap.from_keras(layout_map)
    if not isinstance(layout_map, LayoutMap):
        raise TypeError(
            "layout_map_scope expects a `klm.LayoutMap` (or a "
            "`keras.distribution.LayoutMap`). Received: "
            f"{layout_map!r} of type {type(layout_map).__name__}"
        )
    return layout_map.scope()
