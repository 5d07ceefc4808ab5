"""The daemon ↔ runner contract (``estimator.contract``): one grammar, one limit, one
schema, used by both sides."""

import ast
import json
from dataclasses import replace
from pathlib import Path

import pytest

from estimator.contract import (
    ADMIN_COMMENT_PLAN, MAX_ADMIN_COMMENT_CHARS, MEASURED_FILE, PlanComment, RunnerReport,
    format_plan_comment, parse_plan_comment, plan_tokens,
)
from estimator.plan_string import parse_plan
from slurm_ext.cli_backend import update_pending_argv
from slurm_ext.errors import SlurmArgumentError
from slurm_ext.slurm_client import JobUpdate

ROOT = Path(__file__).resolve().parent.parent


def _imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
    return out


@pytest.mark.parametrize("folder", ["job_scripts", "examples"])
def test_the_runner_side_depends_on_the_estimator_and_the_contract_only(folder):
    """What runs in an allocation never imports the daemon's package (nor the policies)."""
    offenders = {str(p.relative_to(ROOT)): sorted(m for m in _imported_modules(p)
                                                  if m.split(".")[0] in ("slurm_ext", "policy"))
                 for p in (ROOT / folder).rglob("*.py")}
    assert {k: v for k, v in offenders.items() if v} == {}


def test_the_longest_admin_comment_the_daemon_writes_is_one_the_client_accepts():
    pc = PlanComment(requested="a100", cell="a100x8:s2", plan="[dp2tp2|dp4tp1]", micro_batches=16,
                     remat=True, layers=",".join(map(str, range(0, 2000, 7))), samples_per_s=1.5,
                     why="x" * 10_000)
    text = format_plan_comment(pc)
    assert len(text) <= MAX_ADMIN_COMMENT_CHARS
    assert f"AdminComment={text}" in update_pending_argv(7, JobUpdate(admin_comment=text))
    with pytest.raises(SlurmArgumentError, match=str(MAX_ADMIN_COMMENT_CHARS)):
        update_pending_argv(7, JobUpdate(admin_comment="y" * (MAX_ADMIN_COMMENT_CHARS + 1)))


def test_what_the_daemon_writes_the_runner_reads_as_the_same_plan():
    plan = parse_plan("cell=a100x4:s2 plan=[dp2tp1|dp1tp2] mb=8 remat=0 layers=0,10,24")
    written = format_plan_comment(PlanComment(
        requested="any", cell=plan.cell_label, plan="[dp2tp1|dp1tp2]", micro_batches=8, remat=False,
        layers="0,10,24", samples_per_s=95.5, why="started on a100x4:s2 (best); mb=3 is only why's"))
    assert parse_plan(plan_tokens(written)) == plan  # the runner's read
    back = parse_plan_comment(written)  # the daemon's and squeue's read
    assert (back.cell, back.micro_batches, back.remat, back.why) == \
           ("a100x4:s2", 8, False, "started on a100x4:s2 (best); mb=3 is only why's")
    assert plan_tokens("requested=a100 why=waiting for GPUs") is None  # no plan yet


def test_runner_report_round_trips_and_reads_bad_fields_as_unknown():
    report = RunnerReport(job_id="41", restart_count=2, cell="a100x4:s1",
                          plan="cell=a100x4:s1 plan=[dp4tp1] mb=4 remat=1", plan_source=ADMIN_COMMENT_PLAN,
                          global_batch=64, num_devices=4, platform="gpu", iteration_time_s=0.5,
                          steps_measured=8, samples_per_s=128.0, step=120, step_at_s=1.7e9,
                          updated_at_s=1.7e9, tuning_s=12.5, candidates_measured=3)
    assert RunnerReport.from_text(json.dumps(report.to_json())) == report
    bad = {**report.to_json(), "job_id": 41, "step": "120", "iteration_time_s": True,
           "samples_per_s": float("inf"), "tuning_s": None}
    read = RunnerReport.from_text(json.dumps(bad))
    assert (read.job_id, read.step, read.iteration_time_s, read.samples_per_s, read.tuning_s) == \
           ("41", None, None, None, 0.0)
    assert read.cell == report.cell and read.restart_count == 2
    assert RunnerReport.from_text("[1, 2]") is None and RunnerReport.from_text("{not json") is None
    assert MEASURED_FILE == "measured.json"  # operators and docs name it


def test_the_zero_stage_and_offload_reach_the_runner_and_back():
    plan = parse_plan("cell=a100x8:s2 plan=[dp4tp1|dp4tp1] mb=8 remat=0 layers=0,17,34 zero=3")
    written = format_plan_comment(PlanComment(requested="a100", cell=plan.cell_label, plan=plan.stages_label,
                                              micro_batches=8, remat=False, layers="0,17,34", zero_level=3,
                                              why="best"))
    assert parse_plan(plan_tokens(written)) == plan
    back = parse_plan_comment(written)
    assert (back.zero_level, back.offload, back.remat) == (3, False, False)
    offloaded = parse_plan_comment(format_plan_comment(PlanComment(cell="a100x1:s1", plan="[dp1tp1]",
                                                                   micro_batches=4, offload=True)))
    assert offloaded.offload and offloaded.zero_level == 0
    assert "zero=" not in format_plan_comment(PlanComment(cell="a100x1:s1", plan="[dp1tp1]", micro_batches=4))


def test_the_daemon_starts_a_job_with_the_plan_its_estimate_needs_to_fit():
    """A Cell that fits only with its weights split over dp (ZeRO-3) is written with zero=3,
    and with the estimate's own remat, so the runner runs the plan that was estimated."""
    from estimator.cluster import load_cluster
    from estimator.estimate import EstimateOptions, estimate_job
    from estimator.jobs import JobSpec
    from policy.interface import PENDING, Assignment, JobView
    from slurm_ext.act import start_update
    from slurm_ext.jobspec import ElasticSpec
    from slurm_ext.observe import ManagedJob
    from slurm_ext.slurm_client import SlurmJob
    from slurm_ext.steering import Steering
    job = JobSpec("gpt-6.7b", 256, 8, "a100")
    cells = estimate_job(job, load_cluster("crius-1280"), EstimateOptions()).cells
    est = next(e for e in cells if e.feasible and e.cell.gpu_type == "a100" and e.zero_level >= 1)
    view = JobView("5", "alice", job, 0.0, PENDING, None, 0.0, 1000, 0, 0.0, estimates=(est,), dp_only_estimates=())
    managed = ManagedJob(SlurmJob(5, "alice", "t", "PENDING", partition="a100", admin_comment="requested=a100"),
                         ElasticSpec("gpt-6.7b", 256, 1000, 8, "a100"), view)
    steering = Steering("partition", (22, 5, 0), {"a100": "a100"}, {"a100": frozenset({"a100"})}, {})
    per_node = est.cell.gpus_per_node
    nodes = tuple((f"a100-{i}", per_node) for i in range(est.cell.num_gpus // per_node))
    update = start_update(Assignment(est.cell, nodes), managed, steering, "best", "cells-ilp")
    written = parse_plan(plan_tokens(update.admin_comment))
    estimated = parse_plan(est.plan)
    assert (written.zero_level, written.remat, written.stages, written.micro_batches) == \
           (estimated.zero_level, estimated.remat, estimated.stages, estimated.micro_batches)
    assert not update.clear_gpus_per_job
    # A job submitted with --gpus=N: its count per job goes, or Slurm refuses the update.
    by_job = replace(managed, slurm=replace(managed.slurm, gpus_per_job=8))
    assert start_update(Assignment(est.cell, nodes), by_job, steering, "best", "cells-ilp").clear_gpus_per_job


def test_a_time_no_utc_text_can_show_is_left_out_of_the_admin_comment():
    far = format_plan_comment(PlanComment(cell="a100x4:s1", expected_start_s=1.8e9, expected_end_s=1e13))
    assert "start=" in far and "end=" not in far
    assert parse_plan_comment(far).expected_start_s == 1.8e9
    assert "start=" not in format_plan_comment(PlanComment(cell="a100x4:s1", expected_start_s=float("nan")))
