"""The local cluster: `neuron-serving up` supervision (see README.md)."""
