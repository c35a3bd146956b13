"""Threads named in the OS too, so that top -H, perf and the benchmarks' per-thread CPU tell the platform's
threads apart (the span writer, the decomposition)."""
import ctypes


def name_os_thread(name: str) -> None:
    """Give the calling thread `name` (15 bytes at most) in the OS too, Linux only, so that top -H,
    perf and the ingest benchmark's per-thread CPU tell the platform's threads apart (Python 3.14
    does this for every thread itself)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):  # not Linux / no prctl: the name is only cosmetic
        pass
