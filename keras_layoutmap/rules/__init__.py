"""Rules: which layout each weight gets.

- `matching`: many regexes against weight paths, first rule wins, fast.
- `choice`: `Choice`, how a rule placed one weight.
- `rule_map`: `RuleMap`, the ordered rules and their checks.
- `config`: rules as data (JSON-ready configs; JSON, YAML and TOML files).
- `fsdp_policy`: `FSDPRuleMap`, rules whose unmatched large weights are
  sharded over the data axis.
- `resolve`: one weight's layout: kwarg, then rule (with fallbacks), else
  replicated.

Below: `mesh` and `layout`. Above: distributions, `klm.LayoutMap` (rules put
to use), explain, placement.
"""

from keras_layoutmap.rules.choice import Choice
from keras_layoutmap.rules.fsdp_policy import FSDPRuleMap
from keras_layoutmap.rules.resolve import resolve_weight
from keras_layoutmap.rules.rule_map import RuleMap

__all__ = ["Choice", "FSDPRuleMap", "RuleMap", "resolve_weight"]
