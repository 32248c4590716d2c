"""Backends: what the verifier drives. Each turns prompt token ids into TokenEvents."""

from k3verify.serving.backends.base import CompletionParams, TextBackend, TokenConstraint, TokenEvent

__all__ = ["CompletionParams", "TextBackend", "TokenConstraint", "TokenEvent", "EmbeddedBackend"]


def __getattr__(name):
    # Lazy: importing the package must not import torch for callers that only need the types.
    if name == "EmbeddedBackend":
        from k3verify.serving.backends.embedded import EmbeddedBackend
        return EmbeddedBackend
    raise AttributeError(f"module 'k3verify.serving.backends' has no attribute {name!r}")
