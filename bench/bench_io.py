"""Where the benchmarks write their JSON, and how: one place for all of bench/*.py."""
from __future__ import annotations

import json
import os


def default_json(name: str) -> str:
    """``$OUT/name`` (the device tool's output folder) or ``bench/results/name``."""
    return os.path.join(os.environ.get("OUT", "bench/results"), name)


def write_json(path: str, payload: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(payload, f, indent=1)
