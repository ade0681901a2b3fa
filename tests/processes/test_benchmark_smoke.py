"""Every benchmark runs: each script under benchmarks/ with ``--smoke`` (a few seconds through
its real path, checking its own figures), as a subprocess with a timeout.

The scripts run three at a time (longest first), started together when the first test of this
module asks for its result: many of them mostly wait (for spawned processes to import torch, for
a clock-driven fault schedule, for a shaped link), so overlapping them keeps the lane short on
two cores. A second test checks that the list names every script, so a new benchmark cannot be
left out. What a script cannot do here (network namespaces without root, torchft not
installed) it says in its output and skips; the rest of it still runs.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"

# Module (under benchmarks/) -> the seconds its smoke run may take; longest first, the order
# they are started in.
SCRIPTS = {
    "goodput": 300,
    "faults.chaos_allreduce": 240,
    "faults.chaos": 240,
    "training.trainer_quality": 240,
    "rounds.allreduce_round": 180,
    "links.netns_links": 180,
    "training.group_sync": 180,
    "training.sharded_groups": 120,
    "faults.crash_moments": 180,
    "swarm.lanes": 180,
    "rounds.sync_round": 120,
    "codecs.error": 120,
    "training.compute_utilization": 120,
    "rounds.torchft_diloco": 120,
    "codecs.quality": 120,
    "training.async_experiment": 120,
    "training.quorum_experiment": 120,
    "training.streaming_experiment": 120,
    "links.slow_links": 120,
    "codecs.speed": 120,
    "codecs.topk_speed": 60,
    "codecs.round_cost": 60,
    "swarm.pipeline": 120,
    "swarm.replicas": 120,
    "rounds.rendezvous_join": 60,
    "links.relay_bytes": 60,
}
PARALLEL = 3


class Runs:
    """The smoke runs of the selected scripts, started together on first use."""

    def __init__(self, scripts: list[str], out: Path) -> None:
        self.scripts, self.out = scripts, out
        self.futures: dict[str, Future[tuple[int | None, str, float]]] = {}
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(PARALLEL)

    def _run(self, script: str) -> tuple[int | None, str, float]:
        log = self.out / f"{script}.log"
        t0 = time.monotonic()
        with open(log, "w") as f:
            try:
                rc: int | None = subprocess.run(
                    [sys.executable, "-m", f"benchmarks.{script}", "--smoke"],
                    cwd=ROOT,
                    stdout=f,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    timeout=SCRIPTS[script],
                ).returncode
            except subprocess.TimeoutExpired:
                rc = None  # killed at its timeout
        return rc, log.read_text(errors="replace"), time.monotonic() - t0

    def result(self, script: str) -> tuple[int | None, str, float]:
        with self._lock:
            if not self.futures:
                for name in sorted(self.scripts, key=list(SCRIPTS).index):
                    self.futures[name] = self._pool.submit(self._run, name)
        return self.futures[script].result()

    def close(self) -> None:
        self._pool.shutdown(wait=True)


@pytest.fixture(scope="module")
def runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Runs:
    selected = [
        item.callspec.params["script"]
        for item in request.session.items
        if item.module is request.module and hasattr(item, "callspec")
    ]
    r = Runs(selected, tmp_path_factory.mktemp("smoke"))
    yield r  # type: ignore[misc]
    r.close()


@pytest.mark.timeout(900)
@pytest.mark.parametrize("script", list(SCRIPTS))
def test_benchmark_runs_with_smoke(runs: Runs, script: str) -> None:
    rc, output, seconds = runs.result(script)
    assert rc is not None, f"{script} --smoke took more than {SCRIPTS[script]} s:\n{output[-4000:]}"
    assert rc == 0, f"{script} --smoke exited {rc} after {seconds:.0f} s:\n{output[-4000:]}"
    assert "smoke: " in output and " ok" in output, output[-2000:]


def scripts_on_disk() -> set[str]:
    """Every module of a family folder that runs as a script (the harness and the quality
    suite are not families), and every script at the top (``benchmarks/goodput.py``, the path
    its issue names)."""
    found = {
        p.stem for p in BENCHMARKS.glob("*.py") if 'if __name__ == "__main__":' in p.read_text()
    }
    for path in BENCHMARKS.glob("*/*.py"):
        family = path.parent.name
        if family in ("harness", "quality", "results"):
            continue
        if 'if __name__ == "__main__":' in path.read_text():
            found.add(f"{family}.{path.stem}")
    return found


def test_the_smoke_list_names_every_benchmark_script() -> None:
    on_disk = scripts_on_disk()
    assert on_disk == set(SCRIPTS), (
        f"not in SCRIPTS: {sorted(on_disk - set(SCRIPTS))}; "
        f"no such script: {sorted(set(SCRIPTS) - on_disk)}"
    )


def test_the_swarm_family_runs_as_a_module() -> None:
    """``python -m benchmarks.swarm`` (the issue's ``benchmarks/swarm.py``) is pipeline.py's
    main with its flags: its help is pipeline's, under the command the user typed."""
    got = subprocess.run(
        [sys.executable, "-m", "benchmarks.swarm", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        timeout=120,
    )
    assert got.returncode == 0, got.stderr[-2000:]
    assert got.stdout.startswith("usage: python -m benchmarks.swarm "), got.stdout
    assert "Pipeline swarm: the demo's character model in 3 stages" in got.stdout, got.stdout
    assert "--timeout-floor" in got.stdout and "--smoke" in got.stdout, got.stdout
