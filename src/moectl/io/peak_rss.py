"""The process's resident set: now, its high-water mark, and a reset of that mark (the one reader).

:func:`peak_rss` / :func:`reset_peak_rss` read and reset the kernel's high-water mark of the
resident set (``VmHWM`` in ``/proc/self/status``; reset by writing 5 to ``/proc/self/clear_refs``),
which includes allocator slack, the interpreter and the libraries. Where there is no procfs
(macOS), the peak is ``resource.getrusage``'s ``ru_maxrss`` (since the process started) and the
resident set now is unknown. ``serve-offload``'s report (:func:`peak_rss_report`) and
``benchmarks/scale.py`` both read it here.
"""

from __future__ import annotations

import sys


def _status(field: str) -> int:
    """A ``/proc/self/status`` memory field in bytes (0 where there is no procfs)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _maxrss() -> int:
    """``getrusage``'s peak resident set since the process started, bytes (0 where unavailable)."""
    try:
        import resource
    except ImportError:  # Windows
        return 0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak) * (1 if sys.platform == "darwin" else 1024)  # Linux reports KiB, macOS bytes


def rss() -> int:
    """The process's resident set now, bytes (0 where there is no procfs)."""
    return _status("VmRSS")


def peak_rss() -> int:
    """The process's resident-set high-water mark since start or the last :func:`reset_peak_rss`
    (without procfs: since start, from ``getrusage``)."""
    return _status("VmHWM") or _maxrss()


def reset_peak_rss() -> bool:
    """Reset the high-water mark to the current resident set; False where the kernel refuses."""
    try:
        with open("/proc/self/clear_refs", "w") as clear:
            clear.write("5")
        return True
    except OSError:
        return False


def peak_rss_report() -> dict:
    """``{"peak_rss_bytes", "peak_rss_source", "rss_bytes_now"}`` for a JSON report."""
    hwm = _status("VmHWM")
    now = rss()
    return {
        "peak_rss_bytes": hwm or _maxrss(),
        "peak_rss_source": "VmHWM (/proc/self/status)" if hwm else "resource.getrusage(RUSAGE_SELF).ru_maxrss",
        "rss_bytes_now": now or None,
    }
