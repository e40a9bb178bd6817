"""``headroom doctor``: what this machine and installation need to serve, checked one
by one, each a :class:`Check` that is OK, WARN (works, but worse than it could) or FAIL
(``headroom serve`` will not work as set up), with the fix when it is not OK.

:func:`run_checks` runs them in order: headroom itself, the config, torch and its CUDA
build, the NVIDIA driver through NVML, Triton and FlashInfer, the model ``serve`` would
load, the port (the running headroom, found as ``headroom status`` finds it, else one
listening on the configured port, is asked for its ``/api/health``),
the local token's permissions, the dashboard's files (its script is built from
TypeScript in a source tree), and the login service's state. Nothing here changes the
machine. torch is imported (to read its build), never a model.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import shutil
import stat
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

OK, WARN, FAIL = "OK", "WARN", "FAIL"
CUDA_INDEX = "https://download.pytorch.org/whl/cu128"


@dataclass(frozen=True)
class Check:
    """One line of the report: ``status`` (OK, WARN, FAIL), ``name``, what was found,
    and (unless OK) the ``fix``."""

    name: str
    status: str
    detail: str
    fix: str = ""


@dataclass
class Context:
    """Facts shared between checks: the settings (None when the config is broken) and
    the GPUs NVML sees."""

    settings: Any = None
    gpus: list[str] = field(default_factory=list)
    config_path: Path | None = None  # --config; None: HEADROOM_CONFIG or the default file
    cuda_usable: bool = False


def _check_headroom(ctx: Context) -> Check:
    from service.common.version import headroom_version

    return Check(
        "headroom",
        OK,
        f"{headroom_version()} on Python {sys.version.split()[0]} ({sys.executable})",
    )


def _check_config(ctx: Context) -> Check:
    from engine.common.environment import CONFIG
    from service.common.settings import SettingsError
    from service.common.settings_sources import default_config_path, resolve

    path = ctx.config_path or Path(CONFIG.get() or default_config_path())
    try:
        ctx.settings = resolve({}, config_path=ctx.config_path)
    except SettingsError as exc:
        # A value from a HEADROOM_* variable is fixed there, not in the file.
        fix = f"correct or unset {exc.variable}" if exc.variable else f"correct or remove {path}"
        return Check("config", FAIL, str(exc), fix)
    where = f"{path}" if path.exists() else f"{path} (absent: the defaults)"
    return Check("config", OK, where)


def _check_nvml(ctx: Context) -> Check:
    try:
        import pynvml
    except ImportError:
        return Check("driver", FAIL, "pynvml is missing", "pip install nvidia-ml-py")
    try:
        pynvml.nvmlInit()
    except Exception as exc:  # NVMLError_LibraryNotFound, _DriverNotLoaded...
        return Check(
            "driver",
            WARN,
            f"no NVIDIA driver or GPU found by NVML ({exc}): headroom runs on the CPU",
            "to use an NVIDIA GPU, install its driver (nvidia-smi should list the card)",
        )
    try:
        driver = pynvml.nvmlSystemGetDriverVersion()
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            name = pynvml.nvmlDeviceGetName(handle)
            total = pynvml.nvmlDeviceGetMemoryInfo(handle).total
            name = name.decode() if isinstance(name, bytes) else name
            ctx.gpus.append(f"{name} ({total / (1 << 30):.1f} GiB)")
    finally:
        pynvml.nvmlShutdown()
    driver = driver.decode() if isinstance(driver, bytes) else driver
    if not ctx.gpus:
        return Check("driver", WARN, f"NVIDIA driver {driver}, but no GPU", "")
    return Check("driver", OK, f"NVIDIA driver {driver}, NVML: {', '.join(ctx.gpus)}")


def _check_torch(ctx: Context) -> Check:
    try:
        import torch
    except ImportError:
        return Check("torch", FAIL, "torch is not installed", "pip install torch")
    cuda = torch.version.cuda
    build = f"CUDA {cuda} build" if cuda else "CPU build"
    if not ctx.gpus:
        return Check("torch", OK, f"{torch.__version__}, {build}; no GPU: runs on the CPU")
    if cuda is None:
        return Check(
            "torch",
            FAIL,
            f"{torch.__version__} is a CPU build, on a machine with an NVIDIA GPU",
            f"pip install --force-reinstall torch --index-url {CUDA_INDEX} "
            "(installers/install.sh picks the build from nvidia-smi)",
        )
    try:
        ctx.cuda_usable = torch.cuda.is_available()
    except Exception:  # pragma: no cover - some broken drivers raise
        ctx.cuda_usable = False
    if not ctx.cuda_usable:
        return Check(
            "torch",
            FAIL,
            f"{torch.__version__}, {build}, but CUDA cannot initialise",
            "update the NVIDIA driver if it is older than CUDA "
            f"{cuda} needs; after a suspend, reload its UVM module (sudo rmmod nvidia_uvm "
            "&& sudo modprobe nvidia_uvm) or reboot",
        )
    return Check("torch", OK, f"{torch.__version__}, {build}, CUDA works")


def _version_of(module: str) -> str | None:
    if importlib.util.find_spec(module) is None:
        return None
    try:
        return importlib.metadata.version(module)
    except Exception:
        return "installed"


def _check_kernels(ctx: Context) -> Check:
    triton, flashinfer = _version_of("triton"), _version_of("flashinfer")
    found = f"triton {triton or 'missing'}, flashinfer {flashinfer or 'missing (optional)'}"
    if not ctx.cuda_usable:
        # On the CPU the C kernels serve (kernels/cpu, built at the first start by a C
        # compiler); without one torch's slower kernels do.
        from kernels.cpu.build import compiler

        cc = compiler()
        if cc is None or shutil.which(cc) is None:
            return Check("kernels", WARN, f"no C compiler{f' at CC={cc}' if cc else ''}: the CPU runs torch's "
                         "slower kernels", "install gcc or clang (e.g. apt install gcc), or set CC to one")
        return Check("kernels", OK, f"C compiler {cc} for the CPU kernels (built at the first CPU start); "
                     f"{found}, not used on the CPU")
    if triton is None:
        return Check(
            "kernels",
            WARN,
            f"{found}: attention and sampling run the slower torch path",
            "pip install 'headroom[cuda]' (Triton)",
        )
    return Check("kernels", OK, found)


def _check_model(ctx: Context) -> Check:
    model = ctx.settings.model if ctx.settings is not None else None
    if model is not None:
        path = Path(model).expanduser()
        if path.exists():
            return Check("model", OK, f"{path}")
        from engine.common.load_errors import ModelNotFound
        from engine.loader.store import find_model

        try:
            found = find_model(model)
        except ModelNotFound as exc:
            return Check("model", FAIL, str(exc), "set model in the config to one that exists")
        if found is None:
            return Check(
                "model",
                FAIL,
                f"{model}: no such file, folder or name in the store",
                f"`headroom pull {model}` or correct model in the config",
            )
        return Check("model", OK, f"{model} (the store: {found})")
    from engine.common.load_errors import ModelNotFound
    from engine.loader.default_model import DEFAULT_INSTALL, default_gguf_path

    try:
        path = default_gguf_path()
    except ModelNotFound as exc:
        return Check("model", FAIL, str(exc), DEFAULT_INSTALL)
    return Check("model", OK, f"default, {path.name} ({path.stat().st_size / (1 << 20):.0f} MiB)")


def _ask_health(host: str, port: int) -> dict[str, Any] | None:
    """The JSON of ``/api/health`` at ``host:port``, or None when what listens there is
    not headroom (or does not answer)."""
    import httpx

    name = f"[{host}]" if ":" in host else host
    try:
        response = httpx.get(f"http://{name}:{port}/api/health", timeout=3.0)
        body = response.json()
    except (httpx.HTTPError, ValueError):
        return None
    return body if isinstance(body, dict) and "status" in body else None


_SEE_LOG = "see `headroom service logs`, or the log of the headroom serve you started"


def _check_port(ctx: Context) -> Check:
    """The running headroom's health (where ``runtime.json`` says it listens, as
    ``headroom status`` finds it); without one, whether the configured port is free."""
    if ctx.settings is None:
        return Check("port", WARN, "not checked: the config is broken", "")
    from service.cli.instance import service_address

    host, port, info = service_address(ctx.settings.host, ctx.settings.port)
    if host in ("0.0.0.0", "::", ""):
        host = "127.0.0.1"
    if info is not None:
        return _running_health(host, port, info, ctx.settings.port)
    from service.cli.serve import bind_socket

    try:
        bind_socket(host, port).close()
        return Check("port", OK, f"{host}:{port} is free")
    except OSError:
        pass
    health = _ask_health(host, port)
    if health is None:
        return Check(
            "port",
            FAIL,
            f"{host}:{port} is in use by another program",
            "stop it, or set another port (port = N in the config, HEADROOM_PORT or --port)",
        )
    return _health_check(f"headroom answers on {host}:{port}", health)


def _running_health(host: str, port: int, info: dict[str, Any], configured: int) -> Check:
    who = f"headroom serve (pid {info.get('pid')}) on {host}:{port}"
    if port != configured:
        who += f" (the config says port {configured})"
    health = _ask_health(host, port)
    if health is None:
        return Check("port", WARN, f"{who} does not answer /api/health", _SEE_LOG)
    return _health_check(f"{who} answers", health)


def _health_check(detail: str, health: dict[str, Any]) -> Check:
    status = health.get("status")
    detail = f"{detail}: {status}"
    if status == "ready":
        return Check("port", OK, detail)
    reason = health.get("reason") or health.get("detail") or ""
    return Check("port", WARN, f"{detail}{f' ({reason})' if reason else ''}", _SEE_LOG)


def _check_token(ctx: Context) -> Check:
    from service.common.token import read_token, token_path

    path = token_path()
    if not path.exists():
        return Check("token", OK, f"{path} not created yet (headroom serve creates it)")
    if read_token(path) is None:
        return Check("token", FAIL, f"{path} holds no valid token", f"delete {path}")
    if sys.platform == "win32":
        return Check("token", OK, f"{path} (the user folder's permissions)")
    mode = stat.S_IMODE(path.stat().st_mode)
    if mode & 0o077:
        return Check(
            "token",
            FAIL,
            f"{path} is readable by other users (mode {mode:o})",
            f"chmod 600 {path}",
        )
    return Check("token", OK, f"{path} (mode {mode:o})")


def _check_dashboard(ctx: Context) -> Check:
    from service.common.resources import DASHBOARD_BUILD, dashboard_missing, data_dir

    folder = data_dir("dashboard")
    missing = dashboard_missing(folder)
    if missing:
        return Check(
            "dashboard",
            WARN,
            f"not built: {' and '.join(missing)} missing in {folder} (/ui says so; the API serves)",
            DASHBOARD_BUILD,
        )
    return Check("dashboard", OK, f"{folder} (served at /ui)")


def _check_service(ctx: Context) -> Check:
    from service.autostart.manager import SystemdManager, manager_for

    try:
        manager = manager_for()
    except ValueError as exc:
        return Check("service", OK, str(exc))
    installed = manager.is_installed()
    where = f"installed at {manager.path}" if installed else f"not installed ({manager.name})"
    # Checked first: `headroom service install` cannot work without it either.
    problem = manager.user_manager_problem()
    if problem is not None:
        if installed:  # a file the manager cannot confirm is no installed service
            where = f"a unit file at {manager.path} that no service manager confirms"
        return Check("service", WARN, f"{where}, and {problem.what}", problem.fix)
    if not installed:
        return Check(
            "service",
            OK,
            f"{where}; `headroom service install` starts headroom at login",
        )
    if isinstance(manager, SystemdManager):
        if manager.is_enabled() is False:
            return Check(
                "service",
                WARN,
                f"a unit file at {manager.path}, but the user manager does not start it at login (not enabled)",
                "`headroom service install` enables it (or `headroom service uninstall` removes the file)",
            )
        state = manager.active_state()
        if state == "failed":
            return Check(
                "service",
                FAIL,
                f"installed at {manager.path}: failed",
                "`headroom service logs` says why; then `headroom service start`",
            )
        return Check("service", OK, f"installed at {manager.path}: {state}")
    return Check("service", OK, f"installed at {manager.path}")


CHECKS: tuple[Callable[[Context], Check], ...] = (
    _check_headroom,
    _check_config,
    _check_nvml,
    _check_torch,
    _check_kernels,
    _check_model,
    _check_port,
    _check_token,
    _check_dashboard,
    _check_service,
)


def run_checks(config_path: Path | None = None) -> Iterator[Check]:
    """Each check's result in order, with the settings of ``config_path`` (None:
    ``HEADROOM_CONFIG`` or the default file); a check that raises is a FAIL naming the
    error."""
    ctx = Context(config_path=config_path)
    for check in CHECKS:
        name = check.__name__.removeprefix("_check_")
        try:
            yield check(ctx)
        except Exception as exc:  # a doctor reports; it does not crash
            yield Check(name, FAIL, f"the check itself failed: {type(exc).__name__}: {exc}")
