"""``StiefelOptimizer``: what every optimizer of the package shares around its step.

Param groups carry ``orthogonal: bool``; a group is validated (by the subclass's
``_validate_group``) before it is added, so a bad group never enters the optimizer; every
parameter has a *key* — its name when the group has ``names`` (``stiefel_param_groups``) or
torch's ``param_names``, else its flat index (the index ``state_dict`` uses); and floating
state of float16/bfloat16 orthogonal parameters stays float32 across ``load_state_dict``.

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

from .distributed import is_dtensor
from .functional import autocast_on, autocast_set, outside_inference_mode
from .manifold import check_materialised, stiefel_distance
from .plain_sgd import sgd
from .saved_state import agree_on_saved_state, check_saved_structure, check_saved_tensor, state_dtype
from .validation import (
    check_bool,
    check_grad,
    check_no_shared_memory,
    check_orthogonal_params,
    check_state_tensor,
    check_writable,
    param_tensors,
    user_stacklevel,
)

__all__ = ["StiefelOptimizer", "label", "option", "remember_names"]

#: parameter -> name, recorded by ``stiefel_param_groups``: a group's ``names`` list no longer
#: lines up with its ``params`` once ``ZeroRedundancyOptimizer`` gives each rank a subset of
#: them (it copies the other keys of the group whole), but the tensors keep their names here
_names: WeakIdKeyDictionary = WeakIdKeyDictionary()


def remember_names(params: list[torch.Tensor], names: list[str]) -> None:
    """Record ``names[i]`` as the name of ``params[i]`` for labels and ``orthogonality()``."""
    for p, name in zip(params, names):
        _names[p] = name


def lr_on_device(lr: Any) -> bool:
    """Whether the step must not read ``lr`` on the host: a GPU tensor (a read synchronises), or
    any tensor in a compiled step."""
    return isinstance(lr, torch.Tensor) and (lr.device.type != "cpu" or torch.compiler.is_compiling())


def label(key: str | int) -> str:
    """How messages name a parameter: ``'layer.weight'`` or ``#3``."""
    if isinstance(key, str):
        return key if key.startswith("#") else repr(key)
    return f"#{key}"


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


#: group keys that hold no hyper-parameter
_NOT_NUMBERS = ("params", "names", "param_names")


def _plain(value: Any) -> Any:
    """A numpy scalar as the Python number it holds (in a tuple or list, each one); else as is."""
    if isinstance(value, (tuple, list)):
        return type(value)(_plain(v) for v in value)
    scalar = type(value).__module__ == "numpy" and getattr(value, "shape", None) == ()  # (not a user's array)
    return value.item() if scalar else value


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


class StiefelOptimizer(Optimizer):
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
            param_group.update((k, _plain(v)) for k, v in param_group.items() if k not in _NOT_NUMBERS)
            if hasattr(self, "defaults"):
                self.defaults.update((k, _plain(v)) for k, v in self.defaults.items())
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
                    remembered = None if compiling else _names.get(p)
                    key = remembered if remembered in listed_names else listed
                yield group, p, key
                flat += 1

    #: group keys a state_dict of this optimizer always has (a state_dict without them was
    #: saved by another optimizer, e.g. torch.optim.SGD, whose buffers mean something else)
    _STATE_DICT_KEYS: tuple[str, ...] = ("orthogonal",)

    def _check_saved_state(self, p: torch.Tensor, group: dict[str, Any], state: dict[str, Any], text: str) -> None:
        """Refuse saved state of ``p`` that cannot be this optimizer's (subclasses add keys)."""
        buf = state.get("momentum_buffer")
        if buf is not None:
            check_saved_tensor(buf, p, text, "momentum_buffer", state_dtype(p, group))

    def _saved_options(self, saved_groups: list[dict[str, Any]]) -> dict[str, Any]:
        """The optimizer-wide options a state_dict's groups bring (those it has), checked: the
        groups must agree on each, and each must be valid for this optimizer."""
        options = {o: saved_groups[0][o] for o in self._OPTIONS if saved_groups and o in saved_groups[0]}
        for group in saved_groups:
            for o, v in options.items():
                if group.get(o, v) != v:
                    raise ValueError(
                        f"this state_dict's groups disagree on the optimizer-wide option {o} ({v!r} in "
                        f"param_groups[0], {group.get(o)!r} in another); "
                        "it cannot be one optimizer's: load the model's weights only and start the optimizer fresh"
                    )
        try:
            self._validate_options({**self.defaults, **options})
        except (TypeError, ValueError) as exc:
            raise ValueError(
                f"cannot load this state_dict: its optimizer-wide options: {exc}; nothing was loaded"
            ) from exc
        return options

    def state_dict(self) -> dict[str, Any]:
        """As ``torch.optim``, with hyper-parameters set as numpy scalars after a group was added
        (an ``np.logspace`` sweep's lr; the constructor and ``add_param_group`` convert them)
        saved as Python numbers, so that ``torch.load``'s default ``weights_only=True`` loads the
        checkpoint."""
        out = super().state_dict()
        out["param_groups"] = [
            {k: v if k in _NOT_NUMBERS else _plain(v) for k, v in group.items()} for group in out["param_groups"]
        ]
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """As ``torch.optim``, but a state_dict that cannot be this optimizer's is refused with
        the reason (nothing changes): groups without this optimizer's keys, state tensors of
        the wrong shape, a non-floating or non-finite buffer. Optimizer-wide options saved in
        the groups are restored (missing ones, from older checkpoints, keep their current
        value); where that changes one (a checkpoint from a GPU run brings ``backend="triton"``,
        or checks that were off), a ``UserWarning`` names each change — set it again after
        loading to keep this optimizer's. The floating state of float16/bfloat16 orthogonal parameters stays float32
        (``Optimizer.load_state_dict`` casts it to the parameter's dtype). Load pre-hooks run
        first, and what they return is what is checked and loaded; post-hooks run last, after
        the options and the float32 state are in place. With sharded (DTensor) parameters the
        ranks agree on the checks' verdict (one small all-reduce per device mesh): every rank
        loads, or every rank raises. As ``torch.optim``, a loaded state tensor already of its
        parameter's dtype and device is the state_dict's own, not a copy (a later step updates
        it in place): load a ``copy.deepcopy`` to keep a checkpoint held in memory unchanged.
        Inside ``torch.inference_mode`` the state it makes is still ordinary tensors (an inference
        tensor cannot be updated in place by a later step)."""
        with outside_inference_mode():
            self._load_state_dict(state_dict)

    def _load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not isinstance(state_dict, dict):  # (before the copy: None.copy() was the error)
            check_saved_structure(state_dict)
        state_dict = state_dict.copy()  # (as torch: a hook may edit or replace it)
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = pre_hook(self, state_dict)
            if result is not None:
                state_dict = result
        # every check of the saved state, its outline and hyper-parameters included: a refusal on one
        # rank joins the ranks' agreement (with sharded parameters), so that every rank raises or none
        # does (a rank that raised alone left the others waiting in their next collective)
        failed: ValueError | None = None
        try:
            saved, saved_key, options = self._checked_saved(state_dict)
        except ValueError as error:
            failed = error
        agree_on_saved_state(failed, [p for _, p, _ in self._keyed()])
        changed = {o: (self.defaults[o], v) for o, v in options.items() if v != self.defaults[o]}
        pre_hooks, post_hooks = self._optimizer_load_state_dict_pre_hooks, self._optimizer_load_state_dict_post_hooks
        self._optimizer_load_state_dict_pre_hooks = type(pre_hooks)()  # (ran above; the post-hooks run at the end)
        self._optimizer_load_state_dict_post_hooks = type(post_hooks)()
        try:
            super().load_state_dict(state_dict)
        finally:  # (the same dicts: the hooks' handles keep working)
            self._optimizer_load_state_dict_pre_hooks = pre_hooks
            self._optimizer_load_state_dict_post_hooks = post_hooks
        for group in self.param_groups:
            for o in self._OPTIONS:
                group[o] = options.get(o, self.defaults[o])
        self.defaults.update(options)
        # torch casts every loaded state tensor but "step" to a floating parameter's dtype: integer
        # state (FGD's guard counters) keeps its own dtype, and the float32 state of a 16-bit
        # orthogonal parameter stays float32
        for index, (group, p, _) in enumerate(self._keyed()):
            if not isinstance(saved.get(saved_key(index)), dict):
                continue
            cdt = state_dtype(p, group)
            for name, value in saved[saved_key(index)].items():
                if not isinstance(value, torch.Tensor) or name == "step":
                    continue
                if not value.is_floating_point():
                    self.state[p][name] = value.to(device=p.device, copy=True)
                elif cdt != p.dtype:
                    self.state[p][name] = value.to(device=p.device, dtype=cdt, copy=True)
                elif self.state[p][name].is_inference():  # (kept as it is by torch's load: no step could
                    self.state[p][name] = self.state[p][name].clone()  # update it in place; a copy)
        self._loaded()
        self._record_state_kinds()  # (the loaded state's flags were checked against the groups')
        if changed:  # (a constructor's explicit choice replaced without a word is a surprise; warned once
            # the load is complete: a warning raised as an error leaves a whole, usable optimizer)
            what = ", ".join(f"{o} {old!r} → {new!r}" for o, (old, new) in changed.items())
            warnings.warn(
                f"load_state_dict: the state_dict's optimizer-wide options replace this optimizer's: {what}; "
                f"to keep this optimizer's, set them again after loading: {self._restore_order(changed)}",
                UserWarning,
                stacklevel=user_stacklevel(),
            )
        for post_hook in post_hooks.values():
            post_hook(self)

    def _checked_saved(self, state_dict: dict[str, Any]):
        """``load_state_dict``'s checks of ``state_dict`` (raises ``ValueError``; changes nothing):
        its saved state, the key function of its parameters, its optimizer-wide options."""
        check_saved_structure(state_dict)
        saved = state_dict["state"]
        saved_groups = state_dict["param_groups"]
        # the saved state's key of each parameter, in order: what the groups list (flat indices in a
        # torch.optim state_dict, parameter names in one from torch.distributed.checkpoint), matched by
        # position as Optimizer.load_state_dict matches them
        keys = [k for group in saved_groups for k in group.get("params", [])]
        saved_key = lambda index: keys[index] if index < len(keys) else index  # noqa: E731
        name = type(self).__name__
        for k, group in enumerate(saved_groups):
            missing = [key for key in self._STATE_DICT_KEYS if key not in group]
            if missing:
                raise ValueError(
                    f"this state_dict was not saved by {name}: its param_groups[{k}] has no "
                    f"{', '.join(map(repr, missing))} (a torch.optim.SGD state_dict, say, holds momentum in "
                    f"gradient units, not {name}'s); load the model's weights only and start the optimizer fresh"
                )
            try:
                check_bool(f"its param_groups[{k}]['orthogonal']", group["orthogonal"])
            except TypeError as exc:
                raise ValueError(f"cannot load this state_dict: {exc}; nothing was loaded") from exc
        twice = sorted({key for key in keys if keys.count(key) > 1}, key=str) if len(set(keys)) < len(keys) else []
        if twice:
            raise ValueError(
                f"cannot load this state_dict: its param_groups list the parameter key(s) {twice[:3]!r} more than "
                "once (each parameter's state is listed once); nothing was loaded. Were its keys edited?"
            )
        if len(saved_groups) != len(self.param_groups):  # (torch's own error gives no counts)
            raise ValueError(
                f"cannot load this state_dict: it has {len(saved_groups)} param group(s), this {name} "
                f"{len(self.param_groups)}; nothing was loaded. Build the optimizer with the groups the checkpoint "
                "was saved with (stiefel_param_groups(model) makes two), or load the model's weights only"
            )
        options = self._saved_options(saved_groups)
        for k, (saved_group, own) in enumerate(zip(saved_groups, self.param_groups)):
            if saved_group["orthogonal"] != own["orthogonal"]:  # (the state's meaning differs, not a setting)
                raise ValueError(
                    f"cannot load this state_dict: its param_groups[{k}] was saved with orthogonal="
                    f"{saved_group['orthogonal']!r}, this optimizer's has orthogonal={own['orthogonal']!r} "
                    f"(a Euclidean group's momentum is in gradient units, an orthogonal one's state is {name}'s "
                    "own); nothing was loaded. Build the optimizer with the groups the checkpoint was saved with, "
                    "or load the model's weights only and start the optimizer fresh"
                )
            # (torch installs the saved group whole: a hyper-parameter it lacks would be missing at
            # every later step; the optimizer-wide options are set from the saved ones)
            lacking = [k for k in self.defaults if k in own and k not in saved_group and k not in self._OPTIONS]
            if lacking:
                raise ValueError(
                    f"cannot load this state_dict: its param_groups[{k}] has no {', '.join(map(repr, lacking))}; "
                    "nothing was loaded. Put the saved value back (e.g. "
                    f"state_dict['param_groups'][{k}][{lacking[0]!r}] = opt.param_groups[{k}][{lacking[0]!r}]), "
                    "or load the model's weights only and start the optimizer fresh"
                )
            merged = {**own, **{key: v for key, v in saved_group.items() if key != "params"}, **options}
            try:  # the loaded hyper-parameters, and an orthogonal flag only on usable parameters
                self._validate_group(merged, at_step=True)  # (saved mid-schedule: momentum 0 with Nesterov)
                if merged["orthogonal"]:
                    check_orthogonal_params(param_tensors(own["params"]))
            except (TypeError, ValueError) as exc:
                raise ValueError(
                    f"cannot load this state_dict: its param_groups[{k}]: {exc}; nothing was loaded"
                ) from exc
        listed = set(keys)
        stray = [k for k in saved if k not in listed]
        if stray:
            raise ValueError(
                f"cannot load this state_dict: state_dict['state'] has entries for {stray[:3]!r}"
                f"{' …' if len(stray) > 3 else ''}, which its param_groups do not list (their state would be "
                "dropped); nothing was loaded. Was it saved for another model, or were its keys edited?"
            )
        for index, (group, p, key) in enumerate(self._keyed()):
            if saved_key(index) in saved:
                self._check_saved_state(p, group, saved[saved_key(index)], label(key))
        return saved, saved_key, options

    def _loaded(self) -> None:
        """Runs after a successful load, before the post-hooks (subclasses drop caches here)."""

    def _restore_order(self, changed: dict[str, tuple[Any, Any]]) -> str:
        """The assignments that give back this optimizer's options, in an order in which each
        one is valid (``precision`` before ``backend="reference"``, say)."""
        options, todo, steps = dict(self.defaults), dict(changed), []
        while todo:
            for o, (old, _) in todo.items():
                try:
                    self._validate_options({**options, o: old})
                except (TypeError, ValueError):
                    continue
                break
            else:  # (no order works one at a time: list them all)
                o, (old, _) = next(iter(todo.items()))
            options[o] = old
            steps.append(f"opt.{o} = {old!r}")
            del todo[o]
        return "; ".join(steps)

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        for o, default in self._OPTIONS.items():  # an optimizer pickled before an option existed
            self.defaults.setdefault(o, default)
            for group in self.param_groups:
                group.setdefault(o, self.defaults[o])
        self._record_state_kinds()  # (a copy or an unpickled optimizer: its state was made under these flags)

    def _record_state_kinds(self) -> None:
        """Take the groups' present ``orthogonal`` flags as the ones every existing state was made
        under (after a load, whose flags were checked, and in a copy or an unpickled optimizer):
        a flag flipped later is then refused at the step, as in the optimizer that made the state."""
        kinds = self.__dict__["_state_kinds"] = WeakIdKeyDictionary()
        for group in self.param_groups:
            for p in group["params"]:
                if self.state.get(p) and "orthogonal" in group:
                    kinds[p] = group["orthogonal"]

    def orthogonality(self) -> dict[str | int, float]:
        """``‖θᵀθ − I‖_F`` (float64) for every orthogonal parameter, keyed by name when the
        group has ``names`` (``stiefel_param_groups`` sets them) or torch's ``param_names``,
        else by the parameter's flat index (the index ``state_dict`` uses)."""
        return {key: stiefel_distance(p) for group, p, key in self._keyed() if group["orthogonal"]}
