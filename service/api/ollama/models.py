"""The served model as Ollama describes it: ``details`` (family, size, format), the
entries of ``/api/tags`` and ``/api/ps``, and their dates.
"""

from __future__ import annotations

import hashlib
from datetime import datetime, timezone

from engine.common.model_names import tagged
from engine.wire.messages import EngineInfo
from service.api.ollama.schemas import OllamaDetails, OllamaModel
from service.api.services import Services

_BYTES_PER_PARAMETER = {"float32": 4, "float16": 2, "bfloat16": 2}


def details(info: EngineInfo) -> OllamaDetails:
    """Ollama's ``details`` of the served model: family from the architecture
    (``LlamaForCausalLM`` -> ``llama``), the parameter count (``135M``), and as the
    format and quantization level the GGUF block type the weights are held in
    (``gguf``, ``Q4_1``) or, when they are held dequantized, their dtype."""
    family = info.architecture.lower().removesuffix("forcausallm") or info.architecture
    count = info.parameter_count
    if not count:  # an engine that does not count them (tests' fake): from the dense bytes
        per = _BYTES_PER_PARAMETER.get(info.dtype.removeprefix("torch."), 0)
        count = info.weight_bytes // per if per and not info.weight_format else 0
    if count >= 10**9:
        size = f"{count / 10**9:.1f}B"
    elif count:
        size = f"{round(count / 10**6)}M"
    else:
        size = "unknown"
    return OllamaDetails(
        format="gguf" if info.weight_format else "safetensors",
        family=family,
        families=[family],
        parameter_size=size,
        quantization_level=info.weight_format or info.dtype.removeprefix("torch.").upper(),
    )


def rfc3339(moment: datetime) -> str:
    """``moment`` (UTC) as Ollama writes times: RFC 3339 with ``Z``."""
    return moment.isoformat().replace("+00:00", "Z")


def modified_at(svc: Services) -> str:
    """The model's ``modified_at``: when the service started."""
    return rfc3339(datetime.fromtimestamp(svc.started_at, timezone.utc))


def ollama_name(svc: Services, info: EngineInfo) -> str:
    """The one name Ollama's listings give the served model: the first
    ``--served-model-name`` if any, else the engine's, tagged ``:latest`` as Ollama tags
    a model pulled without one. Every other name it answers to (``default``, the store
    name) still works in a request."""
    name = svc.settings.served_model_name[0] if svc.settings.served_model_name else info.model_name
    return tagged(name)


def models(svc: Services, info: EngineInfo) -> list[OllamaModel]:
    """The served model's entry, once (Ollama lists each model once; a model picker
    would show an alias as a second model)."""
    digest = hashlib.sha256(info.model_dir.encode("utf-8")).hexdigest()
    name = ollama_name(svc, info)
    return [
        OllamaModel(
            name=name,
            model=name,
            modified_at=modified_at(svc),
            size=info.weight_bytes,
            digest=digest,
            details=details(info),
        )
    ]
