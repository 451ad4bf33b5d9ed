"""A MoE layer's loaded expert arrays, handed back to the OS expert by expert while pack_moe packs them.

Why: packing wrote a layer's new arrays while its loaded ones were still resident, so the load peaked one layer of
experts above the weights it ends up holding (2.8 GiB on Mixtral-8x7B's bf16 shape). The C++ packer packs one
expert at a time and says when (cpu_kernels.pack_experts' `packed_through`); the pages of the experts already
packed are released then (host_memory.release_pages), so the peak is one expert above the held weights.

Only arrays that nothing but the model holds are released: a caller holding the parameter, or another tensor on
its storage, would read zeros afterwards, so there the layer is packed as before (old and new together).
"""

from __future__ import annotations

import sys

import torch
from torch import nn

from moelight.runtime.host_memory import PAGE, release_pages


def _refs(container: dict, key: str) -> int:
    value = container[key]
    return sys.getrefcount(value)


def _storage_users(t: torch.Tensor) -> int:
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata)


def _alone(container: dict, key: str) -> bool:
    """container[key] is referenced by the container alone (compared with an object that surely is)."""
    return _refs(container, key) <= _refs({key: object()}, key)


def _sole_array(params: dict, name: str) -> torch.Tensor | None:
    """params[name] where the model alone holds it and its storage, and it is contiguous; else None."""
    if params.get(name) is None or not _alone(params, name):  # (checked before `t` is one more reference)
        return None
    t = params[name]
    if not t.is_contiguous() or t.device.type != "cpu":
        return None
    try:
        if _storage_users(t) > _storage_users(torch.empty(1)):
            return None
    except (AttributeError, RuntimeError):  # a torch without the count: assume shared
        return None
    return t


def sole_expert_arrays(moe: nn.Module) -> list[torch.Tensor] | None:
    """The arrays [E, ...] behind `moe`'s gate_up_proj and down_proj (dense parameters, or a QuantizedExperts'
    codes, scales and offsets) when the model alone holds every one of them; None otherwise. Call it before
    taking any reference to them."""
    arrays = []
    for name in ("gate_up_proj", "down_proj"):
        if name in moe._parameters:
            t = _sole_array(moe._parameters, name)
            if t is None:
                return None
            arrays.append(t)
            continue
        if moe._modules.get(name) is None or not _alone(moe._modules, name):
            return None
        held = moe._modules[name]
        for key in list(held._parameters):
            if held._parameters[key] is None:
                continue
            t = _sole_array(held._parameters, key)
            if t is None:
                return None
            arrays.append(t)
    return arrays


class ExpertSources:
    """Releases the loaded arrays' pages of experts 0..i when called with i (pack_experts' packed_through)."""

    def __init__(self, arrays: list[torch.Tensor]) -> None:
        self.spans = [(t.data_ptr(), t.numel() * t.element_size(), t.shape[0]) for t in arrays]
        self.first = [-(-start // PAGE) * PAGE for start, _, _ in self.spans]  # each array's first whole page
        self.released = list(self.first)  # pages handed back, up to here

    def __call__(self, i: int) -> None:
        for k, (start, nbytes, experts) in enumerate(self.spans):
            stop = (start + nbytes * (i + 1) // experts) // PAGE * PAGE
            if stop > self.released[k] and release_pages(self.released[k], stop - self.released[k]):
                self.released[k] = stop

    def released_bytes(self) -> int:
        return sum(done - first for done, first in zip(self.released, self.first, strict=True))
