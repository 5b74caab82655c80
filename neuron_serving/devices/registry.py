"""Device backends by name (``NEURON_SERVING_DEVICE``). Kept apart from ``base.py``
so that the backends import the interface and nothing imports them back."""

from __future__ import annotations

from neuron_serving.devices.base import DeviceBackend


def get_backend(name: str) -> DeviceBackend:
    if name == "cpu":
        from neuron_serving.devices.cpu import CpuBackend

        return CpuBackend()
    if name == "neuron":
        from neuron_serving.devices.neuron import NeuronBackend

        return NeuronBackend()
    raise ValueError(f"unknown device backend {name!r} (known: cpu, neuron)")
