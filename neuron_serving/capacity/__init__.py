"""Capacity: how many whole units to run, decided from what the proxy sees (issue 21).

``signals`` (what is read), ``config`` (the policy's knobs), ``policy.decide`` (the
pure decision function), ``simulator`` (the same function against a trace on a model
of units calibrated from ``bench/results``). See README.md in this directory.
"""
