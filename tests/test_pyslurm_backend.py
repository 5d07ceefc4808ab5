"""The pyslurm backend's reading, offline: what pyslurm reported of a Slurm 25.11 lab becomes
the same jobs and nodes the CLI backend read at the same moment (recorded by
``tests/fixtures/record_pyslurm.py``). The live parity runs in the integration tests."""

import dataclasses
import importlib.util
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from slurm_ext import pyslurm_backend
from slurm_ext.pyslurm_backend import (
    PyslurmClient, PyslurmUnavailable, check_importable, gres_in_use, job_record, node_record,
)
from slurm_ext.slurm_parse import parse_job, parse_node

RECORDED = json.loads((Path(__file__).parent / "fixtures" / "slurm-25.11" / "pyslurm.json").read_text())


class FakeJob(SimpleNamespace):
    """A pyslurm.Job as recorded: its attributes and its resource layout per node."""

    def __init__(self, recorded: dict):
        super().__init__(**recorded["attributes"])
        self._layout = recorded["layout"]

    def get_resource_layout_per_node(self):
        return self._layout


def plain(value) -> object:
    """A dataclass as the recording stored it (tuples as lists)."""
    return json.loads(json.dumps(dataclasses.asdict(value), default=str))


def test_every_job_reads_as_the_cli_read_it():
    jobs = [parse_job(job_record(FakeJob(r), **r["raw_tres"])) for r in RECORDED["jobs"]]
    assert [plain(j) for j in jobs] == RECORDED["cli_jobs"]
    by_name = {j.name: j for j in jobs}
    # The situations the recording set out to catch.
    assert by_name["elastic-gpus"].gpus_per_job == 6  # tres_per_job, which pyslurm cannot read
    # A type without a count is one GPU of it; pyslurm's own reading of it is no GPUs.
    no_count = by_name["typed-no-count"]
    assert (no_count.gpus_per_node, no_count.gpu_type_requested) == (1, "a10")
    recorded = next(r for r in RECORDED["jobs"] if r["attributes"]["name"] == "typed-no-count")
    assert parse_job(job_record(FakeJob(recorded))).gpus_per_node == 0
    two = by_name["running-2node"]
    assert two.granted_gpus_per_node == (1, 1) and two.granted_gpu_type == "v100"
    assert by_name["rescale"].exit_code == 86 and by_name["rescale"].is_held
    limited = [j for j in jobs if j.name == "a100-limited"]
    assert limited and all(j.end_time_s == 0 or j.end_time_s > j.start_time_s for j in limited)
    arrays = [j for j in jobs if j.name == "array-throttled"]
    assert any(j.array_task_spec.endswith("%2") for j in arrays)
    assert 0 in {j.array_task_id for j in arrays}  # pyslurm reads task 0 as unset


def test_every_node_reads_as_the_cli_read_it_with_gpus_in_use_from_the_jobs():
    used = gres_in_use(FakeJob(r) for r in RECORDED["jobs"])
    nodes = [parse_node(node_record(SimpleNamespace(**n), used.get(n["name"]))) for n in RECORDED["nodes"]]
    assert [plain(n) for n in nodes] == RECORDED["cli_nodes"]
    assert sum(n.gpus_used for n in nodes) > 0


def test_gpus_in_use_count_only_jobs_that_hold_resources():
    held = FakeJob({"attributes": {"state": "RUNNING"},
                    "layout": {"n1": {"gres": {"gpu:a100": {"count": 3, "indexes": "0-2"}}}}})
    gone = FakeJob({"attributes": {"state": "COMPLETED"},
                    "layout": {"n1": {"gres": {"gpu:a100": {"count": 4, "indexes": "0-3"}}}}})
    assert gres_in_use([held, gone]) == {"n1": {"gpu:a100": 3}}


def test_without_pyslurm_the_error_says_how_to_install_it(monkeypatch):
    import builtins
    real_import = builtins.__import__

    def no_pyslurm(name, *args, **kwargs):
        if name == "pyslurm":
            raise ImportError("No module named 'pyslurm'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_pyslurm)
    monkeypatch.delitem(__import__("sys").modules, "pyslurm", raising=False)
    # The child process that tries the import first finds no such module either.
    monkeypatch.setattr(pyslurm_backend, "IMPORT_PROBE",
                        pyslurm_backend.IMPORT_PROBE.replace("import pyslurm", "import no_such_pyslurm"))
    with pytest.raises(Exception, match="pip install -e '.\\[pyslurm\\]'.*slurm_backend: cli"):
        PyslurmClient(env={})


def test_a_slurm_conf_that_names_no_file_is_refused_before_slurm_retries_it_for_a_minute(tmp_path):
    missing = tmp_path / "slurm.conf"
    with pytest.raises(PyslurmUnavailable, match=f"SLURM_CONF={missing} is not a file"):
        check_importable({"SLURM_CONF": str(missing)})
    with pytest.raises(PyslurmUnavailable, match="SLURM_CONF= is not a file"):
        check_importable({"SLURM_CONF": ""})


@pytest.mark.skipif(importlib.util.find_spec("pyslurm") is None, reason="pyslurm is not installed")
def test_without_a_slurm_configuration_the_import_is_an_error_not_the_end_of_the_process():
    """Slurm's library ends the process that imports pyslurm without a configuration; the
    child process takes that, and its last line of error becomes the message."""
    environ = {"PATH": "/usr/bin:/bin"}  # the built Slurm's default file is absent, no configless daemon
    with pytest.raises(PyslurmUnavailable, match="pyslurm cannot load Slurm \\(.*fatal.*slurm_backend: cli"):
        check_importable(environ)


def test_clearing_a_jobs_features_goes_through_scontrol_before_the_rest():
    """pyslurm sends an empty constraint as unset (Slurm: no change); a job retyped in a
    mixed partition would keep the old type's constraint and never start."""
    from slurm_ext.slurm_client import JobUpdate

    calls = []

    class Job:
        def __init__(self, job_id):
            self.job_id = job_id

        def modify(self, desc):
            calls.append(("modify", self.job_id, desc))

    client = object.__new__(PyslurmClient)  # no Slurm here: the two halves are recorded
    client._cli = SimpleNamespace(update_pending=lambda ids, update: calls.append(("scontrol", ids, update)))
    client._pyslurm = SimpleNamespace(Job=Job, JobSubmitDescription=lambda **kw: kw, RPCError=RuntimeError)
    client.update_pending([5], JobUpdate(partition="h100", gpus_per_node=4, features="", start_now=False))
    assert calls[0] == ("scontrol", [5], JobUpdate(features="", start_now=False))
    assert calls[1][:2] == ("modify", 5) and "constraints" not in calls[1][2]
    assert calls[1][2]["partitions"] == "h100" and calls[1][2]["gres_per_node"] == "gpu:4"
    calls.clear()
    client.update_pending([5], JobUpdate(features="a100", start_now=False))
    assert calls == [("modify", 5, {"constraints": "a100"})]


def test_a_job_whose_text_is_not_utf8_is_read_through_the_cli_not_the_end_of_the_round():
    """pyslurm decodes a job's strings strictly: one Latin-1 comment had failed every round.
    That job is read as the CLI backend reads it; the others as pyslurm loaded them."""
    from slurm_ext.slurm_client import SlurmJob

    class Latin1Job(FakeJob):
        @property
        def comment(self):
            raise UnicodeDecodeError("utf-8", b"M\xfcller", 1, 2, "invalid start byte")

    good = RECORDED["jobs"][0]
    bad = Latin1Job({**good, "attributes": {k: v for k, v in good["attributes"].items() if k != "comment"}})
    bad.id = 999
    from_cli = SlurmJob(999, "u", "t", "PENDING", comment="elastic M\ufffdller")
    client = object.__new__(PyslurmClient)
    client._cli = SimpleNamespace(job=lambda job_id: from_cli if job_id == 999 else None,
                                  output=lambda argv: "")
    client._pyslurm = SimpleNamespace(Jobs=SimpleNamespace(load=lambda: {1: FakeJob(good), 999: bad}),
                                      RPCError=RuntimeError)
    jobs = client.jobs()
    assert jobs[1] is from_cli and jobs[0].job_id == FakeJob(good).id
    assert 999 not in client.pending_elastic_job_ids()  # read, not raised: the round reads it anyway
