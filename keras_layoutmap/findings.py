"""What strict mode finds wrong with a layout plan, and how it says so.

A `Finding` is a rule that matches no weight, or a weight above the map's
`max_replicated_bytes` that no rule places (it would be replicated whole on
every device); `StrictModeError` carries them. The same words serve a
weight refused at its creation (`strict`), a scope's exit, `explain()` and
`klm explain --strict`.
"""

import dataclasses
import difflib
import re


@dataclasses.dataclass(frozen=True)
class Finding:
    """A strict-mode finding: `kind` is `"unused_rule"` (a rule that matches
    no weight), `"replicated_weight"` (a weight above the map's
    `max_replicated_bytes` that no rule chose) or `"device_memory"` (the
    plan needs more than the `device_memory` given to `explain`); `subject`
    is the rule, the weight's path or `"per_device"`."""

    kind: str
    subject: str
    message: str


class StrictModeError(ValueError):
    """Strict mode found rules that match nothing or large weights that no
    rule places; `findings` lists them."""

    def __init__(self, message, findings):
        super().__init__(message)
        self.findings = list(findings)


def unused_rule(rule):
    """The finding for a rule that matches no weight."""
    return Finding("unused_rule", rule, f"rule {rule!r} matches no weight")


def closest_rules(layout_map, keys, count=3, cutoff=0.3):
    """Up to `count` rules of `layout_map` whose text is most like any of
    `keys` (a weight's object path and variable path), most alike first:
    what a typo or a renamed layer was probably meant to match."""
    keys = [k for k in keys if k]
    scored = []
    for rule in layout_map:
        plain = re.sub(r"\\(.)", r"\1", rule)  # `d1\.kernel` reads `d1.kernel`
        score = max((difflib.SequenceMatcher(None, plain, k).ratio()
                     for k in keys), default=0.0)
        if score >= cutoff:
            scored.append((-score, len(scored), rule))
    return [rule for _, _, rule in sorted(scored)[:count]]


def replicated_weight(layout_map, object_path, path, shape, nbytes):
    """The finding for a weight of `nbytes` per device that no rule places
    (`object_path` and `path` name it), above the map's limit."""
    closest = closest_rules(layout_map, (object_path, path))
    hint = (f"The rules closest to its name (none matches it): "
            f"{', '.join(map(repr, closest))}. " if closest else
            "No rule of the map is close to its name. " if len(layout_map)
            else "The map has no rules. ")
    return Finding(
        "replicated_weight", path,
        f"weight {object_path or path!r} ({path}, shape {tuple(shape)}, "
        f"{nbytes:,} bytes) matches no rule and is replicated on every "
        f"device of the mesh {layout_map.device_mesh!r}; strict mode allows "
        f"at most {layout_map.max_replicated_bytes:,} bytes "
        f"(max_replicated_bytes). {hint}Add a rule for it, or one that "
        "replicates it on purpose.",
    )
