"""Shared fixtures: real models are pulled through the hub (never skipped)."""
from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def smollm2_path():
    from dasllama import hub

    return hub.pull("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def gemma3_path():
    from dasllama import hub

    return hub.pull("gemma3-270m")
