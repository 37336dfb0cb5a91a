"""Module conversion: ``model.to("openreg")`` keeps every ``Parameter`` object (docs/module_conversion.md).

``nn.Module._apply`` (behind ``.to()``, ``.openreg()``, ``.cpu()``, ``.half()``...) asks
``torch._has_compatible_shallow_copy_type(param, converted)`` whether it may move the converted
data *into* the existing parameter (``param.data = converted``, i.e. C++ ``set_data``), or must
make a new ``Parameter`` for each module. torch 2.13 answers with
``TensorImpl::has_compatible_shallow_copy_type``, whose list of dense backends has no PrivateUse1:
for ``cpu`` <-> ``openreg`` it says False, so every module gets a new ``Parameter``, tied weights
come apart and optimizers made before ``.to()`` keep the CPU tensors.

The question is an aten operator (``aten::_has_compatible_shallow_copy_type``, CompositeImplicit),
and both ``_apply`` and the C++ check inside ``set_data`` ask it through the dispatcher. A kernel in
its PrivateUse1 slot answers for every pair whose highest backend is openreg, and only for those:
a pair of CPU tensors never reaches it, so code that never touches openreg is unchanged.
"""

from __future__ import annotations

import torch

# Kept alive for the life of the process: dropping the Library object unregisters the kernel.
_aten = torch.library.Library("aten", "IMPL")

# [docs:start COMPATIBLE_SHALLOW_COPY]
# The dense backends of TensorImpl::has_compatible_shallow_copy_type (c10/core/TensorImpl.h),
# plus openreg. The dispatcher brings a pair here only when openreg is its highest backend and
# neither tensor is sparse, quantized, nested or mkldnn (those functionalities sort above Dense),
# so device type and layout decide.
_DENSE_DEVICE_TYPES = frozenset({"cpu", "cuda", "mps", "hip", "xpu", "hpu", "mtia", "openreg"})


def _has_compatible_shallow_copy_type(self: torch.Tensor, from_: torch.Tensor) -> bool:
    def dense(t: torch.Tensor) -> bool:
        return t.layout == torch.strided and t.device.type in _DENSE_DEVICE_TYPES

    return dense(self) and dense(from_)


_aten.impl("_has_compatible_shallow_copy_type", _has_compatible_shallow_copy_type, "PrivateUse1")
# [docs:end COMPATIBLE_SHALLOW_COPY]


# [docs:start LAZY_ALLOWED]
# A lazy module's UninitializedParameter refuses every torch function but a list of conversions
# (torch.Tensor.cuda, .cpu, .to, ...). The generated Tensor.openreg() is the openreg twin of
# Tensor.cuda(): allow it too, so `lazy_module.openreg()` works as `lazy_module.cuda()` does.
def _allow_on_uninitialized_parameters() -> None:
    allowed = torch.nn.parameter.UninitializedTensorMixin._allowed_methods
    if torch.Tensor.openreg not in allowed:
        allowed.append(torch.Tensor.openreg)


# [docs:end LAZY_ALLOWED]
_allow_on_uninitialized_parameters()
