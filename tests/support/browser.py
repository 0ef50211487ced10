"""A real headless Chromium (Debian's `chromium` and `chromium-driver`) driven by selenium.

What a user sees is what the browser renders, so the status page is tested in one. Every
request the browser makes is read back from its performance log (the DevTools Network
events), and every console message from its browser log: a test can assert that nothing
left 127.0.0.1 and nothing went wrong.
"""

from __future__ import annotations

import contextlib
import json
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from selenium import webdriver
from selenium.webdriver.chrome.service import Service

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
INSTALL = (
    "Debian's chromium and chromium-driver are needed for the status page's browser tests:"
    " `apt-get install -y --no-install-recommends chromium chromium-driver` as root"
    " (`python3 dev.py test` run as root does it)"
)
# Without the background-networking flags Chromium calls home (updates, sync, safe
# browsing), which a closed network refuses, and which the test would take for the page's.
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
    "--window-size=1400,1000",
)


@contextlib.contextmanager
def chromium() -> Iterator[webdriver.Chrome]:
    """A fresh headless Chromium with its own profile; fails naming the packages if absent."""
    if not CHROMIUM.exists() or not CHROMEDRIVER.exists():
        pytest.fail(INSTALL)
    with tempfile.TemporaryDirectory(prefix="relay-chromium-") as profile:
        options = webdriver.ChromeOptions()
        options.binary_location = str(CHROMIUM)
        for flag in (*FLAGS, f"--user-data-dir={profile}"):
            options.add_argument(flag)
        options.set_capability("goog:loggingPrefs", {"browser": "ALL", "performance": "ALL"})
        driver = webdriver.Chrome(options=options, service=Service(str(CHROMEDRIVER)))
        try:
            # The browser's own start page loads chrome:// resources: leave it, then forget
            # them, so that what the logs hold afterwards is the test's.
            driver.get("about:blank")
            requested_urls(driver)
            console_errors(driver)
            yield driver
        finally:
            driver.quit()


def requested_urls(driver: webdriver.Chrome) -> list[str]:
    """Every URL the browser asked for since the last call (DevTools Network events)."""
    urls = []
    for entry in _log(driver, "performance"):
        message: dict[str, Any] = json.loads(entry["message"])["message"]
        if message.get("method") == "Network.requestWillBeSent":
            urls.append(message["params"]["request"]["url"])
    return urls


def console_errors(driver: webdriver.Chrome) -> list[str]:
    """The console's errors since the last call (script errors, failed loads, CSP refusals)."""
    return [e["message"] for e in _log(driver, "browser") if e["level"] == "SEVERE"]


def _log(driver: webdriver.Chrome, kind: str) -> list[dict[str, Any]]:
    """One of the browser's logs since the last read (selenium leaves `get_log` untyped)."""
    read: Callable[[str], list[dict[str, Any]]] = driver.get_log
    return read(kind)
