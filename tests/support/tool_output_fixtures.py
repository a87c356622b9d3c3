"""A real daemon serving the bundled code model with `llmd http` in front, and the real `openai`
client on it: shared by the tool-call and structured-output tests (import the fixtures)."""
from __future__ import annotations

from pathlib import Path

import pytest

from http_fixtures import daemon_and_front
from optional import need

openai = need("openai")

MODEL = Path(__file__).resolve().parents[2] / "models" / "code-target"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(daemon, base URL), one pair per test module."""
    with daemon_and_front(MODEL, tmp_path_factory.mktemp("toy-front")) as pair:
        yield pair


@pytest.fixture
def oai(served):
    return openai.OpenAI(base_url=served[1] + "/v1", api_key="none", timeout=60, max_retries=0)
