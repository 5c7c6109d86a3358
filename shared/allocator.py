"""The C allocator's thresholds for a process that moves large tensors.

glibc's malloc serves a block over its mmap threshold (128 KB at first) with a
fresh mapping and gives it back on free; below it, from the heap, whose top it
trims once more than twice that threshold is free there. Either way the next
large block lands on pages the kernel has to fault in and zero again, and in a
virtual machine a page fault costs microseconds. A stage answering with a
MobileNet input (600 KB) builds and serialises a protobuf message of it per
request: measured here, 1.46 ms of CPU with the defaults against 0.08 ms once
the pages stay mapped, and a request's tensor is built and freed several times
between the client and the model.

So each service keeps large blocks in its heap (up to ``MMAP_THRESHOLD``) and
its freed pages mapped (up to ``TRIM_THRESHOLD`` at the heap's top): a process
holds at most that much more memory than it uses, per malloc arena.
"""

from __future__ import annotations

import ctypes
import logging
import sys

log = logging.getLogger(__name__)

MMAP_THRESHOLD = 32 << 20
"""Blocks up to this size come from the heap (a batch of 16 MobileNet inputs is 9.6 MB)."""
TRIM_THRESHOLD = 64 << 20
"""Free memory the heap's top keeps mapped before it is handed back."""
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
"""mallopt's parameter numbers (malloc.h)."""


def keep_large_blocks() -> bool:
    """Set the thresholds in this process; False where the C library is not glibc."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        # The process's own symbols, libc's among them: find_library would run
        # ldconfig in a subprocess on every service start.
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    done = bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1)
    done = bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1) and done
    if not done:
        log.info("mallopt refused the allocator thresholds; large tensors cost page faults")
    return done
