"""LR schedule: expected values worked out by hand, one comment per step (torchtitan style)."""
import dataclasses
import math

import pytest

from qtrain.train.schedule import LRSchedule


def lrs(s: LRSchedule) -> list[float]:
    return [s(i) for i in range(s.total_steps)]


def test_linear_with_warmup():
    s = LRSchedule(peak_lr=1.0, total_steps=10, warmup=2, final_lr_fraction=0.2, kind="linear")
    expected = [
        0.5,  # step 0: warmup 1/2 (llm.q would use 0 here and waste the step)
        1.0,  # step 1: warmup 2/2 = peak
        0.9,  # step 2: decay p=1/8 -> 0.2 + 0.8*(7/8)
        0.8,  # step 3: p=2/8
        0.7,  # step 4: p=3/8
        0.6,  # step 5: p=4/8
        0.5,  # step 6: p=5/8
        0.4,  # step 7: p=6/8
        0.3,  # step 8: p=7/8
        0.2,  # step 9: p=8/8 -> floor = 0.2 * peak, exactly
    ]
    assert lrs(s) == pytest.approx(expected, abs=1e-12)
    assert s(9) == 0.2


def test_cosine_no_warmup_to_zero():
    s = LRSchedule(peak_lr=1.0, total_steps=6, final_lr_fraction=0.0, kind="cosine")
    expected = [
        (1 + math.cos(math.pi / 6)) / 2,  # step 0: p=1/6 -> 0.9330
        0.75,  # step 1: p=2/6, (1+cos(pi/3))/2
        0.5,  # step 2: p=3/6, (1+cos(pi/2))/2
        0.25,  # step 3: p=4/6
        (1 - math.cos(math.pi / 6)) / 2,  # step 4: p=5/6 -> 0.0670
        0.0,  # step 5: p=1 -> floor 0
    ]
    assert lrs(s) == pytest.approx(expected, abs=1e-12)
    assert s(5) == 0.0


def test_cosine_with_warmup_reaches_floor():
    # llm.q divides by (steps - cooldown) instead of the decay length, so with warmup it stops above the floor.
    s = LRSchedule(peak_lr=2.0, total_steps=7, warmup=3, final_lr_fraction=0.5, kind="cosine")
    expected = [
        2 / 3,  # step 0: warmup 1/3
        4 / 3,  # step 1: warmup 2/3
        2.0,  # step 2: warmup 3/3 = peak
        1.0 + 1.0 * (1 + math.cos(math.pi / 4)) / 2,  # step 3: decay p=1/4 -> 1.8536
        1.5,  # step 4: p=2/4 -> halfway between peak 2 and floor 1
        1.0 + 1.0 * (1 - math.cos(math.pi / 4)) / 2,  # step 5: p=3/4 -> 1.1464
        1.0,  # step 6: p=4/4 -> floor = 0.5 * 2.0
    ]
    assert lrs(s) == pytest.approx(expected, abs=1e-12)
    assert s(6) == 1.0


def test_wsd_with_cooldown():
    s = LRSchedule(peak_lr=1.0, total_steps=8, warmup=2, cooldown=4, final_lr_fraction=0.0, kind="wsd")
    expected = [
        0.5,  # step 0: warmup 1/2
        1.0,  # step 1: warmup 2/2
        1.0,  # step 2: stable
        1.0,  # step 3: stable (last step before the cooldown)
        0.5,  # step 4: cooldown p=1/4 -> 1 - sqrt(1/4)
        1 - math.sqrt(0.5),  # step 5: p=2/4 -> 0.2929
        1 - math.sqrt(0.75),  # step 6: p=3/4 -> 0.1340
        0.0,  # step 7: p=4/4 -> floor (llm.q would still be at 1-sqrt(3/4) here)
    ]
    assert lrs(s) == pytest.approx(expected, abs=1e-12)


def test_wsd_cooldown_to_nonzero_floor():
    s = LRSchedule(peak_lr=2.0, total_steps=4, cooldown=2, final_lr_fraction=0.5, kind="wsd")
    expected = [
        2.0,  # step 0: no warmup, stable at peak
        2.0,  # step 1: stable
        1.0 + 1.0 * (1 - math.sqrt(0.5)),  # step 2: cooldown p=1/2 from 2 towards floor 1 -> 1.2929
        1.0,  # step 3: floor = 0.5 * 2.0
    ]
    assert lrs(s) == pytest.approx(expected, abs=1e-12)
    assert s(3) == 1.0


def test_cosine_with_cooldown_holds_floor():
    s = LRSchedule(peak_lr=1.0, total_steps=6, warmup=1, cooldown=2, final_lr_fraction=0.5, kind="cosine")
    expected = [
        1.0,  # step 0: warmup 1/1 = peak
        0.875,  # step 1: decay over [1, 4), p=1/3 -> 0.5 + 0.5*(1+cos(pi/3))/2
        0.625,  # step 2: p=2/3 -> 0.5 + 0.5*(1+cos(2pi/3))/2
        0.5,  # step 3: p=1 -> floor
        0.5,  # step 4: cooldown starts at the floor the decay already reached, so it holds it
        0.5,  # step 5: last step = floor
    ]
    assert lrs(s) == pytest.approx(expected, abs=1e-12)


def test_warmup_and_cooldown_fill_the_run():
    s = LRSchedule(peak_lr=1.0, total_steps=4, warmup=2, cooldown=2, final_lr_fraction=0.0, kind="cosine")
    expected = [
        0.5,  # step 0: warmup 1/2
        1.0,  # step 1: warmup 2/2; no decay phase, so the cooldown starts from the peak
        1 - math.sqrt(0.5),  # step 2: cooldown p=1/2
        0.0,  # step 3: floor
    ]
    assert lrs(s) == pytest.approx(expected, abs=1e-12)


def test_all_cooldown_starts_from_peak():
    s = LRSchedule(peak_lr=1.0, total_steps=4, cooldown=4, final_lr_fraction=0.0, kind="linear")
    expected = [
        0.5,  # step 0: p=1/4 -> 1 - sqrt(1/4)
        1 - math.sqrt(0.5),  # step 1
        1 - math.sqrt(0.75),  # step 2
        0.0,  # step 3
    ]
    assert lrs(s) == pytest.approx(expected, abs=1e-12)


def test_final_fraction_one_is_constant_after_warmup():
    # llm.q's default --final-lr-fraction 1.0 makes cosine a constant schedule
    s = LRSchedule(peak_lr=3e-4, total_steps=20, warmup=4, kind="cosine")
    assert lrs(s)[:4] == pytest.approx([0.75e-4, 1.5e-4, 2.25e-4, 3e-4])
    assert all(v == 3e-4 for v in lrs(s)[4:])


@pytest.mark.parametrize("kind", ["cosine", "linear", "wsd"])
@pytest.mark.parametrize("warmup,cooldown", [(0, 0), (3, 0), (0, 5), (3, 5), (10, 7), (1, 1), (17, 0), (0, 17)])
@pytest.mark.parametrize("frac", [0.0, 0.1, 0.37, 1.0])
def test_last_step_is_exactly_final_fraction(kind, warmup, cooldown, frac):
    s = LRSchedule(peak_lr=6e-4, total_steps=17, warmup=warmup, cooldown=cooldown, final_lr_fraction=frac,
                   kind=kind)
    values = lrs(s)
    if kind == "wsd" and cooldown == 0 or warmup == 17:
        # no phase decays: wsd without a cooldown, or a run that is all warmup, ends at the peak
        assert values[-1] == pytest.approx(6e-4)
    else:
        assert values[-1] == 6e-4 * frac  # bit-exact, not approximately
    assert values[0] > 0, "step 0 must train"
    assert max(values) <= 6e-4
    if warmup > 0 or (kind == "wsd" and warmup + cooldown < 17) or frac == 1.0:
        assert max(values) == pytest.approx(6e-4)  # the peak is used (end of warmup / stable phase)
    after = values[warmup:]
    assert all(a >= b for a, b in zip(after, after[1:])), "non-increasing after warmup"
    assert s(1000) == values[-1]  # past the end: keep the last LR


@pytest.mark.parametrize("kwargs,flag", [
    (dict(warmup=6, cooldown=5), "--warmup"),
    (dict(warmup=6, cooldown=5), "--cooldown"),
    (dict(warmup=6, cooldown=5), "--steps"),
    (dict(warmup=-1), "--warmup"),
    (dict(cooldown=1.5), "--cooldown"),
    (dict(total_steps=0), "--steps"),
    (dict(peak_lr=0.0), "--lr"),
    (dict(peak_lr=float("nan")), "--lr"),
    (dict(final_lr_fraction=1.5), "--final-lr-fraction"),
    (dict(final_lr_fraction=-0.1), "--final-lr-fraction"),
    (dict(kind="step"), "--lr-schedule"),
])
def test_validate_names_the_option(kwargs, flag):
    args = dict(peak_lr=1e-3, total_steps=10)
    args.update(kwargs)
    with pytest.raises(ValueError, match=flag):
        LRSchedule(**args)


def test_frozen_and_negative_step():
    s = LRSchedule(peak_lr=1e-3, total_steps=10)
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.warmup = 3  # type: ignore[misc]
    with pytest.raises(ValueError):
        s(-1)
