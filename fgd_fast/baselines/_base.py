"""Machinery shared by :class:`CayleySGD` and :class:`CayleyADAM` (one concern: the step loop).

A step validates every group, refuses unusable gradients, stacks the orthogonal parameters of
equal shape and equal hyper-parameters into one tensor ``[X | G]`` in the parameters' own
layout (as FGD's torch backend does), lets the subclass turn ``G`` into the momentum ``M``,
forms the low-rank coefficients, checks the finiteness of M, of the coefficients and of
ADAM's v with one host synchronisation, and only then runs the retraction
(:mod:`.retraction`) and writes parameters and state. A step that raises changes nothing.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any

import torch

from .._matrix import as_w2, stiefel_shape
from .._stiefel_optimizer import (
    StiefelOptimizer,
    lr_on_device,
    option,
    state_outside_inference_mode,
    step_outside_autocast,
)
from ..backends import compute_dtype
from ..guards import raise_if_invalid
from ..manifold import sign_fixed_q
from ..saved_state import check_saved_tensor, state_dtype
from ..validation import (
    check_bool,
    check_choice,
    check_int_at_least,
    check_nonnegative,
    check_positive,
)
from .retraction import NORMS, dense_cayley, lowrank_coefficients

FORMS = ("lowrank", "dense")

#: What ``public_code_compat=True`` changes in the defaults of s, form, norm, renormalize, qr_period.
COMPAT_DEFAULTS = dict(s=5, form="dense", norm="one", renormalize=True, qr_period=101)
PLAIN_DEFAULTS = dict(s=2, form="lowrank", norm="fro", renormalize=False, qr_period=0)


def resolve_defaults(compat: bool, **given: Any) -> dict[str, Any]:
    """Fill the ``None`` entries of ``given`` with the plain or public-code default."""
    table = COMPAT_DEFAULTS if check_bool("public_code_compat", compat) else PLAIN_DEFAULTS
    return {k: (table[k] if v is None else v) for k, v in given.items()}


class Bucket:
    """Equal-shape orthogonal layers with equal hyper-parameters, stacked as ``B = [X | M]``.

    ``store`` is ``(L, 2p, n)`` (rows ``[Xᵀ; Mᵀ]``) when ``θ = W2ᵀ``, else ``(L, n, 2p)``; ``x``
    and ``m`` are always the ``(L, n, p)`` column views, ``m_blocks`` the per-layer native
    views of the M block (for ``torch._foreach_*`` against state tensors). On construction
    the M block holds the gradient ``G``; the subclass's ``_moments`` turns it into ``M``.
    """

    def __init__(self, idx, params, states, group, qr_due: bool):
        first = params[idx[0]]
        n, p, rows = stiefel_shape(first.shape)
        self.idx, self.group, self.qr_due, self.n, self.p, self.rows = idx, group, qr_due, n, p, rows
        self.params = [params[i] for i in idx]
        self.states = [states[i] for i in idx]  # read-only here; _commit writes optimizer.state[p]
        shape = (len(idx), 2 * p, n) if rows else (len(idx), n, 2 * p)
        self.store = torch.empty(shape, dtype=compute_dtype(first.dtype), device=first.device)
        self.col = self.store.transpose(1, 2) if rows else self.store
        x_block = self.store[:, :p, :] if rows else self.store[:, :, :p]
        m_block = self.store[:, p:, :] if rows else self.store[:, :, p:]
        torch._foreach_copy_(list(x_block.unbind(0)), [as_w2(t) for t in self.params])
        self.m_blocks = list(m_block.unbind(0))
        torch._foreach_copy_(self.m_blocks, [as_w2(t.grad) for t in self.params])
        self.x, self.m = self.col[:, :, :p], self.col[:, :, p:]
        self.finite: torch.Tensor | None = None  # per layer: M finite (set once M is formed)
        self.finite_next: torch.Tensor | None = None  # per layer: the retraction's inputs finite
        self.coef: torch.Tensor | None = None  # the low-rank form's Q (:func:`lowrank_coefficients`)
        self.step = [st.get("step", 0) for st in self.states]
        self.scale: torch.Tensor | float = 1.0  # c of W_d = c·W, set by _moments
        self.init: float | None = None  # σ of the start Y₀ = X + tσM (None: projected start)


class CayleyBase(StiefelOptimizer):
    """Common front end; subclasses define the moments and the Euclidean update."""

    _orthogonal_buffers = ("momentum_buffer", "exp_avg")

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        defaults: dict[str, Any],
        *,
        s: int | None,
        form: str | None,
        norm: str | None,
        renormalize: bool | None,
        public_code_compat: bool,
        qr_period: int | None,
        check_finite: bool,
        maximize: bool = False,
    ) -> None:
        """``defaults``: the subclass's hyper-parameters; the options left ``None`` get the
        plain or the public-code default (:func:`resolve_defaults`)."""
        d = resolve_defaults(
            public_code_compat, s=s, form=form, norm=norm, renormalize=renormalize, qr_period=qr_period
        )
        defaults = dict(
            defaults,
            s=d["s"],
            renormalize=d["renormalize"],
            orthogonal=False,
            form=d["form"],
            norm=d["norm"],
            public_code_compat=public_code_compat,
            qr_period=d["qr_period"],
            check_finite=check_finite,
            maximize=maximize,
        )
        self._validate_options(defaults)
        self._validate_group(defaults)
        super().__init__(params, defaults)

    #: optimizer-wide options, kept in ``defaults`` (so copies and state_dicts keep them)
    _OPTIONS = dict(
        form="lowrank", norm="fro", public_code_compat=False, qr_period=0, check_finite=True, maximize=False
    )
    #: (each subclass adds its own hyper-parameter, so one's state_dict never loads into the other)
    _STATE_DICT_KEYS = ("orthogonal", "q", "s")
    form = option("form", '``"lowrank"`` or ``"dense"`` (optimizer-wide, kept in ``defaults``).')
    norm = option("norm", '``"fro"`` or ``"one"`` (optimizer-wide).')
    public_code_compat = option(
        "public_code_compat",
        "Reproduce the public code (optimizer-wide): set later, it changes β and the start Y₀ only; "
        "its defaults of s, form, norm, renormalize and qr_period are chosen at construction.",
    )
    qr_period = option("qr_period", "QR re-orthonormalisation period, 0 for never (optimizer-wide).")
    check_finite = option("check_finite", "Raise on a non-finite gradient (optimizer-wide).")
    maximize = option("maximize", "Maximise the objective: the gradient negated (optimizer-wide).")

    def _check_saved_state(self, p, group, state, text) -> None:
        for name in ("momentum_buffer", "exp_avg"):
            if state.get(name) is not None:
                check_saved_tensor(state[name], p, text, name, state_dtype(p, group))
        k = state.get("step")
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 0):
            raise ValueError(
                f"cannot load this state_dict: parameter {text}'s step is {k!r}, expected a count (an int >= 0); "
                "nothing was loaded (drop that parameter's entry from state_dict['state'] to restart it)"
            )
        v = state.get("exp_avg_sq")
        if v is not None:
            usable = isinstance(v, torch.Tensor) and v.shape == () and v.is_floating_point()
            if not usable or not bool(torch.isfinite(v)) or bool(v < 0):
                got = f"{v.item() if v.numel() == 1 else tuple(v.shape)}" if isinstance(v, torch.Tensor) else repr(v)
                raise ValueError(
                    f"cannot load this state_dict: parameter {text}'s exp_avg_sq is {got}, expected a finite, "
                    "non-negative floating 0-d tensor (the average of ‖G‖²); nothing was loaded (drop that "
                    "parameter's entry from state_dict['state'] to restart its moments)"
                )

    # -- subclass hooks -----------------------------------------------------------------------
    def _validate_group(self, group: dict[str, Any], at_step: bool = False) -> None:
        raise NotImplementedError

    def _bucket_key(self, group: dict[str, Any], state: dict[str, Any]) -> tuple:
        """Hyper-parameters and state flags that must be equal within a bucket."""
        raise NotImplementedError

    def _moments(self, bucket: Bucket) -> tuple[torch.Tensor | float, float | None]:
        """Turn ``bucket``'s M block from ``G`` into ``M`` (no writes elsewhere); return the
        direction scale ``c`` and the start σ (``None``: projected start) for the retraction."""
        raise NotImplementedError

    def _commit(self, bucket: Bucket, wx: list[torch.Tensor]) -> None:
        """Write the new state; ``wx[i]`` is ``W X`` of layer i in its native ``c_o × m`` view."""
        raise NotImplementedError

    def _euclidean(self, group: dict[str, Any], params: list[torch.Tensor]) -> None:
        raise NotImplementedError

    # -- validation ---------------------------------------------------------------------------
    def _validate_options(self, options: dict[str, Any]) -> None:
        check_choice("form", options["form"], FORMS)
        check_choice("norm", options["norm"], NORMS)
        check_bool("public_code_compat", options["public_code_compat"])
        check_int_at_least("qr_period", options["qr_period"], 0, "0 never re-orthonormalises by QR")
        check_bool("check_finite", options["check_finite"])
        check_bool("maximize", options["maximize"])
        if options["form"] == "lowrank" and options["norm"] == "one":
            raise ValueError(
                "norm='one' (the matrix 1-norm of the n×n W) needs form='dense'; use norm='fro' "
                "with form='lowrank', or form='dense'"
            )

    @staticmethod
    def _validate_common(group: dict[str, Any]) -> None:
        check_nonnegative("lr", group["lr"])
        q = check_positive("q", group["q"], "the step bound t ≤ 2q/‖W‖; 0.5 is the paper's")
        if q >= 1.0:
            raise ValueError(
                f"invalid q={q}: it must lie in (0, 1) so that the Cayley fixed-point iteration "
                "contracts (factor ≤ q); 0.5 is the paper's"
            )
        check_int_at_least("s", group["s"], 1, "the number of Cayley fixed-point iterations; 2 is the paper's")
        check_positive("eps", group["eps"], "e.g. eps=1e-8")
        check_nonnegative("weight_decay", group["weight_decay"])
        check_bool("renormalize", group["renormalize"])
        check_bool("orthogonal", group["orthogonal"])

    # -- the step -----------------------------------------------------------------------------
    @torch.no_grad()
    @state_outside_inference_mode
    @step_outside_autocast
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """Perform one optimisation step; nothing changes if it raises."""
        loss = self._run_closure(closure)

        # bucket = equal (shape, layout, dtype, device, group, QR due, subclass key)
        params, states, labels, keys, extra = [], [], [], defaultdict(list), {}
        for group, p, label in self._params_with_grads():
            if not group["orthogonal"] or p.numel() == 0:
                continue
            state = self.state.get(p, {})
            n, pp, rows = stiefel_shape(p.shape)
            step = state.get("step", 0)
            qr_due = self.qr_period > 0 and (step + 1) % self.qr_period == 0
            key = (n, pp, rows, p.dtype, p.device, id(group), qr_due) + self._bucket_key(group, state)
            keys[key].append(len(params))
            extra[key] = (group, qr_due)
            params.append(p)
            states.append(state)
            labels.append(label)

        buckets = []
        for key, idx in keys.items():
            b = Bucket(idx, params, states, *extra[key])
            if self.maximize:
                b.m.neg_()  # ascend: the moments see −G
            b.scale, b.init = self._moments(b)
            if self.check_finite:  # max |M| is NaN/Inf exactly when M (so G or the old state) has a NaN/Inf
                b.finite = torch.isfinite(torch.linalg.vector_norm(b.m, float("inf"), dim=(1, 2)))
            self._prepare(b)
            buckets.append(b)
        raise_if_invalid(  # the one host synchronisation; raises before any write
            [torch.zeros(len(b.idx), device=b.store.device) for b in buckets],
            [b.finite for b in buckets],
            [b.idx for b in buckets],
            labels,
            check_finite=self.check_finite,
            check_manifold=False,
            finite_next=[b.finite_next for b in buckets],
            fgd=False,
            params=params,
        )
        for group in self.param_groups:  # (first: its temporaries allocated before an orthogonal write)
            if not group["orthogonal"]:
                self._euclidean(group, [p for p in group["params"] if p.grad is not None])
        for b in buckets:
            self._retract(b)
        return loss

    def _prepare(self, b: Bucket) -> None:
        """Before the check, writing only the bucket's own copy: renormalise / QR ``X`` if
        asked, and (low-rank form) the coefficients Q from the Gram ``BᵀB``, whose finiteness
        (a finite M whose Gram overflows gives t = 0 and 0·∞) joins the step's one check."""
        g, x = b.group, b.x
        # (at lr 0 the step leaves X as it is: torch's distributed checkpoint makes an optimizer's state
        # by a step at lr 0 and counts on it; an lr on the device is not read here)
        resting = not lr_on_device(g["lr"]) and float(g["lr"]) == 0.0
        if g["renormalize"] and not resting:
            x.div_(torch.linalg.vector_norm(x, dim=1, keepdim=True).add_(g["eps"]))  # x_j ← x_j / (‖x_j‖ + ε)
        if b.qr_due and not resting:
            x.copy_(sign_fixed_q(x))  # X ← Q·sign(diag R)
        flags = []
        if self.form == "lowrank":
            gram = torch.bmm(b.col.transpose(1, 2), b.col)  # BᵀB = [[A, E], [Eᵀ, C]]
            b.coef = lowrank_coefficients(gram, b.scale, **self._hyper(b))  # Q with B Q = [Y − X | W X]
            flags.append(torch.isfinite(b.coef).all(dim=2).all(dim=1))
        v = getattr(b, "v_new", None)  # (CayleyADAM's ‖G‖² average: it overflows past ‖G‖_F ~ 1.8e19)
        if v is not None:
            flags.append(torch.isfinite(v))
        if self.check_finite and flags:
            b.finite_next = flags[0] if len(flags) == 1 else flags[0] & flags[1]

    @staticmethod
    def _hyper(b: Bucket) -> dict[str, Any]:
        """The retraction's hyper-parameters of ``b`` (both forms take the same)."""
        g = b.group
        return dict(lr=g["lr"], q=g["q"], s=g["s"], eps=g["eps"], init=b.init)

    def _retract(self, b: Bucket) -> None:
        """Run the Cayley iteration (from :meth:`_prepare`'s X and Q), write θ and the state."""
        x, p = b.x, b.p
        if self.form == "lowrank":
            coef = b.coef
            if b.rows:
                out = torch.bmm(coef.transpose(1, 2), b.store)  # (BQ)ᵀ = Qᵀ Bᵀ, rows layout
                y, wx = out[:, :p, :].add_(b.store[:, :p, :]), out[:, p:, :]  # Yᵀ = Xᵀ + (B d)ᵀ
            else:
                out = torch.bmm(b.store, coef)  # B Q
                y, wx = out[:, :, :p].add_(x), out[:, :, p:]  # Y = X + B d
        else:
            y, wx = dense_cayley(x, b.m, b.scale, norm=self.norm, **self._hyper(b))
            if b.rows:
                y, wx = y.transpose(1, 2), wx.transpose(1, 2)
        # copy into the tensors themselves (a reshape of a channels_last weight is a copy)
        torch._foreach_copy_(b.params, [t.reshape(q.shape) for t, q in zip(y.unbind(0), b.params)])
        self._commit(b, list(wx.unbind(0)))


def store_state(state: dict[str, Any], name: str, value: torch.Tensor, shape: torch.Size) -> None:
    """``state[name] ← value`` reshaped to ``shape``: in place when it exists, else a new tensor."""
    old = state.get(name)
    if old is not None:
        old.copy_(value.reshape(shape))
    else:
        state[name] = value.reshape(shape).clone(memory_format=torch.contiguous_format)
