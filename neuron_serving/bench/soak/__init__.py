"""`neuron-serving bench soak`: a real cluster under mixed traffic and a seeded fault
schedule; counts that must be zero (lost requests, duplicated engine work, false
ejections, unexpected 5xx) and what grew (``run.py``)."""
