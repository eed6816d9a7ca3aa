"""Integrations (transformers plug-in, offline sampling engine + CLI, vLLM backend): not built yet.

The plan and the mapping of engine metadata to this package's API are in docs/integrations.md.
"""
