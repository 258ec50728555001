"""Serving a patched dir: `python -m codegen serve DIR --tp N` (an OpenAI-compatible HTTP endpoint on rank 0) and
`python -m codegen generate DIR --tp N --prompt ...` (one completion, for scripts)."""
