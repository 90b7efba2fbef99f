"""Policy version names: version N is served, logged and stored as `policy-v<N>` (0 is the base)."""

from __future__ import annotations

import re

PREFIX = "policy-v"
_NAME = re.compile(r"^policy-v(\d+)$")


def version_name(version: int) -> str:
    return f"{PREFIX}{int(version)}"


def parse_version(name: str) -> int | None:
    """N for `policy-v<N>`, None for any other name (a base served name, a directory, a typo)."""
    m = _NAME.match(name)
    return int(m.group(1)) if m else None
