"""Page-locked host memory of exactly a tensor's bytes (engine.layers.pinned_host), with
the CUDA driver's register and unregister calls recorded: the copy equals the tensor,
the registration covers whole pages of its size (not the next power of two), it ends
only when the last view is freed, and a refused registration falls back to torch's
pinning for the rest of the process, as a device that cannot read registered memory at
its host address does from the start."""

from __future__ import annotations

import gc
import mmap

import torch

from engine.layers import pinned_host


def _driver(monkeypatch, refuse: bool = False) -> list[tuple[str, int, int]]:
    calls: list[tuple[str, int, int]] = []

    def register(ptr: int, size: int) -> int:
        calls.append(("register", ptr, size))
        return 1 if refuse else 0

    monkeypatch.setattr(pinned_host, "_register", register)
    monkeypatch.setattr(pinned_host, "_unregister", lambda ptr: calls.append(("unregister", ptr, 0)))
    monkeypatch.setattr(pinned_host, "_usable", True)
    return calls


def test_a_copy_locks_whole_pages_of_its_size_until_its_last_view_goes(monkeypatch):
    calls = _driver(monkeypatch)
    src = torch.arange(157 * 1000 * 3, dtype=torch.int32).view(157, 3000).to(torch.bfloat16)[:, ::2]  # not contiguous
    out = pinned_host.pinned_copy(src)
    assert torch.equal(out, src) and out.is_contiguous() and out.dtype == torch.bfloat16
    (kind, ptr, size), = calls
    nbytes = src.numel() * 2
    assert kind == "register" and ptr == out.data_ptr() and ptr % mmap.PAGESIZE == 0
    assert size == -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE < 2 * nbytes
    view = out[3:5]
    del out
    gc.collect()
    assert len(calls) == 1  # a view still reads it
    assert torch.equal(view, src[3:5])
    del view
    gc.collect()
    assert calls[1] == ("unregister", ptr, 0)


def test_a_refused_registration_falls_back_to_torch_s_pinning_from_then_on(monkeypatch):
    calls = _driver(monkeypatch, refuse=True)
    pinned: list[torch.Tensor] = []
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: pinned.append(self) or self)
    src = torch.randn(4, 1024)
    out = pinned_host.pinned_copy(src)
    assert pinned and out is pinned[0] and torch.equal(out, src)
    assert pinned_host._usable is False
    again = pinned_host.pinned_copy(src * 2)  # no mapping, no registration tried again
    assert again is pinned[1] and torch.equal(again, src * 2)
    gc.collect()
    assert [c[0] for c in calls] == ["register"]  # nothing registered, nothing to unregister


def test_a_device_that_cannot_read_registered_memory_at_its_address_takes_torch_s(monkeypatch):
    calls = _driver(monkeypatch)
    monkeypatch.setattr(pinned_host, "_usable", None)
    monkeypatch.setattr(pinned_host, "_host_pointer_readable", lambda: False)  # WSL2, Windows
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: self)
    src = torch.randn(3, 5)
    assert torch.equal(pinned_host.pinned_copy(src), src) and calls == [] and pinned_host._usable is False
