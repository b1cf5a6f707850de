"""docs/configuration.md and inferd.toml(5) name every configuration key."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from inferd.daemon.config import SCHEMA

ROOT = Path(__file__).resolve().parents[2]
KEYS = [(s, k) for s, keys in SCHEMA.items() for k in keys]


@pytest.mark.parametrize("section, key", KEYS)
def test_configuration_md_documents_the_key_in_its_section(section, key):
    text = (ROOT / "docs" / "configuration.md").read_text()
    part = re.split(r"^### ", text, flags=re.M)
    body = next((p for p in part if p.startswith(f"`[{section}]`")), None)
    assert body is not None, f"docs/configuration.md has no ### `[{section}]`"
    assert re.search(rf"^\| `{key}` \|", body, re.M), f"[{section}] {key} not in its table"


@pytest.mark.parametrize("section, key", KEYS)
def test_man_page_names_the_key(section, key):
    text = (ROOT / "packaging" / "man" / "inferd.toml.5").read_text()
    assert f".B [{section}]" in text and f".B {key}\n" in text, f"[{section}] {key}"
