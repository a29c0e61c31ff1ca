import math

import pytest

from mmgoal.engine.schedules import LRSchedule


def test_warmup_then_cosine():
    s = LRSchedule("cosine", total_steps=110, warmup_steps=10)
    assert [s.factor(i) for i in (0, 4, 9)] == [0.1, 0.5, 1.0]
    assert s.factor(10) == 1.0
    assert s.factor(60) == pytest.approx(0.5)  # half-way through the 100 cosine steps
    assert s.factor(110) == pytest.approx(0.0, abs=1e-12)
    assert s.factor(500) == pytest.approx(0.0, abs=1e-12)  # clamped past the end
    floor = LRSchedule("cosine", total_steps=100, min_ratio=0.1)
    assert floor.factor(100) == pytest.approx(0.1)
    assert floor.factor(50) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 2)))


def test_step_decay_at_epoch_milestones():
    s = LRSchedule("step", steps_per_epoch=10, milestones=[15, 20], gamma=0.1)
    assert s.factor(149) == 1.0
    assert s.factor(150) == pytest.approx(0.1)
    assert s.factor(200) == pytest.approx(0.01)


def test_unknown_kind():
    with pytest.raises(ValueError, match="cosine, linear, step, constant"):
        LRSchedule("exponential")


def test_warmup_ratio_is_a_share_of_the_run():
    from mmgoal.engine.schedules import LRSchedule

    schedule = LRSchedule("cosine", total_steps=200, warmup_ratio=0.1)
    assert schedule.warmup_steps == 20
    assert schedule.factor(9) == 0.5 and schedule.factor(19) == 1.0
    assert schedule.factor(199) < 1e-3
    linear = LRSchedule("linear", total_steps=120, warmup_ratio=0.1)
    assert linear.warmup_steps == 12 and math.isclose(linear.factor(12 + 54), 0.5)
    with pytest.raises(ValueError, match="not both"):
        LRSchedule("cosine", total_steps=10, warmup_steps=2, warmup_ratio=0.1)
