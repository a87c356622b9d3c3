"""One file per architecture llmd runs; each registers itself with llmd.runtime.models.registry."""
