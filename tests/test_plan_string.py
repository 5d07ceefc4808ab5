"""The AdminComment plan string: formatting, parsing, round trips, clear rejections."""

import pytest

from estimator.cells import Cell, StagePlan
from estimator.errors import SpecError
from estimator.plan_string import MAX_PLAN_STRING, PlanString, PlanStringError, format_plan, parse_plan

GOOD = [
    "cell=a100x8:s2 plan=[dp2tp2|dp4tp1] mb=8 remat=1",
    "cell=v100x16:s1 plan=[dp16tp1] mb=1 remat=0",
    "cell=a40x4:s4 plan=[dp1tp1|dp1tp1|dp1tp1|dp1tp1] mb=16 remat=1 layers=0,3,9,12,26",
    "cell=h100x8:s2 plan=[dp1tp4|dp1tp4] mb=32 remat=0",
    "cell=a100x8:s2 plan=[dp4tp1ep|dp4tp1] mb=16 remat=1 zero=2",
    # one-sample micro-batches of the largest global batch (2**24 - 1): the estimator writes it
    "cell=a100x1:s1 plan=[dp1tp1] mb=16777215 remat=1",
]


@pytest.mark.parametrize("text", GOOD)
def test_round_trip_is_exact(text):
    parsed = parse_plan(text)
    assert parsed.format() == text
    assert parse_plan(parsed.format()) == parsed


def test_fields_are_parsed():
    p = parse_plan("cell=a100x8:s2 plan=[dp2tp2|dp4tp1] mb=8 remat=1")
    assert p == PlanString("a100", 8, 2, ((2, 2), (4, 1)), 8, True, None)
    assert p.cell_label == Cell("a100", 8, 4, 2).label()
    # Token order does not matter when reading.
    assert parse_plan("remat=1 mb=8 plan=[dp2tp2|dp4tp1] cell=a100x8:s2") == p


def test_format_plan_writes_layers_only_off_the_default_partition():
    cell = Cell("a100", 8, 4, 2)
    stages = (StagePlan(0, 13, 2, 2), StagePlan(13, 26, 4, 1))
    default = ((0, 13), (13, 26))
    text = format_plan(cell, stages, 8, True, default)
    assert text == "cell=a100x8:s2 plan=[dp2tp2|dp4tp1] mb=8 remat=1"
    assert parse_plan(text).stage_plans(default) == stages
    moved = format_plan(cell, stages, 8, True, ((0, 14), (14, 26)))
    assert moved.endswith(" layers=0,13,26")
    assert parse_plan(moved).stage_plans(((0, 14), (14, 26))) == stages


@pytest.mark.parametrize("text, why", [
    ("", "missing cell"),
    ("cell=a100x8:s2 plan=[dp2tp2|dp4tp1] mb=8", "missing remat"),
    ("cell=a100x8 plan=[dp8tp1] mb=8 remat=1", "is not <gpu>x<count>:s<stages>"),
    ("cell=a100x8:s2 plan=dp2tp2|dp4tp1 mb=8 remat=1", "in brackets"),
    ("cell=a100x8:s2 plan=[dp2tp2|dp4] mb=8 remat=1", "'dp4' is not dp<N>tp<M>"),
    ("cell=a100x8:s2 plan=[dp3tp1|dp5tp1] mb=8 remat=1", "powers of two"),
    ("cell=a100x8:s2 plan=[dp2tp2|dp2tp1] mb=8 remat=1", "use 6 GPUs, cell has 8"),
    ("cell=a100x8:s2 plan=[dp8tp1] mb=8 remat=1", "2 stage(s) but plan lists 1"),
    ("cell=a100x8:s1 plan=[dp8tp1] mb=0 remat=1", "mb='0'"),
    ("cell=a100x8:s1 plan=[dp8tp1] mb=8 remat=yes", "remat='yes'"),
    ("cell=a100x8:s1 plan=[dp8tp1] mb=8 remat=1 mb=4", "mb given twice"),
    ("cell=a100x8:s1 plan=[dp8tp1] mb=8 remat=1 pp=1", "unknown key 'pp'"),
        ("cell=a100x8:s1 plan=[dp8tp1] mb=8 remat=1 zero=4", "zero='4' must be 0, 1, 2 or 3"),
        ("cell=a100x8:s1 plan=[dp8tp1] mb=8 remat=1 offload=yes", "offload='yes'"),
    ("cell=a100x8:s1 plan=[dp8tp1] mb=8 remat=1 stray", "'stray' is not key=value"),
    ("cell=a100x8:s2 plan=[dp4tp1|dp4tp1] mb=8 remat=1 layers=0,20,10", "increasing"),
    ("cell=a100x8:s2 plan=[dp4tp1|dp4tp1] mb=8 remat=1 layers=0,13", "3 increasing"),
])
def test_malformed_strings_are_rejected_with_the_string_quoted(text, why):
    with pytest.raises(PlanStringError) as err:
        parse_plan(text)
    message = str(err.value)
    assert why in message
    assert repr(text) in message  # the bad input is quoted
    assert "expected e.g." in message  # and the right form shown
    assert isinstance(err.value, SpecError)  # the CLI turns it into one line, exit 2


def test_non_strings_and_huge_strings_are_rejected():
    with pytest.raises(PlanStringError):
        parse_plan(None)
    with pytest.raises(PlanStringError, match="longer than"):
        parse_plan("cell=a100x8:s1 " + "x" * MAX_PLAN_STRING)


def test_expert_parallel_stages_are_marked_and_read_back():
    cell = Cell("a100", 8, 4, 2)
    stages = (StagePlan(0, 9, 4, 1, ep=True), StagePlan(9, 18, 2, 2))
    text = format_plan(cell, stages, 16, True, ((0, 9), (9, 18)))
    assert "plan=[dp4tp1ep|dp2tp2]" in text
    parsed = parse_plan(text)
    assert parsed.expert_parallel == (True, False)
    assert parsed.stage_plans(((0, 9), (9, 18))) == stages
    # Without ep stages the field stays empty, as strings from before it read.
    assert parse_plan("cell=a100x8:s1 plan=[dp8tp1] mb=4 remat=1").expert_parallel == ()
