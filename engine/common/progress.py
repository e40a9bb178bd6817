"""How far this process's engine work has got: one counter, advanced as the work goes.

The service's watchdog tells a long step from a stuck one by this counter: the worker's
heartbeat thread (:mod:`engine.worker.heartbeat`) sends it every heartbeat interval, and
a ready worker whose counter stops moving while it has work is killed as hung
(:mod:`service.supervision.liveness`). So it must advance at least every few seconds
even in a very slow step. It is advanced:

- once per layer of a model's forward (:class:`engine.models.decoder.CausalLM`,
  :class:`engine.models.qwen3_next.HybridCausalLM`): a step of a model larger than the
  card, its experts run on the CPU, takes seconds per layer at worst; and once per
  layer of the CPU's C decode layer (:mod:`engine.layers.cpu_decode`);
- once per pass of the worker's main loop (a step that replays a CUDA graph runs no
  layer loop in Python);
- by the test-only ``slow`` fault (:mod:`engine.common.faults`) as it sleeps.

A plain Python int in the process, written by the thread that runs steps and read by
the heartbeat thread (an int read or write is atomic under the GIL; the reader only
needs to see it change). Advancing it launches nothing on a device and syncs nothing,
so it is safe inside a CUDA graph capture: it then advances once while capturing, and
not on replays.
"""

from __future__ import annotations

_count = 0


def advance() -> None:
    """One more unit of work done (a layer, a loop pass, a slice of a slow step)."""
    global _count
    _count += 1


def read() -> int:
    """The counter now: units of work done since the process started."""
    return _count
