"""`plain += dtensor`: in-place arithmetic of a plain tensor with a DTensor.

DTensor cannot change a plain tensor in place into a DTensor: torch 2.13
raises a bare `AssertionError` from its dispatcher. Keras does it where it
starts a sum from a constant: `keras.regularizers.L1L2` computes
`regularization = 0.0; regularization += l1 * sum(|x|)`, so an
`ActivityRegularization` layer, or any `kernel_regularizer=L1L2(...)` of
a weight on a mesh, failed on every plan. Here such a statement computes
the result out of place, as Python then binds the name to it (`x += y` is
`x = x.__iadd__(y)`); a plain tensor with a plain operand, and a DTensor
with anything, keep torch's own in-place operators.

Example (plain tensors: torch's own operator):

>>> import torch
>>> x = torch.zeros(2)
>>> x += torch.ones(2)
>>> x.tolist()
[1.0, 1.0]
"""

import operator

import torch
from torch.distributed.tensor import DTensor

# in-place operator -> the out-of-place one
OPERATORS = {"__iadd__": operator.add, "__isub__": operator.sub,
             "__imul__": operator.mul, "__itruediv__": operator.truediv}


def _wrap(inplace, out_of_place):
    def method(self, other):
        if isinstance(other, DTensor) and not isinstance(self, DTensor):
            return out_of_place(self, other)
        return inplace(self, other)

    method.__name__ = inplace.__name__
    method.__doc__ = inplace.__doc__
    method._klm_wrapped = True
    return method


def install():
    for name, out_of_place in OPERATORS.items():
        inplace = getattr(torch.Tensor, name)
        if not getattr(inplace, "_klm_wrapped", False):
            setattr(torch.Tensor, name, _wrap(inplace, out_of_place))
