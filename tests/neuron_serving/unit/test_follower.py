"""The follower's judgement of a silent leader (neuron_serving/unit/follower.py)."""

from neuron_serving.unit.config import UnitConfig
from neuron_serving.unit.follower import LEADER_SILENCE_FACTOR, leader_silence_timeout
from neuron_serving.unit.late_beats import SATURATED_FACTOR


def test_a_serving_leader_gets_more_silence_than_a_follower_but_never_more_than_startup():
    cfg = UnitConfig()
    serving = leader_silence_timeout(True, cfg.heartbeat_timeout_s, cfg.startup_heartbeat_timeout_s)
    # The leader declares a silent follower hung after heartbeat_timeout_s; a follower
    # gives a silent leader LEADER_SILENCE_FACTOR times that (a starved leader on a
    # saturated host, not a hung one, is the likely cause).
    assert serving == LEADER_SILENCE_FACTOR * cfg.heartbeat_timeout_s > cfg.heartbeat_timeout_s
    assert leader_silence_timeout(False, 2.0, 60.0) == 60.0
    assert leader_silence_timeout(True, 0.5, 0.6) == 0.6
    assert leader_silence_timeout(True, 2.0, 1.0) == 2.0


def test_late_beats_give_a_serving_leader_saturated_factor_more_but_never_more_than_startup():
    calm = leader_silence_timeout(True, 2.0, 60.0)
    assert leader_silence_timeout(True, 2.0, 60.0, late=True) == SATURATED_FACTOR * calm
    assert leader_silence_timeout(True, 2.0, 10.0, late=True) == 10.0
    assert leader_silence_timeout(False, 2.0, 60.0, late=True) == 60.0
