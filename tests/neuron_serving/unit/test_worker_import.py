"""WorkerImport: the follower's worker imports on a thread beside its join."""

from __future__ import annotations

import sys
import time

import pytest

from neuron_serving.unit.worker_import import WorkerImport


def _module(tmp_path, monkeypatch, name: str, body: str) -> str:
    (tmp_path / f"{name}.py").write_text(body)
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


def test_the_import_runs_beside_the_caller_and_wait_returns_once_it_is_done(tmp_path, monkeypatch):
    name = _module(tmp_path, monkeypatch, "ns_slow_worker", "import time\ntime.sleep(0.5)\n")
    t0 = time.monotonic()
    preload = WorkerImport(name).start()
    assert time.monotonic() - t0 < 0.4  # start() does not wait for the import
    preload.wait(30)
    assert name in sys.modules and preload.error is None


def test_a_failed_import_is_raised_by_the_callers_own_import(tmp_path, monkeypatch):
    name = _module(tmp_path, monkeypatch, "ns_broken_worker", "raise ImportError('no torch')\n")
    preload = WorkerImport(name).start()
    preload.wait(30)
    assert isinstance(preload.error, ImportError)
    with pytest.raises(ImportError, match="no torch"):
        __import__(name)


def test_wait_is_bounded(tmp_path, monkeypatch):
    name = _module(tmp_path, monkeypatch, "ns_stuck_worker", "import time\ntime.sleep(3)\n")
    preload = WorkerImport(name).start()
    with pytest.raises(TimeoutError, match="ns_stuck_worker"):
        preload.wait(0.2)
    preload.wait(30)
