"""Fault injection: a seeded schedule of faults, and the injector that applies it to
a running local cluster (see README.md)."""
