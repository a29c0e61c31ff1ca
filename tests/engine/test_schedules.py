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
    with pytest.raises(ValueError, match="cosine, step, constant"):
        LRSchedule("linear")
