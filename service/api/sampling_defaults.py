"""What a request's unset sampling fields mean: the model's own recommendation.

A model folder may carry ``generation_config.json`` (Hugging Face's
:class:`transformers.GenerationConfig`); the fields its authors set there
(``temperature``, ``top_p``, ``top_k``, ``min_p``, ``repetition_penalty``) are the
defaults of every request that leaves them unset, as vLLM does with its
``--generation-config auto``. Only fields that differ from transformers' own defaults
count (``GenerationConfig.to_diff_dict``): a file written by ``save_pretrained`` holds
every field, and transformers' ``temperature=1.0`` is no recommendation. A GGUF's
``general.sampling.*`` metadata reaches the same file when it is converted
(:mod:`engine.loader.gguf_convert`). Fields the model does not set fall back to
OpenAI's defaults (temperature 1, top_p 1, the rest off).

Torch-free: transformers' ``GenerationConfig`` imports no torch.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger("headroom.api")

GENERATION_CONFIG = "generation_config.json"


@dataclass(frozen=True)
class SamplingDefaults:
    """Values for the sampling fields a request leaves unset (OpenAI's when the model
    says nothing). ``top_k`` 0 and ``min_p`` 0 mean off; ``repetition_penalty`` 1 is off.
    ``source`` says where they came from, for logs and ``/api/show``."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    source: str = "OpenAI's defaults"

    def as_dict(self) -> dict[str, float | int]:
        """The sampling values by their request field names (``source`` left out)."""
        return {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "repetition_penalty": self.repetition_penalty,
        }


def _number(value: Any, low: float, high: float) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if low <= value <= high else None


def from_generation_config(fields: dict[str, Any], source: str) -> SamplingDefaults:
    """Defaults from a generation config's explicitly set fields (a ``to_diff_dict``).

    ``do_sample: false`` without a temperature means greedy (temperature 0), as
    transformers' ``generate`` would do. Values outside the API's ranges are ignored
    (logged), never raised: a bad file must not keep the server from answering.
    """
    base = SamplingDefaults()
    temperature = _number(fields.get("temperature"), 0.0, 2.0)
    if fields.get("do_sample") is False and "temperature" not in fields:
        temperature = 0.0
    top_p = _number(fields.get("top_p"), 1e-9, 1.0)
    top_k = fields.get("top_k")
    top_k = top_k if isinstance(top_k, int) and not isinstance(top_k, bool) and top_k >= 0 else None
    min_p = _number(fields.get("min_p"), 0.0, 1.0)
    repetition = _number(fields.get("repetition_penalty"), 1e-9, 10.0)
    ignored = [
        name
        for name, parsed in (
            ("temperature", temperature),
            ("top_p", top_p),
            ("top_k", top_k),
            ("min_p", min_p),
            ("repetition_penalty", repetition),
        )
        if name in fields and fields[name] is not None and parsed is None
    ]
    if ignored:
        log.warning("%s: ignoring out-of-range sampling values %s", source, ", ".join(ignored))
    return SamplingDefaults(
        temperature=base.temperature if temperature is None else temperature,
        top_p=base.top_p if top_p is None else top_p,
        top_k=base.top_k if top_k is None else top_k,
        min_p=base.min_p if min_p is None else min_p,
        repetition_penalty=base.repetition_penalty if repetition is None else repetition,
        source=source,
    )


def load_sampling_defaults(model_dir: str | Path) -> SamplingDefaults:
    """The sampling defaults of the model in ``model_dir``: its ``generation_config.json``
    read through transformers' :class:`~transformers.GenerationConfig`, or OpenAI's
    defaults when there is none or it cannot be read (logged)."""
    path = Path(model_dir) / GENERATION_CONFIG
    if not path.is_file():
        return SamplingDefaults()
    from transformers import GenerationConfig

    try:
        config = GenerationConfig.from_pretrained(str(model_dir))
    except (OSError, ValueError) as exc:
        log.warning("cannot read %s (%s); using OpenAI's sampling defaults", path, exc)
        return SamplingDefaults()
    return from_generation_config(config.to_diff_dict(), str(path))
