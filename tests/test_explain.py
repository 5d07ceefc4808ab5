"""`slurm-ext explain`: its pure parts (why a job waits, why its Cell won, the text form), and
the command on a stand-in client."""

from dataclasses import replace

from estimator.cells import Cell, CellEstimate
from estimator.contract import PlanComment, format_plan_comment, parse_plan_comment
from slurm_ext import explain
from slurm_ext.slurm_client import SlurmJob
from slurm_ext.store import RESCALE, JournalEntry


def est(gpu_type, n, iteration_s, feasible=True, reason=""):
    return CellEstimate(Cell(gpu_type, n, n, 1), (), 4, iteration_s, 64 / iteration_s, 20.0, feasible, reason)


ESTIMATES = (est("a100", 4, 1.0), est("h100", 4, 0.5), est("a10", 2, 9.0, False, "out of memory: 30 GB > 24 GB"))


def pending(admin_comment="requested=any", comment="elastic model=gpt-760m", reason="JobHeldAdmin"):
    return SlurmJob(7, "alice", "t", "PENDING", reason=reason, comment=comment, admin_comment=admin_comment,
                    priority=0)


def test_each_kind_of_wait_and_what_to_do():
    def cat(job, estimates=ESTIMATES, error=None, held=True):
        w = explain.waiting(job, parse_plan_comment(job.admin_comment), estimates, error, held)
        return w and (w.category, w.to_json()["what_to_do"] != "")

    assert cat(pending(comment="")) == (explain.NOT_ELASTIC, True)
    assert cat(pending(), error="model='x': unknown") == (explain.SPEC_ERROR, True)
    none_fit = (est("a10", 2, 9.0, False, "out of memory"),)
    assert cat(pending(), none_fit) == (explain.NO_CELL_FITS, True)
    assert cat(pending()) == (explain.NOT_PLANNED, True)
    waits = format_plan_comment(PlanComment(requested="any", why="waiting for GPUs", expected_start_s=1795608000.0))
    w = explain.waiting(pending(waits), parse_plan_comment(waits), ESTIMATES, None, True)
    assert (w.category, w.detail) == (explain.WAITING_FOR_GPUS, "waiting for GPUs; expected start 2026-11-25T12:00:00Z")
    released = "requested=any cell=a100x4:s1 plan=[dp4tp1] mb=4 remat=1 why=started"
    assert cat(pending(released, reason="Resources"), held=False) == (explain.STARTING, True)
    # Released onto a Cell Slurm will never start as it is: the daemon decides it again.
    assert cat(pending(released, reason="PartitionDown"), held=False) == (explain.DECIDED_AGAIN, True)
    assert cat(pending(released, reason="QOSMaxGRESPerJob"), held=False) == (explain.DECIDED_AGAIN, True)
    assert cat(pending(released, reason="Dependency"), held=False) == (explain.KEPT_BACK, True)
    running = SlurmJob(7, "alice", "t", "RUNNING", comment="elastic", admin_comment=released)
    assert explain.waiting(running, parse_plan_comment(released), ESTIMATES, None, False) is None


def test_why_the_cell_won():
    fastest = parse_plan_comment("cell=h100x4:s1 plan=[dp4tp1] why=started")
    assert explain.why_chosen(fastest, explain.chosen_estimate(fastest, ESTIMATES), ESTIMATES) == \
        "h100x4:s1 is the fastest Cell that fits (128 samples/s)"
    slower = parse_plan_comment("cell=a100x4:s1 plan=[dp4tp1] why=h100 busy until 14:00")
    text = explain.why_chosen(slower, explain.chosen_estimate(slower, ESTIMATES), ESTIMATES)
    assert text == ("1 Cell(s) would be faster, the best h100x4:s1 at 128 samples/s against 64; "
                    "the daemon said: h100 busy until 14:00")
    assert explain.why_chosen(PlanComment(), None, ESTIMATES) is None


def test_text_form_has_every_part():
    job = pending(format_plan_comment(PlanComment(requested="any", why="waiting for GPUs",
                                                  expected_start_s=1795608000.0, expected_end_s=1795615200.0,
                                                  progress_frac=0.0)))
    pc = parse_plan_comment(job.admin_comment)
    entry = JournalEntry(1, 7, RESCALE, None, "done", "", 1795600000.0)
    doc = {"job_id": 7, "state": "PENDING", "elastic": True, "spec_error": None, "chosen": None, "why_chosen": None,
           "forecast": explain.forecast_json(job), "restarts": 1, "history": explain.history((entry,)),
           "waiting": explain.waiting(job, pc, ESTIMATES, None, True).to_json(),
           "cells": [e.to_json() for e in ESTIMATES]}
    text = explain.format_text(doc)
    assert "forecast: start 2026-11-25T12:00:00Z, end 2026-11-25T14:00:00Z, 0.0 % done" in text
    assert "waiting: waiting for GPUs: waiting for GPUs; expected start 2026-11-25T12:00:00Z" in text
    assert "what you can do: nothing: it starts when the GPUs come free" in text
    assert "  2026-11-25T09:46:40Z rescale (done): " in text
    assert "* a10x2:s1       out of memory: 30 GB > 24 GB" in text
    done = replace(job, state="COMPLETED", start_time_s=1795608000, end_time_s=1795610000)
    text = explain.format_text({**doc, "state": "COMPLETED", "forecast": explain.forecast_json(done), "waiting": None})
    assert "ran: start 2026-11-25T12:00:00Z, end 2026-11-25T12:33:20Z\n" in text and "forecast:" not in text


def test_explain_lists_the_cells_while_the_configured_profile_store_is_not_yet_written(tmp_path, monkeypatch):
    """As the daemon does, a profile store that nothing has written yet (or this user
    cannot read) leaves the estimates analytic; it is not the job's spec error."""
    from slurm_ext.observe import profile_db_if_written

    job = SlurmJob(7, "alice", "train", "PENDING", reason="JobHeldAdmin", partition="a100",
                   comment="elastic model=gpt-1.3b global_batch=64 iterations=1000", gpus_per_node=4,
                   gpu_type_requested="a100", node_count=1, priority=0)
    missing = tmp_path / "profile.sqlite"
    assert profile_db_if_written(str(missing)) is None and profile_db_if_written(None) is None
    doc, _ = _explain_on(tmp_path, monkeypatch, job, "#!/bin/bash\n", config=f"profile_db: {missing}\n")
    assert doc["spec_error"] is None and any(c["feasible"] for c in doc["cells"])
    missing.write_bytes(b"")
    assert profile_db_if_written(str(missing)) == str(missing)


def test_a_suspended_job_and_one_kept_back_by_its_dependency_say_why_they_wait():
    released = "requested=any cell=a100x4:s1 plan=[dp4tp1] mb=4 remat=1 why=started"
    kept = pending(released, reason="Dependency")
    w = explain.waiting(kept, parse_plan_comment(released), ESTIMATES, None, False)
    assert w.category == explain.KEPT_BACK and "Dependency" in w.detail
    assert "dependency" in w.to_json()["what_to_do"]
    suspended = SlurmJob(7, "alice", "t", "SPECIAL_EXIT", reason="JobHeldAdmin", comment="elastic",
                         admin_comment=format_plan_comment(PlanComment(requested="any", why="suspended: preempted")),
                         state_flags=("PENDING",))
    w = explain.waiting(suspended, parse_plan_comment(suspended.admin_comment), ESTIMATES, None, True)
    assert w is not None and w.category == explain.WAITING_FOR_GPUS


def _explain_on(tmp_path, monkeypatch, job, script, stored=None, config=""):
    """`slurm-ext explain 7 --json` on a stand-in client, with the daemon's state file
    holding ``stored`` (spec JSON, error) for the job when given, and ``config`` added to
    the daemon's configuration."""
    import json as json_module

    from click.testing import CliRunner

    import slurm_ext.backend as backend
    from slurm_ext.commands.explain import command
    from slurm_ext.slurm_client import Gres, SlurmNode
    from slurm_ext.store import Store

    nodes = tuple(SlurmNode(f"a100-{i}", "idle", ("a100",), (), (Gres("gpu", "a100", 4),), (), 64, 256000)
                  for i in range(4))

    class Client:
        def job(self, job_id):
            return job

        def nodes(self):
            return nodes

        def batch_script(self, job_id):
            if script is None:
                from slurm_ext.errors import SlurmCommandError
                raise SlurmCommandError(("scontrol", "write", "batch_script"), 1, "Access/permission denied")
            return script

    monkeypatch.setattr(backend, "make_client", lambda *args, **kwargs: Client())
    state = tmp_path / "state.db"
    if stored is not None:
        store = Store(str(state))
        store.put_spec(7, *stored, 0.0)
        store.close()
    config_file = tmp_path / "slurm-ext.yaml"
    config_file.write_text(f"state_db: {state}\n{config}")
    out = CliRunner().invoke(command, ["7", "--json", "--config", str(config_file)])
    assert out.exit_code == 0, out.output
    return json_module.loads(out.stdout), out.stderr


def test_explain_takes_the_spec_the_daemon_read_and_not_the_request_it_rewrote(tmp_path, monkeypatch):
    """Submitted with --gres=gpu:4 and started on 8 GPUs: the job now asks Slurm for 8,
    but its Cells are those of the 4 it asked for (4/2 to 4×2), as the daemon's."""
    started = "requested=any cell=a100x8:s1 plan=[dp8tp1] mb=4 remat=1 why=started"
    job = SlurmJob(7, "alice", "train", "RUNNING", partition="a100", admin_comment=started,
                   comment="elastic model=gpt-1.3b global_batch=64 iterations=1000", gpus_per_node=4,
                   node_count=2, priority=1)
    from slurm_ext.jobspec import parse_spec
    asked = parse_spec(job.comment, "#!/bin/bash\n", 4, "any").to_json()
    doc, _ = _explain_on(tmp_path, monkeypatch, job, "#!/bin/bash\n", (asked, None))
    assert doc["spec"]["num_gpus"] == 4 and {c["num_gpus"] for c in doc["cells"]} == {2, 4, 8}
    (tmp_path / "without").mkdir()
    doc, _ = _explain_on(tmp_path / "without", monkeypatch, job, "#!/bin/bash\n")
    assert doc["spec"]["num_gpus"] == 8  # without the state file: what Slurm holds now


def test_a_job_whose_script_this_user_cannot_read_is_not_a_spec_error(tmp_path, monkeypatch):
    """The daemon read the owner's #ELASTIC lines and planned the job; another user (or
    one without the state file) cannot read them, which is not the job's error."""
    started = "requested=any cell=a100x4:s1 plan=[dp4tp1] mb=4 remat=1 why=started"
    job = SlurmJob(7, "alice", "train", "PENDING", reason="JobHeldAdmin", partition="a100", admin_comment=started,
                   comment="elastic", gpus_per_node=4, node_count=1, priority=0)
    doc, err = _explain_on(tmp_path, monkeypatch, job, None)
    assert doc["spec_error"] is None and doc["chosen"]["cell"] == "a100x4:s1"
    assert "cannot be read here (only its owner and root" in err


def test_unread_settings_are_not_a_spec_error_and_the_daemons_verdict_is_shown(tmp_path, monkeypatch):
    """Without the script (another user) or the state file: a held job waiting for GPUs
    is not called a spec error; a job the daemon refused shows the AdminComment's error."""
    waiting = SlurmJob(7, "alice", "train", "PENDING", reason="JobHeldUser", partition="a100",
                       admin_comment="requested=any why=waiting for GPUs", comment="elastic", priority=0)
    doc, err = _explain_on(tmp_path, monkeypatch, waiting, None)
    assert doc["spec_error"] is None and doc["waiting"]["category"] == explain.WAITING_FOR_GPUS
    assert "cannot be read here (only its owner and root" in err
    refused = SlurmJob(8, "alice", "train", "RUNNING", partition="a100", priority=1,
                       admin_comment="requested=a100 error=no Cell meets the deadline; runs as submitted",
                       comment="elastic model=gpt-1.3b global_batch=64 iterations=1000")
    (tmp_path / "b").mkdir()
    doc, _ = _explain_on(tmp_path / "b", monkeypatch, refused, "#!/bin/bash\n")
    assert doc["spec_error"] == "no Cell meets the deadline; runs as submitted" and doc["cells"] == []
