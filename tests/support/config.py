"""Writing relay config files for a test."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ruamel.yaml import YAML


def write_config(path: Path, data: dict[str, Any]) -> Path:
    """Dump `data` as block-style YAML to `path` and return the path."""
    yaml = YAML(typ="safe", pure=True)
    yaml.default_flow_style = False
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as fh:
        yaml.dump(data, fh)
    return path
