"""Rules as data: a `RuleMap` to and from JSON-ready configs, and rules
files in JSON, YAML or TOML.

A config is `{"mesh": {"dims": [[axis, size], ...]}, "rules": [[regex,
specs], ...]}` (plus `strict` and `max_replicated_bytes` when they are not
the defaults); `specs` is a list of axis names, or a list of such lists for
a rule with fallbacks. A rule may also be written `{"rule": regex,
"layout": specs}`.

The functions take the map class to build (`cls`), so each map class
(`klm.LayoutMap`, a `klm.fsdp` map) rebuilds itself.
"""

import json
import tomllib

import yaml

from keras_layoutmap.layout import is_spec_sequence
from keras_layoutmap.mesh import Mesh, as_mesh, live_mesh

DEFAULT_MAX_REPLICATED_BYTES = 1 << 20
_KEYS = {"mesh", "rules", "strict", "max_replicated_bytes", "search",
         "reasons"}


def rules_config(rule_map):
    """`rule_map.get_config()`: its mesh axes and rules as plain data."""
    mesh = rule_map.device_mesh
    config = {
        "mesh": None if mesh is None else as_mesh(mesh).get_config(),
        "rules": [
            [key, layouts[0].sharding_specs] if len(layouts) == 1
            else [key, [lt.sharding_specs for lt in layouts]]
            for key, layouts in rule_map._alternatives.items()
        ],
    }
    if rule_map.strict:
        config["strict"] = True
    if rule_map.search:
        config["search"] = True
    if rule_map.max_replicated_bytes != DEFAULT_MAX_REPLICATED_BYTES:
        config["max_replicated_bytes"] = rule_map.max_replicated_bytes
    reasons = getattr(rule_map, "_reasons", {})
    if reasons:
        config["reasons"] = dict(reasons)
    return config


def build_from_config(cls, config, mesh=None):
    """A `cls` holding the rules of `config`; `mesh` (if given) replaces the
    stored one. Raises `ValueError` saying what a config looks like."""
    if not isinstance(config, dict) or "rules" not in config:
        raise ValueError(
            "A LayoutMap config is a dict with a 'rules' list of "
            f"[regex, sharding_specs] pairs. Received: {config!r}"
        )
    unknown = set(config) - _KEYS
    if unknown:
        raise ValueError(
            "A LayoutMap config has the keys 'mesh', 'rules', 'strict', "
            "'max_replicated_bytes' and 'search'. Received unknown keys "
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
        max_replicated_bytes=config.get(
            "max_replicated_bytes", DEFAULT_MAX_REPLICATED_BYTES),
    )
    layout_map.search = bool(config.get("search", False))
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
    reasons = config.get("reasons") or {}
    if not isinstance(reasons, dict):
        raise ValueError(
            "The 'reasons' of a LayoutMap config map rules to text. "
            f"Received: {reasons!r}")
    for key, reason in reasons.items():
        if key in layout_map._layout_map:  # a rule edited away: no reason
            layout_map.set_reason(key, reason)
    return layout_map


def build_from_keras(cls, layout_map, mesh=None):
    """A `cls` with the rules of a `keras.distribution.LayoutMap` (or of
    another map), in order, fallbacks kept. Rules from Keras' own class
    match anywhere in a path (`re.search`; docs/keras-distribution.md)."""
    mesh = as_mesh(mesh or layout_map.device_mesh)
    result = cls(mesh)
    result.search = getattr(layout_map, "search", True)
    for key in layout_map:
        layouts = getattr(layout_map, "_alternatives", {}).get(key)
        if layouts and len(layouts) > 1:
            result[key] = [tuple(lt.axes) for lt in layouts]
        else:
            result[key] = tuple(layout_map._layout_map[key].axes)
        reason = getattr(layout_map, "_reasons", {}).get(key)
        if reason is not None:
            result.set_reason(key, reason)
    return result


def synced_from_keras(cls, holder, keras_map, mesh=None):
    """The `cls` (a `RuleMap`) that `holder` runs `keras_map` (a
    `keras.distribution.LayoutMap`) as, on `mesh` (else the map's): the one
    made before while the Keras map is unchanged, made again once a rule
    is added or deleted, a layout changed or a mesh replaced; the Keras
    map is the truth. Strict mode's record of the rules that placed a
    weight is kept for the rules still there."""
    mesh = live_mesh(mesh if mesh is not None else keras_map.device_mesh)
    key = (id(keras_map), id(mesh), id(keras_map.device_mesh), tuple(
        (k, tuple(v.axes), id(v.device_mesh))
        for k, v in keras_map._layout_map.items()))
    cached = holder.__dict__.get("_klm_rules")
    if cached is None or cached[0] != key:
        rules = build_from_keras(cls, keras_map, mesh)
        if cached is not None:
            rules._placed_rules = {r for r in cached[1]._placed_rules
                                   if r in rules._layout_map}
        cached = (key, rules)
        holder.__dict__["_klm_rules"] = cached
    return cached[1]


_KINDS = {".json": "JSON", ".yaml": "YAML", ".yml": "YAML", ".toml": "TOML"}


def read_rules_file(path):
    """The config held by a `.json`, `.yaml`/`.yml` or `.toml` file."""
    path = str(path)
    kind = next((k for s, k in _KINDS.items() if path.endswith(s)), None)
    if kind is None:
        raise ValueError(
            f"Unknown rules file type {path!r}: expected .json, .yaml, "
            ".yml or .toml"
        )
    with open(path, "rb") as f:
        data = f.read()
    try:
        if kind == "YAML":
            return yaml.safe_load(data)
        if kind == "TOML":
            return tomllib.loads(data.decode())
        return json.loads(data)
    except Exception as e:  # each parser has its own error type
        raise ValueError(f"{path}: not valid {kind}: {e}") from None


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
