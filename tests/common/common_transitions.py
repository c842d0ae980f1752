"""The host rule run over a sequence of flags: what a device run of the transition (under
``jax.lax.scan``, ``mx.compile``) is compared with, step by step."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import scaler_core as sc
from scaler_core._state import classify, host_update


def host_run(
    config: sc.ScalerConfig, flags: Iterable[bool]
) -> Iterator[tuple[sc.ScalerState, sc.Failure | None]]:
    """After each flag, the host rule's state and the failure that stopped the run (None
    until one does). From the failing step on the state stays the last valid one, as a
    device state keeps its values and records the failure."""
    host = sc.init(config)
    failed: sc.Failure | None = None
    for flag in flags:
        if failed is None:
            kind = classify(host, flag)
            if kind.fails:
                failed = sc.Failure[kind.name]
            else:
                host = host_update(host, flag)
        yield host, failed
