"""DTensor's relayouts, kept off its all-to-all.

A relayout that moves a mesh axis from one dimension of a tensor to another
(`[b, "model", h, c]` to `[b, h, c, "model"]`) is one all-to-all in
TensorFlow 2.21's DTensor (`DTENSOR_USE_ALL_TO_ALL_RELAYOUT`, on by
default), and for a tensor of rank 4 or more it puts values in the wrong
places: rank 4, the axis moved between dimensions 1 and 2, 1 and 3, or
from 3 to 2; rank 5, most pairs of the dimensions after the first. Eagerly
(`dtensor.relayout`) and inside a `tf.function`, where DTensor inserts
such relayouts itself between ops whose layouts differ. So training was
silently wrong: a `BatchNormalization` over images whose channels are
split over `model` (a `Dense` before it with its bias split so), read by a
`Dense` head whose rows are split over `model` (its gradient, reshaped back
to the images, comes split over their height): the statistics' gradients
were summed from misplaced values, and the weights drifted away from one
device's (a loss 10 % off after 2 epochs). Ranks 2 and 3 were right.

With the variable 0, DTensor relayouts by gathering the axis and taking
each device's slice of the other dimension: right at every rank (more
traffic than one all-to-all). DTensor reads the variable once, at its first
relayout in the process, so klm sets it at import, before any. A user who
set it to anything else is warned: the choice stands.
"""

import os
import warnings

VARIABLE = "DTENSOR_USE_ALL_TO_ALL_RELAYOUT"
OFF = ("0", "false")


def install():
    """Turn DTensor's all-to-all relayouts off, unless the user chose."""
    value = os.environ.setdefault(VARIABLE, "0")
    if value.strip().lower() not in OFF:
        warnings.warn(
            f"{VARIABLE}={value}: TensorFlow's DTensor then moves a mesh "
            "axis between two dimensions of a tensor of rank 4 or more with "
            "an all-to-all that puts values in the wrong places (silently "
            "wrong results, e.g. BatchNormalization over images next to "
            "weights split over the same axis). keras-layoutmap sets it to "
            f"0 unless you set it; unset it, or set {VARIABLE}=0.",
            RuntimeWarning, stacklevel=2)
