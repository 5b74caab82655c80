"""Which transport carries a unit's generations.

OpenAI calls and the Triton generate route's text requests go over the leader's
OpenAI channel (``channel_upstream.py``: one multiplexed connection per leader, one
frame per engine step) when the unit announces one and the proxy holds the channel
token (``openai_channel: true``, the default); otherwise over the config's
``upstream_protocol``:

``grpc`` (default): Triton's ``ModelStreamInfer`` (``grpc_upstream.TritonUpstream``).
``http``: Triton's ``generate_stream`` (``http_upstream.TritonHttpUpstream``) for
every unit that has a ``leader_http`` address; a unit without one (e.g. added over
the admin API without it) keeps gRPC. Probes use gRPC either way (``health_checker.py``).
Both yield the same ``GenerationDelta``s and raise the same ``UpstreamError``s, so
retries, migration, cancellation and the metrics do not depend on the choice.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Any

from proxy.channel_upstream import ChannelUpstream
from proxy.config import UnitSpec
from proxy.grpc_upstream import TritonUpstream
from proxy.http_upstream import TritonHttpUpstream
from proxy.upstream import GenerationDelta


class UnitTransport:
    def __init__(self, grpc: TritonUpstream, http: TritonHttpUpstream | None) -> None:
        self.grpc = grpc
        self.http = http
        self.channel: ChannelUpstream | None = None  # set by the server (use_channel)

    def use_channel(self, channel: ChannelUpstream) -> None:
        self.channel = channel

    def generate(
        self, unit: UnitSpec, *args: Any, priority: int = 0
    ) -> AsyncGenerator[GenerationDelta, None]:
        """``Upstream.generate`` on the unit's channel, else its transport. It returns
        the chosen transport's own generator, not a wrapper around it: every layer of
        async generators costs a resumption per token."""
        if self.channel is not None:
            addr = self.channel.address(unit)
            if addr is not None:
                return self.channel.generate(addr, unit, *args, priority=priority)
        return self._for(unit).generate(unit, *args, priority=priority)

    def openai(self, unit: UnitSpec, *args: Any) -> AsyncGenerator[GenerationDelta, None]:
        """``Upstream.openai`` on the unit's channel, else its transport (the same way)."""
        if self.channel is not None:
            addr = self.channel.address(unit)
            if addr is not None:
                return self.channel.openai(addr, unit, *args)
        return self._for(unit).openai(unit, *args)

    def name_for(self, unit: UnitSpec) -> str:
        """What carries the unit's OpenAI calls now: channel, grpc or http (status, metrics)."""
        if self.channel is not None and self.channel.address(unit) is not None:
            return "channel"
        return "http" if self._for(unit) is self.http else "grpc"

    def triton(self, unit: UnitSpec) -> TritonUpstream | TritonHttpUpstream:
        """The unit's Triton transport (the channel's fallback)."""
        return self._for(unit)

    def _for(self, unit: UnitSpec) -> TritonUpstream | TritonHttpUpstream:
        return self.http if self.http is not None and unit.leader_http else self.grpc

    async def close(self) -> None:
        if self.channel is not None:
            await self.channel.close()
        if self.http is not None:
            await self.http.close()
