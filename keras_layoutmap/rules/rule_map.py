"""`RuleMap`: ordered regex rules from weight paths to layouts.

The mapping at the heart of a `klm.LayoutMap`: adding a rule (checked
against its mesh), looking a weight up by its keys, and choosing the layout
that fits a weight's shape (a `rules.choice.Choice`). Rules as data live
in `rules.config`.
"""

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
)
from keras_layoutmap.mesh import Mesh, as_mesh
from keras_layoutmap.rules import config
from keras_layoutmap.rules.choice import Choice
from keras_layoutmap.rules.config import DEFAULT_MAX_REPLICATED_BYTES
from keras_layoutmap.rules.matching import Matcher


class RuleMap(keras_distribution.LayoutMap):
    """Ordered rules mapping weight paths (regexes) to layouts: the mapping,
    its checks and its lookups. `klm.LayoutMap` adds what puts a map to
    use (`scope()`, `explain()`, `check()`).

    A weight is looked up by its object path and its `variable.path`; an
    exact key wins, else the first rule in insertion order whose regex
    fullmatches either key (see `klm.LayoutMap` for the whole contract).
    """

    def __init__(self, mesh=None, strict=False,
                 max_replicated_bytes=DEFAULT_MAX_REPLICATED_BYTES):
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
        self._reasons = {}  # rule -> why it has its layout (auto plans)
        # False: a rule fullmatches a key. True: it matches anywhere in
        # it, `re.search`: maps made from a `keras.distribution.LayoutMap`
        # (`from_keras`; docs/keras-distribution.md says why).
        self.search = False
        self._matcher = None
        self._version = 0  # bumped on every change: strict checks re-run
        # Rules that have given a layout to a weight created on the mesh,
        # of any model built under this map: strict mode does not call them
        # unused when it checks another model built under the same map.
        self._placed_rules = set()

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
        pattern = self._compile(key)
        if key in self._layout_map:
            # Begins as TF-Keras 2's message did: ported tests match it.
            raise ValueError(
                f"{key} already exist in the LayoutMap with value "
                f"{self._describe(key)}: rule {key!r} is already there; "
                "delete it first (`del layout_map[key]`) to replace it."
            )
        layouts, mesh = self._layouts_of(key, layout)
        if self._device_mesh is None:
            self._device_mesh = mesh
        self._layout_map[key] = layouts[0]
        self._alternatives[key] = layouts
        self._patterns[key] = pattern
        self._changed()

    def _compile(self, key):
        """Rule `key` as the regex matched against whole keys."""
        try:
            pattern = re.compile(key)
        except re.error as e:
            raise ValueError(f"Rule {key!r} is not a valid regex: {e}") from None
        if not self.search:
            return pattern
        try:  # `re.search(key, s)` is `re.fullmatch(".*(?:key).*", s)`
            return re.compile(f"(?s:.*?)(?:{key})(?s:.*)")
        except re.error as e:
            raise ValueError(
                f"Rule {key!r} cannot match anywhere in a path as Keras' "
                f"LayoutMap does ({e}); write its flags scoped, `(?i:...)`."
            ) from None

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
        self._reasons.pop(key, None)
        self._changed()

    def set_reason(self, key, reason):
        """Record why rule `key` has its layout (a short phrase, e.g.
        `"column-parallel: feeds ffw_linear"`); `explain()` shows it.
        `klm.auto_layout_map` gives every rule one."""
        if key not in self._layout_map:
            raise KeyError(f"No rule {key!r} in this LayoutMap.")
        if reason is None:
            self._reasons.pop(key, None)
        else:
            self._reasons[key] = str(reason)

    def reason(self, key):
        """Why rule `key` has its layout (see `set_reason`), or None."""
        return self._reasons.get(key)

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

    def note_placed(self, rule):
        """Record that `rule` (a key of this map) gave a layout to a weight
        created on the mesh; any other source (a layer kwarg) is ignored."""
        if rule in self._alternatives:
            self._placed_rules.add(rule)

    def placed_rules(self):
        """The rules that have placed a weight of some model built under
        this map (`note_placed`), as a frozenset."""
        return frozenset(self._placed_rules)

    def _get_matcher(self):
        if self._matcher is None:
            self._matcher = Matcher(self._layout_map, self._patterns)
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

    # -- rules as data (see `rules.config`) ------------------------------------

    def get_config(self):
        """The rules as JSON-ready data: `{"mesh": {"dims": ...}, "rules":
        [[regex, specs], ...]}`, where `specs` is a list of axis names, or
        a list of such lists for a rule with fallbacks. `strict` and
        `max_replicated_bytes` appear when they are not the defaults."""
        return config.rules_config(self)

    @classmethod
    def from_config(cls, config_, mesh=None):
        """Rebuild a map; `mesh` (if given) replaces the stored one, which
        lets the same rules run on a mesh of another shape.

        Each rule is a `[regex, specs]` pair or a `{"rule": regex, "layout":
        specs}` table; `specs` is a list of axis names (`[]`: rank 0), or a
        list of such lists (fallbacks).
        """
        return config.build_from_config(cls, config_, mesh)

    @classmethod
    def from_keras(cls, layout_map, mesh=None):
        """A map of this class with the rules of a
        `keras.distribution.LayoutMap` (e.g. from a keras-hub backbone's
        `get_layout_map()`)."""
        return config.build_from_keras(cls, layout_map, mesh)

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
        data = config.read_rules_file(path)
        try:
            return cls.from_config(data, mesh=mesh)
        except (ValueError, TypeError) as e:
            raise type(e)(f"{path}: {e}") from None

    def __repr__(self):
        rules = ", ".join(f"{k!r}: {self._describe(k)}" for k in self._layout_map)
        return f"{type(self).__name__}({self._device_mesh!r}, {{{rules}}})"


def _is_fallback_list(value):
    """A list or tuple holding layouts (or tuples/lists/configs of axis
    names) is a fallback list; one of axis names only is one layout."""
    return isinstance(value, (list, tuple)) and any(
        isinstance(v, (list, tuple, dict, keras_distribution.TensorLayout))
        for v in value
    )
