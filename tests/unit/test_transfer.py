"""Host batches onto the device: pinned before an asynchronous copy to a GPU, untouched on CPU."""

from __future__ import annotations

import torch

from rayft.train.transfer import pins, to_device


def test_only_a_host_tensor_bound_for_a_gpu_is_pinned():
    host = torch.arange(4)
    assert pins(torch.device("cuda", 0), host)
    assert not pins(torch.device("cpu"), host)
    assert not pins(torch.device("cuda", 0), torch.empty(4, device="meta"))  # not in host memory


def test_a_cpu_batch_is_copied_without_pinning(monkeypatch):
    def refuse(_tensor):
        raise AssertionError("pinned on the CPU path")

    monkeypatch.setattr(torch.Tensor, "pin_memory", refuse)
    batch = {"input_ids": torch.arange(6).view(2, 3), "labels": torch.arange(6).view(2, 3)}
    moved = to_device(batch, torch.device("cpu"))
    assert moved.keys() == batch.keys() and all(torch.equal(moved[k], batch[k]) for k in batch)


def test_a_gpu_bound_batch_is_pinned_then_copied_asynchronously(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda t: calls.append("pin") or t)
    monkeypatch.setattr(torch.Tensor, "to", lambda t, device, non_blocking: calls.append((device, non_blocking)) or t)
    to_device({"input_ids": torch.arange(3)}, torch.device("cuda", 0))
    assert calls == ["pin", (torch.device("cuda", 0), True)]
