"""The NVIDIA GPU's SM clock while a benchmark runs, sampled by nvidia-smi beside it.

The H200's driver lowers the SM clock to 345 MHz within about 1.5 s of light load and raises it
again under steady work (seen in the twentieth session's Vulkan run: 1980 MHz while CUDA
decoded, 345 MHz through most of a Vulkan prefill profile whose submissions each waited for the
host). A measurement taken at 345 MHz says nothing about the kernels, so the benchmarks log
the clock over each timed stretch and print it beside the number.

    with ClockLog() as clk:
        t0 = time.perf_counter(); work(); t1 = time.perf_counter()
    print(clk.span(t0, t1))   # "1980 MHz" or "345-1980 MHz"; "" without nvidia-smi

Samples every `period_ms` (default 20). Without nvidia-smi (a CPU machine) it records nothing.
"""
from __future__ import annotations

import shutil
import subprocess
import threading
import time


class ClockLog:
    def __init__(self, index: int = 0, period_ms: int = 20):
        self.index, self.period_ms = index, period_ms
        self.samples: list[tuple[float, int]] = []  # (time.perf_counter(), MHz)
        self._p = None
        self._t = None

    def __enter__(self) -> "ClockLog":
        exe = shutil.which("nvidia-smi")
        if exe:
            self._p = subprocess.Popen([exe, "-i", str(self.index), "--query-gpu=clocks.sm",
                                        "--format=csv,noheader,nounits", "-lms", str(self.period_ms)],
                                       stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            self._t = threading.Thread(target=self._read, daemon=True)
            self._t.start()
        return self

    def _read(self) -> None:
        for line in self._p.stdout:
            try:
                self.samples.append((time.perf_counter(), int(line.strip())))
            except ValueError:
                pass  # "[N/A]" or a stray line

    def __exit__(self, *exc) -> None:
        if self._p:
            self._p.terminate()
            self._p.wait()
            self._t.join(timeout=2)

    def between(self, t0: float, t1: float) -> list[int]:
        """The samples taken from t0 to t1, and the last one before t0 (the clock at the start)."""
        before = [m for t, m in self.samples if t < t0][-1:]
        return before + [m for t, m in self.samples if t0 <= t <= t1]

    def span(self, t0: float | None = None, t1: float | None = None) -> str:
        """The clock from t0 to t1 (default: every sample) as clock_range() writes it."""
        return clock_range(self.between(t0, t1) if t0 is not None else [m for _, m in self.samples])


def clock_range(mhz: list[int]) -> str:
    """'1980 MHz', or 'LO-HI MHz' where the clock moved; '' with no samples."""
    if not mhz:
        return ""
    lo, hi = min(mhz), max(mhz)
    return f"{lo} MHz" if lo == hi else f"{lo}-{hi} MHz"
