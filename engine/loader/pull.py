"""``headroom pull REPO[:FILE]``: fetch a model from the Hugging Face Hub into the store.

Through huggingface_hub (``hf_hub_download`` for one GGUF file, ``snapshot_download``
for a folder), into :func:`engine.loader.store.store_dir`: downloads resume where an
interrupted one stopped (the ``.incomplete`` blob is continued with a Range request),
show a progress bar, and honour ``HF_ENDPOINT`` (a mirror), ``HF_TOKEN`` and
``HF_HUB_OFFLINE``. Offline, a pull fails at once, saying so. Torch-free.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from engine.loader.store import store_dir

# What a Hugging Face folder needs to load: the config, safetensors weights (and their
# index), the tokenizer and chat template files. Not *.bin, ONNX or other formats.
FOLDER_PATTERNS = (
    "config.json",
    "generation_config.json",
    "*.safetensors",
    "*.safetensors.index.json",
    "tokenizer*",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "chat_template.*",
    "*.model",
)

_REPO = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


class PullError(Exception):
    """A pull that cannot be done; the message says why and what to do. ``usage`` is
    True when the spec itself is wrong (not ``REPO[:FILE.gguf]``)."""

    def __init__(self, message: str, *, usage: bool = False) -> None:
        super().__init__(message)
        self.usage = usage


@dataclass(frozen=True)
class Pulled:
    """A model now in the store: its store ``name`` and the ``path`` to load."""

    name: str
    path: Path


def parse_spec(spec: str) -> tuple[str, str | None]:
    """``"owner/name[:FILE.gguf]"`` -> ``(repo_id, file or None)``.

    Raises:
        PullError: not of that form.
    """
    repo, _, file = spec.partition(":")
    if not _REPO.match(repo):
        raise PullError(f"{spec!r} is not REPO[:FILE]: REPO is owner/name, as on huggingface.co (e.g. "
                        "Qwen/Qwen2.5-0.5B-Instruct or Qwen/Qwen2.5-0.5B-Instruct-GGUF:qwen2.5-0.5b-instruct-q4_k_m.gguf)",
                        usage=True)
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:  # the Hub's own rules on the name ('--' or '..', its length), before any request
        validate_repo_id(repo)
    except HFValidationError as exc:
        reason = str(exc).splitlines()[0].rstrip(".").removesuffix(f": '{repo}'")
        raise PullError(f"{repo!r} is not a repository name the Hub accepts: {reason}", usage=True) from None
    if file and not file.lower().endswith(".gguf"):
        raise PullError(f"{file!r} is not a .gguf file: pull REPO:FILE.gguf for one GGUF file, or REPO alone "
                        "for a Hugging Face folder", usage=True)
    return repo, file or None


def pull(spec: str) -> Pulled:
    """Fetch ``spec`` (``REPO`` or ``REPO:FILE.gguf``) into the store.

    ``REPO`` alone fetches the Hugging Face folder (:data:`FOLDER_PATTERNS`); a
    repository without ``config.json`` but with exactly one GGUF file fetches that file.

    Raises:
        PullError: a bad spec, offline (``HF_HUB_OFFLINE``, or the Hub cannot be
            reached), no such repository or file, or a repository with nothing headroom
            loads; the message says which.
    """
    repo, file = parse_spec(spec)
    from huggingface_hub import HfApi, constants, hf_hub_download, snapshot_download
    from huggingface_hub.errors import (
        EntryNotFoundError,
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    if constants.is_offline_mode():
        raise PullError("offline: HF_HUB_OFFLINE is set, and a pull needs the network "
                        "(`headroom models` lists what is already here)")
    cache = str(store_dir())
    endpoint = constants.ENDPOINT
    try:
        # One request first: offline it fails at once (hf_hub_download's HEAD retries
        # a refused connection for about 20 s), and it lists the repository's files.
        siblings = [s.rfilename for s in HfApi().model_info(repo).siblings or []]
        if file is not None and file not in siblings:
            ggufs = ", ".join(s for s in siblings if s.lower().endswith(".gguf")) or "none"
            raise PullError(f"{repo} has no file {file!r} (its GGUF files: {ggufs})")
        if file is None and "config.json" in siblings:
            if not any(s.endswith(".safetensors") for s in siblings):
                raise PullError(f"{repo} holds no safetensors weights (headroom loads safetensors or GGUF)")
            folder = snapshot_download(repo, cache_dir=cache, allow_patterns=list(FOLDER_PATTERNS))
            return Pulled(repo, Path(folder))
        if file is None:
            file = _only_gguf(repo, siblings)
        path = hf_hub_download(repo, file, cache_dir=cache)
        return Pulled(f"{repo}:{file}", Path(path))
    except (OfflineModeIsEnabled, LocalEntryNotFoundError) as exc:
        raise PullError(f"offline: cannot reach {endpoint} ({_first_line(exc)}); a pull needs the network "
                        "(`headroom models` lists what is already here)") from None
    except (RepositoryNotFoundError, GatedRepoError) as exc:
        raise PullError(f"{repo}: no such repository on {endpoint}, or it is private or gated "
                        f"(set HF_TOKEN for those): {_first_line(exc)}") from None
    except RevisionNotFoundError as exc:
        raise PullError(f"{repo}: {_first_line(exc)}") from None
    except EntryNotFoundError:
        raise PullError(f"{repo} has no file {file!r}") from None
    except HfHubHTTPError as exc:
        raise PullError(f"{repo}: the Hub answered {_first_line(exc)}") from None
    except Exception as exc:
        if not _unreachable(exc):
            raise
        raise PullError(f"offline: cannot reach {endpoint} ({_first_line(exc)}); a pull needs the network "
                        "(`headroom models` lists what is already here)") from None


def _only_gguf(repo: str, siblings: list[str]) -> str:
    """The one GGUF file of a repository without ``config.json``.

    Raises:
        PullError: none, or several (the message lists a pull command for each).
    """
    ggufs = sorted(s for s in siblings if s.lower().endswith(".gguf"))
    if not ggufs:
        raise PullError(f"{repo} holds neither config.json nor a .gguf file: nothing headroom loads")
    if len(ggufs) > 1:
        listed = "\n".join(f"  headroom pull {repo}:{g}" for g in ggufs)
        raise PullError(f"{repo} holds {len(ggufs)} GGUF files; pick one:\n{listed}")
    return ggufs[0]


def _unreachable(exc: BaseException) -> bool:
    """A connection that could not be made or timed out: the HTTP client's transport
    errors (httpx's ``TransportError``, requests' ``ConnectionError``) or the OS's."""
    names = {c.__name__ for c in type(exc).__mro__}
    return bool(names & {"TransportError", "ConnectionError", "Timeout"}) or isinstance(exc, OSError)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
