"""Saved activations moved to host memory once per tensor: offload for a model whose sites share sources.
`save_on_cpu` would copy a block sum once per site that saves it. `OffloadHistory` is the same
saved-tensors hook pair with one host copy per tensor (same object and version; parameters
stay), copied back once per backward, asynchronously on CUDA with `pin_memory`.
"""

from __future__ import annotations

import weakref

import torch


class OffloadHistory(torch.autograd.graph.saved_tensors_hooks):
    """Context manager: tensors saved for backward inside it live on the host, once each; `saves`,
    `copies` and `restores` count references, host copies and copies back.
    """

    def __init__(self, pin_memory: bool = False):
        self.pin_memory = pin_memory and torch.cuda.is_available()
        self.saves = self.copies = self.restores = 0
        self._host: dict[tuple[int, int], tuple[weakref.ref, weakref.ref]] = {}
        self._back: dict[int, tuple[weakref.ref, weakref.ref]] = {}
        super().__init__(self._pack, self._unpack)

    def _pack(self, tensor: torch.Tensor):
        self.saves += 1
        if isinstance(tensor, torch.nn.Parameter):
            return tensor
        key = (id(tensor), tensor._version)
        known = self._host.get(key)
        host = known[1]() if known and known[0]() is tensor else None
        if host is None:
            host = torch.empty(tensor.size(), dtype=tensor.dtype, layout=tensor.layout, device="cpu",
                               pin_memory=self.pin_memory).copy_(tensor) if tensor.layout == torch.strided \
                else tensor.to("cpu", copy=True)
            self.copies += 1
            self._host[key] = (weakref.ref(tensor, lambda _, k=key: self._host.pop(k, None)), weakref.ref(host))
        return tensor.device, host

    def _unpack(self, packed):
        if isinstance(packed, torch.Tensor):
            return packed
        device, host = packed
        known = self._back.get(id(host))
        restored = known[1]() if known and known[0]() is host else None
        if restored is None:
            restored = host.to(device, non_blocking=self.pin_memory, copy=True)
            self.restores += 1
            self._back[id(host)] = (weakref.ref(host, lambda _, k=id(host): self._back.pop(k, None)),
                                    weakref.ref(restored))
        return restored
