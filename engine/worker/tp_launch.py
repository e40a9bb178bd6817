"""Start the ranks of a tensor-parallel worker and keep them one unit.

Rank 0 is the process that calls :func:`start_group` (the worker the service started,
or ``headroom generate``): it spawns ranks 1..N-1 as its children (multiprocessing's
*spawn*: fresh interpreters, no CUDA state inherited), joins the process group with them
and builds its engine. The group lives and dies as one:

- a follower exits or is killed: rank 0's watcher thread sees it, ends the other
  followers and exits (:data:`EXIT_RANK_LOST`); the service's supervisor then restarts
  the worker, as after any worker death, and the in-flight requests fail as then;
- rank 0 dies (killed by the supervisor's watchdog after a hang included): Linux's
  parent-death signal (SIGKILL) ends every follower, so no rank keeps holding memory;
- a follower hangs: rank 0 waits in the next collective, its work counter
  (:mod:`engine.common.progress`, sent with its heartbeats) stops moving, and the
  supervisor's watchdog ends it, hence the followers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import sys
import tempfile
import threading
from collections.abc import Iterator
from typing import Any

from engine.common.parent_death import die_with_parent
from engine.parallel.group import NCCL_ENV, TensorParallel, init_group, leave_group, rank_device

log = logging.getLogger("headroom.parallel")

# rank 0's exit code when a follower is gone (the supervisor restarts the group).
EXIT_RANK_LOST = 5


@dataclasses.dataclass
class Group:
    """Rank 0's handle on its group: its :class:`TensorParallel` and its followers.

    ``stopping`` is set before an orderly stop, so the watcher does not take the
    followers' exits for a failure.
    """

    tp: TensorParallel
    followers: list[multiprocessing.Process]
    stopping: threading.Event = dataclasses.field(default_factory=threading.Event)

    @property
    def pids(self) -> list[int]:
        """Every rank's pid, rank 0 first."""
        return [os.getpid(), *(p.pid for p in self.followers)]

    def end_followers(self) -> None:
        """SIGKILL the followers still alive and reap them."""
        for p in self.followers:
            if p.is_alive():
                p.kill()
        for p in self.followers:
            p.join(timeout=10)


def start_group(config: Any) -> Group:
    """Spawn ranks 1..N-1 of ``config.tensor_parallel_size`` and join the group as
    rank 0 (blocks until every rank joined); starts the watcher thread.

    ``config`` is an :class:`engine.common.config.EngineConfig`; the followers build their
    engines from it on their own device (``cuda:rank``, or the CPU).

    Raises:
        engine.common.errors.SettingRefused: fewer CUDA devices than ranks, or a model the
            group cannot split (checked before any rank starts, so the worker reports it
            as a load error instead of losing a rank); the loader's errors for a
            missing model.
    """
    world = config.tensor_parallel_size
    _check_before_start(config)
    os.environ.update(NCCL_ENV)  # the spawned followers inherit it too
    store = os.path.join(tempfile.mkdtemp(prefix="headroom-tp-"), "store")
    ctx = multiprocessing.get_context("spawn")
    followers = [
        ctx.Process(target=follower_main, args=(rank, config, store, os.getpid()), name=f"headroom-rank{rank}",
                    daemon=True)
        for rank in range(1, world)
    ]
    # The service starts its worker as a daemonic multiprocessing child, and
    # multiprocessing refuses children of those (it could not reap them at exit). The
    # ranks are reaped here (stop_group, end_followers) and killed with rank 0 by the
    # parent-death signal, so the flag is lifted while they start.
    config_of_this = multiprocessing.current_process()._config
    daemon = config_of_this.pop("daemon", None)
    try:
        for p in followers:
            p.start()
    finally:
        if daemon is not None:
            config_of_this["daemon"] = daemon
    group = Group(tp=None, followers=followers)  # type: ignore[arg-type]
    threading.Thread(target=_watch, args=(group,), name="headroom-rank-watcher", daemon=True).start()
    import torch

    group.tp = init_group(0, world, torch.device(rank_device(config.device, 0)), store)
    log.info("tensor-parallel group of %d ranks formed (pids %s)", world, group.pids)
    return group


def _check_before_start(config: Any) -> None:
    import torch

    from engine.core.settings_fit import check_for_model
    from engine.loader.hf_config import load_model_config
    from engine.loader.resolve import resolve_model
    from engine.parallel.split import check_gpu_count

    world = config.tensor_parallel_size
    if rank_device(config.device, 0) != "cpu":
        check_gpu_count(world, torch.cuda.device_count())
    check_for_model(config, load_model_config(resolve_model(config.model)))


def rank_config(config: Any, rank: int) -> Any:
    """``config`` with the device rank ``rank`` runs on."""
    return dataclasses.replace(config, device=rank_device(config.device, rank))


def _watch(group: Group) -> None:
    """Rank 0's watcher: the first follower to exit, unless the group is stopping, ends
    the group (see the module docstring)."""
    sentinels = {p.sentinel: p for p in group.followers}
    ready = multiprocessing.connection.wait(list(sentinels))
    if group.stopping.is_set():
        return
    gone = sentinels[ready[0]]
    gone.join(timeout=1)
    log.error("rank %s (pid %d) exited with code %s; ending the tensor-parallel group so it restarts whole",
              gone.name.removeprefix("headroom-rank"), gone.pid, gone.exitcode)
    group.end_followers()
    sys.stderr.flush()
    os._exit(EXIT_RANK_LOST)


def follower_main(rank: int, config: Any, store: str, leader_pid: int) -> None:
    """Process target of ranks 1..N-1: join the group, build this rank's engine, follow
    rank 0 until it says stop (or is gone)."""
    die_with_parent()  # rank 0 is the parent: a follower dies with it
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # rank 0 decides when the group stops
    if os.getppid() != leader_pid:
        os._exit(EXIT_RANK_LOST)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"%(levelname)s %(name)s[rank {rank}]: %(message)s")
    import torch

    from engine.core.engine import Engine
    from engine.core.tp_follow import follow

    cfg = rank_config(config, rank)
    tp = init_group(rank, config.tensor_parallel_size, torch.device(cfg.device), store)
    engine = Engine(cfg, tp=tp)
    log.info("rank %d ready: KV pool %d pages", rank, engine.info.num_pages)
    follow(engine, tp)
    leave_group()


def stop_group(group: Group) -> None:
    """An orderly stop: tell the followers to leave, reap them, leave the group."""
    from engine.core.tp_follow import stop_followers

    group.stopping.set()
    with contextlib.suppress(Exception):
        stop_followers(group.tp)
    for p in group.followers:
        p.join(timeout=30)
    group.end_followers()
    leave_group()


@contextlib.contextmanager
def parallel_engine(config: Any, factory: Any = None) -> Iterator[Any]:
    """An engine of ``config.tensor_parallel_size`` ranks run from this process (rank 0),
    stopped on exit: ``with parallel_engine(cfg) as engine: engine.step()``."""
    if factory is None:
        from engine.core.engine import Engine as factory
    group = start_group(config)
    try:
        engine = factory(rank_config(config, 0), tp=group.tp)
        engine.tp_group = group
        yield engine
    finally:
        stop_group(group)
