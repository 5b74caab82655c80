"""neuron-serving: a multi-node LLM serving runtime (vLLM inference units, Triton, proxy)."""

__version__ = "0.1.0"
