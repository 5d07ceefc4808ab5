"""Released jobs that a Slurm limit keeps back, without Slurm (``FakeSlurm``): a limit on
one job's size, and a limit on a user's, account's or QOS's total that the job's Cell alone
is over (no other job of the group runs), are given up for a smaller Cell; a total that
other jobs of the group fill keeps the job waiting on its Cell."""

from dataclasses import replace

import pytest

from policy.clock import SimulatedClock
from slurm_ext.daemon import Daemon
from slurm_ext.limits import (PER_JOB_LIMIT_SETTLE_S, group_limit, kept_back_by_slurm,
                              sole_under_group_limit)
from slurm_ext.observe import plan_comment
from slurm_ext.slurm_client import JobUpdate, SlurmJob
from slurm_ext.store import Store
from test_daemon import node
from test_daemon_edges import NOW, STARTED, daemon_for, held


def _refused_by_a_per_job_limit(tmp_path, reason="QOSMaxGRESPerJob"):
    """A job released on 8 GPUs of four a100 nodes that its QOS's per-job limit (or
    ``reason``) refuses; a minute later. Returns (daemon, client, clock, the GPU count refused)."""
    clock = SimulatedClock(float(NOW))
    nodes = [node(f"a100-{i}", "a100", 4) for i in range(1, 5)]
    daemon, client = daemon_for(tmp_path, [held(80, NOW - 100)], nodes, clock=clock)
    assert daemon.round().actions == (("start", 80),)
    (first,) = [c[2] for c in client.calls if c[0] == "update" and c[1] == 80]
    refused = plan_comment(first.admin_comment).cell_parts()[1]
    assert refused == 8  # gpus=4 asked: 2, 4 and 8 offered, 8 the fastest
    client._jobs[80] = replace(client._jobs[80], reason=reason, priority=100)
    clock.advance_to(NOW + 60)
    return daemon, client, clock, refused


def test_a_per_job_limit_learned_outlives_a_daemon_restart(tmp_path):
    """The GPU count Slurm refused under a per-job limit is kept in the state file: a
    restarted daemon deciding the job afresh does not offer the refused count again."""
    daemon, client, clock, refused = _refused_by_a_per_job_limit(tmp_path)
    daemon.round()
    daemon.store.close()
    restarted = Daemon(daemon.config, client, Store(daemon.config.state_db), clock=clock, out=lambda line: None)
    # Waited too long on its new Cell for some other reason: decided afresh after the restart.
    client._jobs[80] = replace(client._jobs[80], reason="Priority")
    clock.advance_to(NOW + 7200)
    client.calls.clear()
    assert restarted.round().actions == (("start", 80),)
    (after,) = [c[2] for c in client.calls if c[0] == "update" and c[1] == 80]
    assert plan_comment(after.admin_comment).cell_parts()[1] < refused


def test_a_cell_over_a_per_job_limit_is_given_up_for_one_slurm_takes(tmp_path):
    """Released on 8 GPUs, the job meets its QOS's limit of GPUs per job: Slurm will never
    start it so, whatever frees up. It is decided afresh on fewer GPUs than were refused
    (it had waited for ever, with 8 GPUs idle)."""
    daemon, client, clock, refused = _refused_by_a_per_job_limit(tmp_path)
    client.calls.clear()
    assert daemon.round().actions == (("start", 80),)
    (again,) = [c[2] for c in client.calls if c[0] == "update" and c[1] == 80]
    assert plan_comment(again.admin_comment).cell_parts()[1] < refused
    # Limits that clear with time still keep it waiting on its Cell (its shown times aside).
    client._jobs[80] = replace(client._jobs[80], reason="QOSMaxGRESPerUser", admin_comment=again.admin_comment)
    clock.advance_to(NOW + 120)
    client.calls.clear()
    assert daemon.round().actions == () and not [c for c in client.calls if c[0] == "release"]
    assert all(c[2] == JobUpdate(admin_comment=c[2].admin_comment, start_now=False)
               and plan_comment(c[2].admin_comment).cell == plan_comment(again.admin_comment).cell
               for c in client.calls if c[0] == "update")
    # Refused down to no GPU at all: the job says so rather than wait unexplained.
    client._jobs[80] = replace(client._jobs[80], reason="QOSMaxGRESPerJob", admin_comment=STARTED.replace(
        "a100x4", "a100x1").replace("dp4tp1", "dp1tp1"))
    clock.advance_to(NOW + 180)
    daemon.round()
    assert "Slurm refuses more (a limit of its user, account or QOS: QOSMaxGRESPerJob)" \
        in plan_comment(client._jobs[80].admin_comment).error


def test_a_per_job_limit_reason_slurm_has_not_looked_at_again_does_not_shrink_the_job_further(tmp_path):
    """Decided afresh on 4 GPUs after 8 were refused, the job still shows the limit's reason
    until Slurm's scheduler looks at it again: rounds in that minute neither lower the cap
    again nor decide the job afresh (it had shrunk round by round to no Cell at all)."""
    daemon, client, clock, refused = _refused_by_a_per_job_limit(tmp_path)
    assert daemon.round().actions == (("start", 80),)
    cap = daemon._gpu_caps[80]
    assert cap == refused - 1
    shrunk = plan_comment(client._jobs[80].admin_comment).cell_parts()[1]
    for k in range(1, 6):  # the old reason, seen again before Slurm's next look
        clock.advance_to(NOW + 60 + 2 * k)
        assert daemon.round().actions == ()
    assert daemon._gpu_caps[80] == cap and daemon.store.gpu_caps()[80] == cap
    assert plan_comment(client._jobs[80].admin_comment).cell_parts()[1] == shrunk
    clock.advance_to(NOW + 60 + PER_JOB_LIMIT_SETTLE_S)  # Slurm refuses the new Cell too
    assert daemon.round().actions == (("start", 80),)
    assert daemon._gpu_caps[80] == shrunk - 1




@pytest.mark.parametrize("reason, group", [
    ("QOSMaxGRESPerUser", "user"), ("QOSMaxNodePerUserLimit", "user"), ("QOSMaxCpuPerUserLimit", "user"),
    ("AssocGrpGRES", "account"), ("AssocGrpNodeLimit", "account"), ("QOSMaxGRESPerAccount", "account"),
    ("QOSGrpGRES", "qos"),
    ("QOSGrpCpuLimit", "qos"),
    # job counts and time clear as other jobs end, whatever the Cell
    ("QOSMaxJobsPerUserLimit", None), ("AssocGrpJobsLimit", None), ("QOSGrpSubmitJobsLimit", None),
    ("AssocGrpWallLimit", None), ("QOSGrpGRESRunMinutes", None), ("AssocGrpGRESMinutes", None),
    # a per-job limit is one without a group; the rest are no limits at all
    ("QOSMaxGRESPerJob", None), ("AssocMaxGRESPerJob", None), ("Priority", None), ("Resources", None),
])
def test_the_group_a_limit_reason_counts(reason, group):
    assert group_limit(SlurmJob(1, "alice", "t", "PENDING", reason=reason)) == group


def _pending(reason):
    return SlurmJob(80, "alice", "t", "PENDING", reason=reason, account="lab", qos="normal", partition="a100",
                    admin_comment=STARTED, priority=100)


@pytest.mark.parametrize("reason, other, shared", [
    ("QOSMaxGRESPerUser", dict(user="alice", account="other"), True),
    ("QOSMaxGRESPerUser", dict(user="bob", account="lab"), False),
    ("AssocGrpGRES", dict(user="bob", account="lab"), True),
    ("AssocGrpGRES", dict(user="alice", account="other"), False),
    ("QOSGrpGRES", dict(user="bob", qos="normal", partition="a40"), True),
    ("QOSGrpGRES", dict(user="bob", qos="high", partition="a100"), True),  # the partition's QOS
    ("QOSGrpGRES", dict(user="bob", qos="high", partition="a40"), False),
])
def test_a_job_is_alone_under_its_groups_limit_only_a_while_after_the_group_last_ran(reason, other, shared):
    job = _pending(reason)
    other = SlurmJob(90, name="o", state="RUNNING", **{"user": "x", "account": "x", "qos": "x", "partition": "x",
                                                        **other})
    sole, seen = sole_under_group_limit([job, other], {}, NOW)
    assert sole == frozenset() and seen == {80: NOW}  # first seen waiting: Slurm may look again
    sole, seen = sole_under_group_limit([job, other], seen, NOW + PER_JOB_LIMIT_SETTLE_S)
    assert (80 in sole) is not shared
    assert kept_back_by_slurm(job, sole) is shared
    # Once the group's other job has ended, Slurm gets its settling time to start the job.
    ended = replace(other, state="COMPLETED")
    sole, seen = sole_under_group_limit([job, ended], seen, NOW + 2 * PER_JOB_LIMIT_SETTLE_S - 1)
    assert (80 in sole) is not shared
    sole, _ = sole_under_group_limit([job, ended], seen, NOW + 3 * PER_JOB_LIMIT_SETTLE_S)
    assert sole == {80}


def test_a_cell_alone_over_its_users_total_is_given_up_for_a_smaller_one(tmp_path):
    """Released on 8 GPUs, the job meets its QOS's limit of GPUs per user, and the user runs
    nothing else: the Cell alone is over the total, Slurm will never start it (it had
    waited for ever with 8 GPUs idle). A minute after it is first seen so, it is decided
    afresh on fewer GPUs than were refused."""
    daemon, client, clock, refused = _refused_by_a_per_job_limit(tmp_path, "QOSMaxGRESPerUser")
    client.calls.clear()
    assert daemon.round().actions == ()  # Slurm may not have looked at it since it ran alone
    assert [c[0] for c in client.calls if c[0] in ("release", "hold")] == []
    clock.advance_to(NOW + 60 + PER_JOB_LIMIT_SETTLE_S)
    client.calls.clear()
    assert daemon.round().actions == (("start", 80),)
    (again,) = [c[2] for c in client.calls if c[0] == "update" and c[1] == 80]
    assert plan_comment(again.admin_comment).cell_parts()[1] < refused


def test_a_users_total_filled_by_the_users_other_job_keeps_the_job_on_its_cell(tmp_path):
    """The user's other job holds part of the total: the job waits on its Cell as long as
    that job runs, and once it has ended Slurm gets a minute to start the job as it is."""
    daemon, client, clock, refused = _refused_by_a_per_job_limit(tmp_path, "QOSMaxGRESPerUser")
    other = SlurmJob(90, "alice", "prep", "RUNNING", partition="a100", priority=1, nodes=("a100-4",),
                     node_count=1, submit_time_s=NOW - 5000, start_time_s=NOW - 4000)
    client._jobs[90] = other
    last_s = NOW
    for k in range(10):  # an hour
        last_s = NOW + 60 + 360 * k
        clock.advance_to(last_s)
        client.calls.clear()
        assert daemon.round().actions == ()
        assert [c for c in client.calls if c[0] in ("release", "hold")] == []
    assert 80 not in daemon._gpu_caps
    assert plan_comment(client._jobs[80].admin_comment).cell_parts()[1] == refused
    client._jobs[90] = replace(other, state="COMPLETED")
    clock.advance_to(last_s + PER_JOB_LIMIT_SETTLE_S - 5)
    assert daemon.round().actions == ()
    clock.advance_to(last_s + PER_JOB_LIMIT_SETTLE_S)
    client.calls.clear()
    assert daemon.round().actions == (("start", 80),)
    (again,) = [c[2] for c in client.calls if c[0] == "update" and c[1] == 80]
    assert plan_comment(again.admin_comment).cell_parts()[1] < refused


def test_a_guaranteed_job_kept_back_by_slurm_keeps_its_share_of_the_quota(tmp_path):
    """alice may hold 4 guaranteed GPUs. Her older job is released on them and waits for
    its dependency: the newer one is not granted her quota meanwhile, to lose it again
    (and be suspended) when the older one starts."""
    from test_daemon_edges import SPEC, seen_by_policy
    kept = SlurmJob(60, "alice", "t", "PENDING", reason="Dependency", partition="a100", priority=1,
                    comment=SPEC + " guaranteed=yes", admin_comment=STARTED, gpus_per_node=4, node_count=1,
                    submit_time_s=NOW - 3600)
    daemon, client = daemon_for(tmp_path, [kept, held(61, NOW - 600, SPEC + " guaranteed=yes")],
                                [node("a100-1", "a100", 4), node("a100-2", "a100", 4)],
                                clock=SimulatedClock(float(NOW)), guarantees={"users": {"alice": 4}})
    assert kept_back_by_slurm(kept)
    seen = seen_by_policy(daemon)
    daemon.round()
    assert {v.job_id: v.guaranteed for v in seen["snapshots"][-1].jobs} == {"61": False}
