"""How a process that cannot start says so: one line on stderr and a non-zero exit, no traceback.

Configuration problems (a missing model folder, a port in use, a bad flag value) are the operator's to fix and
a traceback only hides the one line that matters; it is still logged at debug level (`--log-level debug`).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Callable
from typing import Any

from pdserve.net.listen import StartupError

log = logging.getLogger("pdserve.startup")

STARTUP_FAILED = 2
# The errors a bad setup raises while a process starts; anything else is a bug and keeps its traceback.
STARTUP_ERRORS = (StartupError, ValueError, OSError)


def exit_on_startup_error(prog: str, start: Callable[[], int]) -> int:
    try:
        return start()
    except STARTUP_ERRORS as exc:
        log.debug("startup failed", exc_info=True)
        print(f"{prog}: error: {exc}", file=sys.stderr, flush=True)
        return STARTUP_FAILED


def json_object(text: str) -> dict[str, Any]:
    """An argparse type: a JSON object, or a message saying what is wrong with it."""
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON ({exc})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


class OneLineParser(argparse.ArgumentParser):
    """A bad flag is reported in one line (the usage block would bury it); --help has the rest."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(STARTUP_FAILED, f"{self.prog}: error: {message} (see --help)\n")
