"""FGD's warnings point at the user's line, come once per optimizer, and stay silent where the
README's quick start is (options inherited from the optimizer-wide defaults)."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import fgd_fast


def _group(**extra):
    w = torch.nn.Parameter(fgd_fast.orthogonalize_(torch.randn(8, 4, 3, 3)))
    return dict(params=[w], orthogonal=True, **extra), w


def test_feedback_warning_at_construction_points_at_the_caller():
    group, _ = _group()
    with pytest.warns(RuntimeWarning, match="feedback=0.97") as caught:
        fgd_fast.FGD([group], lr=0.1, feedback=0.97)
    assert caught[0].filename == __file__


def test_a_feedback_set_on_a_group_later_warns_at_the_next_step_once():
    """A schedule (or a hand) that moves a group's feedback out of [0.1, 0.9] after construction
    is warned at the step that uses it, pointing at the caller's line; once per value."""
    group, w = _group()
    opt = fgd_fast.FGD([group], lr=0.1, feedback=0.4)
    opt.param_groups[0]["feedback"] = 0.95
    w.grad = torch.randn_like(w) * 0.01
    with pytest.warns(RuntimeWarning, match="feedback=0.95") as caught:
        opt.step()
    assert caught[0].filename == __file__
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.step()


def test_an_option_that_does_nothing_on_an_orthogonal_group_warns_once():
    group, _ = _group(weight_decay=5e-4, nesterov=True)
    with pytest.warns(UserWarning, match="nesterov=True, weight_decay=0.0005 set on an orthogonal") as caught:
        opt = fgd_fast.FGD([group], lr=0.1)
    assert caught[0].filename == __file__
    again, _ = _group(weight_decay=1e-3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.add_param_group(again)  # once per optimizer and option


def test_a_group_holding_the_optimizer_wide_values_is_silent():
    """A review: ``ZeroRedundancyOptimizer(optimizer_class=FGD, weight_decay=5e-4)`` copies its
    keyword arguments into every group it hands FGD, which warned on every rank that the
    orthogonal group's weight_decay does nothing; a value equal to the optimizer-wide one is the
    inherited one. Another value still warns."""
    group, _ = _group(weight_decay=5e-4, nesterov=False, dampening=0.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fgd_fast.FGD([group], lr=0.1, weight_decay=5e-4)
    other, _ = _group(weight_decay=1e-3)
    with pytest.warns(UserWarning, match="weight_decay=0.001 set on an orthogonal"):
        fgd_fast.FGD([other], lr=0.1, weight_decay=5e-4)


def test_readme_quick_start_is_silent():
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.Conv2d(8, 8, 3))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fgd_fast.FGD(fgd_fast.stiefel_param_groups(net), lr=0.2, momentum=0.9, feedback=0.4, weight_decay=5e-4)


def test_guard_warning_points_at_the_step_call():
    group, w = _group()
    opt = fgd_fast.FGD([group], lr=0.01)
    w.grad = torch.randn_like(w) * 1e6
    with pytest.warns(RuntimeWarning, match="guard bound") as caught:
        opt.step()
    assert caught[0].filename == __file__


@pytest.mark.parametrize("name", ["FGD", "CayleySGD", "LandingSGD"])
def test_a_group_hyper_parameter_set_as_an_attribute_warns(name):
    """A review: ``opt.lr = 0.2`` (and ``opt.momentum``) set a Python attribute no step reads,
    silently, next to options that do read and write as attributes (``opt.max_distance``)."""
    import fgd_fast.baselines

    cls = getattr(fgd_fast, name, None) or getattr(fgd_fast.baselines, name)
    w = torch.nn.Parameter(fgd_fast.orthogonalize_(torch.randn(6, 3)))
    opt = cls([dict(params=[w], orthogonal=True)], lr=0.1)
    with pytest.warns(UserWarning, match=r"lr = 0.2 sets an attribute no step reads.*g\['lr'\]"):
        opt.lr = 0.2
    assert opt.param_groups[0]["lr"] == 0.1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.check_finite = True  # (an option: read and written as an attribute)
        copy.deepcopy(opt)
