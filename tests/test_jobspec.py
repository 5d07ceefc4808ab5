"""Elastic job specs: good specs parse, every kind of bad spec raises a typed, quoting error."""

from datetime import datetime, timezone

import pytest

from estimator.errors import SpecError
from estimator.jobs import JobSpec
from estimator.contract import (
    MAX_COMMENT_CHARS, MAX_SCRIPT_CHARS, ElasticSpecError, comment_settings, is_elastic, script_settings,
)
from slurm_ext.jobspec import ElasticSpec, check_model, parse_spec

SCRIPT = """#!/bin/bash
#SBATCH --comment=elastic
#ELASTIC model=gpt-1.3b global_batch=64
#ELASTIC iterations=500   # a trailing comment is ignored
exec python train.py
"""


@pytest.mark.parametrize("comment, expected", [
    ("elastic", True), ("  Elastic model=x", True), ("ELASTIC", True),
    ("elasticity", False), ("not elastic", False), ("", False), (None, False),
    ("elastic\tmodel=x", True), (" " * 200 + "elastic", True),
    # Only ASCII white space separates words, as the submit hook's Lua reads them: the hook
    # lets these through as plain jobs, so the daemon must not manage them either.
    ("elastic\x1fmodel=x", False), ("elastic\u00a0model=x", False), ("\u00a0elastic", False),
])
def test_is_elastic(comment, expected):
    assert is_elastic(comment) is expected


def test_a_setting_glued_on_by_other_white_space_is_refused_not_split():
    with pytest.raises(ElasticSpecError, match="only letters"):
        comment_settings("elastic model=gpt-1.3b\u00a0global_batch=8")


def test_script_only():
    spec = parse_spec("elastic", SCRIPT)
    assert spec == ElasticSpec("gpt-1.3b", 64, 500)


def test_comment_only_with_all_keys():
    spec = parse_spec("elastic model=moe-1.3b global_batch=32 iterations=10 gpus=8 "
                      "gpu_type=A100 deadline=2026-12-01T18:00:00Z guaranteed=yes")
    assert spec.model == "moe-1.3b"
    assert (spec.global_batch, spec.iterations, spec.num_gpus) == (32, 10, 8)
    assert spec.gpu_type == "a100"
    assert spec.deadline_s == datetime(2026, 12, 1, 18, tzinfo=timezone.utc).timestamp()
    assert spec.guaranteed is True


def test_comment_overrides_script():
    spec = parse_spec("elastic global_batch=128", SCRIPT)
    assert spec.global_batch == 128 and spec.iterations == 500


def test_commas_separate_comment_settings():
    assert comment_settings("elastic model=a,global_batch=2;iterations=3") == {
        "model": "a", "global_batch": "2", "iterations": "3"}


def test_script_lines_must_start_the_line():
    assert script_settings("  #ELASTIC model=x\necho #ELASTIC gpus=2\n") == {}


def test_requested_gpus_and_type_fill_gaps_only():
    spec = parse_spec("elastic", SCRIPT, requested_gpus=8, requested_type="v100")
    assert (spec.num_gpus, spec.gpu_type) == (8, "v100")
    spec = parse_spec("elastic gpus=2 gpu_type=a10", SCRIPT, requested_gpus=8, requested_type="v100")
    assert (spec.num_gpus, spec.gpu_type) == (2, "a10")


def test_a_gpu_count_that_is_not_a_power_of_two_is_refused_with_the_counts_to_ask_for():
    # No Cell has 6 GPUs (each stage runs on a power of two): said at once, with 4 and 8.
    with pytest.raises(ElasticSpecError) as info:
        parse_spec("elastic gpus=6", SCRIPT)
    assert info.value.field == "gpus" and "ask for 4 or 8" in str(info.value)
    # The same from the job's own Slurm request (--gres=gpu:3 -N4), unless gpus= says otherwise.
    with pytest.raises(ElasticSpecError) as info:
        parse_spec("elastic", SCRIPT, requested_gpus=12)
    assert info.value.field == "gpus" and "asks Slurm for 12 GPUs" in str(info.value)
    assert "gpus=8 or gpus=16" in str(info.value)
    assert parse_spec("elastic gpus=8", SCRIPT, requested_gpus=12).num_gpus == 8
    assert [parse_spec(f"elastic gpus={n}", SCRIPT).num_gpus for n in (1, 2, 64)] == [1, 2, 64]


def test_deadline_without_zone_is_utc_and_offsets_apply():
    a = parse_spec("elastic deadline=2026-01-01T00:00:00", SCRIPT).deadline_s
    b = parse_spec("elastic deadline=2026-01-01T01:00:00+01:00", SCRIPT).deadline_s
    assert a == b == datetime(2026, 1, 1, tzinfo=timezone.utc).timestamp()


def test_json_round_trip():
    spec = parse_spec("elastic gpus=4 guaranteed=yes deadline=2026-05-05 max_stages=2", SCRIPT)
    assert ElasticSpec.from_json(spec.to_json()) == spec


def test_max_stages_from_comment_or_script_comment_wins():
    assert parse_spec("elastic", SCRIPT).max_stages is None
    assert parse_spec("elastic max_stages=1", SCRIPT).max_stages == 1
    script = SCRIPT + "#ELASTIC max_stages=4\n"
    assert parse_spec("elastic", script).max_stages == 4
    assert parse_spec("elastic max_stages=1", script).max_stages == 1


def test_json_stored_before_max_stages_existed_reads_as_unlimited():
    old = {k: v for k, v in parse_spec("elastic", SCRIPT).to_json().items() if k != "max_stages"}
    assert ElasticSpec.from_json(old).max_stages is None


def test_a_script_on_the_runtime_api_is_one_stage_and_says_so_to_the_estimator():
    spec = parse_spec("elastic trainer=api", SCRIPT)
    assert (spec.trainer, spec.max_stages) == ("api", 1)
    assert spec.job_spec() == JobSpec("gpt-1.3b", 64, max_stages=1, trainer="api")
    assert ElasticSpec.from_json(spec.to_json()) == spec
    old = {k: v for k, v in parse_spec("elastic", SCRIPT).to_json().items() if k != "trainer"}
    assert ElasticSpec.from_json(old).trainer == "runner"  # stored before the key existed
    assert parse_spec("elastic trainer=api max_stages=1", SCRIPT).max_stages == 1
    with pytest.raises(ElasticSpecError, match="max_stages=.*one stage"):
        parse_spec("elastic trainer=api max_stages=2", SCRIPT)
    with pytest.raises(ElasticSpecError, match="trainer='flax'.*runner.*api"):
        parse_spec("elastic trainer=flax", SCRIPT)


def test_job_spec_carries_every_field_the_estimates_depend_on():
    spec = parse_spec("elastic gpus=8 gpu_type=a100 max_stages=1", SCRIPT)
    job = spec.job_spec()
    assert isinstance(job, JobSpec)
    assert job == JobSpec("gpt-1.3b", 64, 8, "a100", max_stages=1)
    assert parse_spec("elastic", SCRIPT).job_spec().max_stages is None


BAD = [
    # (comment, script, field the error names, text the message quotes)
    ("elastic", None, "model", "missing"),
    ("elastic model=gpt-1.3b iterations=5", None, "global_batch", "missing"),
    ("elastic model=gpt-1.3b global_batch=5", None, "iterations", "missing"),
    ("elastic model=gpt-1.3b global_batch=0 iterations=5", None, "global_batch", "'0'"),
    ("elastic model=gpt-1.3b global_batch=-3 iterations=5", None, "global_batch", "'-3'"),
    ("elastic model=gpt-1.3b global_batch=1e9 iterations=5", None, "global_batch", "'1e9'"),
    ("elastic model=gpt-1.3b global_batch=999999999999 iterations=5", None, "global_batch", "999999999999"),
    ("elastic model=gpt-1.3b global_batch=8 iterations=0", None, "iterations", "'0'"),
    ("elastic model=gpt-1.3b global_batch=8 iterations=ten", None, "iterations", "'ten'"),
    ("elastic model=gpt-1.3b global_batch=8 iterations=5 gpus=0", None, "gpus", "'0'"),
    ("elastic model=gpt-1.3b global_batch=8 iterations=5 gpus=1000000", None, "gpus", "1000000"),
    ("elastic model=gpt-1.3b global_batch=8 iterations=5 gpu_type=tpu", None, "gpu_type", "'tpu'"),
    ("elastic model=gpt-1.3b global_batch=8 iterations=5 max_stages=0", None, "max_stages", "'0'"),
    ("elastic model=gpt-1.3b global_batch=8 iterations=5 max_stages=-1", None, "max_stages", "'-1'"),
    ("elastic model=gpt-1.3b global_batch=8 iterations=5 max_stages=one", None, "max_stages", "'one'"),
    ("elastic model=gpt-1.3b global_batch=8 iterations=5 max_stages=1.5", None, "max_stages", "'1.5'"),
    ("elastic model=gpt-1.3b global_batch=8 iterations=5 max_stages=4096", None, "max_stages", "4096"),
    ("elastic", SCRIPT + "#ELASTIC max_stages=0\n", "max_stages", "'0'"),
    ("elastic model=gpt-1.3b global_batch=8 iterations=5 guaranteed=maybe", None, "guaranteed", "'maybe'"),
    ("elastic model=gpt-1.3b global_batch=8 iterations=5 deadline=tomorrow", None, "deadline", "'tomorrow'"),
    ("elastic model=gpt-1.3b global_batch=8 iterations=5 deadline=1850-01-01", None, "deadline", "1850"),
    ("elastic model=gpt-1.3b global_batch=8 iterations=5 colour=red", None, "comment", "colour=red"),
    ("elastic model gpt-1.3b", None, "comment", "'model'"),
    ("elastic model=", None, "model", "empty"),
    ("elastic model=a model=b global_batch=1 iterations=1", None, "model", "twice"),
    ("elastic model=$(rm -rf /) global_batch=1 iterations=1", None, "model", "$(rm"),
    ("elastic model=`id` global_batch=1 iterations=1", None, "model", "`id`"),
    ("elastic model=a;rm global_batch=1 iterations=1", None, "comment", "rm"),
    ("elastic model=a|b global_batch=1 iterations=1", None, "model", "a|b"),
    ("elastic model=x'y global_batch=1 iterations=1", None, "model", "x'y"),
    ("elastic model=../../etc/passwd global_batch=1 iterations=1", None, "model", "'.."),
    ("elastic", "#ELASTIC model=a global_batch=1 iterations=1 gpus=2&\n", "gpus", "2&"),
    ("elastic", "#ELASTICmodel=a\n", "script", "#ELASTICmodel"),
    ("elastic", "#ELASTIC model=a\n#ELASTIC model=b\n", "model", "twice"),
    ("elastic", "#ELASTIC model=a\n" * 40, "script", "40 #ELASTIC lines"),
    ("elastic model=" + "m" * 300 + " global_batch=1 iterations=1", None, "model", "longer than"),
    ("elastic " + "x=1 " * 400, None, "comment", "longer than"),
    ("plain job", SCRIPT, "comment", "not an elastic job"),
]


@pytest.mark.parametrize("comment, script, field, quoted", BAD)
def test_bad_specs_raise_typed_errors(comment, script, field, quoted):
    with pytest.raises(ElasticSpecError) as info:
        parse_spec(comment, script)
    err = info.value
    assert isinstance(err, SpecError)
    assert err.field == field
    message = str(err)
    assert quoted in message
    assert "\n" not in message and len(message) < 400


def test_huge_inputs_are_refused_quickly():
    with pytest.raises(ElasticSpecError, match="longer than"):
        parse_spec("elastic " + "a" * (MAX_COMMENT_CHARS * 50))
    with pytest.raises(ElasticSpecError, match="not read"):
        parse_spec("elastic", "#" * (MAX_SCRIPT_CHARS + 1))


def test_check_model_wraps_loader_failures():
    spec = parse_spec("elastic model=nope global_batch=1 iterations=1")

    def unknown(name):
        raise SpecError("model", name, "unknown model; known: gpt-1.3b")

    with pytest.raises(ElasticSpecError, match="known: gpt-1.3b"):
        check_model(spec, unknown)

    def unreadable(name):
        raise PermissionError(13, "Permission denied", name)

    path_spec = parse_spec("elastic model=/data/m.yaml global_batch=1 iterations=1")
    with pytest.raises(ElasticSpecError, match="PermissionError"):
        check_model(path_spec, unreadable)
    rel_spec = parse_spec("elastic model=models/m.yaml global_batch=1 iterations=1")
    with pytest.raises(ElasticSpecError, match="absolute path"):
        check_model(rel_spec, lambda name: name)
    assert check_model(spec, lambda name: ("loaded", name)) == ("loaded", "nope")


def test_spec_errors_cross_process_boundaries_whole():
    """A worker pool hands a SpecError back by pickling it: it must come back the same."""
    import pickle
    err = pickle.loads(pickle.dumps(SpecError("stages[1].ep", True, "no MoE layer")))
    assert isinstance(err, SpecError) and (err.field, err.value, err.hint) == ("stages[1].ep", True, "no MoE layer")
    assert str(err) == "stages[1].ep=True: no MoE layer"
    from estimator.plan_string import PlanStringError
    sub = pickle.loads(pickle.dumps(PlanStringError("plan=[", "no closing bracket")))
    assert type(sub) is PlanStringError and "no closing bracket" in str(sub)
