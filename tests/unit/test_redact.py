"""The default redactor removes e-mails, bearer tokens and API keys, and leaves ordinary text alone."""

from __future__ import annotations

import pytest

from flywheel.ingest.redact import redact_json, redact_text


@pytest.mark.parametrize(
    "text, secret",
    [
        ("mail me at jane.doe+work@example.co.uk please", "jane.doe+work@example.co.uk"),
        ("Authorization: Bearer eyJhbGciOiJIUzI1NiJ9.abc.def", "eyJhbGciOiJIUzI1NiJ9.abc.def"),
        ("export OPENAI_API_KEY=sk-proj-abcdefghijklmnopqrstuvwx", "sk-proj-abcdefghijklmnopqrstuvwx"),
        ("token ghp_abcdefghijklmnopqrstuvwxyz0123456789", "ghp_abcdefghijklmnopqrstuvwxyz0123456789"),
        ("aws AKIAABCDEFGHIJKLMNOP here", "AKIAABCDEFGHIJKLMNOP"),
        ('{"api_key": "zq8Xw9vU7tS6"}', "zq8Xw9vU7tS6"),
        ("password=hunter2hunter2", "hunter2hunter2"),
        ("hf_abcdefghijklmnopqrstuvwxyz", "hf_abcdefghijklmnopqrstuvwxyz"),
    ],
)
def test_secret_is_removed(text: str, secret: str) -> None:
    out = redact_text(text)
    assert secret not in out, f"{secret!r} survived redaction: {out!r}"


@pytest.mark.parametrize(
    "text",
    [
        "def add(a, b):\n    return a + b\n",
        "commit 3f9a1c2b7d4e5f60718293a4b5c6d7e8f9a0b1c2 fixed the bug",
        "the tokenizer splits this into 12 tokens",
        "run pytest -k test_keys -x",
    ],
)
def test_ordinary_text_is_untouched(text: str) -> None:
    assert redact_text(text) == text


def test_redact_json_reaches_nested_strings_and_keeps_keys() -> None:
    value = {"to": ["a@b.io", {"cc": "c@d.org"}], "n": 3, "email": None}
    out = redact_json(value, redact_text)
    assert out == {"to": ["[EMAIL]", {"cc": "[EMAIL]"}], "n": 3, "email": None}
