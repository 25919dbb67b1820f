"""``FGD``: the ``torch.optim.Optimizer`` front end (collects state, validates, dispatches)."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

from ._naming import label
from ._stiefel_optimizer import (
    StiefelOptimizer,
    lr_on_device,
    option,
    state_outside_inference_mode,
    step_outside_autocast,
)
from .backends import BACKENDS, PRECISIONS, checked_precision
from .backends.algebra import VARIANTS
from .backends.carry import GRAM_REFRESH
from .distributed import SHARDINGS, is_dtensor
from .functional import GuardReport, _fgd, backend_for, zero_momentum
from .guards import MAX_DISTANCE, RESET, SCALED, TRUST_RADIUS
from .manifold import orthogonalize_, stiefel_distance
from .validation import (
    check_bool,
    check_choice,
    check_dampening,
    check_feedback,
    check_fgd_momentum,
    check_int_at_least,
    check_keys,
    check_lr,
    check_max_distance,
    check_nesterov,
    check_nonnegative,
    check_state_tensor,
    check_trust_radius,
    user_stacklevel,
)

__all__ = ["FGD"]


class FGD(StiefelOptimizer):
    r"""Feedback Gradient Descent (Bu & Chang, AAAI 2022) with SGD for the other parameters.

    Parameters in a group with ``orthogonal=True`` are kept on the Stiefel manifold: with θ the
    ``n × p`` matrix view of a parameter (orthonormal along the smaller side of
    ``W.reshape(c_o, -1)``), ``g`` its gradient and Φ its velocity (``momentum_buffer``, in
    step units), one step is, with ``A = θᵀθ``, ``N = 2I − A``, ``B = θᵀΦ``, ``C = ΦᵀΦ``,
    ``E = θᵀg``, ``S = sym(B)``:

    .. math::

        M_Φ &= N\,[\,−C − (β − 1)S + η\,\mathrm{sym}(E) + N B S − α(BᵀN + B)\,] \\
        Φ &← βΦ − ηg + θ M_Φ \\
        θ &← θ + Φ − α\,θ(A − I)

    The first step uses Φ = 0; ``momentum=0`` is the stateless form
    ``θ ← θ − η(g − θN\,sym(θᵀg)) − αθ(A − I)``. Weight decay, dampening and Nesterov do not
    apply to orthogonal parameters. All other parameters get exactly ``torch.optim.SGD`` (dense
    real gradients; sparse or complex ones are refused).

    What each term does, the two-pass form the fast backends compute, the cost model and the
    precision notes: ``docs/algorithm.md``.

    Args:
        params: parameters or parameter groups; ``fgd_fast.stiefel_param_groups(model)``
            builds them. A group may override ``lr``, ``momentum``, ``feedback``,
            ``weight_decay``, ``dampening`` and ``nesterov``, and sets ``orthogonal: bool``
            (default ``False``); the other arguments are optimizer-wide.
        lr: learning rate η (>= 0), a number or a one-element floating tensor (kept as it is:
            a scheduler changes it in place; the ``"torch"``, ``"triton"`` and ``"cuda"``
            backends read it on the device, so a step captured in a CUDA graph or compiled with
            ``torch.compile`` sees each new value, the reference reads it on the host; a GPU
            tensor, or any tensor in a compiled step, is never read by the optimizer itself, so
            its group is always stepped). At lr = 0 an orthogonal group is not stepped at all (its
            state is created; the feedback term would otherwise still move θ): what
            ``torch.distributed.checkpoint``'s state initialisation relies on.
        momentum: β in [0, 1) (the paper's γ = 1 − β).
        feedback: α in [0, 1), pull back towards θᵀθ = I: a drift D = θᵀθ − I goes to about
            (1 − 2α)D per step, coupled to the velocity's normal part, so θ settles, to first
            order, ‖ΦᵀΦ‖_F / (2α) inside the manifold (further off for α near 1; the paper's α
            relates as α = η·α_paper/4). Outside [0.1, 0.9] it barely pulls back (measured: 71×
            further off at 0.99 than at 0.4, ``benchmarks/studies/feedback_contraction.py``) and FGD
            warns once.
        weight_decay, dampening, nesterov: as in ``torch.optim.SGD`` (Euclidean groups only).
        backend: ``"auto"`` (fastest available, never fails), ``"reference"``, ``"torch"``,
            ``"triton"`` or ``"cuda"`` (raise with the reason if they cannot run); see
            :func:`fgd_fast.backends.resolve_backend` for what ``"auto"`` picks.
        check_finite: raise ``FloatingPointError`` (changing nothing) when an orthogonal
            parameter's gradient or momentum buffer has NaN/Inf, or when the step would write a
            non-finite value (predicted before writing).
        check_manifold: raise ``ValueError`` (changing nothing) when an orthogonal parameter
            is more than ``max_distance`` from the manifold, ‖θᵀθ − I‖_F, or would be after the
            step (computed exactly from the ``p × p`` blocks before writing, a non-finite value
            included; with ``guard`` on the guard keeps it inside). The advice:
            ``opt.reset_parameter(p)``.
            Both checks share one host synchronisation per step; turn both off to capture
            ``step()`` in a CUDA graph (warm up with two steps first; a replay reuses the
            captured step's hyper-parameters, but for an lr given as a CUDA tensor with the
            ``"torch"``, ``"triton"`` or ``"cuda"`` backend, which each replay reads) or to compile it
            with ``fullgraph=True``.
        guard: keep training alive through spikes, on the device with no synchronisation of
            its own. Per layer the distance after the step is computed exactly before anything
            is written; the step written is the largest fraction t ∈ {1, 2^−½, …, 2^−7, 0} of
            the update (t = 0: the pull-back ``θ ← θ − αθ(A − I)`` with Φ = 0, or, where that
            pull-back itself leaves the target, α = ½ when that is nearer) whose stored θ is
            within ``max_distance``, less a rounding margin
            of the parameter's dtype. Φ and g are first scaled into a safety radius ρ
            (``trust_radius``). One rule in every backend; where it does not bind the update is
            exactly the one above, and with it on no finite input from a θ within ``max_distance`` makes a
            step raise.
            ``guard_stats()`` counts the steps it bound; a warning says so once (at the
            checks' synchronisation). See :mod:`fgd_fast.backends.guard_rule`.
        trust_radius: ρ (> 0) of the inputs' scaling ``s = min(1, ρ/(‖Φ‖_F + η‖g‖_F))``, a
            numerical safety net (default 4, far above training's values:
            ``benchmarks/studies/guard_headroom.py``).
        max_distance: the limit of ``check_manifold`` and of the guard, in (0, 1); default 0.5.
        precision: fp32 products of the ``"torch"`` and ``"triton"`` backends: ``"tf32x3"``
            (TF32 tensor cores with θᵀθ, which sets the distance to the manifold, at fp32
            accuracy), ``"ieee"`` (IEEE fp32) or ``"tf32"`` (opt-in; ~1e-3 relative error in
            θᵀθ, so θ settles ~1e-3 off the manifold). The default, ``None``, is
            ``fgd_fast.backends.DEFAULT_PRECISION`` (``"tf32x3"``; the GPU measurements that
            chose it are in the README) for the backends that honour it, ``"ieee"`` for the
            others. A CPU has no TF32 and computes every precision in fp32. ``"auto"`` picks
            Triton on CUDA tensors for ``"tf32x3"`` and ``"tf32"`` and the torch backend
            otherwise. ``"reference"`` and ``"cuda"`` always compute in full precision (whatever
            torch's global TF32 setting), so an explicit one with a precision other than
            ``"ieee"`` is refused.
        variant: ``"official"`` (default: the authors' code, which produced the paper's
            tables; θ moves by the whole new velocity) or ``"paper"`` (Algorithm 1 as printed:
            θ moves by its tangent part, ``θ ← θ + Φ − θN sym(θᵀΦ) − αθ(A − I)``, one more
            ``p × p`` term in M_θ and no extra pass). The two differ by the normal part of Φ,
            a second-order term; the measured difference in the distance to the manifold is
            in ``docs/algorithm.md``.
        maximize: maximise the objective instead (the gradient negated for every parameter,
            as ``torch.optim.SGD(maximize=True)``); optimizer-wide.
        sharding: how a DTensor (FSDP2, tensor-parallel) layer is stepped, always exactly as
            one process would on the whole matrix: ``"auto"`` (default) sums row shards'
            partial Gram blocks over the ranks, except for the layers whose move to one *owner*
            rank (stepped whole there, sent back) makes the step's busiest rank send less: the
            layers ranked by their average saving, the cheapest number of them moved if that
            saves at least 1 MiB (3 MiB where the owner path would otherwise not run; see
            ``distributed.moved_to_owners``), and steps every other placement (column shards,
            2-D meshes) on the owner path; ``"rows"`` always sums row shards, ``"owner"`` sends
            every layer to its owner, ``"gather"`` all-gathers every layer on every rank
            (``3np``). A layer no cheaper path fits is gathered, with a warning. Every rank
            must use the same (checked); see :mod:`fgd_fast.distributed`.
        gram_refresh: the torch backend on a CPU reads ``θᵀθ``, ``θᵀΦ``, ``ΦᵀΦ`` from the
            parameters at least every this many steps and in between carries them from the
            step's ``p × p`` blocks (``θ₊ = θK + sU``, ``Φ₊ = sU + θM_Φ``: exact but for the
            rounding of storing θ₊, Φ₊, which the guard's margin allows for; 2.5 of the step's
            ~6 passes of ``2np²`` saved where ``n ≥ 2p``). Default 1: every step, so a copy or
            a checkpoint continues bit-identically (with carrying, equal to rounding: the
            carried blocks are not state). Carried only for float32/float64 θ with a
            prediction (guard, checks), never across a write the tensors' version counters
            see (``p.copy_``, ``load_state_dict``); after a write through ``p.data`` call
            :func:`fgd_fast.backends.carry.forget`. Other backends and devices read them every
            step.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float | torch.Tensor,
        *,
        momentum: float = 0.9,
        feedback: float = 0.4,
        weight_decay: float = 0.0,
        dampening: float = 0.0,
        nesterov: bool = False,
        backend: str = "auto",
        check_finite: bool = True,
        check_manifold: bool = True,
        max_distance: float = MAX_DISTANCE,
        precision: str | None = None,
        guard: bool = True,
        trust_radius: float = TRUST_RADIUS,
        variant: str = "official",
        maximize: bool = False,
        sharding: str = "auto",
        gram_refresh: int = GRAM_REFRESH,
    ) -> None:
        if precision is None:  # the library's default where the backend honours precision=
            precision = checked_precision(None, backend)
        defaults = dict(
            lr=lr,
            momentum=momentum,
            feedback=feedback,
            weight_decay=weight_decay,
            dampening=dampening,
            nesterov=nesterov,
            orthogonal=False,
            backend=backend,
            precision=precision,
            check_finite=check_finite,
            check_manifold=check_manifold,
            max_distance=max_distance,
            guard=guard,
            trust_radius=trust_radius,
            variant=variant,
            maximize=maximize,
            sharding=sharding,
            gram_refresh=gram_refresh,
        )
        self._validate_options(defaults)
        _check_group(defaults)
        super().__init__(params, defaults)

    _OPTIONS = dict(
        backend="auto",
        precision="ieee",
        check_finite=True,
        check_manifold=True,
        max_distance=MAX_DISTANCE,
        guard=True,
        trust_radius=TRUST_RADIUS,
        variant="official",
        maximize=False,
        sharding="auto",
        gram_refresh=GRAM_REFRESH,
    )
    _STATE_DICT_KEYS = ("orthogonal", "feedback")
    backend = option("backend", "The backend name (optimizer-wide, kept in ``defaults``).")
    precision = option("precision", "fp32 product precision of the torch and Triton backends (optimizer-wide).")
    check_finite = option("check_finite", "Raise on non-finite inputs or outputs of a step (optimizer-wide).")
    check_manifold = option("check_manifold", "Raise on a θ beyond ``max_distance``, before or after (optimizer-wide).")
    max_distance = option("max_distance", "The limit of ``check_manifold`` and of the guard (optimizer-wide).")
    guard = option("guard", "Whether the step guard (exact distance, partial step or reset) is on (optimizer-wide).")
    trust_radius = option("trust_radius", "ρ of the guard's safety radius on ‖Φ‖ + η‖g‖ (optimizer-wide).")
    maximize = option("maximize", "Maximise the objective: the gradient negated (optimizer-wide).")
    variant = option("variant", '``"official"`` (the authors\' code) or ``"paper"`` (Algorithm 1; optimizer-wide).')
    sharding = option("sharding", '``"auto"``, ``"rows"``, ``"owner"`` or ``"gather"``: how DTensor layers step.')
    gram_refresh = option("gram_refresh", "Steps the torch backend on a CPU may carry θᵀθ, θᵀΦ, ΦᵀΦ (optimizer-wide).")

    def _validate_options(self, options: dict[str, Any]) -> None:
        check_choice("backend", options["backend"], BACKENDS)
        check_choice("variant", options["variant"], VARIANTS)
        check_choice("sharding", options["sharding"], SHARDINGS)
        check_int_at_least("gram_refresh", options["gram_refresh"], 1, "1 reads the Gram blocks every step")
        check_bool("maximize", options["maximize"])
        precision, backend = options["precision"], options["backend"]
        check_choice("precision", precision, PRECISIONS)
        checked_precision(
            precision,
            backend,
            "; on an existing optimizer, whose precision may be the default of its first backend, set "
            "opt.precision = 'ieee' before opt.backend",
        )
        check_bool("check_finite", options["check_finite"])
        check_bool("check_manifold", options["check_manifold"])
        check_bool("guard", options["guard"])
        check_max_distance(options["max_distance"])
        check_trust_radius(options["trust_radius"])

    # -- the step ---------------------------------------------------------------------------
    @torch.no_grad()
    @state_outside_inference_mode
    @step_outside_autocast
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """Perform one optimisation step; nothing changes if it raises."""
        # orthogonal DTensors without a gradient on this rank: their meshes join the ranks' agreement (a
        # rank that skipped it, its layers' gradients all None, left the others waiting there)
        idle: list[torch.Tensor] = []
        try:  # (a hyper-parameter refused on one rank only, a scheduler's, also joins the ranks' agreement)
            loss = self._run_closure(closure)
            orth, eucl, resting = self._collect(idle)  # (raises on a parameter listed twice, in any groups)
        except Exception as error:
            try:
                self._raise_with_the_ranks(error)
            except Exception as joined:  # (the agreement itself failed, e.g. the other ranks were in the
                if joined is error:  # closure's own collectives: this rank still raises its own error)
                    raise
                raise error from joined
            raise

        def before_writes() -> None:  # what allocates memory, after every check and before θ or Φ is written
            # the state a first step makes (Φ = 0 at lr = 0, the guard's counters, which the step adds to
            # after its writes): made first, stored once the plain groups' step ran (a failed step makes none)
            made = [(p, self._new_state(p, beta)) for p, beta in resting]
            made += [(p, self._new_state(p, 0.0)) for p in orth["params"]]
            for group, ps in eucl:
                self._group_sgd(group, ps)
            for p, new in made:
                if new:
                    self.state[p].update(new)

        if not (orth["params"] or idle):
            before_writes()
            return loss
        sharded_step = bool(idle) or any(is_dtensor(p) for p in orth["params"])  # (else nothing more to scan)
        # (whether unsharded orthogonal layers step beside sharded ones: from the groups, alike on
        # every rank, not from which of them have a gradient on this one)
        beside = sharded_step and self._unsharded_beside_sharded()
        report = _fgd(
            orth["params"],
            orth["grads"],
            orth["bufs"],
            lr=orth["lr"],
            momentum=orth["momentum"],
            feedback=orth["feedback"],
            labels=orth["labels"],
            **self._fgd_options(),
            _rest_sharded_at_zero_lr=True,
            _unsharded_beside_sharded=beside,
            _idle_dtensors=idle,
            _before_writes=before_writes,
        )
        for p, buf in zip(orth["params"], orth["bufs"]):
            if buf is not None:
                self.state[p]["momentum_buffer"] = buf
        self._count_guarded(orth["params"], report)
        # DTensors at lr = 0 (fgd() agreed on them and stepped nothing): the state a step makes
        rested = [not isinstance(lr, torch.Tensor) and lr == 0.0 for lr in orth["lr"]]
        for p, beta, rest in zip(orth["params"], orth["momentum"], rested):
            if rest:
                self._make_state(p, beta)
        if not torch.compiler.is_compiling() and sharded_step:
            last = self.__dict__.setdefault("_last_distance", WeakIdKeyDictionary())
            distances = report.distance or [None] * len(orth["params"])
            for p, d, rest in zip(orth["params"], distances, rested):  # for orthogonality() on sharded θ
                if d is not None and is_dtensor(p):
                    last[p] = (d, _versions(p))  # (d: a device tensor, no synchronisation here)
                elif not rest:  # (a layer at rest did not move: its distance stands)
                    last.pop(p, None)
        return loss

    def _collect(self, idle: list[torch.Tensor]) -> tuple[dict[str, list], list, list]:
        """The step's one collection pass over the parameters with gradients (checking them):
        the orthogonal layers' arguments of :func:`fgd`, the Euclidean groups' parameters, and
        the unsharded orthogonal parameters at lr = 0 (only their state is made)."""
        orth: dict[str, list] = dict(params=[], grads=[], bufs=[], lr=[], momentum=[], feedback=[], labels=[])
        eucl: list[tuple[dict[str, Any], list[torch.Tensor]]] = []  # (a group's parameters come together)
        resting: list[tuple[torch.Tensor, float]] = []  # lr = 0: only their state is made, after the checks
        for group, p, text in self._params_with_grads(idle):  # the one collection pass (checks the gradients)
            if not group["orthogonal"]:
                if not eucl or eucl[-1][0] is not group:  # (no id(): torch 2.11's Dynamo cannot trace it on a dict)
                    eucl.append((group, []))
                eucl[-1][1].append(p)
                continue
            beta, alpha = float(group["momentum"]), float(group["feedback"])
            self._warn_feedback_once(alpha)
            lr = group["lr"]
            on_device = lr_on_device(lr)  # never read on the host
            # lr = 0: θ and Φ stay as they are; only the state is made (a DTensor's in fgd(), after
            # the ranks' agreement: a rank that skipped it would leave the others waiting there)
            if not on_device and float(lr) == 0.0 and not is_dtensor(p):
                resting.append((p, beta))
                continue
            orth["params"].append(p)
            orth["grads"].append(p.grad)
            orth["bufs"].append(self.state.get(p, {}).get("momentum_buffer") if beta > 0 else None)
            orth["lr"].append(lr if on_device else float(lr))  # (a CPU tensor, read above: no copy to the GPU)
            orth["momentum"].append(beta)
            orth["feedback"].append(alpha)
            orth["labels"].append(text)
        return orth, eucl, resting

    def _fgd_options(self) -> dict[str, Any]:
        """The optimizer-wide options as :func:`fgd` takes them (checked by ``_run_closure`` this
        step, hence ``_validated``)."""
        opts = self.defaults
        return dict(
            backend=opts["backend"],
            check_finite=opts["check_finite"],
            check_manifold=opts["check_manifold"],
            max_distance=float(opts["max_distance"]),
            precision=opts["precision"],
            guard=opts["guard"],
            trust_radius=float(opts["trust_radius"]),
            variant=opts["variant"],
            sharding=opts["sharding"],
            gram_refresh=opts["gram_refresh"],
            maximize=opts["maximize"],  # (ascend along g; agreed by the ranks of a sharded step)
            _validated=True,
        )

    def _raise_with_the_ranks(self, error: Exception) -> None:
        """A step refused on this rank before the ranks' first collective (its own input: a
        gradient or state that does not fit here only): with sharded orthogonal parameters the
        other ranks would wait in the ranks' agreement for it. Join that agreement with the
        failure, so every rank raises (this one ``error``), then return for the caller to raise."""
        sharded = [p for g in self.param_groups if g["orthogonal"] for p in g["params"] if is_dtensor(p)]
        if not sharded or torch.compiler.is_compiling():
            return
        _fgd(
            [],
            [],
            [],
            lr=[],
            momentum=[],
            feedback=[],
            **self._fgd_options(),
            _unsharded_beside_sharded=self._unsharded_beside_sharded(),
            _idle_dtensors=sharded,
            _held=error,
        )

    def _unsharded_beside_sharded(self) -> bool:
        """Whether the orthogonal groups hold both DTensors and plain tensors (the ranks then
        agree on the plain ones' checks each step)."""
        kinds = {is_dtensor(p) for g in self.param_groups if g["orthogonal"] for p in g["params"]}
        return len(kinds) == 2

    def _make_state(self, p: torch.Tensor, beta: float) -> None:
        """The state a step creates (Φ = 0, the guard's counters), without stepping: what a
        step at lr = 0 does, so that ``torch.distributed.checkpoint``'s state initialisation
        (a step at lr = 0 with zero gradients) moves no weight (the feedback term would)."""
        self.state[p].update(self._new_state(p, beta))

    def _new_state(self, p: torch.Tensor, beta: float) -> dict[str, torch.Tensor]:
        """The entries :meth:`_make_state` would add to ``p``'s state (made, not stored)."""
        state, new = self.state.get(p, {}), {}
        if beta > 0 and "momentum_buffer" not in state:
            new["momentum_buffer"] = zero_momentum(p)
        if self.defaults["guard"] and "guard_count" not in state:  # (made outside inference mode: FGD.step is)
            new["guard_count"] = torch.zeros(2, dtype=torch.int64, device=p.device)
        return new

    def _check_orthogonal_state(self, p: torch.Tensor, group: dict[str, Any], label: str) -> None:
        """Before any write: the guard's counters, which the step adds to after θ and Φ are
        written, are two int64 counts on ``p``'s device (a model moved after a step without
        momentum left them behind). (Φ: the step's own check.)"""
        super()._check_orthogonal_state(p, group, label)
        counts = self.state.get(p, {}).get("guard_count")
        if counts is not None and self.defaults["guard"]:
            check_state_tensor(counts, p, torch.int64, label, "guard_count", shape=(2,))

    def _count_guarded(self, params: list[torch.Tensor], report: GuardReport) -> None:
        """Add this step's guard decisions to ``state[p]["guard_count"]`` = [scaled, reset]
        steps (device tensors, no synchronisation); warn once when it first bound (only read
        at the checks' synchronisation)."""
        by_device: dict[torch.device, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        bound = report.read is None or any(report.read)  # read on the host: nothing to count when it never bound
        for p, code in zip(params, report.guarded):
            if code is None:
                continue
            if not bound:
                _guard_counts(self.state[p], p)  # (the counters exist from the first step on)
                continue
            counts, codes = by_device.setdefault(p.device, ([], []))
            counts.append(_guard_counts(self.state[p], p))
            codes.append(code)
        for counts, codes in by_device.values():
            stacked = torch.stack(codes)
            delta = torch.stack([stacked == SCALED, stacked == RESET], 1).to(torch.int64)  # (L, 2)
            torch._foreach_add_(counts, list(delta.unbind(0)))
        if report.read is not None and any(report.read) and not self.__dict__.get("_guard_warned", False):
            self._guard_warned = True
            warnings.warn(
                "the FGD step guard bound: a step was written in part (or reset to the feedback pull-back) "
                "to keep the weights within max_distance of the manifold, likely after a gradient or "
                "learning-rate spike; opt.guard_stats() counts such steps per parameter",
                RuntimeWarning,
                stacklevel=user_stacklevel(),
            )

    def guard_stats(self) -> dict[str | int, dict[str, int]]:
        """Per orthogonal parameter (by name, else flat index): how many steps the guard
        ``"scaled"`` (a fraction of the update written) and how many it ``"reset"``
        (pull-back, Φ₊ = 0).
        Reads device counters (synchronises with the device)."""
        out = {}
        for group, p, key in self._keyed():
            if group["orthogonal"]:
                counts = self.state.get(p, {}).get("guard_count")
                scaled, reset = counts.tolist() if counts is not None else (0, 0)
                out[key] = {"scaled": int(scaled), "reset": int(reset)}
        return out

    @torch.no_grad()
    def reset_parameter(self, param: torch.Tensor) -> None:
        """Recover an orthogonal parameter after a bad step: project it onto the manifold
        (:func:`fgd_fast.orthogonalize_`) and clear its momentum (the next step starts from
        Φ = 0, as the first one does). The advice of the step's errors."""
        for group, p, key in self._keyed():
            if p is param:
                if not group["orthogonal"]:
                    raise ValueError(
                        f"reset_parameter({label(key)}): the parameter is in a group without orthogonal=True, "
                        "which has no manifold to return to; to clear its momentum, opt.state[param].clear()"
                    )
                orthogonalize_(p)
                self.state.get(p, {}).pop("momentum_buffer", None)
                self.__dict__.get("_last_distance", {}).pop(p, None)
                return
        what = f"a tensor of shape {tuple(param.shape)}" if isinstance(param, torch.Tensor) else repr(param)
        raise ValueError(
            f"reset_parameter got {what} that is not one of this optimizer's parameters; pass the "
            "nn.Parameter object itself (not .data, .detach() or a copy)"
        )

    def _validate_group(self, group: dict[str, Any], at_step: bool = False) -> None:
        _check_group(group, at_step)

    def _loaded(self) -> None:
        self.__dict__.pop("_last_distance", None)  # (the model is usually reloaded with it)
        for state in self.state.values():  # (an earlier build saved them as floats after a resume)
            counts = state.get("guard_count")
            if isinstance(counts, torch.Tensor) and counts.dtype != torch.int64:
                state["guard_count"] = counts.to(torch.int64)

    def orthogonality(self, *, fresh: bool = False) -> dict[str | int, float]:
        """``‖θᵀθ − I‖_F`` (float64) for every orthogonal parameter, keyed as ``guard_stats``.

        A sharded (DTensor) parameter answers with the distance its last step computed (exact
        to rounding, from that step's reduced Gram blocks; for a float16/bfloat16 parameter that
        of the float32 θ₊ before it was stored in 16 bits, a few times below the stored θ's:
        ``fresh=True`` measures that): no collective, so one rank alone may
        call it (``if rank == 0: log(opt.orthogonality())``). ``fresh=True``, or a parameter not
        stepped with a prediction yet, or stepped by a compiled step since, or written since in
        place (a write through ``p.data`` is not seen: call ``fresh`` then), measures the whole
        matrix: a collective, every rank must call it. Other
        parameters are always measured (locally)."""
        last = self.__dict__.get("_last_distance", {})
        out = {}
        for group, p, key in self._keyed():
            if group["orthogonal"]:  # (a step since, compiled or not, or a write through p moved its versions)
                known = not fresh and is_dtensor(p) and p in last and last[p][1] == _versions(p)
                out[key] = float(last[p][0]) if known else stiefel_distance(p)
        return out

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """As ``torch.optim.Optimizer``'s; once the group is added, warn (once per value, per
        optimizer) of a feedback outside :data:`FEEDBACK_RANGE` and (once per option name) of
        options this group sets itself that do nothing for orthogonal parameters (nesterov,
        dampening, weight_decay: FGD's update has no such terms); options inherited from the
        optimizer-wide defaults stay silent, and so do values equal to them
        (``ZeroRedundancyOptimizer`` copies its keyword arguments into every group it hands its
        optimizer)."""
        defaults = getattr(self, "defaults", {})
        own = {
            k: param_group[k]
            for k in ("nesterov", "dampening", "weight_decay")
            if k in param_group and not (k in defaults and param_group[k] == defaults[k])
        }
        super().add_param_group(param_group)  # (fills the defaults into param_group)
        group = self.param_groups[-1]
        if not group["orthogonal"]:
            return
        self._warn_feedback_once(float(group["feedback"]))
        idle = [k for k, v in own.items() if v]
        warned = self.__dict__.setdefault("_warned_options", set())
        if idle and not set(idle) <= warned:
            warned.update(idle)
            warnings.warn(
                f"{', '.join(f'{k}={own[k]!r}' for k in idle)} set on an orthogonal=True group does "
                "nothing there (FGD's update has no such term; they apply to the Euclidean groups); "
                "drop it from that group's dict",
                UserWarning,
                stacklevel=user_stacklevel(),
            )

    def _warn_feedback_once(self, alpha: float) -> None:
        lo, hi = FEEDBACK_RANGE
        if lo <= alpha <= hi:  # (first: a compiled step traces no dict method; torch 2.11's Dynamo cannot)
            return
        warned = self.__dict__.setdefault("_warned_feedback", set())
        if alpha not in warned:
            warned.add(alpha)
            warnings.warn(
                f"feedback={alpha}: the drift off the manifold contracts by |1 − 2α| = {abs(1 - 2 * alpha):.3g} "
                f"per step, and near α = 0 or 1 θ settles many times the per-step drift away (measured 71× the "
                f"α = 0.4 distance at α = 0.99); use {lo} ≤ feedback ≤ {hi} (0.4 is the paper's)",
                RuntimeWarning,
                stacklevel=user_stacklevel(),
            )

    def _check_saved_state(self, p: torch.Tensor, group: dict[str, Any], state: dict[str, Any], text: str) -> None:
        super()._check_saved_state(p, group, state, text)
        counts = state.get("guard_count")
        if counts is not None and (
            not isinstance(counts, torch.Tensor)
            or counts.shape != (2,)
            or counts.is_complex()
            or counts.dtype == torch.bool
            or counts.is_meta
            or (counts.is_floating_point() and not _whole_counts(counts))
            or (not counts.is_floating_point() and bool((counts < 0).any()))
        ):
            got = f"{tuple(counts.shape)} {counts.dtype}" if isinstance(counts, torch.Tensor) else repr(counts)
            raise ValueError(
                f"cannot load this state_dict: parameter {text}'s guard_count is {got}, expected a tensor of "
                "two counts (whole numbers >= 0); nothing was loaded. Delete that entry to restart the counts"
            )

    # -- introspection ----------------------------------------------------------------------
    def resolved_backend(self, device: torch.device | str | None = None) -> str:
        """The backend that ``step()`` runs on tensors of ``device`` (default: the device of
        the first orthogonal parameter, else the CPU)."""
        if device is None:
            device = next(
                (p.device for g in self.param_groups if g["orthogonal"] for p in g["params"]), torch.device("cpu")
            )
        return backend_for(self.defaults["backend"], device, self.defaults["precision"])


def _versions(p: torch.Tensor) -> tuple[int, int]:
    """The version counters of a DTensor and of its local shard: an in-place write through
    either (a step's, eager or compiled, or the user's) moves one of them."""
    with torch.no_grad():
        return p._version, p.to_local()._version


def _whole_counts(counts: torch.Tensor) -> bool:
    """Floating counters that are counts (finite, whole, ≥ 0, below 2⁵³): what a resumed run
    of an earlier version saved (torch's load had cast them to the parameter's dtype)."""
    c = counts.detach().double()
    return bool((torch.isfinite(c) & (c >= 0) & (c == c.round()) & (c < 2.0**53)).all())


def _guard_counts(state: dict[str, Any], p: torch.Tensor) -> torch.Tensor:
    """``state["guard_count"]`` = [scaled, reset] steps of ``p``, created at zero if missing."""
    if "guard_count" not in state:  # (made in FGD.step, which runs outside torch.inference_mode)
        state["guard_count"] = torch.zeros(2, dtype=torch.int64, device=p.device)
    return state["guard_count"]


_GROUP_KEYS = ("lr", "momentum", "feedback", "weight_decay", "dampening", "nesterov", "orthogonal")

#: feedback outside this range is accepted with a one-time warning: the drift contracts by
#: |1 − 2α| per step, so α near 0 or 1 barely pulls θ back (benchmarks/studies/feedback_contraction.py)
FEEDBACK_RANGE = (0.1, 0.9)


def _check_group(group: dict[str, Any], at_step: bool = False) -> None:
    """Check a (merged) group's hyper-parameters; raises with the fix, changes nothing
    (``at_step``: see :func:`fgd_fast.validation.check_nesterov`)."""
    check_keys(group, _GROUP_KEYS)
    check_lr(group["lr"])
    check_fgd_momentum(group["momentum"])
    check_feedback(group["feedback"])
    check_nonnegative("weight_decay", group["weight_decay"])
    check_dampening(group["dampening"])
    check_nesterov(group["nesterov"], group["momentum"], group["dampening"], at_step)
    check_bool("orthogonal", group["orthogonal"])
