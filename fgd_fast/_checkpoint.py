"""The optimizers' checkpoints: ``state_dict`` with plain numbers, and ``load_state_dict`` that
checks a state_dict whole before loading any of it (its outline, groups, options and every state
tensor, the ranks agreeing with sharded parameters), restores the optimizer-wide options and keeps
the float32 state of 16-bit orthogonal parameters. A mixin of
:class:`fgd_fast._stiefel_optimizer.StiefelOptimizer`, whose subclasses add their own state's
checks (``_check_saved_state``) and caches to drop (``_loaded``)."""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

from ._naming import label
from .functional import outside_inference_mode
from .saved_state import agree_on_saved_state, check_saved_structure, check_saved_tensor, state_dtype
from .validation import check_bool, check_orthogonal_params, param_tensors, user_stacklevel

__all__ = ["CheckpointMixin", "NOT_NUMBERS", "plain_numbers"]

#: group keys that hold no hyper-parameter
NOT_NUMBERS = ("params", "names", "param_names")


def plain_numbers(value: Any) -> Any:
    """A numpy scalar as the Python number it holds (in a tuple or list, each one); else as is."""
    if isinstance(value, (tuple, list)):
        return type(value)(plain_numbers(v) for v in value)
    scalar = type(value).__module__ == "numpy" and getattr(value, "shape", None) == ()  # (not a user's array)
    return value.item() if scalar else value


class CheckpointMixin:
    """``state_dict``/``load_state_dict`` and what a copy or an unpickled optimizer restores."""

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
            {k: v if k in NOT_NUMBERS else plain_numbers(v) for k, v in group.items()} for group in out["param_groups"]
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
