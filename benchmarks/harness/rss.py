"""Resident memory of benchmark processes: exact peaks read inside, a polled view from outside,
and whether a run fits in the memory available.

``ru_maxrss`` read by a process at its end is exact but says nothing until then; the parent's
``RssPoller`` sees every child while it runs but can miss a spike shorter than its period. The
benchmarks report both, and where the peak is a plateau the two agree to within a megabyte.
"""

from __future__ import annotations

import resource
import threading

import psutil


def rss() -> int:
    """This process's resident set size now, in bytes."""
    return psutil.Process().memory_info().rss


def maxrss() -> int:
    """This process's peak resident set size so far, in bytes."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def base_rss() -> int:
    """RSS of a process that has imported torch and diloco and built one (tiny) torch optimizer:
    the first optimizer imports torch._dynamo and friends (~800 modules, ~75 MB), a cost of
    torch that every training process pays, whatever the model size."""
    import torch

    torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    return rss()


class RssPoller:
    """Polls the RSS of some processes at ~20 Hz; keeps each one's maximum."""

    def __init__(self, period: float = 0.05) -> None:
        self.period = period
        self.peaks: dict[int, int] = {}
        self._procs: dict[int, psutil.Process] = {}
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def watch(self, pid: int) -> None:
        with self._lock:
            try:
                self._procs[pid] = psutil.Process(pid)
            except psutil.NoSuchProcess:
                pass

    def __enter__(self) -> RssPoller:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            with self._lock:
                procs = list(self._procs.items())
            for pid, proc in procs:
                try:
                    value = proc.memory_info().rss
                except psutil.Error:  # gone, or going: its last reading stands
                    continue
                if value > self.peaks.get(pid, 0):
                    self.peaks[pid] = value


def fits(need: int, what: str, force: bool) -> str | None:
    """None when ``need`` bytes fit in the memory available now with a GiB to spare (or
    ``force``); else the line that says ``what`` is skipped, and why."""
    avail = psutil.virtual_memory().available
    if need > avail - 2**30 and not force:
        return (
            f"{what}: skipped, needs about {need / 2**30:.1f} GiB, "
            f"{avail / 2**30:.1f} GiB available (use a smaller --params, or --force)"
        )
    return None


def skipped_for_memory(need: int, what: str, force: bool, skipped: list[str]) -> bool:
    """``fits``, and when it does not, the line printed and added to ``skipped``: True then."""
    msg = fits(need, what, force)
    if msg:
        print(msg, flush=True)
        skipped.append(msg)
    return msg is not None
