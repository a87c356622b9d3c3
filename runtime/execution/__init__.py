"""Execution backends: how one step runs on a device (see base.py). One is chosen per model at load,
by ``choose``; its module is imported only then, so a backend's heavy libraries load only where it
runs."""
from __future__ import annotations

import importlib

from ..config import EXECUTIONS
from ..errors import EngineDirError

# name -> "module:class"; "compiled" follows from an engine directory compiled for a step backend
_BACKENDS = {
    "cpu": "llmd.runtime.execution.cpu:CpuBackend",
    "reference": "llmd.runtime.execution.reference:ReferenceBackend",
    "compiled": "llmd.runtime.execution.compiled:CompiledBackend",
}


def backend_class(name: str):
    """The Execution subclass registered as ``name``."""
    module, _, attr = _BACKENDS[name].partition(":")
    return getattr(importlib.import_module(module), attr)


def choose(setting: str, compiled_step=None) -> str:
    """The backend for the ``execution`` setting (one of EXECUTIONS) and the weights: an engine
    directory compiled for a step backend runs that step; llmd's own model code runs on ``cpu``
    unless ``reference`` is asked for."""
    if setting not in EXECUTIONS:
        raise ValueError(f"execution must be one of {', '.join(EXECUTIONS)}, got {setting!r}")
    if compiled_step is not None:
        if setting != "auto":
            raise EngineDirError(f"this engine directory runs its compiled {compiled_step.name} step; execution "
                                 f"{setting!r} runs llmd's own model code: serve the model directory it was "
                                 "exported from, or leave execution on auto")
        return "compiled"
    return "cpu" if setting == "auto" else setting
