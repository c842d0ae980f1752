"""The step-lifecycle facade: :class:`LossScaler`, an object over the pure core.

It holds the current state and backend and enforces the order of one training
step: scale the loss, backward, unscale each gradient group once, decide
whether to skip, (clip,) step the optimizer only if not skipping, update once.

Every ordering rule is one entry of :data:`TRANSITIONS`: for each
:class:`StepPhase` and each call, either the phase the call leads to or the
message of the :class:`~scaler_core.LifecycleError` that refuses it. A call
looks its entry up *before* doing any work, so a refused call changes nothing.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Hashable, Mapping
from types import MappingProxyType
from typing import Any, TypeVar

from . import _deprecated, _ops
from ._api import PolicyStep, policy_name, policy_result, policy_step
from ._api import update as _update
from ._backend import Backend, backend_for, get_backend
from ._coerce import norm_missing_error
from ._config import ScalerConfig
from ._errors import InvalidArgumentError, LifecycleError
from ._report import LeafReport, non_finite_leaves
from ._serialize import load_dict, to_dict
from ._state import (
    ScalerState,
    StepKind,
    host_outcome,
    start_state,
    step_skipped,
)

__all__ = ["TRANSITIONS", "Call", "LossScaler", "StepPhase", "StepReport", "check_hooks"]

T = TypeVar("T")
DEFAULT_GROUP = "default"


class StepPhase(enum.Enum):
    """Where a :class:`LossScaler` is within one training step."""

    #: No gradients checked since the last ``update()`` (or ever).
    READY = "ready"
    #: Some gradient groups unscaled or checked; the skip decision is not taken.
    CHECKING = "checking"
    #: The skip decision was read (``should_skip_step()``).
    DECIDED = "decided"
    #: ``step()`` ran (or skipped the optimizer).
    STEPPED = "stepped"


class Call(enum.Enum):
    """The facade's calls, as :data:`TRANSITIONS` names them."""

    SCALE_LOSS = "scale_loss()"
    UNSCALE = "unscale()"
    #: ``unscale()`` of a group already unscaled in this step.
    UNSCALE_AGAIN = "unscale() again"
    FIND_NON_FINITE = "find_non_finite()"
    SHOULD_SKIP_STEP = "should_skip_step()"
    STEP = "step()"
    UPDATE = "update()"
    STATE_DICT = "state_dict()"
    LOAD_STATE_DICT = "load_state_dict()"
    ABANDON_STEP = "abandon_step()"


_NO_CHECKS = (
    "No inf checks were recorded prior to {call}; call unscale(grads) or find_non_finite(grads) on "
    "this step's gradients first"
)
_AGAIN = (
    "unscale() has already been called on group {group!r} since the last update(); unscale "
    "each group once per step, after all of its gradients are accumulated (abandon_step() "
    "drops this step's checks, to start it over)"
)
_LATE = (
    "{call} was called after the skip decision of this step was taken (should_skip_step() "
    "or step()); check every group first, then decide (abandon_step() drops this step's "
    "checks, to start it over)"
)
_STEP_TWICE = (
    "step() has already been called since the last update(); call update() to end the step "
    "before stepping again"
)
_MID_STEP = (
    "{call} was called in the middle of a step (gradients were checked but update() was not "
    "called); call it after update(), or after abandon_step() if update() was refused"
)

_P = StepPhase
#: For each phase and call: the phase the call leads to, or the message refusing it.
TRANSITIONS: Mapping[StepPhase, Mapping[Call, StepPhase | str]] = MappingProxyType(
    {
        _P.READY: {
            Call.SCALE_LOSS: _P.READY,
            Call.UNSCALE: _P.CHECKING,
            Call.UNSCALE_AGAIN: _AGAIN,  # never reached: update() forgets the groups
            Call.FIND_NON_FINITE: _P.CHECKING,
            Call.SHOULD_SKIP_STEP: _NO_CHECKS,
            Call.STEP: _NO_CHECKS,
            Call.UPDATE: _NO_CHECKS,
            Call.STATE_DICT: _P.READY,
            Call.LOAD_STATE_DICT: _P.READY,
            Call.ABANDON_STEP: _P.READY,
        },
        _P.CHECKING: {
            Call.SCALE_LOSS: _P.CHECKING,
            Call.UNSCALE: _P.CHECKING,
            Call.UNSCALE_AGAIN: _AGAIN,
            Call.FIND_NON_FINITE: _P.CHECKING,
            Call.SHOULD_SKIP_STEP: _P.DECIDED,
            Call.STEP: _P.STEPPED,
            Call.UPDATE: _P.READY,
            Call.STATE_DICT: _MID_STEP,
            Call.LOAD_STATE_DICT: _MID_STEP,
            Call.ABANDON_STEP: _P.READY,
        },
        _P.DECIDED: {
            Call.SCALE_LOSS: _P.DECIDED,
            Call.UNSCALE: _LATE,
            Call.UNSCALE_AGAIN: _AGAIN,
            Call.FIND_NON_FINITE: _LATE,
            Call.SHOULD_SKIP_STEP: _P.DECIDED,
            Call.STEP: _P.STEPPED,
            Call.UPDATE: _P.READY,
            Call.STATE_DICT: _MID_STEP,
            Call.LOAD_STATE_DICT: _MID_STEP,
            Call.ABANDON_STEP: _P.READY,
        },
        _P.STEPPED: {
            Call.SCALE_LOSS: _P.STEPPED,
            Call.UNSCALE: _LATE,
            Call.UNSCALE_AGAIN: _AGAIN,
            Call.FIND_NON_FINITE: _LATE,
            Call.SHOULD_SKIP_STEP: _P.STEPPED,
            Call.STEP: _STEP_TWICE,
            Call.UPDATE: _P.READY,
            Call.STATE_DICT: _MID_STEP,
            Call.LOAD_STATE_DICT: _MID_STEP,
            Call.ABANDON_STEP: _P.READY,
        },
    }
)


@dataclasses.dataclass(frozen=True)
class StepReport:
    """What one step did, handed to ``on_step`` after each :meth:`LossScaler.update`.

    Nothing here has been read back from a device: ``found``, ``grad_norm`` and
    the state's fields stay where they were computed, so building the report
    costs no host synchronisation; reading :attr:`kind` or :attr:`scale` on a
    device state does (once, when you read it).

    Attributes:
        state: The state after the step.
        found: The step's skip flag for non-finite gradients (after any reduction).
        grad_norm: The global L2 norm of the unscaled gradients, when the step
            computed one (:meth:`LossScaler.unscale_and_clip`,
            :meth:`LossScaler.unscale_and_norm`), else ``None``.
        leaves: With ``report_leaves=True``, the non-finite leaves of the
            step's gradients (only looked for on a step that found some).
    """

    state: ScalerState
    found: Any
    grad_norm: Any
    leaves: tuple[LeafReport, ...] = ()

    @property
    def kind(self) -> StepKind | None:
        """The :class:`StepKind` of the step (reads one value from a device state)."""
        return self.state.last_step

    @property
    def scale(self) -> float:
        """The scale after the step, as a Python float (reads it from a device)."""
        return self.state.current_scale()


def check_hooks(on_step: object, report_leaves: object) -> None:
    """Refuse a scaler's per-step hooks that cannot serve: ``on_step`` a callable taking
    a :class:`StepReport` (or ``None``), ``report_leaves`` a bool. The facade and the
    PyTorch drop-in take the same two.

    Raises:
        InvalidArgumentError: Either is something else.
    """
    if on_step is not None and not callable(on_step):
        raise InvalidArgumentError(
            f"on_step={on_step!r}, but it must be a callable taking a StepReport (or None)"
        )
    if not isinstance(report_leaves, bool):
        raise InvalidArgumentError(f"report_leaves={report_leaves!r}, but it must be a bool")


def _combined_norm(backend: Backend, norms: list[Any]) -> Any:
    """The L2 norm of several gradient groups from their norms (0-d float32 arrays).

    It is the norm of the vector of the groups' norms, so it is computed as each
    group's norm was: by the measuring pass at scale 1 (which writes nothing),
    squares summed in float64 where the library has it and rounded once. Squaring
    the float32 norms in float32 instead overflows above about ``1.8e19`` and
    flushes below about ``1e-19``.
    """
    _, _, total = _ops.unscale_and_norm(backend, [n.reshape(1) for n in norms], 1.0)
    return total


class LossScaler:
    """Holds a scaler's state and enforces the order of a training step.

    The framework-agnostic facade, for any backend (it was called ``GradScaler``;
    that name still works, deprecated). For PyTorch's own API (``scale(outputs)``,
    ``unscale_(optimizer)``, ``step(optimizer)``) use the drop-in
    ``scaler_core.torch.GradScaler``.

    Several gradient groups (one per optimizer, say) are unscaled separately;
    their flags are OR-ed, as are the flags of :meth:`find_non_finite` calls on
    gradient-accumulation micro-batches. One :meth:`update` ends the step.

    Args:
        config: The policy; PyTorch's defaults when omitted.
        backend: A backend name or object; ``None`` picks it from the first
            gradients passed to :meth:`unscale` or :meth:`find_non_finite`.
        state: Resume from this state (its config wins over ``config``).
        reduce_found: For data parallelism: a function that OR-reduces a found
            flag across replicas with the framework's own collective (mpi4py,
            NCCL, JAX). Applied once per step, to the OR of the local groups,
            before the skip decision and the update; every replica must call
            :meth:`should_skip_step` / :meth:`update` in the same order.
        policy: Your own transition ``policy(state, found) -> state`` (a pure
            function; see "Testing your own policy" in docs/policies.md), used by
            :meth:`update` instead of :func:`scaler_core.update`. With spike
            skipping on it is called as ``policy(state, found, grad_norm)`` with
            the step's norm; a two-argument policy runs there too, with the spike
            decision left to :func:`scaler_core.update` (docs/policies.md says how).
        on_step: Called once per :meth:`update`, after the state advanced, with
            a :class:`StepReport` (the step's kind, norm, scale, flag): log skips
            and backoffs there. It runs no host synchronisation of its own.
        report_leaves: On a step whose gradients hold NaN or inf, find which
            leaves (:func:`scaler_core.non_finite_leaves`) and put them in the
            report. Costs one more read of the gradients, only on such steps (and,
            for a device flag, one host read of the flag per unscale).

    >>> import numpy as np
    >>> scaler = LossScaler()
    >>> grads = {"w": np.array([65536.0, -131072.0], np.float32)}
    >>> grads = scaler.unscale(grads)
    >>> grads["w"].tolist(), scaler.should_skip_step()
    ([1.0, -2.0], False)
    >>> _ = scaler.update()
    >>> scaler.state.steps
    1
    """

    def __init__(  # noqa: PLR0913 - keyword-only options (PyTorch's GradScaler has six)
        self,
        config: ScalerConfig | None = None,
        *,
        backend: str | Backend | None = None,
        state: ScalerState | None = None,
        reduce_found: Callable[[Any], Any] | None = None,
        policy: Callable[..., ScalerState] | None = None,
        on_step: Callable[[StepReport], Any] | None = None,
        report_leaves: bool = False,
    ) -> None:
        self._state = start_state(config, state)
        if policy is not None and not callable(policy):
            raise InvalidArgumentError(
                f"policy={policy!r}, but it must be a callable policy(state, found) -> state "
                f"(or None for scaler_core.update)"
            )
        self._policy = policy
        self._step = self._policy_step(self._state.config)  # refuses a policy before any step
        check_hooks(on_step, report_leaves)
        self._on_step = on_step
        self._report_leaves = report_leaves
        self._norms: dict[Hashable, Any] = {}
        self._leaves: list[LeafReport] = []
        self._last: StepReport | None = None
        self._backend = None if backend is None else get_backend(backend)
        if reduce_found is not None and not callable(reduce_found):
            raise InvalidArgumentError(
                f"reduce_found={reduce_found!r}, but it must be a callable taking and "
                f"returning a found flag (or None)"
            )
        self._reduce_found = reduce_found
        self._phase = StepPhase.READY
        self._reduced: Any = None  # this step's flag once reduced (the decision)
        self._flags: dict[Hashable, Any] = {}
        self._unscaled: set[Hashable] = set()

    # ----------------------------------------------------------------- reading
    @property
    def config(self) -> ScalerConfig:
        """The policy (static)."""
        return self._state.config

    @property
    def state(self) -> ScalerState:
        """The current immutable state."""
        return self._state

    def current_scale(self) -> float:
        """The current scale as a Python float (raises a recorded collapse)."""
        return self._state.current_scale()

    @property
    def scale(self) -> float:
        """Deprecated: :meth:`current_scale` (``.scale`` of PyTorch's scaler multiplies)."""
        _deprecated.warn("LossScaler.scale", "LossScaler.current_scale()")
        return self.current_scale()

    @property
    def phase(self) -> StepPhase:
        """Where the scaler is within the current step (see :data:`TRANSITIONS`)."""
        return self._phase

    @property
    def backend(self) -> Backend | None:
        """The backend in use, once known."""
        return self._backend

    @property
    def found_non_finite(self) -> Any:
        """The OR of this step's local flags so far (a device value), or ``None``."""
        if not self._flags:
            return None
        return self._backend_for(None).any(*self._flags.values())

    @property
    def grad_norm(self) -> Any:
        """This step's global norm of the unscaled gradients so far (a device value), or
        ``None`` when no call computed one. Several groups combine as one vector would:
        the norm of the groups' norms, by the backend's own norm kernel (float64 sums
        where the library has them), so two groups of norm ``3e19`` give ``4.24e19``,
        not inf, and two of ``1e-23`` give ``1.41e-23``, not 0."""
        norms = list(self._norms.values())
        if not norms:
            return None
        if len(norms) == 1:
            return norms[0]
        return _combined_norm(self._backend_for(None), norms)

    @property
    def last_report(self) -> StepReport | None:
        """The :class:`StepReport` of the last :meth:`update`, or ``None`` before one."""
        return self._last

    def _step_found(self) -> Any:
        """This step's flag, reduced across replicas once if ``reduce_found`` is set."""
        if self._reduced is None:
            found = self.found_non_finite
            self._reduced = found if self._reduce_found is None else self._reduce_found(found)
        return self._reduced

    # ------------------------------------------------------------------- steps
    def scale_loss(self, loss: T) -> T:
        """``loss * scale``: backpropagate this instead of ``loss``."""
        self._next(Call.SCALE_LOSS)
        return self._backend_for(loss, "loss").scale_loss(loss, self._state.scale)  # type: ignore[no-any-return]

    def unscale(self, grads: T, group: Hashable = DEFAULT_GROUP) -> T:
        """Unscale one group's gradients (in place where the library allows).

        Call once per group per step, after all its gradients are accumulated.

        Returns:
            The unscaled gradients (the same objects for NumPy and CuPy).

        Raises:
            LifecycleError: ``group`` was already unscaled since the last update,
                or the skip decision of this step was already taken. Nothing
                is unscaled then.
        """
        phase = self._next(Call.UNSCALE_AGAIN if group in self._unscaled else Call.UNSCALE, group)
        backend = self._backend_for(grads)
        grads, found = _ops.unscale(backend, grads, self._state.scale)
        self._unscaled.add(group)
        self._record(backend, group, found, phase, grads)
        return grads

    def unscale_and_norm(self, grads: T, group: Hashable = DEFAULT_GROUP) -> T:
        """:meth:`unscale`, also giving the group's norm in the same pass (:attr:`grad_norm`).

        Raises:
            LifecycleError: As :meth:`unscale`.
        """
        phase = self._next(Call.UNSCALE_AGAIN if group in self._unscaled else Call.UNSCALE, group)
        backend = self._backend_for(grads)
        grads, found, norm = _ops.unscale_and_norm(backend, grads, self._state.scale)
        self._unscaled.add(group)
        self._norms[group] = norm
        self._record(backend, group, found, phase, grads)
        return grads

    def unscale_and_clip(self, grads: T, max_norm: float, group: Hashable = DEFAULT_GROUP) -> T:
        """Unscale the last group of the step, decide, and clip it to ``max_norm`` if stepping.

        The step's decision is taken here, from this group's flag OR-ed with the
        groups checked before it (reduced across replicas with ``reduce_found``):
        on a skipped step nothing is written (the gradients keep their scaled
        values); otherwise they are unscaled and clipped in one more pass, with
        PyTorch's ``clip_grad_norm_`` coefficient. Two reads and one write of each
        gradient at most. The norm before clipping is :attr:`grad_norm`. Then
        :meth:`step` and :meth:`update` as usual.

        Raises:
            LifecycleError: As :meth:`unscale`.
            InvalidArgumentError: ``max_norm`` is not a positive finite number.
        """
        phase = self._next(Call.UNSCALE_AGAIN if group in self._unscaled else Call.UNSCALE, group)
        decided = TRANSITIONS[phase][Call.SHOULD_SKIP_STEP]
        if isinstance(decided, str):  # not so in the table: a decision follows a check
            raise LifecycleError(decided.format(call=Call.SHOULD_SKIP_STEP.value, group=group))
        backend = self._backend_for(grads)

        def decide(found: Any) -> Any:
            # Between the read and the write: this group's flag joins the step's, and
            # the step's (reduced across replicas once) decides whether to write.
            self._record(backend, group, found, phase, grads)
            self._reduced = None
            return self._step_found()

        grads, _, norm = _ops.unscale_and_clip(backend, grads, self._state.scale, max_norm, decide)
        self._unscaled.add(group)
        self._norms[group] = norm
        self._phase = decided
        return grads

    def find_non_finite(self, grads: Any, group: Hashable = DEFAULT_GROUP) -> Any:
        """Check gradients for NaN/inf without unscaling; may be called many times.

        For gradient-accumulation micro-batches, static scales and bfloat16:
        every call's flag is OR-ed into ``group``'s.

        Returns:
            This call's flag (a device value).

        Raises:
            LifecycleError: The skip decision of this step was already taken.
        """
        phase = self._next(Call.FIND_NON_FINITE, group)
        backend = self._backend_for(grads)
        found = _ops.find_non_finite(backend, grads)
        self._record(backend, group, found, phase, grads)
        return found

    def should_skip_step(self) -> bool:
        """Whether this step is skipped (a host synchronisation): its gradients held
        NaN/inf, with spike skipping on its norm is a spike, or its update will be
        refused (:func:`scaler_core.step_skipped` of the state the update gives).

        Clip and step the optimizer only when this is false.

        Raises:
            LifecycleError: No gradients were checked in this step.
            ScaleCollapseError: A device transition recorded a failure in the
                state (``SkipLimitError`` for the skip limit); nothing changes.
            InvalidArgumentError: Spike skipping is on and no call of this step
                computed a norm (use :meth:`unscale_and_norm` or
                :meth:`unscale_and_clip`).
        """
        phase = self._next(Call.SHOULD_SKIP_STEP)
        found = self._backend_for(None).to_bool(self._step_found())
        norm = None
        if self.config.spike_threshold is not None:
            norm = self.grad_norm
            if norm is None:
                raise norm_missing_error(self.config)
            norm = float(norm)
        # A host-side look: a failure a device transition recorded raises here.
        state = self._state.to_host()
        # The shared rule, over the state this step's update would give (a step the
        # update would refuse is skipped: its failure is recorded, not raised, here).
        skip: bool = step_skipped(host_outcome(state, found, norm))
        self._phase = phase
        return skip

    def step(self, optimizer_step: Callable[..., T], *args: Any, **kwargs: Any) -> T | None:
        """Call ``optimizer_step(*args, **kwargs)`` unless the step is skipped.

        Returns:
            Its return value, or ``None`` when skipped.

        Raises:
            LifecycleError: No gradients were checked, or step() already ran
                since the last update().
        """
        phase = self._next(Call.STEP)
        skip = self.should_skip_step()
        self._phase = phase
        return None if skip else optimizer_step(*args, **kwargs)

    def abandon_step(self) -> None:
        """Drop this step's checks and decision, keeping the state: the way out of a refusal.

        After :meth:`update` refused a step (``ScaleCollapseError``,
        ``SkipLimitError``), the step's flags are kept, so ``update()`` refuses again;
        abandon the step, then resume from a checkpoint (:meth:`load_state_dict`),
        fix the cause, or start the next step. Allowed in every phase; nothing else
        changes (the scale and the counters are those before the step).
        """
        phase = self._next(Call.ABANDON_STEP)
        self._forget_step()
        self._phase = phase

    def update(self) -> ScalerState:
        """End the step: advance the state with the OR of this step's flags (and,
        with spike skipping on, its :attr:`grad_norm`), by the policy.

        Raises:
            LifecycleError: No gradients were checked in this step.
            ScaleCollapseError: The step was refused (fail-closed); the scaler
                keeps its previous state and this step's flags (see
                :meth:`abandon_step`).
            InvalidArgumentError: Spike skipping is on and no call of this step
                computed a norm.
            InvalidStateError: The policy returned something other than a
                :class:`ScalerState`; the scaler keeps its previous state.
        """
        phase = self._next(Call.UPDATE)
        found, norm = self._step_found(), self.grad_norm
        new = self._step(self._state, found, norm)
        if self._policy is not None:
            new = policy_result(policy_name(self._policy), new)
        self._state = new
        self._last = StepReport(new, found, norm, tuple(self._leaves))
        self._forget_step()
        self._phase = phase
        if self._on_step is not None:
            self._on_step(self._last)
        return self._state

    # ------------------------------------------------------------------ saving
    def state_dict(self) -> dict[str, Any]:
        """The state as a JSON-safe dict (see :func:`scaler_core.to_dict`), checked as
        :meth:`load_state_dict` will check it, so what is saved can be loaded.

        Raises:
            LifecycleError: Called mid-step (checks recorded but not updated).
            InvalidStateError: The state holds a field no load would accept (a state
                given by hand or returned by a policy); the message is the load's.
            ScaleCollapseError: A device transition recorded a failure.
        """
        self._next(Call.STATE_DICT)
        return to_dict(self._state)

    def load_state_dict(self, data: dict[str, Any]) -> None:
        """Replace the state with a validated one; nothing changes on error.

        Reads every dict :func:`scaler_core.from_dict` reads: this class's
        :meth:`state_dict` (a scaler-core checkpoint, with its own config);
        ``torch.amp.GradScaler.state_dict()``, whose scale, factors, interval and
        growth tracker replace this scaler's while every knob PyTorch lacks (floor,
        ceiling, hysteresis, skip limit, spike skipping) stays this scaler's
        :attr:`config`, as ``scaler_core.torch.GradScaler`` loads it; and
        ``scaler_core.torch.GradScaler.state_dict()``, as that class loads it.

        Raises:
            InvalidStateError: ``data`` is malformed or out of range (for PyTorch's
                dict: against this scaler's config, such as a scale below its
                ``min_scale``).
            InvalidArgumentError: The policy cannot be called as its config
                needs (spike skipping on or off).
            LifecycleError: Called mid-step.
        """
        self._next(Call.LOAD_STATE_DICT)
        state = load_dict(data, self._state.config)
        # A checkpoint may turn spike skipping on or off: the policy is called anew.
        self._step = self._policy_step(state.config)
        self._state = state

    def __repr__(self) -> str:
        return f"LossScaler(state={self._state!r})"

    # ---------------------------------------------------------------- internal
    def _policy_step(self, config: ScalerConfig) -> PolicyStep:
        if self._policy is None:
            return _update
        return policy_step(policy_name(self._policy), config, self._policy)

    def _backend_for(self, values: Any, what: str = "grads") -> Backend:
        if self._backend is None:
            if values is None:
                return get_backend()
            self._backend = backend_for(values, root=what)
        return self._backend

    def _next(self, call: Call, group: Hashable = DEFAULT_GROUP) -> StepPhase:
        """The phase ``call`` leads to; raises the table's refusal before any work."""
        outcome = TRANSITIONS[self._phase][call]
        if isinstance(outcome, str):
            raise LifecycleError(outcome.format(call=call.value, group=group))
        return outcome

    def _record(
        self, backend: Backend, group: Hashable, found: Any, phase: StepPhase, grads: Any
    ) -> None:
        previous = self._flags.get(group)
        self._flags[group] = found if previous is None else backend.any(previous, found)
        self._phase = phase
        if self._report_leaves and backend.to_bool(found):
            self._leaves.extend(non_finite_leaves(grads, backend=backend))

    def _forget_step(self) -> None:
        self._reduced = None
        self._flags.clear()
        self._unscaled.clear()
        self._norms.clear()
        self._leaves.clear()
