"""Files the daemon (root) reads on a user's behalf (``slurm_ext.user_files``): a job's
model YAML and its runner's ``measured.json``. A user controls both paths: a swapped
symlink must not reveal a root-only file, and a FIFO or an absurd number must not stop
the daemon's rounds for everyone."""

import json
import os
import threading

import pytest

from estimator.contract import MEASURED_FILE, PlanComment, RunnerReport, format_plan_comment
from estimator.errors import SpecError
from policy.clock import SimulatedClock
from slurm_ext.config import resolve
from slurm_ext.daemon import Daemon
from slurm_ext.observe import model_loader_for
from slurm_ext.slurm_client import SlurmJob
from slurm_ext.store import Store
from slurm_ext.user_files import read_user_file
from test_daemon import TRAINER, node
from test_daemon_rounds import FakeSlurm, measured_json

NOW = 1_800_000_000
SECRET = "root:$y$j9T$SECRETHASHabcdef0123456789:19700:0:99999:7:::\n"
MODEL_YAML = "hidden: 256\nlayers: 4\nheads: 4\nsequence: 128\nvocab: 1000\n"


def _daemon(tmp_path, client, clock=None, **config) -> Daemon:
    cfg = resolve({"state_db": str(tmp_path / "s.db"), "forecast_every_s": 0, **config}, {}, {})
    return Daemon(cfg, client, Store(cfg.state_db), clock=clock or SimulatedClock(float(NOW)), out=lambda line: None)


def _running(job_id: int = 41) -> SlurmJob:
    comment = format_plan_comment(PlanComment(requested="any", cell="a100x4:s1", plan="[dp4tp1]",
                                              micro_batches=4, remat=True, layers="0,24", why="started"))
    return SlurmJob(job_id, "alice", "train", "RUNNING", partition="a100", comment="elastic model=gpt-760m",
                    admin_comment=comment, gpus_per_node=4, granted_gpus_per_node=(4,), granted_gpu_type="a100",
                    nodes=("a100-1",), node_count=1, submit_time_s=NOW - 100, start_time_s=NOW - 100,
                    priority=1, requeue=True)


def _waiting(job_id: int, model: str) -> SlurmJob:
    return SlurmJob(job_id, "nobody", "t", "PENDING", reason="JobHeldAdmin", partition="a100", priority=0,
                    comment=f"elastic model={model} gpus=4 global_batch=64 iterations=1000",
                    admin_comment="requested=any", gpus_per_node=4, node_count=1, submit_time_s=NOW - 60)


def test_a_model_file_swapped_for_a_link_to_a_root_only_file_is_refused_without_its_contents(tmp_path, open_dir):
    secret = open_dir / "shadow"
    secret.write_text(SECRET)
    os.chmod(secret, 0o600)
    model = open_dir / "m.yaml"
    model.write_text(MODEL_YAML)
    os.chmod(model, 0o644)
    client = FakeSlurm([_waiting(41, str(model))], [node("a100-1", "a100", 4, used=4)], TRAINER)
    clock = SimulatedClock(float(NOW))
    d = _daemon(tmp_path, client, clock)
    d.round()
    assert "error=" not in client._jobs[41].admin_comment  # read and estimated: it waits for GPUs
    model.unlink()
    model.symlink_to(secret)  # after the spec was accepted: every round reads the file again
    clock.advance_to(NOW + 60)
    d.round()
    comment = client._jobs[41].admin_comment
    assert "must be readable by the job's owner" in comment
    assert "SECRET" not in comment and "root:" not in comment


def test_a_fifo_as_measured_json_does_not_block_the_round(tmp_path):
    client = FakeSlurm([_running()], [node("a100-1", "a100", 4, used=4)], TRAINER)
    (tmp_path / "41").mkdir()
    fifo = tmp_path / "41" / MEASURED_FILE
    os.mkfifo(fifo)
    d = _daemon(tmp_path, client, checkpoint_root=str(tmp_path))
    t = threading.Thread(target=d.round, daemon=True)
    t.start()
    t.join(30)
    blocked = t.is_alive()
    if blocked:  # let the thread end before the test process does
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        t.join(5)
    assert not blocked


def test_an_absurd_number_in_measured_json_is_ignored_and_other_jobs_still_start(tmp_path):
    client = FakeSlurm([_running(), _waiting(42, "gpt-760m")],
                       [node("a100-1", "a100", 4, used=4), node("a100-2", "a100", 4)], TRAINER)
    (tmp_path / "41").mkdir()
    raw = json.loads(measured_json("cell=a100x4:s1 plan=[dp4tp1] mb=4 remat=1 layers=0,24"))
    raw.update(iteration_time_s=10 ** 400, step=10 ** 400)
    (tmp_path / "41" / MEASURED_FILE).write_text(json.dumps(raw))
    assert _daemon(tmp_path, client, checkpoint_root=str(tmp_path)).run(once=True) == 0
    assert ("release", 42) in [c[:2] for c in client.calls]


def test_a_report_field_beyond_any_count_reads_as_missing():
    report = RunnerReport.from_text(json.dumps({"job_id": "7", "step": 2 ** 60, "iteration_time_s": 10 ** 400,
                                                "steps_measured": 12}))
    assert report.step is None and report.iteration_time_s is None and report.steps_measured == 12


def test_read_user_file_reads_a_regular_file_its_owner_may_read(tmp_path, open_dir):
    path = open_dir / "m.yaml"
    path.write_text(MODEL_YAML)
    os.chmod(path, 0o644)
    assert read_user_file(str(path), 1024, owner="nobody") == MODEL_YAML.encode()
    private = open_dir / "private"
    private.mkdir(mode=0o700)  # root's own directory: nobody may not enter it
    (private / "m.yaml").write_text(MODEL_YAML)
    os.chmod(private / "m.yaml", 0o644)
    with pytest.raises(SpecError, match="in directories they may enter"):
        read_user_file(str(private / "m.yaml"), 1024, owner="nobody")
    os.chmod(path, 0o600)  # root's own: nobody may not read it
    with pytest.raises(SpecError, match="readable by the job's owner"):
        read_user_file(str(path), 1024, owner="nobody")
    assert read_user_file(str(path), 1024) == MODEL_YAML.encode()  # no owner: any regular file
    with pytest.raises(SpecError, match="at most 16 bytes"):
        read_user_file(str(path), 16)
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(SpecError, match="regular file"):
        read_user_file(str(tmp_path / "fifo"), 1024)
    with pytest.raises(SpecError, match="regular file"):
        read_user_file("/dev/zero", 1024)
    with pytest.raises(FileNotFoundError):
        read_user_file(str(tmp_path / "missing.yaml"), 1024)


def test_a_path_where_the_owner_may_not_look_says_nothing_of_what_is_there(open_dir):
    """Links the owner may make, into a directory only root may enter: a file there, one
    too large, a missing one and a device are one refusal alike (the daemon reads as root)."""
    private = open_dir / "private"
    private.mkdir(mode=0o700)
    (private / "small.yaml").write_text(MODEL_YAML)
    (private / "big.yaml").write_bytes(b"x" * 4096)
    for target in ("small.yaml", "big.yaml", "missing.yaml"):
        (open_dir / f"to-{target}").symlink_to(private / target)
    answers = set()
    for target in ("small.yaml", "big.yaml", "missing.yaml"):
        with pytest.raises(SpecError) as info:
            read_user_file(str(open_dir / f"to-{target}"), 1024, owner="nobody")
        answers.add(info.value.hint)
    assert answers == {"the file must be readable by the job's owner (owned by them or world-readable, in "
                       "directories they may enter)"}


def test_a_model_fifo_or_a_relative_name_is_refused_without_reading(open_dir):
    os.mkfifo(open_dir / "fifo.yaml")
    with pytest.raises(SpecError, match="regular file"):  # never opened
        model_loader_for("nobody")(str(open_dir / "fifo.yaml"))
    with pytest.raises(SpecError, match="not a built-in model"):  # never a file in the daemon's directory
        model_loader_for("nobody")("mine.yaml")
