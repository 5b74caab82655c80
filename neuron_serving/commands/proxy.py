"""`neuron-serving proxy --config FILE`: the health-probing proxy in front of many units."""

from __future__ import annotations

import argparse
import sys

from neuron_serving.exitcodes import ExitCode


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "proxy",
        help="run the health-probing proxy (OpenAI API, /status, /metrics, admin API)",
        description=__doc__.splitlines()[0],
    )
    p.add_argument("--config", required=True, metavar="FILE", help="proxy config (YAML or JSON)")
    p.add_argument(
        "--port", type=int, default=None, help="client port (default: config, else 8080)"
    )
    p.add_argument(
        "--admin-port", type=int, default=None, help="admin port (default: config, else 8081)"
    )
    p.add_argument(
        "--host", default=None, help="client bind address (default: config, else 127.0.0.1)"
    )
    p.add_argument(
        "--api-key",
        default=None,
        help="client API key (tenant 'default'), as vLLM's --api-key; clients send "
        "'Authorization: Bearer KEY' (default: env NEURON_SERVING_API_KEY)",
    )
    p.add_argument(
        "--allow-unauthenticated",
        action="store_true",
        default=None,
        help="serve the client API on a non-loopback host with no API key",
    )
    p.add_argument("--log-level", default="INFO", help="logging level (default INFO)")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    # Imported here: the CLI builds every command's parser, and the proxy pulls in
    # grpc, tritonclient and aiohttp.
    import asyncio
    import gc
    import logging
    import signal

    from proxy.config import load_config
    from proxy.server import ProxyServer

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        config = load_config(
            args.config,
            port=args.port,
            admin_port=args.admin_port,
            host=args.host,
            api_key=args.api_key,
            allow_unauthenticated=args.allow_unauthenticated,
        )
        server = ProxyServer(config)  # reads the API keys file
        server.check_exposure()
    except (OSError, ValueError, TypeError) as e:
        print(f"neuron-serving proxy: bad config {args.config}: {e}", file=sys.stderr)
        return ExitCode.USAGE

    async def serve() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await server.start()
        # Everything built so far (modules, config, registry, clients) lives as long as
        # the process: out of the cyclic collector's reach, a full collection no longer
        # walks it (vLLM's EngineCore does the same after start-up, gc_utils.freeze_gc_heap).
        gc.collect()
        gc.freeze()
        print(
            f"proxy on http://{config.host}:{server.port} (admin {config.admin_host}:{server.admin_port})",
            flush=True,
        )
        try:
            await stop.wait()
        finally:
            await server.stop()

    from neuron_serving import envs

    # uvloop by default: the proxy's work per token is socket reads and writes, which
    # libuv does in C (bench cpu: less CPU per token, proxy/README.md). grpc.aio runs on
    # it through its poller thread, as it does on asyncio's loop.
    loop = envs.NEURON_SERVING_PROXY_EVENT_LOOP
    if loop == "uvloop":
        import uvloop

        uvloop.run(serve())
    elif loop == "asyncio":
        asyncio.run(serve())
    else:
        print(f"neuron-serving proxy: NEURON_SERVING_PROXY_EVENT_LOOP={loop!r} is not "
              "uvloop or asyncio", file=sys.stderr)  # fmt: skip
        return ExitCode.USAGE
    return ExitCode.OK
