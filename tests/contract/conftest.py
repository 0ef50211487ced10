"""The `broker` fixture: every harness in tests/contract/brokers/, one module per broker.

Each module defines `async def start(request) -> BrokerHarness`. Adding a broker is
adding a module; the contract suite then runs against it unchanged.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import AsyncIterator

import pytest

from tests.contract import brokers
from tests.contract.harness import BrokerHarness

KINDS = sorted(m.name for m in pkgutil.iter_modules(brokers.__path__))


@pytest.fixture(params=KINDS)
async def broker(request: pytest.FixtureRequest) -> AsyncIterator[BrokerHarness]:
    module = importlib.import_module(f"tests.contract.brokers.{request.param}")
    harness: BrokerHarness = await module.start(request)
    try:
        await harness.prepare()
        yield harness
    finally:
        await harness.close()
