"""The OpenAI-compatible server over a text backend (embedded engine, vLLM) and the backends."""
