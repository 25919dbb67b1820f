"""``StiefelOptimizer``: what every optimizer of the package shares around its step.

Param groups carry ``orthogonal: bool``; a group is validated (by the subclass's
``_validate_group``) before it is added, so a bad group never enters the optimizer; every
parameter has a *key* — its name when the group has ``names`` (``stiefel_param_groups``) or
torch's ``param_names``, else its flat index (the index ``state_dict`` uses;
:mod:`fgd_fast._naming`); checkpoints are :mod:`fgd_fast._checkpoint`'s (a mixin: floating
state of float16/bfloat16 orthogonal parameters stays float32 across ``load_state_dict``).

Optimizer-wide options (``backend``, the checks, ``form``, …) live in ``defaults`` like
torch's ``foreach``/``maximize`` — and so, merged, in every group and in ``state_dict`` — so
``copy.deepcopy``, ``pickle``, ``torch.save`` and ``state_dict`` keep them. They read and
write as attributes (``opt.max_distance = 0.3`` validates and sets them everywhere); a group
may not give one a different value.
"""

from __future__ import annotations

import difflib
import functools
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch.optim.optimizer import Optimizer
from torch.utils.weak import WeakIdKeyDictionary

from ._checkpoint import NOT_NUMBERS, CheckpointMixin, plain_numbers
from ._naming import label, remembered_name
from .distributed import is_dtensor
from .functional import autocast_on, autocast_set, outside_inference_mode
from .manifold import check_materialised, stiefel_distance
from .plain_sgd import sgd
from .saved_state import state_dtype
from .validation import (
    check_grad,
    check_no_shared_memory,
    check_orthogonal_params,
    check_state_tensor,
    check_writable,
    param_tensors,
    user_stacklevel,
)

__all__ = ["StiefelOptimizer", "option"]


def lr_on_device(lr: Any) -> bool:
    """Whether the step must not read ``lr`` on the host: a GPU tensor (a read synchronises), or
    any tensor in a compiled step."""
    return isinstance(lr, torch.Tensor) and (lr.device.type != "cpu" or torch.compiler.is_compiling())


def option(name: str, doc: str = "") -> property:
    """An optimizer-wide option stored in ``defaults`` (and every group), read and written as
    an attribute; writing validates it (changing nothing if it is invalid)."""

    def get(self) -> Any:
        return self.defaults[name]

    def set(self, value: Any) -> None:
        self._validate_options({**self.defaults, name: value})
        self.defaults[name] = value
        for group in self.param_groups:
            group[name] = value

    return property(get, set, doc=doc or f"The optimizer-wide option ``{name}`` (kept in ``defaults``).")


def state_outside_inference_mode(step: Callable) -> Callable:
    """Run an optimizer's ``step`` outside ``torch.inference_mode`` (still under ``no_grad``): the
    state it makes (momentum buffers, moments, counters) is then no inference tensor, which a later
    step outside the mode could not update in place (it raised after writing some parameters)."""

    @functools.wraps(step)
    def wrapper(*args, **kwargs):
        with outside_inference_mode(), torch.no_grad():  # (leaving inference mode turns grad mode back on)
            return step(*args, **kwargs)

    return wrapper


def step_outside_autocast(step: Callable) -> Callable:
    """Run an optimizer's ``step`` with any ``torch.autocast`` the caller entered turned off (its
    arithmetic in the parameters' dtypes, as :func:`.functional.outside_autocast`); the closure
    still runs under the caller's autocast, as in a ``torch.optim`` optimizer."""

    @functools.wraps(step)
    def wrapper(self, closure: Callable[[], float] | None = None):
        devices = autocast_on()
        if not devices:
            return step(self, closure)
        if closure is not None:
            closure = functools.partial(_under_autocast, closure, devices)
        with autocast_set(devices, enabled=False):
            return step(self, closure)

    return wrapper


class _Memory:
    """The tensors a step writes (parameters with a gradient, their state), each parameter once:
    one listed twice, in any groups (one appended to another group's list after it was added,
    which the group's own check did not see), is refused. Labels are made only for an error
    (about 1 µs a parameter in all: the check runs at every step)."""

    def __init__(self) -> None:
        self.tensors: list[torch.Tensor] = []
        self.guarded: list[bool] = []
        self.read_only: list[bool] = []  # (a gradient: read, never written)
        self.whose: list[tuple[str, str | None]] = []  # (the parameter's label, the state entry or None)
        self.seen: dict[int, str] = {}

    def add(self, p: torch.Tensor, group: dict[str, Any], state: dict[str, Any], text: str) -> None:
        self.once(p, text)
        if is_dtensor(p):  # (its shards' memory is the mesh's, and so is its state's: not checked here)
            return
        orthogonal = bool(group["orthogonal"])
        self._add(p, orthogonal, text, None)
        for name, value in state.items():  # (a plain one's momentum may not share an orthogonal one's memory)
            if isinstance(value, torch.Tensor):
                self._add(value, orthogonal, text, name)
        if isinstance(p.grad, torch.Tensor) and not is_dtensor(p.grad):
            self._add(p.grad, orthogonal, text, "gradient", read_only=True)

    def _add(self, t: torch.Tensor, guarded: bool, text: str, name: str | None, read_only: bool = False) -> None:
        self.tensors.append(t)
        self.guarded.append(guarded)
        self.read_only.append(read_only)
        self.whose.append((text, name))

    def label(self, i: int) -> str:
        text, name = self.whose[i]
        return f"parameter {text}" if name is None else f"parameter {text}'s {name}"

    def once(self, p: torch.Tensor, text: str) -> None:
        if id(p) in self.seen:
            raise ValueError(
                f"parameter {text} is the same tensor as parameter {self.seen[id(p)]}: listed twice (in one group's "
                "list or in two groups'), it would be stepped twice in every step; the step was not applied and "
                "nothing changed. List each parameter once"
            )
        self.seen[id(p)] = text


def _under_autocast(closure: Callable[[], float], devices) -> float:
    with autocast_set(devices, enabled=True):
        return closure()


def _names_given(param_group: dict[str, Any], params) -> list | None:
    """The names a group gives its parameters: its ``param_names`` / ``names`` list, else those of
    ``(name, tensor)`` pairs in ``params`` (None for an entry without one)."""
    names = param_group.get("param_names") or param_group.get("names")
    if not names and not isinstance(params, torch.Tensor):  # (named: (name, tensor) pairs)
        names = [p[0] if isinstance(p, tuple) else None for p in params]
    return names


class StiefelOptimizer(CheckpointMixin, Optimizer):
    #: the optimizer-wide options (kept in ``defaults``, equal in every group) and their
    #: defaults (what an optimizer pickled before an option existed gets)
    _OPTIONS: dict[str, Any] = {}
    #: the state buffers of an orthogonal parameter that the step reads without checking them
    #: itself (shaped like the parameter); ``_check_orthogonal_state`` checks them before any write
    _orthogonal_buffers: tuple[str, ...] = ()

    #: per-group hyper-parameters: ``opt.lr = 0.2`` sets a Python attribute no step reads
    _GROUP_ONLY = ("lr", "momentum", "feedback", "weight_decay", "dampening", "nesterov", "betas", "attraction")

    def __setattr__(self, name: str, value: Any) -> None:
        if name in self._GROUP_ONLY and name not in self.__dict__ and name not in self._OPTIONS:
            warnings.warn(
                f"{type(self).__name__}.{name} = {value!r} sets an attribute no step reads: {name} is a per-group "
                f"hyper-parameter; set it in each group (for g in opt.param_groups: g[{name!r}] = ...), as a "
                "scheduler does",
                UserWarning,
                stacklevel=2,
            )
        super().__setattr__(name, value)

    def _validate_group(self, group: dict[str, Any], at_step: bool = False) -> None:
        """Raise (changing nothing) if a merged group's hyper-parameters are invalid (``at_step``:
        checked again at a step, where a scheduled momentum of 0 may meet ``nesterov``)."""
        raise NotImplementedError

    def _validate_options(self, options: dict[str, Any]) -> None:
        """Raise (changing nothing) if the optimizer-wide options in ``options`` are invalid."""

    def _check_options(self, groups: Iterable[dict[str, Any]]) -> None:
        """The options are valid and every group holds the optimizer's values."""
        self._validate_options(self.defaults)
        for group in groups:
            for name in self._OPTIONS:
                if name in group and group[name] != self.defaults[name]:
                    raise ValueError(
                        f"{name} is optimizer-wide: a parameter group holds {name}={group[name]!r} but the optimizer "
                        f"{self.defaults[name]!r}; set it on the optimizer (opt.{name} = value), which updates "
                        "every group"
                    )

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """As ``torch.optim``, but the group is validated first (a bad one is refused, nothing
        added) and the optimizer keeps a copy of the dict: torch writes the defaults into the
        dict it is given, so a list of groups reused for a second optimizer would carry the
        first one's options."""
        if isinstance(param_group, dict):
            param_group = dict(param_group)
            params = param_group.get("params", [])
            if not isinstance(params, (torch.Tensor, set)):
                param_group["params"] = params = list(params)  # a generator is read only once
            if hasattr(self, "defaults"):
                self._check_options([param_group])
            merged = {**self.defaults, **param_group}
            self._validate_group(merged)
            self._warn_misspelled_keys(param_group)
            if not isinstance(params, set):  # (torch refuses a set itself)
                tensors = param_tensors(params)
                check_writable(tensors)
                names = _names_given(param_group, params)
                if merged["orthogonal"]:
                    labels = None
                    if names and len(names) == len(tensors) and any(name is not None for name in names):
                        labels = [
                            f"parameter {i} of the group" if name is None else f"parameter {name!r}"
                            for i, name in enumerate(names)
                        ]
                    check_orthogonal_params(tensors, labels)
                self._check_memory_of_new(tensors, bool(merged["orthogonal"]))
                self._check_names_of_new(names, len(tensors))
            # numpy scalars as the Python numbers they hold: one arithmetic whatever the type given (a
            # float32 β₁ computed Adam's bias correction in float32), and a state_dict weights_only loads
            param_group.update((k, plain_numbers(v)) for k, v in param_group.items() if k not in NOT_NUMBERS)
            if hasattr(self, "defaults"):
                self.defaults.update((k, plain_numbers(v)) for k, v in self.defaults.items())
        super().add_param_group(param_group)

    def _check_names_of_new(self, names, count: int) -> None:
        """A new group's parameter names (:func:`_names_given`, where they line up with its
        ``count`` parameters) must differ from each other and from every name already in the
        optimizer: :meth:`orthogonality`, ``guard_stats`` and the messages key parameters by name,
        so a repeated name would hide one of them (two sub-models' ``stiefel_param_groups`` both
        name a weight ``"0.weight"``)."""
        if not names or isinstance(names, str) or len(names) != count:
            return
        seen: dict[str, str] = {}
        for i, group in enumerate(getattr(self, "param_groups", [])):
            old = group.get("param_names") or group.get("names")
            if old and len(old) == len(group["params"]):
                seen.update((n, f"group {i}") for n in old if isinstance(n, str))
        here = f"group {len(getattr(self, 'param_groups', []))}"
        for name in names:
            if not isinstance(name, str):
                continue
            if name in seen:
                where = "twice in that group" if seen[name] == here else f"in {seen[name]} and {here}"
                raise ValueError(
                    f"two parameters are named {name!r} ({where}): orthogonality(), guard_stats() and the "
                    "messages key parameters by name, so one would hide the other; give the groups distinct "
                    "names, e.g. stiefel_param_groups(model.encoder, prefix='encoder.') for groups built "
                    "from sub-modules, or build them from the whole model; nothing was added"
                )
            seen[name] = here

    def _check_memory_of_new(self, tensors: list[torch.Tensor], orthogonal: bool) -> None:
        """A new group's parameters share no memory with an orthogonal parameter or its state,
        theirs or the groups' already added (two Parameters made from one tensor, one made from
        another's momentum buffer); the step checks again."""
        old = [(p, bool(g["orthogonal"])) for g in getattr(self, "param_groups", []) for p in g["params"]]
        both = [(p, f"parameter {i} of the optimizer", o) for i, (p, o) in enumerate(old)]
        for i, (p, o) in enumerate(old):  # (the state of the steps taken so far)
            state = self.state.get(p, {}) if isinstance(p, torch.Tensor) else {}
            both += [
                (v, f"parameter {i} of the optimizer's {k}", o) for k, v in state.items() if isinstance(v, torch.Tensor)
            ]
        added = {id(p) for p, _ in old}  # (one already added: torch refuses it as in two groups)
        both += [(p, f"parameter {i} of the group", orthogonal) for i, p in enumerate(tensors) if id(p) not in added]
        both = [entry for entry in both if isinstance(entry[0], torch.Tensor) and not is_dtensor(entry[0])]
        tensors, labels, guarded = ([entry[k] for entry in both] for k in range(3))
        check_no_shared_memory(tensors, labels, guarded, outcome="the group was not added")

    def _warn_misspelled_keys(self, param_group: dict[str, Any]) -> None:
        """A group key that is no option but close to one (``"orthogonl"``) warns: torch keeps
        unknown keys (schedulers and loggers add their own), so a typo would silently leave the
        option at its default — for ``orthogonal``, the constraint off."""
        options = [*self.defaults, "params"]
        for key in param_group:  # (a key holding an option's name, max_momentum or lr0, extends it: no typo)
            if isinstance(key, str) and key not in options and not any(o in key for o in options):
                near = difflib.get_close_matches(key, options, n=1, cutoff=0.85)
                if near:
                    warnings.warn(
                        f"param group key {key!r} is not an option of {type(self).__name__} (torch keeps it, and it "
                        f"does nothing); did you mean {near[0]!r}?",
                        UserWarning,
                        stacklevel=user_stacklevel(),
                    )

    def _run_closure(self, closure: Callable[[], float] | None) -> float | None:
        """Evaluate ``closure`` with gradients enabled and re-validate every group (a
        scheduler may have changed a hyper-parameter), before anything is written."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._check_options(self.param_groups)
        for group in self.param_groups:
            self._validate_group(group, at_step=True)
        if not torch.compiler.is_compiling():
            self._warn_if_nothing_orthogonal()
        return loss

    def _warn_if_nothing_orthogonal(self) -> None:
        """Once per optimizer: a step with no orthogonal group is plain SGD (FGD's default
        momentum is 0.9, torch's SGD's 0), the mistake of ``FGD(model.parameters(), ...)``."""
        if "_said_nothing_orthogonal" in self.__dict__ or any(g["orthogonal"] for g in self.param_groups):
            return
        self._said_nothing_orthogonal = True
        name = type(self).__name__
        momentum = self.defaults.get("momentum")
        how = f" (momentum {momentum})" if isinstance(momentum, (int, float)) else ""
        warnings.warn(
            f"{name} has no orthogonal=True group: every parameter takes the unconstrained step{how}; build "
            "the groups with fgd_fast.stiefel_param_groups(model) (or mark a group orthogonal=True) to "
            "constrain the weights",
            UserWarning,
            stacklevel=user_stacklevel(),
        )

    def _check_sgd_state(self, p: torch.Tensor, label: str) -> None:
        """Before any write: a Euclidean parameter's ``momentum_buffer`` must fit it."""
        buf = self.state.get(p, {}).get("momentum_buffer")
        if buf is not None:
            check_state_tensor(buf, p, p.dtype, label, "momentum_buffer")

    def _check_orthogonal_state(self, p: torch.Tensor, group: dict[str, Any], label: str) -> None:
        """Before any write: the buffers of orthogonal ``p`` named in ``_orthogonal_buffers``
        must fit it (shape, device, the state's dtype; no inference tensor); ``None`` or absent:
        none yet (their finiteness is the step's device check).
        FGD names none: its step checks Φ itself."""
        state = self.state.get(p, {})
        for name in self._orthogonal_buffers:
            if state.get(name) is not None:
                check_state_tensor(state[name], p, state_dtype(p, group), label, name)

    def _check_state_kind(self, p: torch.Tensor, group: dict[str, Any], text: str) -> None:
        """Before any write: ``p``'s state was made under its group's present ``orthogonal``
        flag. A flag flipped between steps (an unconstrained warm-up, then the constraint) would
        read a plain momentum (gradient units) as the orthogonal step's state, or the other way
        round; ``load_state_dict`` refuses the same mismatch. Kept per parameter, outside the
        state (not saved: a loaded state's flags are checked at load)."""
        kinds = self.__dict__.setdefault("_state_kinds", WeakIdKeyDictionary())
        made = kinds.get(p)
        if made is not None and made != group["orthogonal"] and self.state.get(p):
            raise ValueError(
                f"parameter {text}: its group is orthogonal={group['orthogonal']!r} now, but its optimizer state "
                f"({', '.join(map(str, self.state[p]))}) was made under orthogonal={made!r}, where it means "
                "something else (a plain momentum is in gradient units); the step was not applied and nothing "
                "changed. Clear it to restart the momentum (opt.state[param].clear()), or set the flag back"
            )
        if made is None or made != group["orthogonal"]:  # (a weak dictionary's store costs ~1 µs: not each step)
            kinds[p] = group["orthogonal"]

    def _params_with_grads(
        self, idle: list[torch.Tensor] | None = None
    ) -> Iterator[tuple[dict[str, Any], torch.Tensor, str]]:
        """``(group, param, label)`` of every parameter with a gradient, in ``state_dict``
        order; raises (before any write) on a gradient no optimizer here can use and on state
        that does not fit its parameter (a Euclidean ``momentum_buffer``; an orthogonal one's, as
        the subclass checks it). ``idle``: a list that
        collects the orthogonal DTensor parameters without a gradient (their ranks' agreement)."""
        compiling = torch.compiler.is_compiling()
        memory = _Memory()  # what the step writes, for the shared-memory check at the end
        for group, p, key in self._keyed():
            if p.grad is None:
                if idle is not None and group["orthogonal"] and is_dtensor(p):
                    idle.append(p)
                continue
            text = label(key)
            check_grad(p, f"parameter {text}")
            if not compiling:  # (Dynamo cannot trace the weak dictionary)
                check_writable([p], [f"parameter {text}"])  # (appended to a group's list after it was added)
                memory.add(p, group, self.state.get(p, {}), text)
                self._check_state_kind(p, group, text)
            if not group["orthogonal"]:
                self._check_sgd_state(p, f"parameter {text}")
            else:  # (a Euclidean one steps as torch.optim.SGD would, on the meta device too)
                if p.dim() < 2:  # (checked when added: its .data was replaced since)
                    raise ValueError(
                        f"orthogonal parameter {text} has shape {tuple(p.shape)} now: a Stiefel constraint needs at "
                        "least 2 dims (was its .data replaced after the optimizer was built?); give it back a "
                        "matrix-shaped weight, or move it to a group without orthogonal=True; nothing changed"
                    )
                check_materialised(p, f"{type(self).__name__}.step (parameter {text})")
                self._check_orthogonal_state(p, group, f"parameter {text}")
            yield group, p, text
        if not compiling:  # (every caller collects the whole pass before writing)
            check_no_shared_memory(memory.tensors, memory.label, memory.guarded, read_only=memory.read_only)

    def _group_sgd(self, group: dict[str, Any], params: list[torch.Tensor]) -> None:
        """:meth:`_sgd` on a plain group's ``params`` with the group's momentum, dampening and
        Nesterov flag."""
        momentum, dampening = float(group["momentum"]), float(group["dampening"])
        self._sgd(params, group, momentum=momentum, dampening=dampening, nesterov=group["nesterov"])

    def _sgd(
        self,
        params: list[torch.Tensor],
        group: dict[str, Any],
        *,
        momentum: float,
        dampening: float = 0.0,
        nesterov: bool = False,
    ) -> None:
        """``torch.optim.SGD`` on Euclidean ``params`` of ``group``, Φ in ``momentum_buffer``
        (``maximize`` from the optimizer's options, where it has one)."""
        bufs = [self.state.get(p, {}).get("momentum_buffer") for p in params]
        sgd(
            params,
            [p.grad for p in params],
            bufs,
            lr=lr if isinstance(lr := group["lr"], torch.Tensor) else float(lr),  # (a GPU tensor: read on the device)
            momentum=momentum,
            dampening=dampening,
            weight_decay=float(group["weight_decay"]),
            nesterov=nesterov,
            maximize=bool(self.defaults.get("maximize", False)),
        )
        if momentum != 0.0:
            for p, buf in zip(params, bufs):
                self.state[p]["momentum_buffer"] = buf

    def _keyed(self) -> Iterator[tuple[dict[str, Any], torch.Tensor, str | int]]:
        """``(group, param, key)`` for every parameter, in ``state_dict`` order. The key of a
        parameter in a group with ``names`` / ``param_names`` is its name: the one
        ``stiefel_param_groups`` recorded for the tensor where the group lists it (right even
        when ``ZeroRedundancyOptimizer`` gave this rank a reordered subset of the group), else the
        list's entry when the list lines up with ``params``; otherwise its flat index — as the
        string ``"#i"`` when any group has names, so that the keys are of one type (also after
        ``add_param_group``), else the int ``i`` that ``state_dict`` uses."""
        named = any(g.get("param_names") or g.get("names") for g in self.param_groups)
        flat = 0
        compiling = torch.compiler.is_compiling()
        for group in self.param_groups:
            names = group.get("param_names") or group.get("names")
            listed_names = set(names) if names and not compiling else ()
            for j, p in enumerate(group["params"]):
                index = f"#{flat}" if named else flat
                if not names:
                    key = index
                else:
                    listed = names[j] if len(names) == len(group["params"]) else index
                    # (Dynamo cannot trace the WeakIdKeyDictionary; a compiled step labels by the list.) The
                    # recorded name where the group lists it (a ZeRO rank's reordered subset), else the list's:
                    # a later stiefel_param_groups call on a model holding this one renames no key of this one
                    remembered = None if compiling else remembered_name(p)
                    key = remembered if remembered in listed_names else listed
                yield group, p, key
                flat += 1

    def orthogonality(self) -> dict[str | int, float]:
        """``‖θᵀθ − I‖_F`` (float64) for every orthogonal parameter, keyed by name when the
        group has ``names`` (``stiefel_param_groups`` sets them) or torch's ``param_names``,
        else by the parameter's flat index (the index ``state_dict`` uses)."""
        return {key: stiefel_distance(p) for group, p, key in self._keyed() if group["orthogonal"]}
