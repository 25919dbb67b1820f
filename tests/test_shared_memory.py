"""Parameters and state that share memory: refused before anything is written.

Two Parameters made from one tensor, a momentum buffer set to its parameter's memory or to
another layer's, a buffer made by ``expand()``: a step would write such memory twice (each
update over the other's), past what the guard predicted for each tensor alone — θ was stored
beyond ``max_distance`` and the next step refused it — or fail in an in-place write after
other layers were written. Views of one buffer that share no entry (FSDP-style flat storage,
interleaved columns) are no alias and step as usual.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fgd_fast
from fgd_fast.baselines import CayleySGD, LandingSGD
from helpers import backend_params

OPTIMIZERS = [
    pytest.param(lambda groups, b=b.values[0]: fgd_fast.FGD(groups, lr=0.1, backend=b), marks=b.marks, id=f"FGD-{b.id}")
    for b in backend_params(("reference", "torch", "triton"), "cpu")
] + [
    pytest.param(lambda groups: CayleySGD(groups, lr=0.1), id="CayleySGD"),
    pytest.param(lambda groups: LandingSGD(groups, lr=0.1), id="LandingSGD"),
]


def _stiefel(*shape, seed=0):
    return fgd_fast.orthogonalize_(torch.randn(*shape, generator=torch.Generator().manual_seed(seed)))


def _aliases(kind):
    """Two orthogonal Parameters whose memory overlaps, in three ways."""
    if kind == "one-tensor":
        base = _stiefel(6, 10)
        return nn.Parameter(base), nn.Parameter(base)
    if kind == "overlapping-rows":
        base = torch.zeros(8, 10)
        base[:6] = _stiefel(6, 10)
        return nn.Parameter(base[:6]), nn.Parameter(base[2:8])
    base = _stiefel(10, 10)  # θ and θᵀ: one matrix
    return nn.Parameter(base), nn.Parameter(base.t())


@pytest.mark.parametrize("kind", ["one-tensor", "overlapping-rows", "transposed"])
@pytest.mark.parametrize("make", OPTIMIZERS)
def test_parameters_sharing_memory_are_refused_when_added_and_at_the_step(make, kind):
    p, q = _aliases(kind)
    with pytest.raises(ValueError, match=r"parameter 0 of the group and parameter 1 of the group share memory.*clone"):
        make([dict(params=[p, q], orthogonal=True)])
    opt = make([dict(params=[p], orthogonal=True)])
    with pytest.raises(ValueError, match="share memory.*the group was not added"):
        opt.add_param_group(dict(params=[q]))  # a plain group's parameter over an orthogonal one's memory
    assert len(opt.param_groups) == 1
    opt.param_groups[0]["params"].append(q)  # (past the group's check: the step's)
    p.grad, q.grad = torch.randn(p.shape), torch.randn(q.shape)
    before = p.detach().clone()
    with pytest.raises(ValueError, match="parameter #0 and parameter #1 share memory.*nothing changed"):
        opt.step()
    assert torch.equal(p, before) and not opt.state[p] and not opt.state[q]


@pytest.mark.parametrize("make", OPTIMIZERS)
def test_a_new_parameter_over_an_orthogonal_parameters_state_is_refused_when_added(make):
    """A fuzz review: a plain parameter made from an orthogonal layer's momentum buffer was
    accepted by add_param_group (only the step refused it), though the group's check looks at
    the state too now, as the README says."""
    p = nn.Parameter(_stiefel(6, 10))
    opt = make([dict(params=[p], orthogonal=True)])
    p.grad = torch.randn(p.shape)
    opt.step()
    (buffer,) = [v for v in opt.state[p].values() if isinstance(v, torch.Tensor) and v.shape == p.shape]
    q = nn.Parameter(torch.zeros(1))
    q.data = buffer
    with pytest.raises(ValueError, match="parameter 0 of the optimizer's .* and parameter 0 of the group share memory"):
        opt.add_param_group(dict(params=[q]))
    assert len(opt.param_groups) == 1


@pytest.mark.parametrize("kind", ["one-entry", "other-dtype"])
def test_views_that_share_one_entry_or_bytes_of_another_dtype_are_refused(kind):
    """The edges of the overlap test (a review: both survived every test): two views of one flat
    buffer whose last and first entries are one entry (a span one entry short misses it), and a
    float16 view over bytes a float32 view holds (entries of other sizes: compared by bytes)."""
    flat = torch.zeros(64)
    if kind == "one-entry":
        p, q = flat[0:16].view(4, 4), flat[15:31].view(4, 4)
    else:
        p, q = flat.view(torch.float16)[:32].view(8, 4), flat[8:24].view(8, 2)
    with pytest.raises(ValueError, match="share memory"):
        fgd_fast.FGD([dict(params=[nn.Parameter(p), nn.Parameter(q)], orthogonal=True)], lr=0.1)
    fgd_fast.FGD([dict(params=[nn.Parameter(flat[0:16].view(4, 4)), nn.Parameter(flat[16:32].view(4, 4))])], lr=0.1)


@pytest.mark.parametrize("make", OPTIMIZERS)
def test_views_of_one_buffer_that_share_no_entry_step_as_separate_tensors(make):
    """Disjoint rows of one flat buffer and the even and odd columns of one matrix (their spans
    meet, their entries do not) step exactly as copies of them do."""
    flat, cols = torch.zeros(12, 10), torch.zeros(10, 12)
    flat[:6], flat[6:] = _stiefel(6, 10, seed=1), _stiefel(6, 10, seed=2)
    cols[:, ::2], cols[:, 1::2] = _stiefel(10, 6, seed=3), _stiefel(10, 6, seed=4)
    views = [nn.Parameter(t) for t in (flat[:6], flat[6:], cols[:, ::2], cols[:, 1::2])]
    copies = [nn.Parameter(v.detach().clone()) for v in views]
    opts = [make([dict(params=ps, orthogonal=True)]) for ps in (views, copies)]
    for step in range(2):
        for v, c in zip(views, copies):
            v.grad = 0.05 * torch.randn(v.shape, generator=torch.Generator().manual_seed(step))
            c.grad = v.grad.clone()
        for opt in opts:
            opt.step()
    for v, c in zip(views, copies):
        torch.testing.assert_close(v, c, rtol=0, atol=1e-6)
    assert not torch.equal(views[0], _stiefel(6, 10, seed=1))  # (they moved)


def _stepped(backend="torch"):
    ps = [nn.Parameter(_stiefel(6, 10, seed=k)) for k in range(2)] + [nn.Parameter(torch.zeros(5))]
    opt = fgd_fast.FGD([dict(params=ps[:2], orthogonal=True), dict(params=ps[2:])], lr=0.1, backend=backend)
    for p in ps:
        p.grad = 0.05 * torch.randn(p.shape)
    opt.step()
    for p in ps:
        p.grad = 0.05 * torch.randn(p.shape)
    return ps, opt


STATE_EDITS = {  # what a hand edit or a checkpoint whose entries were one tensor can do
    "buffer-is-its-parameter": (lambda ps, st: st[ps[0]].update(momentum_buffer=ps[0].data), "#0 and parameter #0's"),
    "buffer-of-two-layers": (
        lambda ps, st: st[ps[1]].update(momentum_buffer=st[ps[0]]["momentum_buffer"]),
        "#0's momentum_buffer and parameter #1's momentum_buffer",
    ),
    "plain-buffer-over-a-layer": (
        lambda ps, st: st[ps[2]].update(momentum_buffer=ps[0].data.view(-1)[:5]),
        "#0 and parameter #2's momentum_buffer",
    ),
    "buffer-by-expand": (
        lambda ps, st: st[ps[1]].update(momentum_buffer=torch.zeros(1, 10).expand(6, 10)),
        r"#1: momentum_buffer \(strides \(0, 1\)\) has entries that share memory",
    ),
    "plain-buffer-by-expand": (
        lambda ps, st: st[ps[2]].update(momentum_buffer=torch.zeros(1).expand(5)),
        "#2: momentum_buffer .* has entries that share memory",
    ),
}


@pytest.mark.parametrize("backend", backend_params(("reference", "torch", "triton"), "cpu"))
@pytest.mark.parametrize("edit", list(STATE_EDITS))
def test_state_sharing_memory_is_refused_before_any_write(edit, backend):
    ps, opt = _stepped(backend)
    change, match = STATE_EDITS[edit]
    change(ps, opt.state)
    before = [p.detach().clone() for p in ps] + [s["momentum_buffer"].clone() for s in opt.state.values()]
    with pytest.raises(ValueError, match=match + ".*nothing changed"):
        opt.step()
    after = [p.detach() for p in ps] + [s["momentum_buffer"] for s in opt.state.values()]
    assert all(torch.equal(a, b) for a, b in zip(before, after))


def test_a_checkpoint_whose_buffers_were_one_tensor_is_refused_at_the_step(tmp_path):
    """``torch.save``/``torch.load`` keep two entries that are one tensor one tensor; the loaded
    optimizer's step says so, and cloning the buffers, as the error says, lets it step."""
    ps, opt = _stepped()
    opt.state[ps[1]]["momentum_buffer"] = opt.state[ps[0]]["momentum_buffer"]
    torch.save(opt.state_dict(), tmp_path / "opt.pt")
    ps2, opt2 = _stepped()
    opt2.load_state_dict(torch.load(tmp_path / "opt.pt"))
    with pytest.raises(ValueError, match="momentum_buffer share memory"):
        opt2.step()
    for p in ps2:
        opt2.state[p]["momentum_buffer"] = opt2.state[p]["momentum_buffer"].clone()
    opt2.step()


def test_an_orthogonal_parameter_also_in_a_plain_groups_list_is_refused():
    """A review: appended to a plain group's list after construction, an orthogonal parameter was
    stepped by FGD and then by SGD (SGD's momentum read FGD's Φ), silently; the next step blamed a
    flipped orthogonal flag. The step now names the repeat, before any write."""
    ps, opt = _stepped()
    opt.param_groups[1]["params"].append(ps[0])
    before = [p.detach().clone() for p in ps]
    with pytest.raises(ValueError, match=r"parameter #3 is the same tensor as parameter #0: listed twice"):
        opt.step()
    assert all(torch.equal(a, b.detach()) for a, b in zip(before, ps))


def test_the_functional_step_refuses_parameters_and_buffers_that_share_memory():
    base = _stiefel(6, 10)
    p, q = base.clone(), base.clone()
    g = [0.05 * torch.randn(6, 10) for _ in range(2)]
    with pytest.raises(ValueError, match=r"params\[0\] and params\[1\] share memory"):
        fgd_fast.fgd([base, base.view(6, 10)], g, [None, None], lr=0.1, momentum=0.9, feedback=0.4)
    buf = torch.zeros(6, 10)
    with pytest.raises(ValueError, match=r"params\[0\]'s momentum_buffer and params\[1\]'s momentum_buffer share"):
        fgd_fast.fgd([p, q], g, [buf, buf], lr=0.1, momentum=0.9, feedback=0.4)
    assert torch.equal(p, base) and torch.equal(q, base) and not buf.any()


def _grad_alias(kind, p, q, plain, opt):
    """A gradient for ``q`` (orthogonal, 6 × 10) over memory the step writes."""
    if kind == "another-parameter":
        return p.detach()
    if kind == "own-momentum":
        return opt.state[q]["momentum_buffer"]
    if kind == "another-momentum":
        return opt.state[p]["momentum_buffer"]
    return plain.detach()  # a plain group's parameter (SGD writes it before the orthogonal step)


@pytest.mark.parametrize("kind", ["another-parameter", "own-momentum", "another-momentum", "plain-parameter"])
@pytest.mark.parametrize("make", OPTIMIZERS)
def test_a_gradient_over_memory_the_step_writes_is_refused_before_any_write(make, kind):
    """A review: a gradient sharing memory with a parameter or momentum buffer the step writes was
    read after that write by the torch backend (it writes a layer before reading the next one's
    gradient; plain groups step first): results differed from the reference's by 1e-6 to 3e-4,
    silently. Refused now, with the fix, before anything is written."""
    p, q = nn.Parameter(_stiefel(6, 10)), nn.Parameter(_stiefel(6, 10, seed=1))
    plain = nn.Parameter(torch.randn(6, 10))
    opt = make([dict(params=[p, q], orthogonal=True), dict(params=[plain], momentum=0.9)])
    if "momentum_buffer" not in opt.state_dict()["state"].get(0, {}) and "momentum" in kind:
        for t in (p, q, plain):
            t.grad = 0.01 * torch.randn(t.shape)
        opt.step()
        if "momentum_buffer" not in opt.state[p]:
            pytest.skip("this optimizer keeps no momentum buffer")
    for t in (p, plain):
        t.grad = 0.01 * torch.randn(t.shape)
    q.grad = _grad_alias(kind, p, q, plain, opt)
    before = [t.detach().clone() for t in (p, q, plain)]
    state = {k: v.clone() for s in opt.state.values() for k, v in s.items() if isinstance(v, torch.Tensor)}
    with pytest.raises(
        ValueError,
        match=r"'s gradient shares memory with parameter .*which the step writes.*nothing "
        r"changed.*p\.grad = p\.grad\.clone\(\)",
    ):
        opt.step()
    assert all(torch.equal(a, b.detach()) for a, b in zip(before, (p, q, plain)))
    after = {k: v for s in opt.state.values() for k, v in s.items() if isinstance(v, torch.Tensor)}
    assert all(torch.equal(state[k], after[k]) for k in state)
    q.grad = q.grad.clone()  # the fix the message gives
    opt.step()


@pytest.mark.parametrize("make", OPTIMIZERS)
def test_gradients_sharing_memory_with_each_other_step_as_their_copies(make):
    """Gradients are only read: two views of one gradient buffer (one tensor for two layers, as
    a flat gradient bucket may hand out) are no alias and step as the copies would."""
    runs = []
    for shared in (True, False):
        ps = [nn.Parameter(_stiefel(6, 10, seed=k)) for k in range(2)]
        opt = make([dict(params=ps, orthogonal=True)])
        g = 0.05 * torch.randn(6, 10, generator=torch.Generator().manual_seed(2))
        ps[0].grad, ps[1].grad = (g, g) if shared else (g.clone(), g.clone())
        opt.step()
        runs.append([p.detach().clone() for p in ps])
    assert all(torch.equal(a, b) for a, b in zip(*runs))


def test_the_functional_step_refuses_a_gradient_over_a_buffer_it_writes():
    p, q = _stiefel(6, 10), _stiefel(6, 10, seed=1)
    buf = 0.01 * torch.randn(6, 10)
    before = (p.clone(), q.clone(), buf.clone())
    with pytest.raises(ValueError, match=r"params\[1\]'s gradient shares memory with params\[0\]'s momentum_buffer"):
        fgd_fast.fgd([p, q], [torch.randn(6, 10), buf], [buf, None], lr=0.1, momentum=0.9, feedback=0.4)
    assert all(torch.equal(a, b) for a, b in zip(before, (p, q, buf)))
