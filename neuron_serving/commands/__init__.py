"""One module per `neuron-serving` sub-command (see neuron_serving/cli.py)."""

# vLLM's names for our flags, accepted beside ours (same meaning, same dest), so the
# flags a `vllm serve` user knows work here too.
TP_FLAGS = ("--tp", "--tensor-parallel-size", "-tp")
KV_CACHE_FLAGS = ("--kv-cache-bytes", "--kv-cache-memory-bytes")
