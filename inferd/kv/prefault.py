"""Fault the KV pool's pages in ahead of the block allocator, on CPU time nothing else wants.

Why: a large CPU pool is a lazily zero-filled mapping (`allocate_kv_cache` in
inferd/engine/model_runner.py), so the first write to each page faults. In a virtual machine that
can cost 0.2-2 ms per MB (the host backs guest memory on first touch too), and with prefix caching
finished sequences' blocks stay cached, so new requests keep writing to fresh blocks: the
32 x (128 in, 128 out) throughput scenario writes ~750 MB of fresh KV, and a step that faults its
pages in pays for them in its own time (a 2,048-token chunk's K/V copy is ~30x slower on fresh
pages than on faulted ones).

How: fresh blocks leave the pool in ascending id order (inferd/kv/block_pool.py), so the pages the
engine writes next belong to the blocks just above the highest id handed out so far. Daemon
threads at SCHED_IDLE priority (one per CPU, up to 4: page faults proceed in parallel across
CPUs) keep `ahead_bytes` of those faulted in with madvise(MADV_POPULATE_WRITE).
That maps pages without writing to them: it is safe while the engine writes the same blocks, and
memory keeps its contents (zero, or what the engine wrote). At
SCHED_IDLE it runs only where a CPU would otherwise idle (while a server waits for requests,
between a step's parallel regions), so it does not slow steps down; a page it has not reached
yet faults on first write as before. Needs Linux >= 5.14; elsewhere it does nothing.
"""

from __future__ import annotations

import atexit
import ctypes
import logging
import mmap
import os
import threading
import weakref

import torch

logger = logging.getLogger(__name__)

_MADV_POPULATE_WRITE = 23  # linux/mman.h, since 5.14
_CHUNK_BYTES = 16 << 20  # per madvise round: the thread checks for a dropped pool between rounds


def _madvise():
    if os.name != "posix" or not hasattr(os, "sched_setscheduler"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None
    fn = libc.madvise
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


# Every prefaulter not yet collected: stopped at exit (`_stop_all`).
_live: weakref.WeakSet[KVPrefaulter] = weakref.WeakSet()


def _stop_all() -> None:
    """At interpreter exit, before finalization: stop every prefaulter and wait for its workers.
    A worker holds its pool while it populates it; left running, one that drops the last
    reference during finalization runs the tensor's deleter there, and its GIL acquisition aborts
    the process ("terminate called without an active exception", e.g. in a script that makes and
    drops one engine, then makes another)."""
    for prefaulter in list(_live):
        prefaulter.stop()


atexit.register(_stop_all)


class KVPrefaulter:
    """Keeps the pages of blocks [0, high water + ahead) of a `[layers, 2, num_blocks, ...]` CPU
    pool faulted in; `advance(high_water)` after each allocation moves the target."""

    def __init__(self, data: torch.Tensor, ahead_bytes: int, workers: int | None = None) -> None:
        assert data.is_cpu and data.is_contiguous() and data.dim() >= 3
        self.num_blocks = data.shape[2]
        self._regions = data.shape[0] * data.shape[1]  # one per (layer, K or V)
        self._block_bytes = data[0, 0, 0].numel() * data.element_size()
        self._region_bytes = self.num_blocks * self._block_bytes
        self._ahead = max(1, ahead_bytes // (self._block_bytes * self._regions))
        self._chunk = max(1, _CHUNK_BYTES // (self._block_bytes * self._regions))
        self._step = max(1, min(self._chunk, self._ahead // 4))
        self._data = weakref.ref(data)  # the pool may be replaced or dropped: then the threads end
        self._base = data.data_ptr()
        self._cond = threading.Condition()
        self._target = min(self.num_blocks, self._ahead)
        self._madvise = _madvise()
        self.enabled = self._madvise is not None
        n = workers or min(4, os.cpu_count() or 1, self._regions)
        # Worker w faults in the regions r with r % n == w; blocks [0, _done[w]) of them are in.
        self._done = [0] * n
        self.threads = [threading.Thread(target=self._run, args=(w,), name="inferd-kv-prefault", daemon=True)
                        for w in range(n if self.enabled else 0)]  # fmt: skip
        for t in self.threads:
            t.start()
        _live.add(self)

    def stop(self, timeout: float = 10.0) -> None:
        """End the workers (each after the madvise round in flight) and wait for them."""
        with self._cond:
            self.enabled = False
            self._cond.notify_all()
        for t in self.threads:
            if t is not threading.current_thread():
                t.join(timeout)

    @property
    def target(self) -> int:
        """Blocks [0, target) are to be faulted in (the high-water mark + `ahead`, in steps)."""
        return self._target

    @property
    def done(self) -> int:
        """Blocks [0, done) are faulted in, in every layer."""
        return min(self._done)

    def advance(self, high_water: int) -> None:
        """Blocks below `high_water` have been handed out: keep `ahead` more beyond them ready.
        The workers are woken once the target has moved by a quarter of `ahead` (or a chunk),
        not for every block a decode step adds."""
        target = min(self.num_blocks, high_water + self._ahead)
        if target >= self._target + self._step or (target == self.num_blocks and target > self._target):
            with self._cond:
                self._target = target
                self._cond.notify_all()

    def wait(self, timeout: float) -> bool:
        """Block until the current target is reached (benchmarks: measure steady state, not page
        faults); False on timeout or when prefaulting is off."""
        with self._cond:
            reached = self._cond.wait_for(lambda: not self.enabled or self.done >= self._target, timeout)
            return self.enabled and reached

    def _populate(self, worker: int, lo: int, hi: int) -> bool:
        page = mmap.PAGESIZE
        first_page = self._base & ~(page - 1)  # the pool's first page: mapped, it holds its start
        last_page = (self._base + self._regions * self._region_bytes) & ~(page - 1)  # exclusive
        for r in range(worker, self._regions, len(self._done)):
            start = self._base + r * self._region_bytes + lo * self._block_bytes
            end = self._base + r * self._region_bytes + hi * self._block_bytes
            start = max(first_page, start & ~(page - 1))
            end = min(last_page, (end + page - 1) & ~(page - 1))
            if end > start and self._madvise(start, end - start, _MADV_POPULATE_WRITE) != 0:
                err = ctypes.get_errno()
                logger.debug("KV prefault off: madvise(MADV_POPULATE_WRITE) failed: %s", os.strerror(err))
                return False
        return True

    def _run(self, worker: int) -> None:
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # this thread only
            os.sched_setaffinity(0, range(os.cpu_count() or 1))  # not just the engine thread's core
        except (OSError, AttributeError):
            pass
        while True:
            with self._cond:
                while self.enabled and self._done[worker] >= self._target:
                    self._cond.wait(1.0)
                    if self._data() is None:
                        return
                if not self.enabled:
                    return
                lo = self._done[worker]
                hi = min(self._target, lo + self._chunk)
            pool = self._data()  # held while its pages are populated: the mapping stays valid
            if pool is None:
                return
            ok = self._populate(worker, lo, hi)
            del pool
            with self._cond:
                if not ok:
                    self.enabled = False
                else:
                    self._done[worker] = hi
                self._cond.notify_all()
