"""The contenders of the benchmark: how each optimizer is set up on a workload and stepped.

Every contender turns a fresh model into a :class:`Case` with three operations: ``set_grads``
installs one gradient per constrained weight (given in the weight's own shape, as autograd
would produce it), ``step`` is the work that is timed, and ``weights`` returns the
constrained weights in their own shape (for ``‖θᵀθ − I‖_F``). Only the constrained weights
get gradients, so a step is the Stiefel part of an optimizer step; every other parameter has
``grad = None`` and is skipped by every optimizer.

==========================  ===============================================================
name                        what
==========================  ===============================================================
``fgd-auto``                ``fgd_fast.FGD(backend="auto")`` at the default precision (the
                            ratios' denominator)
``fgd-<backend>``           ``FGD(backend=...)`` for reference, torch, triton, cuda, at
                            ``precision="ieee"`` (IEEE fp32 products; FGD's default is
                            ``"tf32x3"`` where a backend honours it)
``fgd-<backend>-<prec>``    ``FGD(backend=..., precision=...)``: torch and triton at
                            ``"tf32x3"`` and ``"tf32"``
``fgd-torch-carried``       ``FGD(backend="torch", precision="ieee", gram_refresh=4)``: the
                            Grams carried between refreshes
``cayley-sgd-lowrank``      ``CayleySGD(form="lowrank")`` (no ``n × n`` matrix)
``cayley-sgd-dense``        ``CayleySGD(form="dense")`` (``n × n`` skew matrix, as the
                            public code)
``cayley-adam-lowrank``     ``CayleyADAM(form="lowrank")``
``landing-sgd``             ``LandingSGD`` (Landing with the safe step; attraction 1, safe
                            distance 0.5): retraction-free and O(np²) like FGD
``geoopt-qr``               geoopt ``RiemannianSGD`` on ``EuclideanStiefel`` (QR retraction)
``geoopt-canonical``        geoopt ``RiemannianSGD`` on ``CanonicalStiefel`` (Cayley
                            retraction by an ``n × n`` solve)
``torch-orthogonal``        ``torch.nn.utils.parametrizations.orthogonal`` + SGD; the timed
                            step materialises the weights from the parametrization,
                            back-propagates the gradient through it and steps SGD
``sgd``                     ``torch.optim.SGD(foreach=True)``, no constraint: the floor
==========================  ===============================================================

Models arrive with their constrained weights already orthonormal (:mod:`workloads`), so
every contender is built with ``orthogonalize=False`` and starts from the same point. All
use momentum 0.9 (Cayley ADAM: betas 0.9, 0.99), FGD feedback 0.4, and the same ``lr``.
:func:`unavailable` gives the reason a contender cannot run on a device (recorded in the
report): FGD backends that :func:`fgd_fast.backends.resolve_backend` refuses, Triton on a
CPU (the interpreter is a correctness tool, not a timing), geoopt when it is not installed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

import fgd_fast
from fgd_fast._matrix import as_stiefel
from fgd_fast.backends import BackendUnavailable, resolve_backend
from fgd_fast.baselines import CayleyADAM, CayleySGD, LandingSGD, geoopt_stiefel_sgd, torch_orthogonal_sgd

__all__ = ["CONTENDERS", "Case", "Contender", "contender", "unavailable", "MOMENTUM", "FEEDBACK"]

MOMENTUM = 0.9
FEEDBACK = 0.4
ADAM_BETAS = (0.9, 0.99)


class Case:
    """An optimizer over the constrained weights of one model, ready to step.

    ``params`` are the tensors the optimizer updates: the weights ``W`` themselves, or with
    ``theta_layout`` their ``n × p`` matrices θ (geoopt's manifold parameters). ``owners``
    (``(module, attribute)`` per weight) is given when ``W`` is computed by a parametrization.
    """

    def __init__(
        self, optimizer: torch.optim.Optimizer, params: list[torch.Tensor], *, theta_layout: bool = False, owners=None
    ):
        self.optimizer = optimizer
        self.params = params
        self.theta_layout = theta_layout
        self.owners: list[tuple[nn.Module, str]] | None = owners

    def set_grads(self, grads: list[torch.Tensor]) -> None:
        """Install ``grads`` (one per constrained weight, in the weight's shape)."""
        for p, g in zip(self.params, grads):
            p.grad = as_stiefel(g).contiguous() if self.theta_layout else g

    def step(self) -> None:
        """One optimizer step (the timed work)."""
        self.optimizer.step()

    @torch.no_grad()
    def weights(self) -> list[torch.Tensor]:
        """The constrained weights in their own shape (``W``)."""
        if self.owners is not None:
            return [getattr(m, a).detach() for m, a in self.owners]
        return [p.detach() for p in self.params]


class ParametrizedCase(Case):
    """Weights computed by a parametrization: a step is forward + backward + ``optimizer.step``.

    The gradient with respect to each ``W`` is injected with ``torch.autograd.backward(W,
    grad)``, so the timed work is exactly: materialise every ``W`` from the parametrization,
    back-propagate through it to the unconstrained tensor, and step SGD (no model, no loss
    arithmetic).
    """

    def __init__(self, optimizer, owners: list[tuple[nn.Module, str]]):
        super().__init__(optimizer, [], owners=owners)
        self.grads: list[torch.Tensor] = []

    def set_grads(self, grads):
        self.grads = list(grads)

    def step(self):
        self.optimizer.zero_grad(set_to_none=True)
        ws = [getattr(m, a) for m, a in self.owners]
        torch.autograd.backward(ws, self.grads)
        self.optimizer.step()


def _owners(model: nn.Module, names: list[str]) -> list[tuple[nn.Module, str]]:
    out = []
    for name in names:
        path, _, attr = name.rpartition(".")
        out.append((model.get_submodule(path) if path else model, attr))
    return out


def _fgd(backend: str, precision: str | None = None, **options) -> Callable[[nn.Module, str, float], Case]:
    def make(model, rule, lr):
        group = fgd_fast.stiefel_param_groups(model, rule, orthogonalize=False)[0]
        hyper = dict(lr=lr, momentum=MOMENTUM, feedback=FEEDBACK)
        opt = fgd_fast.FGD([group], **hyper, backend=backend, precision=precision, **options)
        return Case(opt, group["params"])

    return make


def _cayley(cls, **options) -> Callable[[nn.Module, str, float], Case]:
    def make(model, rule, lr):
        group = fgd_fast.stiefel_param_groups(model, rule, orthogonalize=False)[0]
        hyper = dict(betas=ADAM_BETAS) if cls is CayleyADAM else dict(momentum=MOMENTUM)
        return Case(cls([group], lr=lr, **hyper, **options), group["params"])

    return make


def _landing(model, rule, lr):
    group = fgd_fast.stiefel_param_groups(model, rule, orthogonalize=False)[0]
    return Case(LandingSGD([group], lr=lr, momentum=MOMENTUM), group["params"])


def _geoopt(canonical: bool) -> Callable[[nn.Module, str, float], Case]:
    def make(model, rule, lr):
        names = [n for n, _ in fgd_fast.select_stiefel(model, rule)]
        opt = geoopt_stiefel_sgd(model, rule, lr=lr, momentum=MOMENTUM, canonical=canonical, orthogonalize=False)
        return Case(opt, list(opt.param_groups[0]["params"]), theta_layout=True, owners=_owners(model, names))

    return make


def _torch_orthogonal(model, rule, lr):
    names = [n for n, _ in fgd_fast.select_stiefel(model, rule)]
    opt = torch_orthogonal_sgd(model, rule, lr=lr, momentum=MOMENTUM, orthogonalize=False)
    return ParametrizedCase(opt, _owners(model, names))


def _sgd(model, rule, lr):
    params = fgd_fast.stiefel_param_groups(model, rule, orthogonalize=False)[0]["params"]
    return Case(torch.optim.SGD(params, lr=lr, momentum=MOMENTUM, foreach=True), params)


@dataclass(frozen=True)
class Contender:
    """A named way to optimize the constrained weights of a model."""

    name: str
    family: str  # "fgd", "cayley", "landing", "geoopt", "torch-orthogonal" or "sgd"
    make: Callable[[nn.Module, str, float], Case]
    backend: str | None = None  # FGD's backend argument
    precision: str | None = None  # FGD's precision argument (None: FGD's default)


CONTENDERS: tuple[Contender, ...] = (
    Contender("fgd-auto", "fgd", _fgd("auto"), "auto"),
    Contender("fgd-reference", "fgd", _fgd("reference"), "reference"),
    Contender("fgd-torch", "fgd", _fgd("torch", "ieee"), "torch", "ieee"),
    Contender("fgd-triton", "fgd", _fgd("triton", "ieee"), "triton", "ieee"),
    Contender("fgd-cuda", "fgd", _fgd("cuda"), "cuda"),
    Contender("fgd-torch-carried", "fgd", _fgd("torch", "ieee", gram_refresh=4), "torch", "ieee"),
    Contender("fgd-torch-tf32x3", "fgd", _fgd("torch", "tf32x3"), "torch", "tf32x3"),
    Contender("fgd-torch-tf32", "fgd", _fgd("torch", "tf32"), "torch", "tf32"),
    Contender("fgd-triton-tf32x3", "fgd", _fgd("triton", "tf32x3"), "triton", "tf32x3"),
    Contender("fgd-triton-tf32", "fgd", _fgd("triton", "tf32"), "triton", "tf32"),
    Contender("cayley-sgd-lowrank", "cayley", _cayley(CayleySGD, form="lowrank")),
    Contender("cayley-sgd-dense", "cayley", _cayley(CayleySGD, form="dense")),
    Contender("cayley-adam-lowrank", "cayley", _cayley(CayleyADAM, form="lowrank")),
    Contender("landing-sgd", "landing", _landing),
    Contender("geoopt-qr", "geoopt", _geoopt(canonical=False)),
    Contender("geoopt-canonical", "geoopt", _geoopt(canonical=True)),
    Contender("torch-orthogonal", "torch-orthogonal", _torch_orthogonal),
    Contender("sgd", "sgd", _sgd),
)


def contender(name: str) -> Contender:
    """The contender called ``name``."""
    for c in CONTENDERS:
        if c.name == name:
            return c
    raise KeyError(f"unknown contender {name!r}: {', '.join(c.name for c in CONTENDERS)}")


def _default_precision(backend: str) -> str:
    """The precision ``FGD(backend=backend)`` runs at when none is given."""
    return fgd_fast.FGD([torch.nn.Parameter(torch.eye(1))], lr=0.0, backend=backend).precision


def unavailable(c: Contender, device: torch.device, *, allow_interpreter: bool = False) -> str | None:
    """Why ``c`` cannot be measured on ``device`` (``None`` if it can).

    ``allow_interpreter`` lets ``fgd-triton`` run on a CPU under ``TRITON_INTERPRET=1`` (the
    smoke test uses it to exercise the case; such a time means nothing).
    """
    if c.family == "fgd":
        if c.backend == "triton" and device.type == "cpu" and not allow_interpreter:
            return (
                "a CPU runs Triton kernels only under the interpreter (TRITON_INTERPRET=1): a "
                "correctness tool, not a meaningful timing"
            )
        try:
            resolve_backend(c.backend, device, c.precision or _default_precision(c.backend))
        except BackendUnavailable as exc:
            return str(exc).splitlines()[0]
        if c.precision == "tf32" and device.type == "cpu":
            return f"a CPU has no TF32: fgd-{c.backend}-tf32 computes exactly fgd-{c.backend}'s fp32 products here"
        return None
    if c.family == "geoopt":
        try:
            import geoopt  # noqa: F401
        except ImportError:
            return "geoopt is not installed (optional: pip install geoopt)"
    return None
