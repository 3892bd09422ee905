"""Checkpoint marks as pure functions: the freeze cut, the window, and the alignment of a restored run."""

from __future__ import annotations

from keepstate.db.repos.ledger import Position
from keepstate.gateway.marks import align, high_cut, low_cut, window


def pos(ordinal: int, arrived: float, delivered: float | None, body: str | None = None) -> Position:
    return Position(run_id="r", ordinal=ordinal, call_key=f"k{ordinal}", body_hash=body or f"h{ordinal}",
                    source="upstream", delivered=delivered is not None, arrived_at=arrived, delivered_at=delivered)


# calls 0..3: 0 and 1 answered before t=10; 2 arrived at 9 and answered at 12 (in flight at 10); 3 after the thaw
RUN = [pos(0, 1, 2), pos(1, 3, 4), pos(2, 9, 12), pos(3, 13, 14)]


def test_low_cut_is_the_call_in_flight_at_the_freeze() -> None:
    assert low_cut(RUN, 10) == 2
    assert low_cut(RUN, 12.5) == 3  # call 2 answered, call 3 not made yet
    assert low_cut(RUN, 0) == 0
    assert low_cut(RUN, 100) == 4


def test_high_cut_counts_calls_made_by_then() -> None:
    assert high_cut(RUN, 10) == 3
    assert high_cut(RUN, 0) == 0
    assert high_cut(RUN, 13) == 4


def test_calls_after_the_thaw_do_not_move_the_window() -> None:
    assert window(RUN, 10, 10, floor=0) == (2, 3)
    assert window(RUN, 5, 6, floor=0) == (2, 2)
    # the same run, had the mark been taken before call 3 existed
    assert window(RUN[:3], 10, 10, floor=0) == (2, 3)


def test_without_a_freeze_start_the_window_opens_at_the_floor() -> None:
    assert window(RUN, None, 100, floor=1) == (1, 4)
    assert window(RUN, None, 0, floor=2) == (0, 0)  # a floor past the cut never inverts the window


def test_undelivered_error_keeps_the_low_cut_conservative() -> None:
    run = [pos(0, 1, None), pos(1, 2, 3)]  # call 0 got no answer (an error the SDK may retry)
    assert low_cut(run, 5) == 0


def test_rows_without_times_count_as_long_past() -> None:
    old = [Position(run_id="r", ordinal=0, call_key="k0", body_hash="h0", source="upstream", delivered=True),
           Position(run_id="r", ordinal=1, call_key="k1", body_hash="h1", source="upstream", delivered=False)]
    assert low_cut(old, 0) == 1 and high_cut(old, 0) == 2


def test_align_picks_the_lowest_matching_offset() -> None:
    source = {p.ordinal: p for p in RUN}
    assert align(source, 0, "h2", 0, 4) == 2
    assert align(source, 1, "h3", 0, 4) == 2  # found from the restored run's second call
    assert align(source, 0, "nope", 0, 4) is None
    assert align(source, 0, "h1", 2, 3) is None  # outside the window
    twice = {0: pos(0, 1, 2, "same"), 1: pos(1, 3, 4, "same")}
    assert align(twice, 0, "same", 0, 1) == 0
