"""Tracing is optional: without the `otel` extra, the relay never imports OpenTelemetry.

A fresh interpreter is needed to see what is imported (this one has the test extra), so
this runs in a subprocess, outside the unit tier.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

from relay.core.tracing import enabled


def test_without_the_otel_extra_nothing_is_imported_and_publish_is_untouched() -> None:
    """A subprocess in which `opentelemetry` cannot be imported, as without the extra."""
    script = textwrap.dedent(
        """
        import asyncio, sys
        from importlib.abc import MetaPathFinder

        attempts = []

        class NoOpenTelemetry(MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name == "opentelemetry" or name.startswith("opentelemetry."):
                    attempts.append(name)
                    raise ModuleNotFoundError(f"No module named {name!r}", name=name)
                return None

        sys.meta_path.insert(0, NoOpenTelemetry())

        import relay.cli.main  # everything `relay run` imports
        from relay.config import OutboxConfig
        from relay.core import tracing
        from relay.core.delivery import Delivery
        from relay.core.metrics import Metrics
        from relay.core.lane_state import OutboxState

        class Publisher:
            name, duplicates = "fake", 0
            async def publish(self, messages):
                return [None] * len(messages)

        publisher = Publisher()
        config = OutboxConfig.model_validate(
            {"broker": "fake", "messages": {"E": {"type": "t", "destination": "d"}}}
        )
        delivery = Delivery(
            "loans", config, publisher=publisher, metrics=Metrics(),
            state=OutboxState("loans"), stop=asyncio.Event(), interrupt=asyncio.Event(),
        )
        assert not tracing.enabled()
        assert delivery._send == publisher.publish  # the adapter's own method, no wrapper
        loaded = sorted(m for m in sys.modules if m.split(".")[0] == "opentelemetry")
        assert not loaded, loaded
        assert attempts, "the relay never tried to import opentelemetry"
        print("ok")
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"
    assert enabled()  # here, with the test extra, it is installed
