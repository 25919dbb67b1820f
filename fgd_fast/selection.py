"""Which weights of a model are Stiefel-constrained, and the param groups for them."""

from __future__ import annotations

import difflib
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from torch.nn.utils import parametrize

from ._naming import remember_names
from .manifold import check_materialised, orthogonalize_
from .validation import check_bool, check_orthogonal_params, check_writable, is_numpy_bool, user_stacklevel

__all__ = ["RULES", "stiefel_param_groups", "select_stiefel"]

Rule = str | Callable[[str, torch.Tensor], bool]
RULES = ("paper", "official", "all")


def _conv2d_weights(model: nn.Module) -> set[int]:
    """The plain ``nn.Conv2d`` weights (read from the module's parameters: ``m.weight`` of a
    parametrized one would run its parametrization, e.g. spectral norm's power iteration)."""
    weights = (m._parameters.get("weight") for m in model.modules() if isinstance(m, nn.Conv2d))
    return {id(w) for w in weights if w is not None}


def _names(exclude_name: str, name: str) -> bool:
    """Whether an ``exclude`` entry names a parameter or module ``name``: itself, or a module
    above it (``"fc"`` names ``fc.weight``)."""
    return name == exclude_name or name.startswith(exclude_name + ".")


def _normed_convs(model: nn.Module, test: Callable[[tuple[int, ...]], bool], exclude: tuple[str, ...]) -> list[str]:
    """Names of the ``nn.Conv2d`` modules whose weight is computed from other trainable tensors
    (a parametrization, e.g. ``torch.nn.utils.parametrizations.spectral_norm``, or the older
    hook-based ``torch.nn.utils.spectral_norm`` / ``weight_norm``: ``weight_orig``, ``weight_g``
    and ``weight_v``) and that the rule's shape ``test`` would otherwise take, leaving out those
    ``exclude`` names."""
    found = []
    for n, m in model.named_modules():
        if not isinstance(m, nn.Conv2d):
            continue
        hooked = "weight" not in m._parameters and any(f"weight{x}" in m._parameters for x in ("_orig", "_g", "_v"))
        if not (parametrize.is_parametrized(m, "weight") or hooked):
            continue
        shape = (m.out_channels, m.in_channels // m.groups, *m.kernel_size)  # (without computing the weight)
        # left out by its module's name or one of its trainable tensors' (weight_orig, …original0)
        names = [x for x in (n, *(name for name, _ in m.named_parameters(prefix=n))) if x]
        if test(shape) and not any(_names(e, x) for x in names for e in exclude):
            found.append(n or "the model itself")
    return found


def _paper(shape: tuple[int, ...]) -> bool:
    # 4-D conv weight (c_o, c_i, k1, k2) with c_i·k1·k2 >= c_o and min(k1, k2) > 1
    c_o, c_i, k1, k2 = shape
    return c_i * k1 * k2 >= c_o and min(k1, k2) > 1


def _official(shape: tuple[int, ...]) -> bool:
    # the authors' code: c_o <= c_i and k1 > 1
    c_o, c_i, k1, _ = shape
    return c_o <= c_i and k1 > 1


def select_stiefel(
    model: nn.Module, rule: Rule = "paper", *, exclude: Iterable[str] = ()
) -> list[tuple[str, torch.Tensor]]:
    """``(name, parameter)`` of every weight ``rule`` constrains, in ``named_parameters`` order.

    * ``"paper"``: ``nn.Conv2d`` weights with ``c_i·k1·k2 >= c_o`` and ``min(k1, k2) > 1``;
    * ``"official"`` (the authors' code): ``nn.Conv2d`` weights with ``c_o <= c_i``, ``k1 > 1``;
    * ``"all"``: every parameter with at least 2 dims — the classifier head and embeddings
      included, whose rows then cannot grow to scale the logits; that can cost accuracy, so
      leave them out with ``exclude``; so are other ≥ 2-D tensors that are no weight matrix:
      a class token or positional embedding, ``nn.MultiheadAttention``'s ``bias_k``/``bias_v``,
      a weight norm's magnitude (all projected to unit norm): leave them out with ``exclude``
      too, or pass a callable;
    * a callable ``rule(name, param) -> bool`` (a numpy bool is a bool).

    A grouped or depthwise convolution's weight (``c_o × c_i/groups × k1 × k2``) is constrained as
    one matrix over all its filters, which is stricter than orthonormal filters within each group;
    leave it out with ``exclude`` (or a callable) where that is not meant.

    ``"paper"`` and ``"official"`` skip an ``nn.Conv2d`` whose weight is computed from other
    tensors (a parametrization, e.g. weight or spectral norm, or the older norm hooks: its
    trainable tensors are not the weight), with a warning where the rule would take it and
    ``exclude`` names neither the module nor its tensors.

    ``exclude``: parameter or module names left unconstrained (``"fc"`` leaves out ``fc.weight``;
    a name matches itself and everything below it; a tied weight is left out by any of its
    names); a name that matches nothing in the model (a typo would silently constrain the weight
    it meant to leave out) raises ``ValueError``.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"expected the model (an nn.Module), got {type(model).__name__}; pass the module itself, e.g. "
            "stiefel_param_groups(model), not its parameters or state_dict"
        )
    if exclude is None or not isinstance(exclude, (str, Iterable)):
        raise TypeError(f"exclude= takes parameter or module names, got {exclude!r}; pass () to leave none out")
    exclude = tuple(exclude) if not isinstance(exclude, str) else (exclude,)
    _check_excluded(model, exclude)
    chosen = _select(model, rule, exclude)
    if not exclude:
        return chosen
    aliases: dict[int, list[str]] = {}  # every name of a tensor (a tied head's too: named_parameters drops it)
    for n, p in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(n)

    def left_out(p: torch.Tensor) -> bool:
        return any(_names(e, n) for n in aliases.get(id(p), ()) for e in exclude)

    return [(n, p) for n, p in chosen if not left_out(p)]


def _check_excluded(model: nn.Module, exclude: tuple[str, ...]) -> None:
    """Every ``exclude`` name must be a parameter's or a module's name (or a prefix of one)."""
    if not exclude:
        return
    names = [n for n, _ in model.named_parameters(remove_duplicate=False)]
    names += [n for n, _ in model.named_modules(remove_duplicate=False) if n]
    for e in exclude:
        if not isinstance(e, str):
            raise TypeError(f"exclude= takes parameter or module names (str), got {type(e).__name__}: {e!r}")
        if not any(_names(e, n) for n in names):
            wrapped = [f"{w}.{e}" for w in ("module", "_orig_mod") if any(n.startswith(f"{w}.{e}") for n in names)]
            near = wrapped or difflib.get_close_matches(e, names, n=3)
            hint = f"; did you mean {' or '.join(map(repr, near))}?" if near else " (see model.named_parameters())"
            if wrapped:
                hint += " (a wrapped model's names start with its wrapper's prefix: DataParallel, torch.compile)"
            raise ValueError(f"exclude={e!r} matches no parameter or module of the model{hint}")


def _select(model: nn.Module, rule: Rule, exclude: tuple[str, ...]) -> list[tuple[str, torch.Tensor]]:
    if callable(rule):
        chosen = []
        for name, p in model.named_parameters():
            verdict = rule(name, p)
            if is_numpy_bool(verdict):  # (a bool, as for flags)
                verdict = bool(verdict)
            if not isinstance(verdict, bool):
                raise TypeError(
                    f"rule({name!r}, param) must return a bool, got {type(verdict).__name__}; wrap it in bool(...)"
                )
            chosen.append((name, p)) if verdict else None
        return chosen
    if rule not in RULES:
        raise ValueError(
            f"unknown rule={rule!r}: choose one of {', '.join(map(repr, RULES))}, "
            "or pass a callable (name, param) -> bool"
        )
    if rule == "all":
        return [(n, p) for n, p in model.named_parameters() if p.dim() >= 2]
    convs = _conv2d_weights(model)
    test = _paper if rule == "paper" else _official
    skipped = _normed_convs(model, test, exclude)
    if skipped:
        warnings.warn(
            f"select_stiefel: rule={rule!r} leaves out the nn.Conv2d weight(s) computed from other tensors of "
            f"{', '.join(skipped[:3])}{' …' if len(skipped) > 3 else ''} (a parametrization, e.g. weight or "
            "spectral norm, or a norm hook: the trainable tensors are not the weight, so no constraint on "
            "them makes it orthonormal); remove it to constrain them, or name the modules (or their "
            "tensors, e.g. 'conv.weight_orig') in exclude= to silence this",
            UserWarning,
            stacklevel=user_stacklevel(),
        )
    return [(n, p) for n, p in model.named_parameters() if id(p) in convs and p.dim() == 4 and test(tuple(p.shape))]


def stiefel_param_groups(
    model: nn.Module,
    rule: Rule = "paper",
    *,
    orthogonalize: bool = True,
    exclude: Iterable[str] = (),
    prefix: str = "",
) -> list[dict[str, Any]]:
    """Param groups for :class:`fgd_fast.FGD`: ``[{"params": [...], "orthogonal": True},
    {"params": [...]}]`` over ``model``'s parameters, the first holding the weights chosen by
    ``rule`` (see :func:`select_stiefel`, ``exclude`` as there), the second every other trainable
    parameter. Frozen parameters (``requires_grad=False``) are in neither, so an optimizer built
    from these groups never steps them, even once unfrozen (unlike ``torch.optim.SGD(model.parameters())``);
    a warning names those the rule takes. Each group also has
    a ``"names"`` list (the ``named_parameters`` names), which FGD uses in messages and in
    :meth:`FGD.orthogonality`; it is not torch's ``param_names`` key, so groups without
    names can still be added next to these. ``prefix`` is put before every name (``exclude``
    still takes the names within ``model``): groups built from sub-modules, e.g. to give each its
    own lr, need it to keep their names apart (``prefix="encoder."``), and an optimizer refuses a
    name it already holds.

    With ``orthogonalize=True`` the chosen weights are projected onto the manifold in place
    (:func:`fgd_fast.orthogonalize_`), as FGD requires ``θᵀθ ≈ I`` at the start.

    Distributed: call it after ``fully_shard`` (FSDP2 replaces the parameters by DTensors;
    the projection is then a collective, run it on every rank). Under
    ``ZeroRedundancyOptimizer`` each rank's optimizer gets a subset of every group; FGD
    still names each parameter correctly (it remembers the tensors' names).
    """
    orthogonalize = check_bool("orthogonalize", orthogonalize)
    if not isinstance(prefix, str):
        raise TypeError(f"prefix= takes a str put before every parameter name, got {type(prefix).__name__}")
    selected = select_stiefel(model, rule, exclude=exclude)
    chosen = [(n, p) for n, p in selected if p.requires_grad]
    frozen = [n for n, p in selected if not p.requires_grad]
    if frozen:  # (torch.optim.SGD(model.parameters()) would hold them and step them once unfrozen)
        warnings.warn(
            f"stiefel_param_groups: {len(frozen)} weight(s) rule={rule!r} takes are frozen (requires_grad=False) "
            f"and left out of the groups, neither projected nor stepped: {', '.join(frozen[:3])}"
            f"{' …' if len(frozen) > 3 else ''}; an optimizer built from these groups never steps them, even once "
            "unfrozen: build the groups after unfreezing (or add them then with opt.add_param_group), or name "
            "them in exclude= if they stay frozen",
            UserWarning,
            stacklevel=user_stacklevel(),
        )
    if not chosen:  # (FGD then is plain SGD: say so, a rule meant for convolutions on an MLP does this)
        what = "nn.Conv2d weights with k > 1" if rule in ("paper", "official") else "weights"
        warnings.warn(
            f"stiefel_param_groups: rule={rule!r} selected no trainable weight of this model as orthogonal "
            f"(it takes {what}), so FGD will train it as plain SGD; for Linear layers use rule='all' "
            "(with exclude= for the classifier head) or a callable rule",
            UserWarning,
            stacklevel=user_stacklevel(),
        )
    chosen_ids = {id(p) for _, p in chosen}
    for name, p in chosen:  # every choice checked before any is projected (a failure changes nothing)
        try:
            check_orthogonal_params([p], [repr(name)])
            check_writable([p], [repr(name)])  # (a projection writes it in place: expand()ed memory failed there)
        except ValueError as exc:
            raise ValueError(
                f"rule={rule!r} selected {name!r} ({tuple(p.shape)} {p.dtype}): {exc}; or make the rule leave "
                "it out (e.g. return False for p.dim() < 2) or name it in exclude="
            ) from None
    if orthogonalize:
        for name, p in chosen:  # (a meta or non-finite tensor refused before any weight is projected)
            check_materialised(p, "stiefel_param_groups(orthogonalize=True)")
            if not bool(torch.isfinite(p.detach()).all()):
                raise ValueError(
                    f"stiefel_param_groups(orthogonalize=True): {name!r} has NaN or Inf entries, which no projection "
                    "recovers; nothing was projected. Re-initialise that weight (e.g. module.reset_parameters()) "
                    "or load a finite checkpoint first"
                )
        for _, p in chosen:
            orthogonalize_(p.data)
    rest = [(n, p) for n, p in model.named_parameters() if p.requires_grad and id(p) not in chosen_ids]
    chosen = [(prefix + n, p) for n, p in chosen]
    rest = [(prefix + n, p) for n, p in rest]
    remember_names([p for _, p in chosen + rest], [n for n, _ in chosen + rest])  # labels survive ZeRO's sharding
    return [
        {"params": [p for _, p in chosen], "names": [n for n, _ in chosen], "orthogonal": True},
        {"params": [p for _, p in rest], "names": [n for n, _ in rest]},
    ]
