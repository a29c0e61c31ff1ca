import math

import pytest

import mmgoal  # noqa: F401  (registers the schedules)
from mmgoal.engine.schedules import LRSchedule
from mmgoal.registry import SCHEDULES


def schedule(kind, **kwargs):
    return SCHEDULES.build({"type": kind, **kwargs})


def test_warmup_then_cosine():
    s = schedule("cosine", total_steps=110, warmup_steps=10)
    assert [s.factor(i) for i in (0, 4, 9)] == [0.1, 0.5, 1.0]
    assert s.factor(10) == 1.0
    assert s.factor(60) == pytest.approx(0.5)  # half-way through the 100 cosine steps
    assert s.factor(110) == pytest.approx(0.0, abs=1e-12)
    assert s.factor(500) == pytest.approx(0.0, abs=1e-12)  # clamped past the end
    floor = schedule("cosine", total_steps=100, min_ratio=0.1)
    assert floor.factor(100) == pytest.approx(0.1)
    assert floor.factor(50) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 2)))


def test_step_decay_at_epoch_milestones():
    s = schedule("step", steps_per_epoch=10, milestones=[15, 20], gamma=0.1)
    assert s.factor(149) == 1.0
    assert s.factor(150) == pytest.approx(0.1)
    assert s.factor(200) == pytest.approx(0.01)
    constant = schedule("constant", total_steps=50, warmup_steps=4)
    assert [constant.factor(i) for i in (1, 3, 4, 49)] == [0.5, 1.0, 1.0, 1.0]


def test_unknown_type_and_options_of_another_schedule():
    with pytest.raises(KeyError, match="'exponential' is not in the schedule registry.*"
                                       "constant, cosine, linear, step"):
        schedule("exponential")
    # a step-decay option on a cosine schedule is a mistake, not ignored
    with pytest.raises(ValueError, match="schedule 'cosine' got unknown config key.*'milestones'"):
        schedule("cosine", milestones=[3])


def test_warmup_ratio_is_a_share_of_the_run():
    s = schedule("cosine", total_steps=200, warmup_ratio=0.1)
    assert s.warmup_steps == 20
    assert s.factor(9) == 0.5 and s.factor(19) == 1.0
    assert s.factor(199) < 1e-3
    linear = schedule("linear", total_steps=120, warmup_ratio=0.1)
    assert linear.warmup_steps == 12 and math.isclose(linear.factor(12 + 54), 0.5)
    with pytest.raises(ValueError, match="not both"):
        schedule("cosine", total_steps=10, warmup_steps=2, warmup_ratio=0.1)


def test_a_schedule_of_your_own():
    @SCHEDULES.register("test_exponential")
    class ExponentialSchedule(LRSchedule):
        def __init__(self, rate: float = 0.5, **common) -> None:
            super().__init__(**common)
            self.rate = rate

        def decay(self, step: int) -> float:
            return self.rate ** (step - self.warmup_steps)

    try:
        s = schedule("test_exponential", rate=0.5, warmup_steps=2, total_steps=10)
        assert [s.factor(i) for i in (0, 2, 4)] == [0.5, 1.0, 0.25]
        # the base's options are known through **common; anything else is refused
        with pytest.raises(ValueError, match="accepts: rate, total_steps, steps_per_epoch, "
                                             "warmup_steps, warmup_ratio"):
            schedule("test_exponential", gamma=0.1)
    finally:
        SCHEDULES._entries.pop("test_exponential")
