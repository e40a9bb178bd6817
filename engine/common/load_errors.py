"""Errors raised while finding, converting and loading a model.

Torch-free, so the service can import them and map them to messages. Every message
names the path involved and says what to do about it.
"""

from __future__ import annotations


class ModelLoadError(Exception):
    """Base class: the model could not be found, read, converted or loaded."""


class ModelNotFound(ModelLoadError):
    """The path does not exist, holds no model, or the default model is not installed."""


class UnsupportedArchitecture(ModelLoadError):
    """``config.json`` (or a GGUF file) names an architecture headroom cannot run."""


class UnsupportedConfig(ModelLoadError):
    """A supported architecture with a variant headroom does not implement
    (a RoPE scaling type, a sliding window, an activation other than SiLU)."""


class ConfigFieldMissing(ModelLoadError):
    """``config.json`` lacks a field the model cannot be built without."""


class CorruptWeights(ModelLoadError):
    """A weight file is truncated, has a garbage header, or cannot be read."""


class WeightMismatch(ModelLoadError):
    """The weight files do not match the config: tensors missing, unexpected or of the
    wrong shape."""


class UnsupportedGGUFType(ModelLoadError):
    """A GGUF tensor is stored in a type the converter cannot dequantize."""


def cache_not_writable(gguf_name: str, folder: object, error: OSError) -> ModelLoadError:
    """The error for a GGUF's conversion folder (under ``HEADROOM_CACHE_DIR``) that cannot
    be created or written, naming the fix: the conversion's and serve's precheck alike."""
    return ModelLoadError(f"cannot write the conversion of {gguf_name} under {folder} ({error}); "
                          "point HEADROOM_CACHE_DIR at a writable folder")


def _with_subclasses(cls: type) -> list[type]:
    return [cls, *(c for sub in cls.__subclasses__() for c in _with_subclasses(sub))]


# The class names of every error above, as a worker's error message carries its kind: a
# load that fails on the model's files fails the same on every try.
LOAD_ERROR_NAMES = frozenset(c.__name__ for c in _with_subclasses(ModelLoadError))
