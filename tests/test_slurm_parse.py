"""The Slurm output parsers, on output recorded from Slurm 22.05 and 25.11 and on constructed
23.02 shapes."""

from dataclasses import dataclass
from pathlib import Path

import pytest

from estimator.cluster import load_cluster
from slurm_ext.errors import SlurmParseError
from slurm_ext.slurm_client import Gres, SlurmNode
from slurm_ext.slurm_parse import (
    exit_code, expand_hostlist, listing_exit_code, listing_records, number, parse_gres,
    parse_gres_detail, parse_gres_item, parse_job_detail, parse_job_listing, parse_jobs,
    parse_nodes, parse_sbatch_parsable, state_and_flags, GroupedSinfoError, JOB_BASE_STATES,
    job_state,
)

FIXTURES = Path(__file__).parent / "fixtures"
RECORDED = FIXTURES / "slurm-22.05"
CONSTRUCTED = FIXTURES / "constructed"


@dataclass(frozen=True)
class Recording:
    """One version's recordings: its directory and which document lists nodes one by one."""

    path: Path
    nodes_doc: str  # sinfo (22.05) or scontrol_nodes (23.11 and later)

    def nodes(self, situation: str) -> Path:
        return self.path / f"{self.nodes_doc}_{situation}.json"


RECORDINGS = [Recording(FIXTURES / "slurm-22.05", "sinfo"),
              Recording(FIXTURES / "slurm-25.11", "scontrol_nodes")]


@pytest.fixture(params=RECORDINGS, ids=lambda r: r.path.name)
def rec(request) -> Recording:
    return request.param


def jobs_of(path: Path) -> dict:
    return {j.job_id: j for j in parse_jobs(path.read_text())}


def nodes_of(path: Path) -> dict:
    return {n.name: n for n in parse_nodes(path.read_text())}


# ---- recorded 22.05 and 25.11 ---------------------------------------------------------------

def test_empty_output_and_empty_queue_give_no_jobs(rec):
    assert parse_jobs((rec.path / "squeue_empty.json").read_text()) == ()
    assert parse_jobs("") == ()
    assert parse_nodes("  \n") == ()


def test_elastic_jobs_as_job_submit_lua_left_them(rec):
    jobs = jobs_of(rec.path / "squeue_pending_held.json")
    typed = jobs[1]
    assert typed.is_elastic and typed.is_held and typed.is_pending and typed.is_active
    assert (typed.partition, typed.gpus_per_node, typed.gpu_type_requested) == ("a100", 4, None)
    assert typed.admin_comment == "requested=a100" and typed.requeue
    assert typed.node_count == 2 and typed.nodes == () and typed.granted_gpus == 0
    assert typed.comment.startswith("elastic model=gpt-1.3b")
    assert typed.user == "root" and typed.name == "elastic-typed" and typed.batch
    assert typed.submit_time_s > 1_600_000_000 and typed.start_time_s == 0
    assert typed.exit_code is None
    untyped = jobs[2]
    assert untyped.admin_comment == "requested=any" and untyped.partition == "a10"


def test_plain_held_job_keeps_its_type_and_a_pending_array_its_task_spec(rec):
    jobs = jobs_of(rec.path / "squeue_pending_held.json")
    plain = jobs[3]
    assert not plain.is_elastic and plain.is_held
    assert (plain.gpus_per_node, plain.gpu_type_requested) == (2, "v100")
    array = jobs[4]
    assert array.array_job_id == 4 and array.array_task_id is None
    assert array.array_task_spec == "0-7%2"


def test_running_jobs_report_granted_gpus_per_node_from_gres_detail(rec):
    jobs = jobs_of(rec.path / "squeue_running.json")
    two_node = next(j for j in jobs.values() if j.name == "running-2node")
    assert two_node.is_running and two_node.reason == ""
    assert two_node.nodes == ("v100-1", "v100-2")
    assert two_node.granted_gpus_per_node == (3, 3) and two_node.granted_gpu_type == "v100"
    assert two_node.start_time_s >= two_node.submit_time_s > 0
    rescale = next(j for j in jobs.values() if j.name == "rescale")
    assert rescale.gpu_type_requested is None and rescale.granted_gpu_type == "a10"
    waits = next(j for j in jobs.values() if j.name == "a100-waits")
    assert waits.is_pending and not waits.is_held and waits.reason == "Resources"


def test_array_tasks_are_separate_jobs_of_one_array(rec):
    jobs = jobs_of(rec.path / "squeue_running.json")
    tasks = sorted((j.array_task_id, j.job_id) for j in jobs.values() if j.name == "array-running")
    assert [t for t, _ in tasks] == [0, 1, 2]
    assert len({j.array_job_id for j in jobs.values() if j.name == "array-running"}) == 1
    assert all(jobs[i].granted_gpus_per_node == (2,) for _, i in tasks)


def test_cancelled_jobs_are_reported_but_not_active(rec):
    jobs = jobs_of(rec.path / "squeue_running.json")
    cancelled = [j for j in jobs.values() if j.state == "CANCELLED"]
    assert cancelled and not any(j.is_active or j.is_held for j in cancelled)


def test_requeued_held_job_after_exit_86(rec):
    job = next(j for j in jobs_of(rec.path / "squeue_requeued_held.json").values()
               if j.name == "rescale")
    assert job.state == "SPECIAL_EXIT" and job.is_held and job.is_active
    assert job.restart_count == 1 and job.exit_code == 86
    assert job.granted_gpus_per_node == () and job.nodes == ()


def test_idle_nodes_match_the_lab_cluster_spec(rec):
    nodes = nodes_of(rec.nodes("idle"))
    cluster = load_cluster("lab")
    assert set(nodes) == {n for g in cluster.node_groups for n in g.node_names()}
    for g in cluster.node_groups:
        for name in g.node_names():
            node = nodes[name]
            assert node.state == "idle" and node.is_usable
            assert node.gres == (Gres("gpu", g.gpu_type, g.gpus_per_node),)
            assert node.gpus_used == 0 and node.features == (g.gpu_type,)
            assert node.partitions == (g.partition,)
            assert node.cpus > 0 and node.real_memory_mb > 0


def test_gpus_used_on_nodes_match_gpus_granted_to_running_jobs(rec):
    nodes = nodes_of(rec.nodes("busy"))
    jobs = parse_jobs((rec.path / "squeue_running.json").read_text())
    granted: dict[str, int] = {}
    for j in jobs:
        for node, n in zip(j.nodes, j.granted_gpus_per_node):
            granted[node] = granted.get(node, 0) + n
    assert granted and {n: node.gpus_used for n, node in nodes.items() if node.gpus_used} == granted
    assert {n.state for n in nodes.values()} == {"idle", "mixed"}


# ---- constructed newer shapes -------------------------------------------------------------

def test_slurm_23_02_number_objects():
    jobs = jobs_of(CONSTRUCTED / "squeue_23.02.json")
    held = jobs[101]
    assert held.priority == 0 and held.is_held and held.node_count == 2
    assert held.submit_time_s == 1700000000 and held.array_job_id is None
    running = jobs[102]
    assert running.restart_count == 2 and running.granted_gpus_per_node == (3, 3)
    assert running.end_time_s == 1700086600
    assert running.exit_code == 0  # a restarted job reports its last run's status
    task = jobs[105]
    assert (task.array_job_id, task.array_task_id) == (104, 1)
    assert jobs[106].state == "COMPLETED" and jobs[106].exit_code == 1


def test_slurm_25_11_requeued_job_state_list_reads_as_squeue_prints_it():
    # 25.11 --json gives ["PENDING", "SPECIAL_EXIT"]; squeue -O State and the C API say SPECIAL_EXIT.
    job = next(j for j in jobs_of(FIXTURES / "slurm-25.11" / "squeue_requeued_held.json").values()
               if j.name == "rescale")
    assert (job.state, job.state_flags) == ("SPECIAL_EXIT", ("PENDING",))
    assert job_state(["RUNNING", "COMPLETING"]) == ("COMPLETING", ("RUNNING",))
    assert job_state(["PENDING", "REQUEUED", "SPECIAL_EXIT"]) == ("REQUEUED", ("PENDING", "SPECIAL_EXIT"))
    assert job_state("RUNNING") == ("RUNNING", ())
    assert exit_code({"return_code": 0, "signal": {"id": 9, "name": "KILL"}}) == 128 + 9


@pytest.mark.parametrize("state", [["PENDING", "RESV_DEL_HOLD"], ["PENDING", "EXPEDITING"], ["PENDING", "FUTURE_FLAG"]])
def test_a_job_in_a_state_squeue_shows_as_a_flag_is_still_active(state):
    """RESV_DEL_HOLD (its reservation deleted) and EXPEDITING are what squeue shows for a
    pending job: read as ended, the daemon dropped its progress, original submit time and
    spec, and closed its open rescale. Only a terminal state ends a job."""
    from slurm_ext.slurm_client import SlurmJob
    base, flags = job_state(state)
    job = SlurmJob(7, "u", "n", base, state_flags=flags, priority=0)
    assert job.is_active
    assert job.is_held == (base != "EXPEDITING")  # priority 0: held, except while Slurm requeues it
    assert not SlurmJob(7, "u", "n", job_state(["CANCELLED"])[0]).is_active


def test_slurm_25_11_sinfo_groups_nodes_so_the_scontrol_document_is_read():
    for situation in ("idle", "busy"):
        with pytest.raises(GroupedSinfoError):
            parse_nodes((FIXTURES / "slurm-25.11" / f"sinfo_{situation}.json").read_text())


def test_newer_sinfo_state_lists_flags_and_duplicate_nodes():
    nodes = nodes_of(CONSTRUCTED / "sinfo_23.02.json")
    assert nodes["a100-1"].state == "mixed" and nodes["a100-1"].is_usable
    assert nodes["a100-2"].state == "idle" and nodes["a100-2"].state_flags == ("DRAIN",)
    assert not nodes["a100-2"].is_usable
    assert not nodes["v100-1"].is_usable
    assert nodes["v100-1"].features == ("v100", "nvlink")
    assert nodes["v100-1"].partitions == ("v100", "all")


@pytest.mark.parametrize("flag", ["MAINTENANCE", "REBOOT_REQUESTED", "REBOOT_ISSUED", "INVALID_REG"])
def test_a_node_under_a_slurm_23_11_flag_that_keeps_jobs_off_it_is_not_usable(flag):
    """23.11 and later spell these flags out (22.05: maint, reboot, inval): a node in
    maintenance or about to reboot has no GPUs to give."""
    node = SlurmNode("a100-3", "idle", state_flags=(flag,), gres=(Gres("gpu", "a100", 4),))
    assert not node.is_usable and node.gpus_free == 0
    assert SlurmNode("a100-3", "idle", gres=(Gres("gpu", "a100", 4),)).gpus_free == 4


def test_controller_errors_and_garbage_raise_quoting_the_text():
    with pytest.raises(SlurmParseError, match="Unable to contact slurm controller"):
        parse_jobs((CONSTRUCTED / "squeue_errors.json").read_text())
    with pytest.raises(SlurmParseError, match="squeue: error: Invalid"):
        parse_jobs("squeue: error: Invalid user")
    with pytest.raises(SlurmParseError, match="job_id"):
        parse_jobs('{"jobs": [{"name": "no id"}]}')
    with pytest.raises(SlurmParseError, match="name"):
        parse_nodes('{"nodes": [{"state": "idle"}]}')


# ---- small pieces -------------------------------------------------------------------------

@pytest.mark.parametrize("hostlist, names", [
    ("", ()),
    ("h100-1", ("h100-1",)),
    ("a100-[1-2]", ("a100-1", "a100-2")),
    ("v100-[1-2],h100-1", ("v100-1", "v100-2", "h100-1")),
    ("n[08-10]", ("n08", "n09", "n10")),
    ("gpu[1,3-4]x", ("gpu1x", "gpu3x", "gpu4x")),
    ("r[1-2]n[1-2]", ("r1n1", "r1n2", "r2n1", "r2n2")),
])
def test_expand_hostlist(hostlist, names):
    assert expand_hostlist(hostlist) == names


def test_expand_hostlist_rejects_a_non_numeric_range():
    with pytest.raises(SlurmParseError, match=r"a\[x-y\]"):
        expand_hostlist("a[x-y]")


@pytest.mark.parametrize("item, gres", [
    ("gpu:a100:4", Gres("gpu", "a100", 4)),
    ("gres:gpu:4", Gres("gpu", None, 4)),
    ("gres/gpu:a100=4", Gres("gpu", "a100", 4)),
    ("gres/gpu=2", Gres("gpu", None, 2)),
    ("gpu:v100:3(IDX:0-2)", Gres("gpu", "v100", 3)),
    ("gpu:a100:4(S:0-1)", Gres("gpu", "a100", 4)),
    ("gpu", Gres("gpu", None, 1)),
    ("mps:1K", Gres("mps", None, 1024)),
    ("(null)", None),
    ("", None),
])
def test_parse_gres_item(item, gres):
    assert parse_gres_item(item) == gres


def test_parse_gres_lists_and_details():
    assert parse_gres("gpu:a10:2(S:0),gpu:a10:1(S:1)") == (Gres("gpu", "a10", 2), Gres("gpu", "a10", 1))
    assert parse_gres(["gres/gpu:h100:8"]) == (Gres("gpu", "h100", 8),)
    assert parse_gres_detail(["gpu:v100:3(IDX:0-2)", "gpu:v100:1(IDX:3)"]) == ((3, 1), "v100")
    assert parse_gres_detail([]) == ((), None)


@pytest.mark.parametrize("raw, value", [
    (5, 5), (2.0, 2), (None, None), ("7", 7), ("x", None),
    ({"set": True, "infinite": False, "number": 42}, 42),
    ({"set": False, "infinite": False, "number": 0}, None),
    ({"set": True, "infinite": True, "number": 0}, None),
])
def test_number_unwraps_plain_and_object_numbers(raw, value):
    assert number(raw) == value


def test_exit_codes_of_each_shape():
    assert exit_code(86 << 8) == 86
    assert exit_code(9) == 128 + 9
    assert exit_code({"status": ["EXITED"], "return_code": {"set": True, "number": 3}}) == 3
    assert exit_code(None) is None


def test_state_and_flags_of_strings_and_lists():
    assert state_and_flags("PENDING", JOB_BASE_STATES) == ("PENDING", ())
    assert state_and_flags(["REQUEUED", "PENDING"], JOB_BASE_STATES) == ("REQUEUED", ("PENDING",))
    assert state_and_flags(["CONFIGURING_X", "RUNNING"], JOB_BASE_STATES) == ("RUNNING", ("CONFIGURING_X",))
    assert state_and_flags([], JOB_BASE_STATES) == ("", ())


def test_sbatch_parsable_output():
    assert parse_sbatch_parsable("123\n") == 123
    assert parse_sbatch_parsable("77;lab\n") == 77
    with pytest.raises(SlurmParseError, match="Submitted batch job"):
        parse_sbatch_parsable("Submitted batch job 5")


# ---- the cheap listing (recorded 22.05: listing/*, see record_listing.py there) -----------

LISTING = RECORDED / "listing"
SITUATIONS = ("pending_held", "running", "requeued_held")


def listing_of(name: str) -> dict:
    texts = [(LISTING / f"{name}.{part}.txt").read_text() for part in ("main", "admin_comment", "name")]
    return {j.job_id: j for j in parse_job_listing(*texts)}


@pytest.mark.parametrize("name", SITUATIONS)
def test_listing_reads_the_same_jobs_as_json(name):
    """Recorded back to back: every field agrees, but what only JSON or detail carries."""
    from dataclasses import asdict
    by_json = {j.job_id: j for j in parse_jobs((LISTING / f"{name}.json").read_text())}
    listed = listing_of(name)
    assert sorted(listed) == sorted(by_json) and len(listed) >= 4
    for job_id, j in by_json.items():
        a, b = asdict(j), asdict(listed[job_id])
        # A running job without a time limit has no end in either (JSON's year past its
        # start is read as none); JSON projects a waiting one's, the listing says NONE.
        if j.is_active and not j.is_running:
            assert b.pop("end_time_s") == 0
            a.pop("end_time_s")
        # Granted GPUs per node come from `parse_job_detail`.
        if j.is_running:
            for key in ("granted_gpus_per_node", "granted_gpu_type"):
                a.pop(key), b.pop(key)
        assert a == b, job_id


def test_unchanged_records_are_reused_and_changed_ones_parsed_again():
    texts = [(LISTING / f"running.{part}.txt").read_text() for part in ("main", "admin_comment", "name")]
    memo: dict = {}
    first = {j.job_id: j for j in parse_job_listing(*texts, memo=memo)}
    admin = texts[1].replace("5|(null)|", "5|why=changed|")
    again = {j.job_id: j for j in parse_job_listing(texts[0], admin, texts[2], memo=memo)}
    assert again[8] is first[8] and again == {**first, 5: again[5]}
    assert again[5].admin_comment == "why=changed" and first[5].admin_comment == ""
    assert set(memo) == set(first)


def test_listing_keeps_pipes_and_newlines_inside_free_text():
    jobs = listing_of("pending_held")
    tricky = jobs[2]
    # The comment holds '|', a newline and a line imitating a record of job 1.
    assert tricky.comment == "elastic model=gpt-760m note=a|b\n1|1|N/A|RUNNING|None|h100|root|"
    assert tricky.admin_comment == "requested=any cell=a10x2:s2 plan=[dp1tp1|dp1tp1] why=chosen"
    assert tricky.name == "name|with pipe JOB_GRES=x"
    assert jobs[1].state == "PENDING" and jobs[1].is_held  # not the imitation's RUNNING
    assert jobs[3].comment == "" and jobs[3].admin_comment == ""  # Slurm prints (null)


def test_free_text_with_digits_of_other_scripts_or_an_invented_record_is_free_text():
    """``'²'.isdigit()`` is True and ``int('²')`` raises: a comment with a line starting
    '²|' made every listing of everybody's jobs fail (and the daemon's poll, outside its
    round's error handling, stop the service). In the pending listing a comment's later
    lines are its own, not jobs of their own."""
    from slurm_ext.slurm_parse import parse_pending_listing
    assert listing_records("5|a|plain\n²|b|x|\n", 3) == {5: ["5", "a", "plain\n²|b|x"]}
    assert parse_pending_listing("5|plain\n²|elastic|\n") == []
    assert parse_pending_listing("5|plain\nelastic|\n6|elastic model=x|\n") == [6]
    assert number("²") is None and number("12") == 12
    # A blank line inside free text is kept, as Slurm's JSON keeps it.
    assert listing_records("5|a|elastic a\n\nb|\n6|b|x|\n", 3)[5][2] == "elastic a\n\nb"


def test_a_typed_request_per_job_names_the_gpu_type():
    """``--gpus=a100:8`` (Slurm's tres_per_job ``gres/gpu:a100:8``) lost its type, which
    the submit hook and the docs read as the request."""
    from slurm_ext.slurm_parse import parse_job
    job = parse_job({"job_id": 7, "job_state": "PENDING", "tres_per_job": "gres/gpu:a100:8"})
    assert (job.gpus_per_job, job.gpus_per_node, job.gpu_type_requested) == (8, 0, "a100")
    line = "7|7|N/A|PENDING|None|gpu|u|N/A|gres:gpu:a100:8||1|0|1795625990|N/A|N/A|1|1|1|0|(null)|(null)|elastic|\n"
    (listed,) = parse_job_listing(line, "7|(null)|\n", "7|t|\n")
    assert (listed.gpus_per_job, listed.gpu_type_requested) == (8, "a100")


def test_listing_exit_status_of_a_requeued_job():
    job = listing_of("requeued_held")[7]
    assert (job.state, job.restart_count, job.exit_code, job.is_held) == ("SPECIAL_EXIT", 1, 86, True)
    assert listing_exit_code("22016") == 86 and listing_exit_code("0:9") == 137
    assert listing_exit_code("2:0") == 2


def test_a_comment_imitating_a_whole_record_is_refused_or_dropped():
    main = (LISTING / "pending_held.main.txt").read_text()
    admin = (LISTING / "pending_held.admin_comment.txt").read_text()
    names = (LISTING / "pending_held.name.txt").read_text()
    line = next(ln for ln in main.splitlines() if ln.startswith("3|"))
    forged_existing = main.replace("note=a|b", "note=a|b\n" + line.replace("JobHeldUser", "None"))
    with pytest.raises(SlurmParseError, match="listed twice"):
        parse_job_listing(forged_existing, admin, names)
    # A record of a job Slurm does not have: not in the AdminComment listing, left out.
    forged_new = main.replace("note=a|b", "note=a|b\n" + line.replace("3|3|", "99|99|", 1))
    assert 99 not in {j.job_id for j in parse_job_listing(forged_new, admin, names)}
    assert listing_records("12|x|y|\nmore|\n13|z|w|\n", 3) == {12: ["12", "x", "y|\nmore"],
                                                                13: ["13", "z", "w"]}


def test_granted_gpus_per_node_from_scontrol_detail():
    names = {j.job_id: j.name for j in listing_of("running").values()}
    detail = parse_job_detail((LISTING / "running.detail.txt").read_text(), names)
    assert detail[8] == {"a100-1": (4, "a100"), "a100-2": (2, "a100")}  # --gpus=6 over 2 nodes
    assert detail[5] == {"v100-1": (3, "v100"), "v100-2": (3, "v100")}
    assert detail[10] == {"h100-1": (2, "h100")}  # an array task
    assert 9 not in detail and 1 not in detail  # pending, cancelled: nothing granted
    # The JSON of the same moment agrees.
    by_json = {j.job_id: j for j in parse_jobs((LISTING / "running.json").read_text())}
    for job_id, per_node in detail.items():
        assert tuple(per_node[n][0] for n in by_json[job_id].nodes) == by_json[job_id].granted_gpus_per_node


def test_detail_imitated_in_a_name_or_a_comment_is_not_believed():
    real = "JobId=5 JobName=x UserId=u(0) CoreSpec=* JOB_GRES=gpu:a10:1   Nodes=a10-1 CPU_IDs=0 Mem=0 GRES=gpu:a10:1(IDX:0) MinCPUsNode=1"
    fake = "y JOB_GRES=gpu:h100:8   Nodes=h100-1 CPU_IDs=0 Mem=0 GRES=gpu:h100:8(IDX:0-7) MinCPUsNode=1"
    named = real.replace("JobName=x", f"JobName=x {fake}")
    assert parse_job_detail(named, {5: f"x {fake}"}) == {5: {"a10-1": (1, "a10")}}
    assert parse_job_detail(named, {5: "z"}) == {}  # not the name the listing showed
    assert parse_job_detail(real + "\n" + real.replace("a10", "h100"), {5: "x"}) == {}  # two lines


def test_account_and_qos_from_json_and_the_listing():
    (job,) = parse_jobs('{"jobs": [{"job_id": 5, "job_state": "PENDING", "account": "ml", "qos": "high"}]}')
    assert (job.account, job.qos) == ("ml", "high")
    main = "5|5|N/A|PENDING|Priority|a10|bob|gres:gpu:1|N/A||1|0|1|0|0|10|1|1|0|ml|high|elastic|\n"
    (listed,) = parse_job_listing(main, "5|(null)|\n", "5|train|\n")
    assert (listed.account, listed.qos, listed.user, listed.comment) == ("ml", "high", "bob", "elastic")
    (unset,) = parse_job_listing(main.replace("|ml|high|", "|(null)|(null)|"), "5|(null)|\n", "5|t|\n")
    assert (unset.account, unset.qos) == ("", "")


def test_reservation_nodes_from_scontrol_show():
    from slurm_ext.slurm_parse import parse_reservation_nodes
    line = ("ReservationName=slurm-ext-hold StartTime=2026-11-25T17:40:00 EndTime=Unknown "
            "Duration=UNLIMITED Nodes=a100-[1-2],h100-1 NodeCnt=3 CoreCnt=48 Features=(null) "
            "PartitionName=(null) Flags=IGNORE_JOBS,SPEC_NODES Users=root\n")
    assert parse_reservation_nodes(line) == ("a100-1", "a100-2", "h100-1")
    with pytest.raises(SlurmParseError):
        parse_reservation_nodes("Reservation x not found")
