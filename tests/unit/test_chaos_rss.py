"""bench/chaos.py's RSS growth: within a label's longest life, and from its first life to its last at the same age."""

from bench.chaos import level, rss_growth


def life(start: float, seconds: int, mib_at) -> list[tuple[float, float]]:
    return [(start + t, mib_at(t)) for t in range(seconds)]


def test_growth_within_the_longest_life_and_across_lives():
    series = {
        1: ("learner", life(0, 300, lambda t: 500.0)),  # first life: flat 500 MiB, 5 min
        2: ("learner", life(400, 1200, lambda t: 520.0 + t / 60)),  # second, longest: grows 1 MiB a minute
        3: ("learner", life(1700, 240, lambda t: 530.0)),  # last life: 530 at 2 min
        4: ("actor a0: child", life(0, 600, lambda t: 300.0)),
    }
    g = rss_growth(series)
    learner = g["learner"]
    assert learner["lives"] == 3 and round(learner["longest_min"], 2) == round(1199 / 60, 2)
    assert 522 <= learner["settled"] <= 523  # 2-3 min into the longest life
    assert 538 <= learner["end"] <= 540  # its last minute
    assert (learner["first"], learner["last"]) == (500.0, 530.0)
    assert g["actor a0: child"]["lives"] == 1 and g["actor a0: child"]["end"] == 300.0


def test_a_life_shorter_than_the_settling_time_has_no_level():
    g = rss_growth({7: ("actor a1", life(0, 60, lambda t: 100.0))})
    assert g["actor a1"]["settled"] is None and g["actor a1"]["first"] is None
    assert level([], 0, 10) is None
