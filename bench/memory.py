"""Measuring the relay's memory during a drain: VmRSS sampled by a child process, the
kernel's peak (VmHWM) reset before the drain, and the heap trimmed first, so that what
earlier phases left does not hide the relay's own growth."""

from __future__ import annotations

import contextlib
import ctypes
import os
import resource
import subprocess
import sys

RSS_PERIOD = 0.01  # VmRSS sampling period during the backlog run (a child process)


def vmrss_kib() -> int:
    """Resident set size now, from /proc/self/status (Linux), in KiB."""
    return status_kib("VmRSS:")


def status_kib(key: str) -> int:
    with open("/proc/self/status", encoding="ascii") as fh:
        for line in fh:
            if line.startswith(key):
                return int(line.split()[1])
    return 0


def reset_peak_rss() -> bool:
    """Reset the kernel's peak RSS of this process (VmHWM, and so ru_maxrss) to its RSS now.

    Linux 4.0 and later; False where refused. Read at the end, VmHWM is then the exact peak
    in between, which sampling can only approach.
    """
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as fh:
            fh.write("5")
    except OSError:
        return False
    return True


def maxrss_kib() -> int:
    """Peak resident set size of this process so far (ru_maxrss is in KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def trim_heap() -> None:
    """Give free heap memory back to the OS (glibc's malloc_trim), if this is glibc.

    The phases before the drain hold a chunk of `--batch` events at a time; with big payloads
    that is tens of MiB, which glibc keeps once freed. Trimmed, VmRSS at the drain's start is
    what is live, so the growth during the drain is the relay's, not hidden in that slack.
    """
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


# The sampler's child process: VmRSS of process `pid` every `period` s until stdin closes,
# then "peak_kib samples max_gap_s late" on stdout (late: gaps longer than 50 ms).
SAMPLER = """
import select, sys, time
pid, period = sys.argv[1], float(sys.argv[2])
def rss():
    with open(f"/proc/{pid}/status", encoding="ascii") as fh:
        return next((int(l.split()[1]) for l in fh if l.startswith("VmRSS:")), 0)
peak, samples, gap, late, last = 0, 0, 0.0, 0, None
print("ready", flush=True)
while True:
    peak, now = max(peak, rss()), time.perf_counter()
    late += now - (last or now) > 0.05
    gap, last, samples = max(gap, now - (last or now)), now, samples + 1
    if select.select([sys.stdin], [], [], period)[0]:
        break
print(peak, samples, gap, late, flush=True)
"""


class RssSampler:
    """Reads this process's VmRSS every `period` seconds from a child process; keeps the peak.

    Not a task: a long synchronous stretch of the event loop (decoding or mapping a batch of
    big events) would delay it and hide the peak that stretch makes. Not a thread either: it
    needs the GIL, which C code running a whole batch can hold for longer than 50 ms. The
    child's CPU is not this process's, so it adds nothing to the relay's CPU per event.
    """

    def __init__(self, period: float = RSS_PERIOD) -> None:
        self.period = period
        self.peak_kib = 0
        self.samples = 0
        self.max_gap = 0.0  # seconds between two readings, at most
        self.late = 0  # gaps longer than 50 ms (the child was not scheduled in time)
        self._child: subprocess.Popen[str] | None = None

    def __enter__(self) -> RssSampler:
        command = [sys.executable, "-c", SAMPLER, str(os.getpid()), str(self.period)]
        self._child = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        assert self._child.stdout is not None
        self._child.stdout.readline()  # "ready": sampling has begun (before the timers start)
        return self

    def __exit__(self, *_: object) -> None:
        assert self._child is not None
        out, _err = self._child.communicate(timeout=10)  # closes stdin: the child reports
        peak, samples, gap, late = out.split()
        self.peak_kib, self.samples, self.max_gap = int(peak), int(samples), float(gap)
        self.late = int(late)
