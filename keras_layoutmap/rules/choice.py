"""`Choice`: how a rule placed one weight (what `RuleMap.choose` returns)."""

import dataclasses


@dataclasses.dataclass(frozen=True)
class Choice:
    """How a rule placed one weight.

    `rule` is the rule that matched (None: no rule, replicated); `layout`
    the layout given; for a rule with fallbacks, `index` is which of its
    `count` layouts (0-based) placed the weight and `refused` holds
    `(layout, reason)` for each earlier one. `index` is None for a rule
    with one layout. `follows` names the kernel a variable that
    quantization added follows (None for any other weight).
    """

    rule: object
    layout: object
    index: object = None
    count: int = 1
    refused: tuple = ()
    # For a variable that quantization added (a scale, an amax history):
    # the weight it follows, named by its object path (see rules.quantized).
    follows: object = None
