"""Test-only fault injection: raise ``torch.OutOfMemoryError`` at a named site of a step,
make a step or a live KV pool resize slow, or fail CUDA's initialisation when an engine starts.

The OOM handling of :meth:`engine.core.engine.Engine.step` must be exercised on machines
without a GPU, where a real out-of-memory never happens at a chosen moment. A rule
names a site, a request and a count:

``prefill``
    the forward of a step that carries a prefill chunk of the request (raised after
    the forward ran, so the step's keys and values are already written: the harder
    case for rollback);
``decode``
    the forward of a step in which the request decodes (same point);
``sample``
    sampling of a step in which the request samples, after the sampler has drawn
    (its random generator has advanced: rollback must restore it).

``slow``
    a step that runs the request (prefill or decode) computes ``seconds`` longer, after
    its forward: it sleeps in slices of :data:`SLOW_SLICE_S`, advancing the work counter
    (:mod:`engine.common.progress`) after each, as a long step's layers do. A slow
    step, not a hang: the service's watchdog must leave it alone. Written
    ``slow:request:times:seconds`` (times and seconds both required), e.g.
    ``slow:*:1:25``.

``slow_resize``
    the next live resize of the KV pool (``Engine.resize_kv_pool``) takes ``seconds``
    longer, spread over its buffers: after each buffer's copy it sleeps its share
    *without* advancing the work counter, so only the resize's own advance per buffer
    (:meth:`engine.kvcache.pool.KVPool.resize`) keeps the watchdog away. Written as
    ``slow`` is, the request part ignored (write ``*``): ``slow_resize:*:1:8``.

``cuda_init``
    the start of an engine on any device but ``cpu``
    (:func:`engine.core.startup.resolve_device`): CUDA's initialisation fails with
    :class:`engine.common.errors.CudaUnavailable`, as after a laptop's suspend (error 999). The
    request part is ignored (write ``*``). Each worker is a new process, so a count
    that spans workers lives in a spool file (below): each engine start that fires it
    writes the file back with one less, until none is left.

``request_id`` ``"*"`` matches any request. Each firing uses up one of ``times``;
a step fires at most once per site.

Configured by the ``HEADROOM_FAULTS`` environment variable, read once when the engine
(its :class:`engine.core.runner.ModelRunner`) is built, e.g.
``HEADROOM_FAULTS="prefill:req-1:2,sample:*:1,slow:*:1:25"`` (``site:request[:times]``
and ``slow:request:times:seconds``, rules separated by ``,``; times defaults to 1), or
in-process through ``Engine.faults`` (``engine.faults.add("decode", "req-1", times=3)``).
With neither, the runner holds no injector and pays one ``is None`` test per step.

Faults can also be armed while a worker runs (the chaos run, :mod:`service.bench.chaos`):
``HEADROOM_FAULTS_DIR`` names a folder where a test drops files ``NAME.fault``, each
holding rules in the syntax above. The injector looks there at most every
:data:`SPOOL_POLL_S` seconds; it claims a file by renaming it ``NAME.taken`` (so one
worker arms it once, even across restarts), and renames it ``NAME.fired`` once all its
rules have fired. Off unless the variable is set.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from engine.common import environment, progress

log = logging.getLogger("headroom.faults")

ENV_VAR = environment.FAULTS.name
SITES: tuple[str, ...] = ("prefill", "decode", "sample", "slow", "slow_resize", "cuda_init")
CUDA_INIT = "cuda_init"
SLOW = "slow"
SLOW_RESIZE = "slow_resize"
TIMED_SITES = (SLOW, SLOW_RESIZE)  # their rules end with seconds
SLOW_SLICE_S = 0.1  # a slow step advances the work counter this often (seconds)
ANY_REQUEST = "*"
SPOOL_ENV_VAR = environment.FAULTS_DIR.name
SPOOL_POLL_S = 0.05


@dataclass
class FaultRule:
    """Raise at ``site`` for ``request_id`` (or any, ``"*"``) ``remaining`` more times
    (at ``slow``: take ``seconds`` longer)."""

    site: str
    request_id: str
    remaining: int
    source: Path | None = None  # the claimed spool file it came from, if any
    seconds: float = 0.0


class FaultInjector:
    """A list of :class:`FaultRule`; :meth:`check` raises when one matches.

    Attributes:
        fired: ``(site, request_id)`` of every injected fault, in order (the request id
            is the matched one, also for ``"*"`` rules: the first match in the step).
    """

    def __init__(self, spool: Path | None = None) -> None:
        self.rules: list[FaultRule] = []
        self.fired: list[tuple[str, str]] = []
        self.spool = spool
        self._next_poll = 0.0

    @classmethod
    def parse(cls, spec: str) -> FaultInjector:
        """Build an injector from ``site:request[:times]`` rules (``slow:request:times:seconds``)
        separated by ``,``.

        Raises:
            ValueError: a rule without a request, an unknown site, a count that is not
                a positive integer (the part after ``*:``, or a trailing part written as
                a number: ``prefill:*:abc``, ``decode:r:1.5``), a ``slow`` rule without
                its times and seconds; the message quotes the rule.
        """
        injector = cls()
        for raw in spec.split(","):
            rule = raw.strip()
            if not rule:
                continue
            site, sep, rest = rule.partition(":")
            if not sep or not rest:
                form = _timed_form(site) if site.strip() in TIMED_SITES else "site:request[:times], e.g. prefill:req-1:2"
                raise ValueError(f"{ENV_VAR} rule {rule!r}: expected {form}")
            seconds = 0.0
            if site.strip() in TIMED_SITES:
                rest, seconds = _slow_seconds(rule, rest)
            request_id, times = rest, 1
            head, sep, tail = rest.rpartition(":")
            # A trailing ":N" is the count; request ids may contain ':' themselves.
            counted = sep and _is_count_place(head, tail)
            if counted and seconds and not _is_count(tail):
                raise ValueError(f"{ENV_VAR} rule {rule!r}: expected {_timed_form(site)}")
            if counted:
                request_id, times = head, _count(rule, tail)
            elif seconds:
                raise ValueError(f"{ENV_VAR} rule {rule!r}: expected {_timed_form(site)}")
            try:
                injector.add(site.strip(), request_id.strip(), times, seconds=seconds)
            except ValueError as exc:
                raise ValueError(f"{ENV_VAR} rule {rule!r}: {exc}") from None
        return injector

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> FaultInjector | None:
        """The injector ``HEADROOM_FAULTS`` asks for, or None when it is unset or empty.

        Raises:
            ValueError: a malformed rule (see :meth:`parse`).
        """
        env = environment.variables() if environ is None else environ
        spec = env.get(ENV_VAR, "").strip()
        spool = env.get(SPOOL_ENV_VAR, "").strip()
        if not spec and not spool:
            return None
        injector = cls.parse(spec) if spec else cls()
        injector.spool = Path(spool) if spool else None
        return injector

    def poll_spool(self) -> None:
        """Arm the rules of the spool folder's new ``*.fault`` files (at most every
        :data:`SPOOL_POLL_S` seconds). A file that cannot be read or parsed is renamed
        ``*.bad`` and ignored."""
        now = time.monotonic()
        if self.spool is None or now < self._next_poll:
            return
        self._next_poll = now + SPOOL_POLL_S
        try:
            files = sorted(self.spool.glob("*.fault"))
        except OSError:
            return
        for path in files:
            if _only_cuda_init(path):
                continue  # the engine's start takes those (check_cuda_init)
            taken = path.with_suffix(".taken")
            try:
                os.rename(path, taken)  # atomic: exactly one worker claims it
                parsed = FaultInjector.parse(taken.read_text())
            except FileNotFoundError:
                continue
            except (OSError, ValueError):
                with contextlib.suppress(OSError):
                    os.rename(taken, path.with_suffix(".bad"))
                continue
            for rule in parsed.rules:
                rule.source = taken
                self.rules.append(rule)

    def add(self, site: str, request_id: str = ANY_REQUEST, times: int = 1, *, seconds: float = 0.0) -> None:
        """Raise ``torch.OutOfMemoryError`` at ``site`` for ``request_id`` ``times`` times
        (at ``slow``: make ``times`` steps take ``seconds`` longer).

        Raises:
            ValueError: ``site`` not one of :data:`SITES`; an empty request id;
                ``times < 1``; a ``slow`` fault without ``seconds > 0``, or ``seconds``
                at another site.
        """
        if site not in SITES:
            raise ValueError(f"unknown fault site {site!r}; choose one of {', '.join(SITES)}")
        if not request_id:
            raise ValueError(f"empty request id (use {ANY_REQUEST!r} for any request)")
        if times < 1:
            raise ValueError(f"times must be >= 1, got {times}")
        if (site in TIMED_SITES) != (seconds > 0):
            raise ValueError(f"seconds > 0 go with the {SLOW!r} site only, or {SLOW_RESIZE!r}, got {seconds} "
                             f"at {site!r}")
        self.rules.append(FaultRule(site, request_id, times, seconds=seconds))

    def clear(self) -> None:
        self.rules.clear()

    @property
    def pending(self) -> int:
        """Faults still to inject, over all rules."""
        return sum(r.remaining for r in self.rules)

    def check(self, site: str, request_ids: Iterable[str]) -> None:
        """Raise if a live rule for ``site`` matches one of ``request_ids`` (the requests
        the step runs at that site); uses up one count of the first such rule. At
        ``slow``, take the rule's seconds instead (:func:`compute_slowly`) and return.

        Raises:
            torch.OutOfMemoryError: the injected fault, with a CUDA-like message.
        """
        if self.spool is not None:
            self.poll_spool()
        ids = list(request_ids)
        if not ids:
            return
        for rule in self.rules:
            if rule.site != site or rule.remaining <= 0:
                continue
            if rule.request_id == ANY_REQUEST:
                hit = ids[0]
            elif rule.request_id in ids:
                hit = rule.request_id
            else:
                continue
            rule.remaining -= 1
            self.fired.append((site, hit))
            if rule.source is not None and rule.remaining == 0:
                self._mark_fired(rule.source)
            if site == SLOW:
                log.warning("injected fault: a slow step of %.1f s (request %s)", rule.seconds, hit)
                compute_slowly(rule.seconds)
                log.warning("injected fault: the slow step of %.1f s is over", rule.seconds)
                return
            import torch  # here, not at import: the service reads the rules torch-free

            raise torch.OutOfMemoryError(
                "CUDA out of memory. Tried to allocate (an injected amount) "
                f"(injected at site {site} for request {hit})"
            )

    def resize_seconds(self) -> float:
        """The seconds the next live resize of the KV pool takes longer: a ``slow_resize``
        rule's (one of its counts used up), 0.0 when none is armed."""
        if self.spool is not None:
            self.poll_spool()
        for rule in self.rules:
            if rule.site == SLOW_RESIZE and rule.remaining > 0:
                rule.remaining -= 1
                self.fired.append((SLOW_RESIZE, ANY_REQUEST))
                if rule.source is not None and rule.remaining == 0:
                    self._mark_fired(rule.source)
                log.warning("injected fault: a slow KV pool resize, %.1f s longer", rule.seconds)
                return rule.seconds
        return 0.0

    def _mark_fired(self, source: Path) -> None:
        """Rename a spool file ``*.fired`` once every rule it held has fired."""
        if any(r.source == source and r.remaining > 0 for r in self.rules):
            return
        with contextlib.suppress(OSError):
            os.rename(source, source.with_suffix(".fired"))


SLOW_FORM = "slow:request:times:seconds, e.g. slow:*:1:25"


def _timed_form(site: str) -> str:
    """How a rule of a site that takes seconds is written."""
    return SLOW_FORM if site.strip() == SLOW else "slow_resize:*:times:seconds, e.g. slow_resize:*:1:8"


def _is_count_place(head: str, tail: str) -> bool:
    """Whether ``tail``, after a rule's last ``:``, is meant as its count: it follows the
    wildcard ``*`` (which holds no ``:``), or it starts as a number does (a digit, a
    sign, a point). Anything else is part of a request id that holds a ``:``."""
    text = tail.strip()
    return head.strip() == ANY_REQUEST or (text[:1].isdigit() or text[:1] in "+-.")


def _is_count(tail: str) -> bool:
    """Whether ``tail`` is written as an integer (its sign is checked by ``add``)."""
    return re.fullmatch(r"-?[0-9]+", tail.strip()) is not None


def _count(rule: str, tail: str) -> int:
    """A rule's count, written as an integer.

    Raises:
        ValueError: not an integer; the message quotes the rule.
    """
    if not _is_count(tail):
        raise ValueError(f"{ENV_VAR} rule {rule!r}: the count {tail.strip()!r} is not a positive integer")
    return int(tail)


def _slow_seconds(rule: str, rest: str) -> tuple[str, float]:
    """Split a ``slow`` rule's ``request:times:seconds`` into ``request:times`` and the
    seconds (a positive number).

    Raises:
        ValueError: no seconds, or not a positive number; the message quotes the rule.
    """
    head, sep, tail = rest.rpartition(":")
    try:
        seconds = float(tail)
    except ValueError:
        seconds = 0.0
    if not sep or not seconds > 0 or seconds == float("inf"):
        raise ValueError(f"{ENV_VAR} rule {rule!r}: expected {_timed_form(rule.partition(':')[0])}")
    return head, seconds


def compute_slowly(seconds: float) -> None:
    """Take ``seconds`` as a long step would: sleep in slices of :data:`SLOW_SLICE_S`,
    advancing the work counter (:mod:`engine.common.progress`) after each."""
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        time.sleep(min(SLOW_SLICE_S, left))
        progress.advance()


def _only_cuda_init(path: Path) -> bool:
    """Whether the spool file ``path`` holds ``cuda_init`` rules only."""
    try:
        rules = FaultInjector.parse(path.read_text()).rules
    except (OSError, ValueError):
        return False
    return bool(rules) and all(r.site == CUDA_INIT for r in rules)


def check_cuda_init(environ: Mapping[str, str] | None = None) -> None:
    """Fire an armed ``cuda_init`` fault: from ``HEADROOM_FAULTS`` (every engine start
    while it is set) or from a spool file (one count per engine start, across workers:
    the file is claimed, and written back with one count less until none is left).

    Raises:
        engine.common.errors.CudaUnavailable: the injected failure, worded as CUDA's.
    """
    from engine.common.errors import CUDA_HINTS, CudaUnavailable

    env = environment.variables() if environ is None else environ
    failure = CudaUnavailable(
        "CUDA failed to initialise: CUDA unknown error (error 999, injected at site "
        f"cuda_init); {CUDA_HINTS}"
    )
    spec = env.get(ENV_VAR, "").strip()
    if spec and any(r.site == CUDA_INIT for r in FaultInjector.parse(spec).rules):
        raise failure
    spool = env.get(SPOOL_ENV_VAR, "").strip()
    if not spool:
        return
    for path in sorted(Path(spool).glob("*.fault")):
        if not _only_cuda_init(path):
            continue
        taken = path.with_suffix(".taken")
        try:
            os.rename(path, taken)  # atomic: one engine start takes one count
            rules = FaultInjector.parse(taken.read_text()).rules
        except (FileNotFoundError, ValueError):
            continue
        left = sum(r.remaining for r in rules) - 1
        if left > 0:
            scratch = taken.with_suffix(".next")
            scratch.write_text(f"{CUDA_INIT}:*:{left}")
            os.rename(scratch, path)
            os.unlink(taken)
        else:
            os.rename(taken, path.with_suffix(".fired"))
        raise failure
