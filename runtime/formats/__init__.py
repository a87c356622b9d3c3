"""Readers of the formats llmd runs (GGUF files; more to come)."""
