"""``headroom bench chaos``: many clients, a worker killed and out of memory at random, a
desktop taking and giving back memory, and the figures that say nothing was lost.

The run (:func:`run_chaos`):

1. starts ``headroom serve`` (unless ``--url`` names a running one) with a simulated
   card playing a VRAM timeline (``--vram-source simulated``; or the real card with
   ``--hog``) and a fault folder armed at runtime (``HEADROOM_FAULTS_DIR``, test-only,
   :mod:`engine.common.faults`);
2. runs the greedy bodies of :func:`service.bench.chaos_requests.greedy_pool` once,
   undisturbed: the reference;
3. sends N requests (:func:`service.bench.chaos_requests.make_specs`) from C client threads
   while a killer SIGKILLs the worker K times and an arming thread drops M one-shot OOM
   faults at random sites, each at a random point of the run's progress; ``--hog``
   also starts a process taking and freeing GPU memory with torch;
4. waits for the engine to go idle, clears the prefix cache (``/api/control/cache``)
   and reads the engine's page counters; stops the service (SIGTERM, graceful) and
   looks for any worker still alive.

It prints: sent, succeeded, failed with a documented error (by code), hung, wrong output
against the reference (greedy requests that succeeded with other text), undocumented
endings, restarts, time back to ready after each kill (median, max), orphan processes,
pages leaked, OOMs injected, p50/p99 TTFT. The zeros that matter are in
:meth:`ChaosReport.problems`.
"""

from __future__ import annotations

import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from service.bench.chaos_options import ChaosOptions
from service.bench.chaos_requests import Outcome, Spec, greedy_pool, make_specs, run_one
from service.bench.chaos_service import HOG_SCRIPT, ChaosService, wait_ready
from service.bench.serve import percentile, reach
from service.supervision.stale import is_alive

READY_TIMEOUT_S = 900.0
OOM_SITES = ("prefill", "decode", "sample")

@dataclass
class ChaosReport:
    """The run's figures (see the module docstring); times in seconds."""

    outcomes: list[Outcome] = field(default_factory=list)
    wrong: list[str] = field(default_factory=list)
    restarts: int = 0
    back_to_ready_s: list[float] = field(default_factory=list)
    orphans: list[int] = field(default_factory=list)
    pages_leaked: int | None = None
    pages_leaked_before_clear: int | None = None
    ooms_armed: int = 0
    ooms_fired: int = 0
    ooms_lost: int = 0  # claimed by a worker that was killed before they fired
    hog_exit_code: int | None = None  # --hog's process, when it ended before the run did
    service_exit_code: int | None = None
    elapsed_s: float = 0.0

    def count(self, status: str) -> int:
        return sum(1 for o in self.outcomes if o.status == status)

    def ttfts(self) -> list[float]:
        return [o.ttft_s for o in self.outcomes if o.ttft_s is not None and o.status == "ok"]

    def problems(self) -> list[str]:
        """What must be zero (or clean) and is not; empty for a good run."""
        out = []
        for status in ("hung", "undocumented"):
            if self.count(status):
                details = [o.detail for o in self.outcomes if o.status == status][:5]
                out.append(f"{self.count(status)} {status}: {details}")
        if self.wrong:
            out.append(f"{len(self.wrong)} wrong outputs: {self.wrong[:3]}")
        if self.orphans:
            out.append(f"orphan worker processes: {self.orphans}")
        if self.pages_leaked != 0:
            out.append(f"pages leaked: {self.pages_leaked}")
        if self.hog_exit_code is not None:
            out.append(
                f"the memory hog (--hog) died during the run (exit code {self.hog_exit_code}; "
                "its error is above): the desktop's load the run was to play stopped"
            )
        if self.service_exit_code not in (None, 0):
            out.append(f"the service exited with {self.service_exit_code}")
        return out

    def render(self) -> str:
        failed = Counter(o.code for o in self.outcomes if o.status == "failed")
        ttft = self.ttfts()
        back = self.back_to_ready_s
        lines = [
            f"sent                   {len(self.outcomes)} ({self.count('vanished')} clients "
            "vanished mid-answer on purpose)",
            f"succeeded              {self.count('ok')}",
            f"failed, documented     {sum(failed.values())}"
            + (f" ({', '.join(f'{c}: {n}' for c, n in sorted(failed.items()))})" if failed else ""),
            f"failed, undocumented   {self.count('undocumented')}",
            f"hung                   {self.count('hung')}",
            f"wrong output           {len(self.wrong)} (greedy, against the undisturbed run)",
            f"restarts               {self.restarts}",
            "time back to ready     "
            + (
                f"median {statistics.median(back):.1f} s, max {max(back):.1f} s"
                if back
                else "no kill"
            ),
            f"orphan processes       {len(self.orphans)}",
            f"pages leaked           {self.pages_leaked} (after idle and a prefix-cache clear; "
            f"{self.pages_leaked_before_clear} held by neither a request nor the cache before)",
            f"OOMs injected          {self.ooms_fired} of {self.ooms_armed} armed ("
            f"{self.ooms_lost} claimed by a worker that was killed or ran no step at that "
            f"site since, {self.ooms_armed - self.ooms_fired - self.ooms_lost} not claimed)",
            f"retries after 503      {sum(o.retries for o in self.outcomes)} (Retry-After "
            "honoured while the worker restarted)",
            "TTFT (streams)         "
            + (
                f"p50 {percentile(ttft, 50) * 1000:.0f} ms, p99 {percentile(ttft, 99) * 1000:.0f} ms"
                if ttft
                else "none"
            ),
            f"elapsed                {self.elapsed_s:.0f} s",
        ]
        return "\n".join(lines)


def _reference(url: str, clients: int, max_tokens: int, hang_s: float) -> dict[int, str]:
    """Each greedy body's text on the undisturbed service (``clients`` at a time)."""
    pool = greedy_pool(max_tokens)
    specs = [Spec("greedy", False, body, key) for key, body in enumerate(pool)]
    outcomes = _run_clients(url, specs, clients, hang_s, on_done=lambda: None)
    texts = {}
    for o in outcomes:
        if o.status != "ok":
            raise RuntimeError(
                f"the undisturbed reference run failed: {o.status} {o.code} {o.detail}"
            )
        texts[o.spec.key] = o.texts[0]
    return texts


def _run_clients(url, specs, clients, hang_s, on_done) -> list[Outcome]:  # type: ignore[no-untyped-def]
    """Send ``specs`` from ``clients`` threads; ``on_done()`` after each request."""
    queue = list(reversed(specs))
    lock = threading.Lock()
    outcomes: list[Outcome] = []

    def client() -> None:
        with httpx.Client(base_url=url) as http:
            while True:
                with lock:
                    if not queue:
                        return
                    spec = queue.pop()
                outcome = run_one(http, spec, hang_s)
                with lock:
                    outcomes.append(outcome)
                on_done()

    threads = [threading.Thread(target=client, daemon=True) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return outcomes


class _Progress:
    """Requests done so far; waiters block until a count is reached or the run ends."""

    def __init__(self) -> None:
        self.done = 0
        self.finished = False
        self._cond = threading.Condition()

    def tick(self) -> None:
        with self._cond:
            self.done += 1
            self._cond.notify_all()

    def end(self) -> None:
        with self._cond:
            self.finished = True
            self._cond.notify_all()

    def wait_for(self, count: int) -> bool:
        """False if the run ended first."""
        with self._cond:
            self._cond.wait_for(lambda: self.done >= count or self.finished)
            return self.done >= count


def _killer(url, points, progress, report, seen_pids) -> None:  # type: ignore[no-untyped-def]
    """SIGKILL the ready worker at each progress point; time its way back to ready."""
    with httpx.Client(base_url=url) as http:
        for point in points:
            if not progress.wait_for(point):
                return
            pid = wait_ready(http, READY_TIMEOUT_S)["worker_pid"]
            seen_pids.add(pid)
            killed_at = time.monotonic()
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                continue
            health = wait_ready(http, READY_TIMEOUT_S, other_than=pid)
            report.back_to_ready_s.append(time.monotonic() - killed_at)
            seen_pids.add(health["worker_pid"])


def _armer(faults_dir: Path, points, progress, rng, report) -> None:  # type: ignore[no-untyped-def]
    """Drop a one-shot OOM rule at a random site at each progress point."""
    for i, point in enumerate(points):
        if not progress.wait_for(point):
            return
        site = rng.choice(OOM_SITES)
        tmp = faults_dir / f".oom-{i}.tmp"
        tmp.write_text(f"{site}:*:1\n")
        os.rename(tmp, faults_dir / f"oom-{i}.fault")  # whole, or not at all
        report.ooms_armed += 1


def _points(count: int, total: int, low: float, high: float, rng: random.Random) -> list[int]:
    span = range(max(1, int(total * low)), max(2, int(total * high)))
    return sorted(rng.choice(span) for _ in range(count))


def _quiesce_and_count_pages(url: str, token: str | None, report: ChaosReport) -> None:
    """Wait until the engine is idle, then pages held by nothing; clear the prefix cache
    and count again: every page must be free."""
    with httpx.Client(base_url=url, timeout=60) as http:
        wait_ready(http, READY_TIMEOUT_S)
        deadline = time.monotonic() + 300
        while True:
            engine = http.get("/api/status").json()["counters"]["engine"]
            if engine and engine["running"] == 0 and engine["waiting"] == 0:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"the engine never went idle: {engine}")
            time.sleep(0.2)
        report.pages_leaked_before_clear = (
            engine["total_pages"] - engine["free_pages"] - engine["cached_pages"]
        )
        if token is None:
            return
        r = http.post(
            "/api/control/cache",
            json={"clear_prefix_cache": True},
            headers={"Authorization": f"Bearer {token}"},
        )
        r.raise_for_status()
        engine = http.get("/api/status").json()["counters"]["engine"]
        report.pages_leaked = engine["total_pages"] - engine["free_pages"]


def _count_faults(faults_dir: Path | None, suffix: str) -> int:
    if faults_dir is None or not faults_dir.is_dir():
        return 0
    return len(list(faults_dir.glob(f"*{suffix}")))


def _workdir(opts: ChaosOptions) -> Path:
    """The started service's folder: ``--workdir``, else a new one in the temp folder
    (made only for a run that starts a service: a ``--url`` run leaves none behind)."""
    workdir = opts.workdir or Path(tempfile.mkdtemp(prefix="headroom-chaos-"))
    workdir.mkdir(parents=True, exist_ok=True)
    return workdir


def run_chaos(opts: ChaosOptions, out=print) -> ChaosReport:  # type: ignore[no-untyped-def]
    """Run the chaos run of ``opts`` and return its figures (printed with ``out``)."""
    rng = random.Random(opts.seed)
    report = ChaosReport()
    if opts.url:
        reach(opts.url)  # a service not ours must answer now: it is not waited for as one starting
    service = None if opts.url else ChaosService(opts, _workdir(opts))
    url = opts.url or service.url  # type: ignore[union-attr]
    faults_dir = service.faults_dir if service else opts.faults_dir
    hog = None
    seen_pids: set[int] = set()
    started = time.monotonic()
    try:
        with httpx.Client(base_url=url) as http:
            out(f"chaos: waiting for {url} (log: {service.log_path if service else 'not ours'})")
            first = wait_ready(http, READY_TIMEOUT_S, service=service)
        seen_pids.add(first["worker_pid"])
        restarts_before = first.get("restarts", 0)
        token = opts.token
        if token is None and service is not None:
            token = service.token_path.read_text().strip()
        elif token is None:
            from service.common.token import load_or_create_token

            token = load_or_create_token()
        out("chaos: the undisturbed reference run")
        reference = _reference(url, opts.clients, opts.max_tokens, opts.hang_s)
        if opts.hog_gib is not None:
            hog = subprocess.Popen(
                [sys.executable, "-c", HOG_SCRIPT, str(opts.hog_gib)], stdout=subprocess.PIPE
            )
            if hog.stdout.readline().strip() != b"hog ready":  # type: ignore[union-attr]
                raise RuntimeError(
                    "the memory hog did not start (--hog needs torch with a CUDA device)"
                )
        specs = make_specs(opts.requests, opts.max_tokens, rng)
        progress = _Progress()
        kill_points = _points(opts.kills, opts.requests, 0.1, 0.85, rng)
        oom_points = _points(opts.ooms if faults_dir else 0, opts.requests, 0.02, 0.9, rng)
        actors = [
            threading.Thread(
                target=_killer, args=(url, kill_points, progress, report, seen_pids), daemon=True
            ),
        ]
        if faults_dir is not None:
            actors.append(
                threading.Thread(
                    target=_armer,
                    args=(faults_dir, oom_points, progress, random.Random(opts.seed + 1), report),
                    daemon=True,
                )
            )
        for a in actors:
            a.start()
        out(
            f"chaos: {opts.requests} requests from {opts.clients} clients, "
            f"{opts.kills} kills, {len(oom_points)} OOMs"
        )
        report.outcomes = _run_clients(url, specs, opts.clients, opts.hang_s, progress.tick)
        progress.end()
        for a in actors:
            a.join()
        for o in report.outcomes:
            if o.spec.kind == "greedy" and o.status == "ok" and o.texts[0] != reference[o.spec.key]:
                report.wrong.append(f"{o.texts[0]!r} != {reference[o.spec.key]!r}")
        _quiesce_and_count_pages(url, token, report)
        with httpx.Client(base_url=url) as http:
            last = wait_ready(http, READY_TIMEOUT_S, service=service)
        seen_pids.add(last["worker_pid"])
        report.restarts = last.get("restarts", 0) - restarts_before
    finally:
        if hog is not None:
            report.hog_exit_code = hog.poll()  # None: still running, as it must be
            hog.kill()
            hog.wait()
        if service is not None:
            report.service_exit_code = service.stop()
        report.ooms_fired = _count_faults(faults_dir, ".fired")
        report.ooms_lost = _count_faults(faults_dir, ".taken")
        report.elapsed_s = time.monotonic() - started
    # A killed worker, or (after the service stopped) any worker, still alive is an orphan.
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(is_alive(p) for p in seen_pids):
        time.sleep(0.2)
    current = None if service is not None else last["worker_pid"]
    report.orphans = sorted(p for p in seen_pids if p != current and is_alive(p))
    out(report.render())
    return report
