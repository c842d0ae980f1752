"""What every rank script here shares: leaving the gloo group, and the process.

The scripts import it as ``_ranks`` (a script's own folder is first on ``sys.path``).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

import torch.distributed as dist


def leave() -> None:
    """Leave the gloo group once every rank is done with it."""
    dist.barrier()  # no rank tears gloo down while another still talks to it
    dist.destroy_process_group()


def run(main: Callable[[], None]) -> None:
    """``main()``, then exit at once: everything is written by then.

    The interpreter's teardown is skipped: on a loaded machine gloo's threads, torn
    down there, sometimes abort the process ("terminate called without an active
    exception", 1 run in 8 here) after the work is done.
    """
    main()
    sys.stdout.flush()
    os._exit(0)
