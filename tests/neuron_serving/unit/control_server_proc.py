"""A leader's control server alone in its own process, for hostile tests.

``python -m tests.neuron_serving.unit.control_server_proc --port P [...]`` runs a
real ``ControlServer`` (no vLLM) and answers one command per stdin line with one
JSON line on stdout, so a test can flood it from outside and read what the
flood cost it from the process itself:

    stats          {"rss": bytes, "threads": OS threads, "fds": n, "links": [ranks], ...join_stats}
    wait SECONDS   {"ok": true} once every rank joined, else {"error": "..."}
    start          {"ok": true} after Start went to the joined followers
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

import psutil

from neuron_serving.unit.config import UnitConfig
from neuron_serving.unit.control_server import ControlServer, UnitJoinError
from neuron_serving.unit.messages import Start
from neuron_serving.versions import runtime_versions


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--handshake-timeout", type=float, default=10.0)
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(message)s")
    unit = UnitConfig(
        control_port=args.port, join_timeout_s=60, handshake_timeout_s=args.handshake_timeout
    )
    token = os.environ["NEURON_SERVING_UNIT_TOKEN"].encode()
    server = ControlServer(unit, args.world_size, token, runtime_versions(), lambda *a: None)
    server.listen()
    me = psutil.Process()

    def answer(obj: dict) -> None:
        sys.stdout.write(json.dumps(obj) + "\n")
        sys.stdout.flush()

    answer({"ready": True, "pid": os.getpid()})
    for line in sys.stdin:
        cmd, *rest = line.split()
        if cmd == "stats":
            answer(
                {
                    "rss": me.memory_info().rss,
                    "threads": me.num_threads(),  # OS threads, as psutil counts from outside
                    "fds": me.num_fds(),
                    "links": sorted(server.links),
                    **server.join_stats(),
                }
            )
        elif cmd == "wait":
            try:
                server.wait_for_followers(float(rest[0]))
                answer({"ok": True})
            except UnitJoinError as e:
                answer({"error": str(e)})
        elif cmd == "start":
            server.start_unit(Start("127.0.0.1", args.port + 1, f"tcp://127.0.0.1:{args.port + 2}"))
            answer({"ok": True})
    server.close(clean=True)


if __name__ == "__main__":
    main()
