"""Talking to an OpenAI-compatible endpoint from outside: which model it serves."""
from __future__ import annotations


def served_model(root: str, model_name: str | None = None) -> str:
    """Probe an OpenAI-compatible endpoint's /models (root: http://host:port/v1) and return
    the model to ask for: `model_name`, else the first one listed. A closed port is a
    one-line UsageError naming the URL (clients answer it with a traceback after retries)."""
    import httpx

    from k3verify.errors import UsageError
    root = root.rstrip("/")
    try:
        listing = httpx.get(root + "/models", timeout=30)
    except httpx.HTTPError as e:  # nothing listens: --model-name would not help, so do not suggest it
        raise UsageError(f"cannot reach {root}: {type(e).__name__}: {e}") from None
    if model_name is not None:
        return model_name
    try:
        data = listing.json().get("data") or []
    except (ValueError, AttributeError) as e:
        raise UsageError(f"cannot list models at {root}/models (HTTP {listing.status_code}, "
                         f"{type(e).__name__}); pass --model-name") from None
    if not data:
        raise UsageError(f"{root}/models lists no model; pass --model-name")
    return data[0]["id"]
