"""Shared test helpers: which backends can run here, and parametrisation over them."""
from __future__ import annotations

import copy

import pytest
import torch

from fgd_fast.backends import BackendUnavailable, resolve_backend


def backend_reason(name: str, device: str = "cpu") -> str | None:
    """None if ``name`` runs on ``device`` here, else why not."""
    try:
        resolve_backend(name, torch.device(device))
    except BackendUnavailable as exc:
        return str(exc)
    return None


def backend_params(names=("reference", "torch", "triton", "cuda")):
    """pytest params for each backend on the device tests use (CUDA when present)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    out = []
    for name in names:
        reason = backend_reason(name, device)
        marks = [pytest.mark.skip(reason=reason)] if reason else []
        out.append(pytest.param(name, marks=marks, id=name))
    return out


def device_for_tests() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def snapshot(net, opt):
    """Parameters and optimizer state, to check later that a failed step changed nothing."""
    return [p.detach().clone() for p in net.parameters()], copy.deepcopy(opt.state_dict())


def assert_unchanged(net, opt, snap):
    params, state = snap
    for p, q in zip(net.parameters(), params):
        assert torch.equal(p, q)
    now = opt.state_dict()
    assert now["state"].keys() == state["state"].keys()
    for k, entry in state["state"].items():
        for key, value in entry.items():
            now_value = now["state"][k][key]
            assert torch.equal(now_value, value) if isinstance(value, torch.Tensor) else now_value == value
