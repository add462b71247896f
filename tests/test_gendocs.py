"""docs/configuration.md is generated from the settings and the parsers, and committed fresh."""

from __future__ import annotations

from dataclasses import fields

from cachestore.settings import StoreSettings
from ops import gendocs
from service.settings import _ENV_CASTS, PodSettings


def test_configuration_page_is_fresh() -> None:
    assert gendocs.PAGE.read_text() == gendocs.render(), "run python -m ops.gendocs"


def test_configuration_page_lists_every_setting() -> None:
    page = gendocs.PAGE.read_text()
    for name in _ENV_CASTS:
        assert f"`KVSTASH_{name.upper()}`" in page
    for f in fields(PodSettings):
        assert f"| `{f.name}` |" in page
    for f in fields(StoreSettings):
        if f.name != "url":
            assert f"| `{f.name}` |" in page
    for flag in ("--redis-url", "--codec", "--upstream", "--flash-attn", "--json"):
        assert f"`{flag}" in page
