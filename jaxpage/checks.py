"""The configuration modules' one way to refuse a value."""

from __future__ import annotations


def require(condition: bool, message: str) -> None:
    """Raise ``ValueError(message)`` unless ``condition``: the message names the offending
    value and what is accepted."""
    if not condition:
        raise ValueError(message)
