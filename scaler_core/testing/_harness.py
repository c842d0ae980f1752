"""What one check of the Backend contract works with: the backend under test and its
conversions (:class:`BackendSubject`), and :class:`Check`, through which a check calls the
backend's operations, reads its arrays and flags, and fails with a message naming the
check, the backend and the call that was running.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np

from .. import _ops
from .._backend import Backend
from .._errors import BackendContractError

__all__ = ["BackendSubject", "Check"]


@dataclasses.dataclass(frozen=True)
class BackendSubject:
    """A backend under test, with the two conversions the checks need.

    Attributes:
        backend: The backend.
        asarray: A host NumPy array to an array of the backend's library (same
            dtype, shape and values; a 0-d array stays 0-d).
        to_numpy: An array of the library back to a host NumPy array.
        dtypes: The gradient dtypes checked (those the library round-trips).
        flushes_subnormals: The library computes with subnormals flushed to zero
            (XLA does, on CPU and GPU): subnormal inputs of the multiply count as
            zero and subnormal products become zero, signs kept. The
            ``subnormals`` check then expects exactly that, and nothing else.
    """

    backend: Backend
    asarray: Callable[[np.ndarray], Any]
    to_numpy: Callable[[Any], np.ndarray]
    dtypes: tuple[np.dtype[Any], ...]
    flushes_subnormals: bool = False

    @property
    def name(self) -> str:
        return str(self.backend.name)


class Check:
    """One check of one backend: how it reads arrays and flags, and how it fails."""

    def __init__(self, name: str, subject: BackendSubject) -> None:
        self.name, self.subject, self.backend = name, subject, subject.backend
        #: The call in progress, named by the members it runs: what an unexpected
        #: exception is reported as coming from.
        self.doing = "the check"

    @property
    def prefix(self) -> str:
        return f"check {self.name!r} failed for backend {self.subject.name!r}: "

    def fail(self, what: str) -> BackendContractError:
        return BackendContractError(self.prefix + what)

    def unexpected(self, exc: BaseException) -> BackendContractError:
        """An exception the contract does not document, as a contract failure naming the
        members that were running (chain it with ``from exc``)."""
        return self.fail(
            f"{self.doing} raised {type(exc).__name__}: {exc}, but a backend's members must "
            f"return what the Backend protocol says, or raise the errors it documents"
        )

    def now(self, doing: str) -> None:
        self.doing = doing

    # The operations as users call them: composed, once, from the backend's passes.
    def unscale(self, grads: Any, scale: Any) -> tuple[Any, Any]:
        self.now("unscale (plan(grads, writable=True), then unscale(plan, scale))")
        return _ops.unscale(self.backend, grads, scale)

    def unscale_and_norm(self, grads: Any, scale: Any) -> tuple[Any, Any, Any]:
        self.now("unscale_and_norm (plan(grads, writable=True), then measure(write=True))")
        return _ops.unscale_and_norm(self.backend, grads, scale)

    def unscale_and_clip(
        self, grads: Any, scale: Any, max_norm: Any, reduce: Callable[[Any], Any] | None = None
    ) -> tuple[Any, Any, Any]:
        self.now("unscale_and_clip (plan(), measure(write=False), then clip())")
        return _ops.unscale_and_clip(self.backend, grads, scale, max_norm, reduce)

    def find_non_finite(self, grads: Any) -> Any:
        self.now("find_non_finite (plan(grads, writable=False), then unscale(plan, None))")
        return _ops.find_non_finite(self.backend, grads)

    def host(self, x: Any) -> np.ndarray:
        """A host copy (a NumPy backend's arrays change in place afterwards)."""
        self.now(f"to_numpy() of a {type(x).__qualname__}")
        return np.array(self.subject.to_numpy(x))

    def array(self, host: np.ndarray) -> Any:
        self.now(f"asarray() of a {host.dtype} array of shape {host.shape}")
        return self.subject.asarray(host)

    def flag(self, flag: Any, what: str) -> bool:
        try:
            value = self.backend.to_bool(flag)
        except Exception as exc:
            raise self.fail(f"to_bool() refused the flag {what} returned: {exc!r}") from exc
        if type(value) is not bool:
            raise self.fail(f"to_bool() returned {value!r}, not a bool")
        return value

    def raises(
        self, error: type[Exception], call: Callable[[], Any], what: str, names: str = ""
    ) -> None:
        """``call()`` must raise ``error``, with ``names`` in its message."""
        try:
            call()
        except error as exc:
            if names not in str(exc):
                raise self.fail(
                    f"{what} raised {type(exc).__name__} without naming {names!r}"
                ) from exc
            return
        except Exception as exc:
            raise self.fail(
                f"{what} raised {type(exc).__name__}({exc}), not {error.__name__}"
            ) from exc
        raise self.fail(f"{what} did not raise {error.__name__}")
