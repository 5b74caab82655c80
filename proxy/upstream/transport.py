"""Which transport carries a unit's generations, and why each exists.

The leader's OpenAI channel (``channel.ChannelUpstream``: one multiplexed
connection per leader) carries OpenAI calls and the Triton generate route's text
requests when the unit announces one and the proxy holds the channel token
(``openai_channel: true``, the default). It stays because it costs the proxy the
least CPU per streamed token of the transports measured (``bench cpu``, figures in
bench/README.md, "cpu"), and because it alone brings the units' engine load and KV
cache events, which flow control and ``kv_aware`` routing read.

Triton's gRPC ``ModelStreamInfer`` (``triton_grpc.TritonUpstream``) carries the rest:
a unit whose channel is not connected yet (the first requests after a leader
starts), one without a channel, a proxy without the token. It stays because a unit
must be servable before and without the channel, and because the probes speak gRPC
(``health_checker.py``). Both yield the same ``GenerationDelta``s and raise the same
``UpstreamError``s, so retries, migration, cancellation and the metrics do not
depend on the choice.

A third, Triton's HTTP ``generate_stream``, was removed (measured in the same
section): cheaper than gRPC per token but dearer than the channel, no better at a
burst, unable to carry the checkpoint version, and only ever a second fallback.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Any

from proxy.config import UnitSpec
from proxy.upstream.base import GenerationDelta
from proxy.upstream.channel import ChannelUpstream
from proxy.upstream.triton_grpc import TritonUpstream


class UnitTransport:
    def __init__(self, grpc: TritonUpstream, channel: ChannelUpstream | None = None) -> None:
        self.grpc = grpc
        self.channel = channel

    def generate(
        self, unit: UnitSpec, *args: Any, priority: int = 0
    ) -> AsyncGenerator[GenerationDelta, None]:
        """``Upstream.generate`` on the unit's channel, else gRPC. It returns the chosen
        transport's own generator, not a wrapper around it: every layer of async
        generators costs a resumption per token."""
        if self.channel is not None:
            addr = self.channel.address(unit)
            if addr is not None:
                return self.channel.generate(addr, unit, *args, priority=priority)
        return self.grpc.generate(unit, *args, priority=priority)

    def openai(self, unit: UnitSpec, *args: Any) -> AsyncGenerator[GenerationDelta, None]:
        """``Upstream.openai`` on the unit's channel, else gRPC (the same way)."""
        if self.channel is not None:
            addr = self.channel.address(unit)
            if addr is not None:
                return self.channel.openai(addr, unit, *args)
        return self.grpc.openai(unit, *args)

    def name_for(self, unit: UnitSpec) -> str:
        """What carries the unit's calls now: channel or grpc (status, metrics)."""
        if self.channel is not None and self.channel.address(unit) is not None:
            return "channel"
        return "grpc"

    async def close(self) -> None:
        if self.channel is not None:
            await self.channel.close()
