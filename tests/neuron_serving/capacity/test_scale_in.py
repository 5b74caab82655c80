"""Scale-in order and the units it never takes."""

from __future__ import annotations

from neuron_serving.capacity import scale_in
from neuron_serving.capacity.config import PolicyConfig
from neuron_serving.capacity.policy import Held, PolicyState, decide
from neuron_serving.capacity.signals import Phase, Purpose

from .helpers import SLOTS, signals, unit


def test_order_batch_then_unhealthy_starting_then_least_loaded_newest() -> None:
    units = (
        unit(0, running=3, since=0),
        unit(1, running=1, since=5),
        unit(2, running=1, since=9),
        unit(3, Phase.STARTING),
        unit(4, Phase.UNHEALTHY),
        unit(5, purpose=Purpose.BATCH, running=9),
    )
    assert scale_in.pick(units, 6) == ("u5", "u4", "u3", "u2", "u1")  # u0: the last ready


def test_never_mid_deploy_draining_or_the_last_ready_unit_of_a_model() -> None:
    units = (
        unit(0, model="a"),
        unit(1, model="a", mid_deploy=True),
        unit(2, model="b"),
        unit(3, model="b", phase=Phase.DRAINING),
        unit(4, model="b", phase=Phase.STARTING),
    )
    # a: u0 is its only ready unit not mid-deploy, and u1 is mid-deploy; b: u2 is
    # its last ready one (u3 drains, u4 is not ready). Only u4 may go.
    assert scale_in.pick(units, 5) == ("u4",)


def test_a_model_keeps_one_ready_unit_when_several_go() -> None:
    units = tuple(unit(i, model="a") for i in range(3)) + (unit(3, model="b"),)
    assert len(scale_in.pick(units, 4)) == 2


def test_decide_reports_protected_units() -> None:
    cfg = PolicyConfig(max_units=10, max_num_seqs=SLOTS, scale_down_cooldown_s=0)
    units = (unit(0), unit(1, mid_deploy=True), unit(2, mid_deploy=True))
    state = PolicyState()
    for t in range(0, 80, 2):
        d, state = decide(signals(t, units, rt=0), state, cfg)
    assert not d.remove and d.held == Held.PROTECTED and d.desired < d.current
