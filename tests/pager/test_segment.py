from moelane.pager.segment import PrefillBoundaryDetector


def fires(sizes: list[int], ratio: float = 0.8) -> list[int]:
    d = PrefillBoundaryDetector(ratio)
    return [i for i, s in enumerate(sizes) if d.observe(s)]


def test_long_prefill_then_decode_fires_on_first_decode_segment() -> None:
    # the source's numbers: prefill segments up to 8637, a 3854 tail, then 1472-expert decode tokens; the tail does
    # not fire because the first prefill segment (4600) was small enough
    assert fires([4600, 8637, 8610, 3854, 1472, 1470, 1472, 1468]) == [4]
    # with only big segments before it, the short tail itself is the boundary
    assert fires([8637, 8400, 8610, 3854, 1472, 1470]) == [3]


def test_decode_only_never_fires() -> None:
    assert fires([1472, 1470, 1472, 1468, 1471, 1466]) == []


def test_first_segment_decode_sized_never_fires_even_if_prefill_follows() -> None:
    assert fires([1472, 8000, 8300, 1472, 1400]) == []


def test_partial_last_token_after_boundary_does_not_fire_again() -> None:
    assert fires([5000, 5100, 1472, 1472, 300, 1472, 10]) == [2]


def test_varying_prefill_fires_against_smallest_seen_before() -> None:
    # a prefill shrinking by less than 20% a step never fires (4000 is exactly 0.8 * 5000: not below);
    # 2000 < 0.8 * 3000 does
    assert fires([6000, 5000, 4000, 3500, 3000, 2000]) == [5]
    assert fires([3000, 9000, 2500, 8000, 2401, 1900]) == [5]


def test_threshold_is_strict() -> None:
    assert fires([1000, 800, 640]) == []
    assert fires([1000, 800, 639]) == [2]
    assert fires([1000, 800]) == []
    assert fires([1000, 799]) == [1]


def test_minimum_updates_after_the_check() -> None:
    # 700 < 0.8 * 1000 fires; the check used the minimum before 700, not 700 itself
    assert fires([1000, 700]) == [1]


def test_fired_flag() -> None:
    d = PrefillBoundaryDetector()
    assert not d.fired
    d.observe(100)
    d.observe(10)
    assert d.fired
