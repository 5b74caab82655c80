"""Triton leader vs vLLM's own OpenAI server: now `neuron-serving bench serving`.

    .venv/bin/python bench/triton_vs_vllm.py [--model DIR] [--quick] [--repeats N] [--json]

Kept as a thin wrapper for the references to it; the benchmark lives in
``neuron_serving/bench/serving.py`` and writes ``bench/results/serving[-quick].json``.
"""

from __future__ import annotations

import argparse
import sys

from neuron_serving.bench import serving

if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="model dir (default: build the demo model)")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--json", action="store_true")
    a = p.parse_args()
    sys.exit(serving.main(a.quick, a.model, a.json, a.repeats))
