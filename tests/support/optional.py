"""Optional packages a test module needs, checked at collection without importing them.

Every worker collects every module, so ``pytest.importorskip`` at a module's top imports onnxscript,
transformers or openai in both workers, for seconds each, whichever worker runs the tests. ``need``
skips the module where the package is missing and gives a stand-in that imports it on first use."""
import importlib
import importlib.util

import pytest


class _OnFirstUse:
    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, attr):
        return getattr(importlib.import_module(self._name), attr)


def need(name: str) -> _OnFirstUse:
    if importlib.util.find_spec(name) is None:
        pytest.skip(f"{name} is not installed", allow_module_level=True)
    return _OnFirstUse(name)
