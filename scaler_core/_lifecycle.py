"""The step-lifecycle facade: a ``GradScaler``-style object over the pure core.

It holds the current state and backend and enforces the order of one training
step: scale the loss, backward, unscale each gradient group once, decide
whether to skip, (clip,) step the optimizer only if not skipping, update once.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any, TypeVar

from ._api import update as _update
from ._backend import Backend, backend_for, get_backend
from ._config import ScalerConfig
from ._errors import InvalidStateError, LifecycleError
from ._serialize import from_dict, to_dict
from ._state import ScalerState, start_state

__all__ = ["GradScaler"]

T = TypeVar("T")
DEFAULT_GROUP = "default"


class GradScaler:
    """Holds a scaler's state and enforces the order of a training step.

    Several gradient groups (one per optimizer, say) are unscaled separately;
    their flags are OR-ed, as are the flags of :meth:`detect` calls on
    gradient-accumulation micro-batches. One :meth:`update` ends the step.

    Args:
        config: The policy; PyTorch's defaults when omitted.
        backend: A backend name or object; ``None`` picks it from the first
            gradients passed to :meth:`unscale` or :meth:`detect`.
        state: Resume from this state (its config wins over ``config``).
        reduce_found: For data parallelism: a function that OR-reduces a found
            flag across replicas with the framework's own collective (mpi4py,
            NCCL, JAX). Applied once per step, to the OR of the local groups,
            before the skip decision and the update; every replica must call
            :meth:`should_skip_step` / :meth:`update` in the same order.
        policy: Your own transition ``policy(state, found) -> state`` (a pure
            function; see "Testing your own policy" in the README), used by
            :meth:`update` instead of :func:`scaler_core.update`.

    >>> import numpy as np
    >>> scaler = GradScaler()
    >>> grads = {"w": np.array([65536.0, -131072.0], np.float32)}
    >>> grads = scaler.unscale(grads)
    >>> grads["w"].tolist(), scaler.should_skip_step()
    ([1.0, -2.0], False)
    >>> _ = scaler.update()
    >>> scaler.state.steps
    1
    """

    def __init__(
        self,
        config: ScalerConfig | None = None,
        *,
        backend: str | Backend | None = None,
        state: ScalerState | None = None,
        reduce_found: Callable[[Any], Any] | None = None,
        policy: Callable[[ScalerState, Any], ScalerState] | None = None,
    ) -> None:
        self._state = start_state(config, state)
        self._backend = None if backend is None else get_backend(backend)
        if reduce_found is not None and not callable(reduce_found):
            raise InvalidStateError(
                f"reduce_found={reduce_found!r}, but it must be a callable taking and "
                f"returning a found flag (or None)"
            )
        self._reduce_found = reduce_found
        if policy is not None and not callable(policy):
            raise InvalidStateError(
                f"policy={policy!r}, but it must be a callable policy(state, found) -> state "
                f"(or None for scaler_core.update)"
            )
        self._policy = _update if policy is None else policy
        self._reduced: Any = None
        self._flags: dict[Hashable, Any] = {}
        self._unscaled: set[Hashable] = set()
        self._stepped = False

    # ----------------------------------------------------------------- reading
    @property
    def config(self) -> ScalerConfig:
        """The policy (static)."""
        return self._state.config

    @property
    def state(self) -> ScalerState:
        """The current immutable state."""
        return self._state

    @property
    def scale(self) -> float:
        """The current scale as a Python float (raises a recorded collapse)."""
        return self._state.current_scale()

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

    def _step_found(self) -> Any:
        """This step's flag, reduced across replicas once if ``reduce_found`` is set."""
        if self._reduced is None:
            found = self.found_non_finite
            self._reduced = found if self._reduce_found is None else self._reduce_found(found)
        return self._reduced

    # ------------------------------------------------------------------- steps
    def scale_loss(self, loss: T) -> T:
        """``loss * scale``: backpropagate this instead of ``loss``."""
        return self._backend_for(loss).scale_loss(loss, self._state.scale)  # type: ignore[no-any-return]

    def unscale(self, grads: T, group: Hashable = DEFAULT_GROUP) -> T:
        """Unscale one group's gradients (in place where the library allows).

        Call once per group per step, after all its gradients are accumulated.

        Returns:
            The unscaled gradients (the same objects for NumPy and CuPy).

        Raises:
            LifecycleError: ``group`` was already unscaled since the last update.
        """
        if group in self._unscaled:
            raise LifecycleError(
                f"unscale() has already been called on group {group!r} since the last "
                f"update(); unscale each group once per step, after all of its gradients "
                f"are accumulated"
            )
        backend = self._backend_for(grads)
        grads, found = backend.unscale(grads, self._state.scale)
        self._unscaled.add(group)
        self._record(backend, group, found)
        return grads

    def detect(self, grads: Any, group: Hashable = DEFAULT_GROUP) -> Any:
        """Check gradients for NaN/inf without unscaling; may be called many times.

        For gradient-accumulation micro-batches, static scales and bfloat16:
        every call's flag is OR-ed into ``group``'s.

        Returns:
            This call's flag (a device value).
        """
        backend = self._backend_for(grads)
        found = backend.find_non_finite(grads)
        self._record(backend, group, found)
        return found

    def should_skip_step(self) -> bool:
        """Whether this step's gradients held NaN/inf (a host synchronisation).

        Clip and step the optimizer only when this is false.

        Raises:
            LifecycleError: No gradients were checked in this step.
        """
        self._need_checks("should_skip_step()")
        return self._backend_for(None).to_bool(self._step_found())

    def step(self, optimizer_step: Callable[..., T], *args: Any, **kwargs: Any) -> T | None:
        """Call ``optimizer_step(*args, **kwargs)`` unless the step is skipped.

        Returns:
            Its return value, or ``None`` when skipped.

        Raises:
            LifecycleError: No gradients were checked, or step() already ran
                since the last update().
        """
        if self._stepped:
            raise LifecycleError(
                "step() has already been called since the last update(); call update() "
                "to end the step before stepping again"
            )
        skip = self.should_skip_step()
        self._stepped = True
        return None if skip else optimizer_step(*args, **kwargs)

    def update(self) -> ScalerState:
        """End the step: advance the state with the OR of this step's flags.

        Raises:
            LifecycleError: No gradients were checked in this step.
            ScaleCollapseError: The step was refused (fail-closed); the scaler
                keeps its previous state and this step's flags.
        """
        self._need_checks("update()")
        new = self._policy(self._state, self._step_found())
        if not isinstance(new, ScalerState):
            raise InvalidStateError(
                f"policy {self._policy!r} returned {new!r}, but it must return a ScalerState "
                f"(build it with dataclasses.replace(state, ...))"
            )
        self._state = new
        self._reduced = None
        self._flags.clear()
        self._unscaled.clear()
        self._stepped = False
        return self._state

    # ------------------------------------------------------------------ saving
    def state_dict(self) -> dict[str, Any]:
        """The state as a JSON-safe dict (see :func:`scaler_core.to_dict`).

        Raises:
            LifecycleError: Called mid-step (checks recorded but not updated).
        """
        if self._flags:
            raise LifecycleError(
                "state_dict() was called in the middle of a step (gradients were checked "
                "but update() was not called); save after update()"
            )
        return to_dict(self._state)

    def load_state_dict(self, data: dict[str, Any]) -> None:
        """Replace the state with a validated one; nothing changes on error.

        Raises:
            InvalidStateError: ``data`` is malformed or out of range.
            LifecycleError: Called mid-step.
        """
        if self._flags:
            raise LifecycleError(
                "load_state_dict() was called in the middle of a step; call update() "
                "first, or build a new GradScaler"
            )
        self._state = from_dict(data)

    def __repr__(self) -> str:
        return f"GradScaler(state={self._state!r})"

    # ---------------------------------------------------------------- internal
    def _backend_for(self, values: Any) -> Backend:
        if self._backend is None:
            if values is None:
                return get_backend("numpy")
            self._backend = backend_for(values)
        return self._backend

    def _record(self, backend: Backend, group: Hashable, found: Any) -> None:
        if self._reduced is not None:
            raise LifecycleError(
                "gradients were checked after the skip decision of this step was taken "
                "(should_skip_step() or step()); check every group first, then decide"
            )
        previous = self._flags.get(group)
        self._flags[group] = found if previous is None else backend.any(previous, found)

    def _need_checks(self, what: str) -> None:
        if not self._flags:
            raise LifecycleError(
                f"No inf checks were recorded prior to {what}; call unscale(grads) or "
                f"detect(grads) on this step's gradients first"
            )
