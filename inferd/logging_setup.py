"""The log format every inferd process shares (the CLI and the server's engine process)."""

from __future__ import annotations

import logging
import sys


def configure_logging(level: int | str) -> None:
    """Log records go to stderr as `LEVEL HH:MM:SS logger: message`."""
    logging.basicConfig(level=level, format="%(levelname)s %(asctime)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S", stream=sys.stderr)  # fmt: skip
