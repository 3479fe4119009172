"""keras-hub's `CausalLM.make_generate_function`, wrapped by a backend once
keras-hub is loaded: shared by the backends whose `generate()` gathers
weights once per call (torch's and TensorFlow's `decoding`).

keras-hub is never imported here: a backend calls `wrap_when_loaded`
where it places a variable (a dict lookup until keras-hub is loaded), and
at install, where keras-hub was imported first.
"""

import sys

CAUSAL_LM_MODULE = "keras_hub.src.models.causal_lm"


def wrap_when_loaded(wrap):
    """Replace keras-hub's `CausalLM.make_generate_function` by
    `wrap(make_generate_function)`, once (`_klm_wrapped_by` names the
    wrap), if keras-hub is loaded."""
    module = sys.modules.get(CAUSAL_LM_MODULE)
    causal_lm = getattr(module, "CausalLM", None)
    if causal_lm is None:
        return
    tag = wrap.__qualname__ + "@" + wrap.__module__
    current = causal_lm.make_generate_function
    if getattr(current, "_klm_wrapped_by", None) == tag:
        return
    wrapped = wrap(current)
    wrapped._klm_wrapped_by = tag
    causal_lm.make_generate_function = wrapped
