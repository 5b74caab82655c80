"""Which transport carries a unit's generations: the config's ``upstream_protocol``.

``grpc`` (default): Triton's ``ModelStreamInfer`` (``grpc_upstream.TritonUpstream``).
``http``: Triton's ``generate_stream`` (``http_upstream.TritonHttpUpstream``) for
every unit that has a ``leader_http`` address; a unit without one (e.g. added over
the admin API without it) keeps gRPC. Probes use gRPC either way (``health_checker.py``).
Both yield the same ``GenerationDelta``s and raise the same ``UpstreamError``s, so
retries, migration, cancellation and the metrics do not depend on the choice.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from proxy.config import UnitSpec
from proxy.grpc_upstream import TritonUpstream
from proxy.http_upstream import TritonHttpUpstream
from proxy.upstream import GenerationDelta


class UnitTransport:
    def __init__(self, grpc: TritonUpstream, http: TritonHttpUpstream | None) -> None:
        self.grpc = grpc
        self.http = http

    def generate(self, unit: UnitSpec, *args: Any) -> AsyncIterator[GenerationDelta]:
        """``Upstream.generate`` on the unit's transport. It returns the chosen
        transport's own generator, not a wrapper around it: every layer of async
        generators costs a resumption per token."""
        return self._for(unit).generate(unit, *args)

    def openai(self, unit: UnitSpec, *args: Any) -> AsyncIterator[GenerationDelta]:
        """``Upstream.openai`` on the unit's transport (the same way)."""
        return self._for(unit).openai(unit, *args)

    def _for(self, unit: UnitSpec) -> TritonUpstream | TritonHttpUpstream:
        return self.http if self.http is not None and unit.leader_http else self.grpc

    async def close(self) -> None:
        if self.http is not None:
            await self.http.close()
