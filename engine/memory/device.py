"""What the device's memory looks like now: NVML on a real GPU, flags when simulated.

Torch-free. NVML is preferred to ``torch.cuda.mem_get_info`` because it sees every
process on the card (the desktop, other apps, a dying predecessor) by pid.
"""

from __future__ import annotations

import os

from engine.common.units import fmt_bytes
from engine.memory.plan import DeviceMemory


def simulated_device(total_bytes: int, free_bytes: int | None = None, *, display_attached: bool = False) -> DeviceMemory:
    """A device that exists only in numbers: ``free_bytes`` defaults to ``total_bytes``.

    Raises:
        ValueError: ``free_bytes`` outside ``[0, total_bytes]``.
    """
    free = total_bytes if free_bytes is None else free_bytes
    if not 0 <= free <= total_bytes:
        raise ValueError(f"--device-free ({free} bytes) must lie between 0 and --device-total ({total_bytes} bytes)")
    return DeviceMemory(
        name=f"simulated device ({fmt_bytes(total_bytes)})",
        total_bytes=total_bytes,
        free_bytes=free,
        others_bytes=total_bytes - free,
        display_attached=display_attached,
        simulated=True,
    )


def probe_nvml(index: int = 0, own_pids: frozenset[int] | None = None) -> DeviceMemory | None:
    """Read device ``index`` through NVML; None where NVML or the GPU is missing.

    ``others_bytes`` is what NVML attributes to processes outside ``own_pids`` (default:
    this process), plus any used memory NVML attributes to no listed process (the
    driver's and the display's own, invisible processes in containers).
    """
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return None
    try:
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        mem = pynvml.nvmlDeviceGetMemoryInfo(handle)
        name = pynvml.nvmlDeviceGetName(handle)
        name = name.decode() if isinstance(name, bytes) else name
        own = own_pids if own_pids is not None else frozenset({os.getpid()})
        procs: dict[int, int] = {}
        for getter in (pynvml.nvmlDeviceGetComputeRunningProcesses, pynvml.nvmlDeviceGetGraphicsRunningProcesses):
            try:
                for p in getter(handle):
                    procs[p.pid] = max(procs.get(p.pid, 0), int(p.usedGpuMemory or 0))
            except pynvml.NVMLError:
                pass
        ours = sum(b for pid, b in procs.items() if pid in own)
        others = max(int(mem.used) - ours, 0)
        top = sorted(((pid, proc_name(pid), b) for pid, b in procs.items() if pid not in own), key=lambda t: -t[2])[:5]
        try:
            display = bool(pynvml.nvmlDeviceGetDisplayActive(handle)) or bool(pynvml.nvmlDeviceGetDisplayMode(handle))
        except pynvml.NVMLError:
            display = False
        return DeviceMemory(
            name=f"{name} (GPU {index})",
            total_bytes=int(mem.total),
            free_bytes=int(mem.free),
            others_bytes=others,
            display_attached=display,
            top_consumers=tuple(top),
        )
    except pynvml.NVMLError:
        return None
    finally:
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError:
            pass


def proc_name(pid: int) -> str:
    """A process's short name (``/proc/PID/comm``), ``"?"`` where it cannot be read."""
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return "?"


def nvml_index(cuda_index: int = 0, env: dict[str, str] | None = None) -> int:
    """NVML's index of CUDA device ``cuda_index``: ``CUDA_VISIBLE_DEVICES`` renumbers the
    CUDA devices, NVML does not (entries that are not plain numbers, such as GPU UUIDs,
    are taken as the identity)."""
    visible = (os.environ if env is None else env).get("CUDA_VISIBLE_DEVICES", "")
    parts = [p.strip() for p in visible.split(",")] if visible.strip() else []
    if cuda_index < len(parts) and parts[cuda_index].isdigit():
        return int(parts[cuda_index])
    return cuda_index
