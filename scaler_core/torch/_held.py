"""The drop-in's scaler-core state, kept over its two routes: the machine the class asks.

PyTorch's ``GradScaler`` holds two tensors, ``_scale`` and ``_growth_tracker``, which
PyTorch's own code (and frameworks) read and write; every other field of a
:class:`~scaler_core.ScalerState` (hysteresis, skip counters, the failure code) is
a 0-d tensor beside them on the scale's device, held here. Where the scale lives
decides the route, once (:func:`~scaler_core.backends.torch_kernels.reads_free`):

* the host route (the CPU): values cost nothing to read, so the transition runs on
  the host, a refused step raises in ``update``, and the state of the last update
  is kept as a host copy (read again only if code wrote the two tensors directly);
* the device route (an accelerator): the transition runs on the device with nothing
  read back, a refused step is recorded in the failure code, and every later step
  is skipped until a checkpoint is loaded.

:class:`HeldState` knows nothing of optimizers or of PyTorch's call order; the
drop-in hands it the two tensors and the step's flags and asks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any

import torch

from .._backend import get_backend
from .._config import ScalerConfig
from .._f32 import f32
from .._state import DATA_FIELDS, FLOAT_FIELDS, ScalerState, host_update, init
from ..backends import torch_kernels as kernels
from ._plan import Plans

__all__ = ["HeldState"]

#: The state fields beyond PyTorch's two tensors (``_scale``, ``_growth_tracker``).
_EXTRA = tuple(name for name in DATA_FIELDS if name not in ("scale", "growth_tracker"))


class HeldState:
    """A drop-in's policy and state: a host state until the scale's tensors exist, then
    tensors beside them (and, on the host route, a copy of the last update's state).

    Args:
        start: The state to start from (its config is the policy).
    """

    __slots__ = ("behind", "config", "extra", "inverse_of", "mirror", "start")

    def __init__(self, start: ScalerState) -> None:
        self.config: ScalerConfig = start.config
        #: The host state the tensors are made from (and, before they exist, the state).
        self.start = start
        #: The fields beyond PyTorch's two, as 0-d tensors on the scale's device.
        self.extra: dict[str, torch.Tensor] | None = None
        #: On the host route, the state at the last update (see :meth:`current`).
        self.mirror: ScalerState | None = None
        #: Whether :attr:`extra` is behind :attr:`mirror`: the host route writes
        #: PyTorch's two tensors at each update and the others only when read.
        self.behind = False
        #: The last inverse scale made: the scale tensor (held, so its identity is
        #: never another's), its version then, the inverse.
        self.inverse_of: tuple[torch.Tensor, int, torch.Tensor] | None = None

    @classmethod
    def of(cls, config: ScalerConfig) -> HeldState:
        """A fresh state under ``config``."""
        return cls(init(config))

    @staticmethod
    def unpickled(state: dict[str, Any]) -> dict[str, Any]:
        """A pickled drop-in's ``__dict__`` as the drop-in holds it now: one pickled
        before its state was held apart (``_start``, ``_extra``, ``_mirror``,
        ``_config``) gets it held here, and no plan (see :mod:`._plan`)."""
        state = dict(state)
        start = state.pop("_start", None)
        for old in ("_extra", "_mirror", "_config"):
            state.pop(old, None)
        if "_held" not in state:
            state["_held"] = None if start is None else HeldState(start)
        state.setdefault("_plans", Plans())
        return state

    def detached(self, state: ScalerState) -> HeldState:
        """A copy holding ``state`` on the host and no tensor (for pickling)."""
        return HeldState(state)

    # ------------------------------------------------------------------ reading
    def attach(self, device: torch.device) -> None:
        """Make the fields' tensors on ``device``, from :attr:`start` (PyTorch's lazy
        init has just made its two)."""
        start = self.start
        self.extra = {
            name: torch.full(
                (),
                getattr(start, name),
                dtype=torch.float32 if name in FLOAT_FIELDS else torch.int32,
                device=device,
            )
            for name in _EXTRA
        }

    def device_state(self, scale: torch.Tensor, tracker: torch.Tensor) -> ScalerState:
        """The state as it lives: 0-d tensors on the scale's device (brought up to
        date first where the host route left them behind)."""
        extra: Any = self.extra
        if self.behind:
            self.behind = False
            mirror = self.mirror
            for name in _EXTRA:
                extra[name].fill_(getattr(mirror, name))
        return ScalerState(self.config, scale, tracker, **extra)

    def read(
        self,
        scale: torch.Tensor | None,
        tracker: torch.Tensor | None,
        initial: tuple[float, int],
    ) -> ScalerState:
        """The state on the host (before the tensors exist: the start, with the
        ``initial`` scale and growth tracker PyTorch's lazy init will make them from)."""
        if scale is None or tracker is None or self.extra is None:
            return dataclasses.replace(self.start, scale=f32(initial[0]), growth_tracker=initial[1])
        return self.device_state(scale, tracker).to_host()

    def raise_recorded(self, scale: torch.Tensor | None, tracker: torch.Tensor | None) -> None:
        """Raise a failure recorded on the device (one host read of its code)."""
        extra = self.extra
        if scale is None or tracker is None or not extra:
            return
        failure = (
            self.mirror.failure if self.behind and self.mirror else int(extra["failure"].item())
        )
        if failure:
            self.device_state(scale, tracker).check()

    def inverse(self, scale: torch.Tensor) -> torch.Tensor:
        """``1 / scale`` as PyTorch's ``unscale_`` makes it (in float64, then float32),
        kept while the scale tensor is the same and unwritten (its version counter,
        which every in-place write bumps; no value is read)."""
        kept = self.inverse_of
        if kept is None or kept[0] is not scale or kept[1] != scale._version:
            kept = self.inverse_of = (scale, scale._version, scale.double().reciprocal().float())
        return kept[2]

    @staticmethod
    def host_route(scale: torch.Tensor) -> bool:
        """Whether the scale lives where its values are read for free (the CPU): the
        rules then run on the host, raising on a failing step; elsewhere they run on
        the device and a failure is recorded there."""
        return kernels.reads_free(scale.device)

    def held_failure(self, scale: torch.Tensor) -> torch.Tensor | None:
        """On the device route, a bool tensor: whether a failure is recorded (no step may
        move a parameter until the user loads a checkpoint); ``None`` on the host route,
        where a failing step raised instead."""
        if self.extra is None or self.host_route(scale):
            return None
        return self.extra["failure"] != 0

    def step_flag(self, found: Iterable[torch.Tensor], scale: torch.Tensor) -> Any:
        """The step's flag from the optimizers' per-device flags: a bool on the host
        route (one read), a 0-d bool tensor on the scale's device otherwise."""
        if self.host_route(scale):
            return kernels.any_found(found, scale.device, read=True)
        return kernels.any_found(found, scale.device)

    def current(self, scale: torch.Tensor, tracker: torch.Tensor) -> ScalerState:
        """The host route's state: the copy kept at the last update while the two tensors
        PyTorch exposes still hold its values (code that writes them directly is seen),
        else read from the tensors; under the current config (a setter called since the
        last update has changed it)."""
        mirror = self.mirror
        if (
            mirror is not None
            and scale.item() == mirror.scale
            and tracker.item() == mirror.growth_tracker
        ):
            config = self.config
            return mirror if mirror.config is config else dataclasses.replace(mirror, config=config)
        return self.device_state(scale, tracker).to_host()

    # ----------------------------------------------------------------- changing
    def advance(self, scale: torch.Tensor, tracker: torch.Tensor, flag: Any) -> ScalerState:
        """Run the config's transition on the step's flag (from :meth:`step_flag`) and
        hold the result: on the host (raising a refused step, nothing changed) or on
        the scale's device (a refused step recorded)."""
        if self.host_route(scale):
            current = self.current(scale, tracker)
            new = host_update(current, flag)
            self._write(scale, tracker, current, new)
            return new
        new = get_backend("torch").update(self.device_state(scale, tracker), flag)
        self._copy(scale, tracker, new)
        return new

    def count(
        self,
        scale: torch.Tensor,
        tracker: torch.Tensor,
        flag: Any,
        checked: bool,
        set_scale: Callable[[], None],
    ) -> ScalerState:
        """A step whose scale is set by hand: ``set_scale`` sets it, no rule of the config
        runs, and a ``checked`` step is still counted (as under a static config: the
        skip counters, ``last_kind``, the skip limit, which may refuse it before
        anything changes)."""
        if self.host_route(scale):
            current = self.current(scale, tracker)
            counted = host_update(_counting(current), flag) if checked else current
            set_scale()
            new = dataclasses.replace(counted, config=current.config, scale=float(scale.item()))
            self._write(scale, tracker, current, new, skip=("scale",))
            return new
        if checked:  # counted on the device; a refused step is recorded there
            counted = get_backend("torch").update(
                _counting(self.device_state(scale, tracker)), flag
            )
            self._copy(scale, tracker, counted, skip=("scale",))
        set_scale()
        return self.device_state(scale, tracker)

    def load(
        self, state: ScalerState, scale: torch.Tensor | None, tracker: torch.Tensor | None
    ) -> None:
        """Hold ``state`` (a loaded checkpoint): the start, and the tensors if made."""
        self.config = state.config
        self.start = state
        self.mirror, self.behind = None, False
        if scale is not None and tracker is not None and self.extra is not None:
            for name in DATA_FIELDS:
                self._field(scale, tracker, name).fill_(getattr(state, name))

    def set_config(self, **fields: Any) -> None:
        """Change the policy's ``fields`` (PyTorch's setters), the state kept."""
        self.config = dataclasses.replace(self.config, **fields)
        self.start = dataclasses.replace(self.start, config=self.config)

    def _field(self, scale: torch.Tensor, tracker: torch.Tensor, name: str) -> torch.Tensor:
        if name == "scale":
            return scale
        if name == "growth_tracker":
            return tracker
        return self.extra[name]  # type: ignore[index]

    def _write(
        self,
        scale: torch.Tensor,
        tracker: torch.Tensor,
        old: ScalerState,
        new: ScalerState,
        skip: tuple[str, ...] = (),
    ) -> None:
        """Hold ``new`` on the host route: fill PyTorch's two tensors (but ``skip``) where
        their value changed; the other fields' tensors are filled when next read
        (:meth:`device_state`)."""
        if "scale" not in skip and new.scale != old.scale:
            scale.fill_(new.scale)
        if new.growth_tracker != old.growth_tracker:
            tracker.fill_(new.growth_tracker)
        self.mirror = new
        self.behind = True

    def _copy(
        self,
        scale: torch.Tensor,
        tracker: torch.Tensor,
        new: ScalerState,
        skip: tuple[str, ...] = (),
    ) -> None:
        """Copy a device state's fields (but ``skip``) into the held tensors."""
        for name in DATA_FIELDS:
            if name not in skip:
                self._field(scale, tracker, name).copy_(getattr(new, name))


def _counting(state: ScalerState) -> ScalerState:
    """``state`` under its config made static: its transition counts a step (``steps``,
    ``skipped_steps``, ``consecutive_skips``, ``last_kind``, the skip limit) and changes
    nothing else. What ``update(new_scale)`` applies, since the scale is set by hand."""
    return dataclasses.replace(state, config=dataclasses.replace(state.config, dynamic=False))
