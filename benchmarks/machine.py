"""The machine a benchmark ran on, named in every report."""

from __future__ import annotations

import platform
import subprocess


def cpu_name() -> str:
    """lscpu's model name (platform.processor() where lscpu is missing)."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    return platform.processor() or "unknown CPU"
