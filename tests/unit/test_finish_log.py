"""Finishes router replicas tell each other: each reader gets the others' finishes after
its cursor, without prompt text; a reader too far behind skips what was dropped."""

from __future__ import annotations

from dataclasses import replace

import pytest

from app.routing.finish_log import FinishLog, lengths_of, shareable
from app.routing.length import RunningHistoryLength
from app.routing.registry import PolicyKind, build_routing
from app.routing.view import FinishReport
from tests.unit.routing_utils import make_request

pytestmark = pytest.mark.unit


def finish(rid: str, tokens: int = 100) -> FinishReport:
    request = make_request(10.0, rid=rid, session_id="s1")
    return FinishReport(replace(request, prompt="secret text " * 100, block_hashes=(1, 2, 3)),
                        "A800", tokens, 0.1, 0.5)


def test_each_reader_gets_the_others_finishes_after_its_cursor():
    log = FinishLog()
    log.tell("r1", [finish("a"), finish("b")])
    log.tell("r2", [finish("c")])
    cursor, got = log.since(0, "r1")
    assert cursor == 3 and [r.request.request_id for r in got] == ["c"]
    cursor, got = log.since(0, "r2")
    assert [r.request.request_id for r in got] == ["a", "b"]
    assert log.since(cursor, "r2") == (3, [])
    log.tell("r1", [finish("d")])
    assert [r.request.request_id for r in log.since(cursor, "r2")[1]] == ["d"]


def test_a_full_log_drops_the_oldest_and_a_late_reader_skips_them():
    log = FinishLog(capacity=2)
    log.tell("r1", [finish("a"), finish("b"), finish("c")])
    cursor, got = log.since(0, "r2")
    assert cursor == 3 and [r.request.request_id for r in got] == ["b", "c"]
    with pytest.raises(ValueError, match="capacity"):
        FinishLog(capacity=0)


def test_a_told_finish_carries_no_prompt_text_and_keeps_what_estimators_read():
    report = finish("a", tokens=77)
    slim = shareable(report)
    assert slim.request.prompt is None and slim.request.block_hashes == ()
    assert (slim.num_output_tokens, slim.request.session_id, slim.request.num_prompt_tokens,
            slim.request.task) == (77, "s1", report.request.num_prompt_tokens,
                                   report.request.task)
    log = FinishLog()
    log.tell("r1", [report])
    assert log.since(0, "r2")[1][0].request.prompt is None


def test_goodserve_keeps_a_length_estimator_and_a_baseline_none():
    assert isinstance(lengths_of(build_routing(PolicyKind.GOODSERVE).policy),
                      RunningHistoryLength)
    assert lengths_of(build_routing("round-robin").policy) is None
