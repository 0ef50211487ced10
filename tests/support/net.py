"""Small socket utilities for starting local servers on free ports."""

from __future__ import annotations

from relay.demo.embedded import free_port, port_open, wait_for_port

__all__ = ["free_port", "port_open", "wait_for_port"]
