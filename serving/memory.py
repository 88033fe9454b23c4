"""The server process's allocator: buffers of large requests go back to the OS when freed.

glibc's malloc serves an allocation of 128 KiB or more from its own mapping, but after freeing one it raises that
threshold (up to 32 MiB) and serves the next from the heap, where freed memory stays with the process. A server
that decodes requests of up to --max-message-bytes then keeps, request after request, the peak of the largest:
with both thresholds fixed, each large buffer is unmapped when freed and the heap is trimmed."""

from __future__ import annotations

import ctypes

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
M_MMAP_THRESHOLD = -3
LARGE_BYTES = 128 * 1024  # glibc's default mmap threshold, kept fixed


def return_large_buffers() -> bool:
    """Fix glibc's mmap and trim thresholds at LARGE_BYTES; False where the C library is not glibc (musl, macOS),
    whose allocators return large buffers by their own rules."""
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the process's own symbols: the C library it runs on, no file opened
    except (OSError, AttributeError):
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, LARGE_BYTES)) and bool(mallopt(M_TRIM_THRESHOLD, LARGE_BYTES))
