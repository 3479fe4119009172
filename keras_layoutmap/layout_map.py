"""`LayoutMap`: ordered regex rules from weight paths to layouts."""

import contextlib
import json
import re

from keras import distribution as keras_distribution

from keras_layoutmap.layout import Layout, as_layout, check_fits
from keras_layoutmap.mesh import Mesh, as_mesh

try:  # the regex parser, to read a rule's literal prefix
    from re import _parser as _regex_parser
except ImportError:  # Python 3.10
    import sre_parse as _regex_parser


def literal_prefix(rule):
    """The literal text every key `rule` fullmatches must start with.

    `"block_3\\.mlp\\..*"` gives `"block_3.mlp."`; a rule that starts with
    anything but literal characters (or sets flags such as `(?i)`) gives "".
    """
    try:
        parsed = _regex_parser.parse(rule)
    except Exception:
        return ""
    if parsed.state.flags & (re.IGNORECASE | re.VERBOSE):
        return ""
    prefix = []
    for op, value in parsed:
        if op is not _regex_parser.LITERAL:
            break
        prefix.append(chr(value))
    return "".join(prefix)


class _Matcher:
    """First-rule-wins matching of many regexes against a key.

    A key is tried only against the rules that can match it: those without a
    literal prefix, and those whose literal prefix the key starts with (found
    with one dict look-up per distinct prefix length). The candidates are
    joined into one alternation of named groups, compiled once per distinct
    candidate set: for `fullmatch`, Python's regex engine tries the branches
    in order, so the branch that matches is the first rule, in insertion
    order, that matches the whole key. Rules that cannot be joined (numbered
    back-references, clashing group names) are tried one by one.
    """

    def __init__(self, rules):
        self.rules = list(rules)
        self.compiled = [re.compile(r) for r in self.rules]
        self.broad = []
        self.by_length = {}  # prefix length -> {prefix: [rule index, ...]}
        for i, rule in enumerate(self.rules):
            prefix = literal_prefix(rule)
            if prefix:
                table = self.by_length.setdefault(len(prefix), {})
                table.setdefault(prefix, []).append(i)
            else:
                self.broad.append(i)
        self.joinable = not any(re.search(r"\\\d|\(\?P=", r) for r in self.rules)
        self._joined = {}

    def _candidates(self, key):
        found = list(self.broad)
        for length, table in self.by_length.items():
            hit = table.get(key[:length])
            if hit:
                found.extend(hit)
        return tuple(sorted(found))

    def _join(self, candidates):
        if self.joinable:
            try:
                return re.compile(
                    "|".join(f"(?P<_klm{i}>{self.rules[i]})" for i in candidates)
                )
            except re.error:
                pass
        return None

    def all(self, key):
        """Indices of every rule that fullmatches `key`."""
        return [i for i in self._candidates(key) if self.compiled[i].fullmatch(key)]

    def first(self, key):
        """Index of the first rule that fullmatches `key`, or None."""
        candidates = self._candidates(key)
        if not candidates:
            return None
        if candidates not in self._joined:
            self._joined[candidates] = self._join(candidates)
        joined = self._joined[candidates]
        if joined is not None:
            m = joined.fullmatch(key)
            return None if m is None else int(m.lastgroup[4:])
        for i in candidates:
            if self.compiled[i].fullmatch(key):
                return i
        return None


class LayoutMap(keras_distribution.LayoutMap):
    """Ordered rules mapping weight paths (regexes) to layouts.

    A weight is looked up by its TF-Keras *object path* (`"feature.kernel"`,
    `"d1.kernel"`) and by its Keras 3 `variable.path`
    (`"sequential/d1/kernel"`). An exact key wins; otherwise the first rule,
    in insertion order, whose regex `fullmatch`es either key. A weight that
    matches nothing is replicated on the map's mesh.

    It is a `keras.distribution.LayoutMap`, so it can be handed to
    `keras.distribution.ModelParallel` as well.

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

    def __init__(self, mesh=None):
        super().__init__(as_mesh(mesh))
        self._matcher = None
        self._distribution = None

    # -- the mapping -------------------------------------------------------

    def get_default_mesh(self):
        """The mesh of this map: unmatched weights are replicated on it."""
        return self._device_mesh

    def __setitem__(self, key, layout):
        if not isinstance(key, str):
            raise TypeError(
                f"LayoutMap keys are regex strings. Received: {key!r} of type "
                f"{type(key).__name__}"
            )
        try:
            re.compile(key)
        except re.error as e:
            raise ValueError(f"Rule {key!r} is not a valid regex: {e}") from None
        if key in self._layout_map:
            raise ValueError(
                f"Rule {key!r} is already in the LayoutMap with layout "
                f"{self._layout_map[key]!r}; delete it first to replace it."
            )
        layout = as_layout(layout, self._device_mesh, where=f"Rule {key!r}")
        if layout.mesh is None:
            raise ValueError(
                f"Rule {key!r}: the layout {layout.sharding_specs} has no mesh "
                "and neither has the LayoutMap. Pass `mesh=` to LayoutMap() "
                "or give the layout a mesh."
            )
        if self._device_mesh is None:
            self._device_mesh = layout.mesh
        elif layout.mesh != self._device_mesh:
            raise ValueError(
                f"Rule {key!r}: its layout is on {layout.mesh!r} but the "
                f"LayoutMap's mesh is {self._device_mesh!r}; all rules of a "
                "map share one mesh."
            )
        self._layout_map[key] = layout
        self._changed()

    def __delitem__(self, key):
        del self._layout_map[key]
        self._changed()

    def __getitem__(self, key):
        """The layout for `key`: an exact key, else the first matching rule,
        else None (Keras' `LayoutMap` contract)."""
        return self.match(key)[1]

    def _changed(self):
        self._matcher = None
        self._distribution = None

    def match(self, *keys):
        """`(rule, layout)` for the first of `keys`' matches, or `(None, None)`.

        An exact key wins over regexes; among regexes the first rule in
        insertion order that fullmatches any of `keys` wins.
        """
        for key in keys:
            if key is not None and key in self._layout_map:
                return key, self._layout_map[key]
        if self._matcher is None:
            self._matcher = _Matcher(self._layout_map)
        hits = [self._matcher.first(k) for k in keys if k is not None]
        hits = [h for h in hits if h is not None]
        if not hits:
            return None, None
        rule = self._matcher.rules[min(hits)]
        return rule, self._layout_map[rule]

    def matching_rules(self, *keys):
        """Every rule (exact key or regex) that matches any of `keys`."""
        if self._matcher is None:
            self._matcher = _Matcher(self._layout_map)
        found = {k for k in keys if k is not None and k in self._layout_map}
        for key in keys:
            if key is not None:
                found.update(self._matcher.rules[i] for i in self._matcher.all(key))
        return found

    def resolve(self, shape, *keys):
        """`(rule, layout)` for a weight of `shape` named by `keys`.

        Unmatched weights get a replicated layout on the map's mesh (rule
        None). Raises `ValueError` naming the weight, the rule, the axis and
        the sizes when the layout cannot hold the weight.
        """
        rule, layout = self.match(*keys)
        if layout is None:
            if self._device_mesh is None:
                return None, None
            return None, Layout.replicated(self._device_mesh, len(shape))
        check_fits(layout, shape, " / ".join(k for k in keys if k), rule)
        return rule, layout

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
        >>> mesh = klm.create_mesh([("batch", 2)],
        ...     devices=klm.list_devices()[:2])
        >>> layout_map = klm.LayoutMap(mesh)
        >>> layout_map["d1.kernel"] = ("unsharded", "batch")
        >>> with layout_map.scope():
        ...     model = keras.Sequential([keras.Input((4,)),
        ...                               keras.layers.Dense(2, name="d1")])
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

    def explain(self, model):
        """A report of which rule gives each weight of `model` its layout."""
        from keras_layoutmap.explain import explain

        return explain(model, self)

    # -- rules as data -------------------------------------------------------

    def get_config(self):
        mesh = self._device_mesh
        return {
            "mesh": None if mesh is None else as_mesh(mesh).get_config(),
            "rules": [
                [key, layout.sharding_specs]
                for key, layout in self._layout_map.items()
            ],
        }

    @classmethod
    def from_config(cls, config, mesh=None):
        """Rebuild a map; `mesh` (if given) replaces the stored one, which
        lets the same rules run on a mesh of another shape."""
        if not isinstance(config, dict) or "rules" not in config:
            raise ValueError(
                "A LayoutMap config is a dict with a 'rules' list of "
                f"[regex, sharding_specs] pairs. Received: {config!r}"
            )
        if mesh is None and config.get("mesh") is not None:
            mesh = Mesh.from_config(config["mesh"])
        layout_map = cls(mesh)
        rules = config["rules"]
        if isinstance(rules, dict):
            rules = list(rules.items())
        for entry in rules:
            if isinstance(entry, dict):
                key, specs = entry["rule"], entry["layout"]
            else:
                key, specs = entry
            layout_map[key] = tuple(specs)
        return layout_map

    @classmethod
    def from_keras(cls, layout_map, mesh=None):
        """A `klm.LayoutMap` with the rules of a `keras.distribution.LayoutMap`
        (e.g. from a keras-hub backbone's `get_layout_map()`)."""
        mesh = as_mesh(mesh or layout_map.device_mesh)
        result = cls(mesh)
        for key in layout_map:
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

        Every format holds the `get_config()` structure::

            mesh:
              dims: [[batch, 4], [model, 2]]
            rules:
              - [".*dense.*kernel", [unsharded, model]]
              - [".*dense.*bias", [model]]
        """
        path = str(path)
        with open(path, "rb") as f:
            data = f.read()
        if path.endswith((".yaml", ".yml")):
            import yaml

            config = yaml.safe_load(data)
        elif path.endswith(".toml"):
            import tomllib

            config = tomllib.loads(data.decode())
        elif path.endswith(".json"):
            config = json.loads(data)
        else:
            raise ValueError(
                f"Unknown rules file type {path!r}: expected .json, .yaml, "
                ".yml or .toml"
            )
        return cls.from_config(config, mesh=mesh)

    def __repr__(self):
        rules = ", ".join(
            f"{k!r}: {v.sharding_specs}" for k, v in self._layout_map.items()
        )
        return f"LayoutMap({self._device_mesh!r}, {{{rules}}})"


def layout_map_scope(layout_map):
    """`layout_map.scope()` under TF-Keras 2.9-2.12's name
    (`tf.keras.dtensor.experimental.layout_map_scope`), for ported code.

    Example:

    >>> import keras, keras_layoutmap as klm
    >>> mesh = klm.create_mesh([("batch", 2)],
    ...     devices=klm.list_devices()[:2])
    >>> layout_map = klm.LayoutMap(mesh)
    >>> layout_map["d1.kernel"] = ("unsharded", "batch")
    >>> with klm.layout_map_scope(layout_map):
    ...     model = keras.Sequential([keras.Input((4,)),
    ...                               keras.layers.Dense(2, name="d1")])
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
