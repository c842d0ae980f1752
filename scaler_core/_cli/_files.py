"""Output files of the command line: checked before any work, written with one-line errors."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from scaler_core._errors import InvalidArgumentError

__all__ = ["PLOT_FORMATS", "check_output", "write"]

#: The image formats ``--plot`` writes, by file name suffix (matplotlib's own names).
PLOT_FORMATS = {".png": "png", ".pdf": "pdf", ".svg": "svg"}


def check_output(flag: str, path: str, formats: dict[str, str] | None = None) -> None:
    """Refuse, before any work, an output path that cannot be written.

    Raises:
        InvalidArgumentError: The folder does not exist or is not writable, the
            path is a folder, or its suffix is not one of ``formats``.
    """
    folder = os.path.dirname(os.path.abspath(path))
    if formats is not None and os.path.splitext(path)[1].lower() not in formats:
        raise InvalidArgumentError(
            f"{flag} {path!r}: the file name must end in {', '.join(formats)} (the format written)"
        )
    if not os.path.isdir(folder):
        raise InvalidArgumentError(
            f"{flag} {path!r}: the folder {folder!r} does not exist; create it first"
        )
    if os.path.isdir(path):
        raise InvalidArgumentError(f"{flag} {path!r} is a folder; pass a file name")
    if not os.access(folder, os.W_OK):
        raise InvalidArgumentError(f"{flag} {path!r}: the folder {folder!r} is not writable")


def write(flag: str, path: str, save: Callable[[str], Any]) -> None:
    """``save(path)``, with a failure to write (a full disk, ``/dev/full``) as one line.

    Raises:
        InvalidArgumentError: Writing failed; the message names the flag, the
            path and the reason.
    """
    try:
        save(path)
    except OSError as exc:
        reason = exc.strerror or str(exc)
        raise InvalidArgumentError(f"{flag} {path!r} could not be written: {reason}") from exc
