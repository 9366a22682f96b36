"""One warning per slow fallback path and process, on any device: where inferd has no kernel for
what it runs (a device, a dtype, a missing compiler) it stays correct on a plain PyTorch path and
says so once, in the engine's log, naming the cost. The set of paths already reported is
process-wide on purpose: every engine in the process takes the same fallbacks."""

from __future__ import annotations

import logging
import threading

logger = logging.getLogger("inferd.engine")

_reported: set[str] = set()
_lock = threading.Lock()


def warn_slow_path(key: str, message: str, *args: object) -> None:
    """Log `message % args` as a warning the first time `key` is reported in this process."""
    with _lock:
        if key in _reported:
            return
        _reported.add(key)
    logger.warning("slow path: " + message, *args)
