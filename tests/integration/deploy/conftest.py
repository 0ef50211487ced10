"""The chart, loaded once per module by helm-python-sdk (Helm v4 as a library)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.integration.deploy.chart import CHART, INSTALL, helm_python


@pytest.fixture(scope="module")
def chart() -> Iterator[Any]:
    if helm_python is None:
        pytest.fail(
            f"helm-python-sdk is not installed: {INSTALL['helm-python-sdk']}", pytrace=False
        )
    with helm_python.Chart.load(CHART) as loaded:
        yield loaded
