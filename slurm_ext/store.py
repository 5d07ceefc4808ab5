"""The daemon's state: SQLite (standard library), one file, safe across crashes.

Tables:

- ``specs``: the elastic spec (or the spec error) seen for each job.
- ``submit_times``: each job's original submit time; a requeue resets Slurm's.
- ``progress``: iterations a job completed before its current run (kept across rescales).
- ``estimates``: cached estimator results, by a key the caller builds, with the
  estimator's version that made them (:class:`EstimateCache` keeps them in memory too).
- ``refit_observations``: running jobs' measured speeds, one row per job and plan that
  ran, newest kept per GPU type (``slurm_ext.refit``: the online refit fits them all).
- ``refit_times``: when each GPU type was last refitted (the refit's rate limit).
- ``journal``: every action on Slurm is written here *before* it is taken and marked
  ``done`` (or ``failed``) after. A daemon that dies mid-action finds the open entries on
  start; :func:`plan_recovery` says, purely from the entries and the jobs' current state,
  what to redo so no job is lost or left held.

Journal states: ``intended`` (written, maybe partly applied), ``done``, ``failed``,
``abandoned`` (no longer applicable; the next round decides afresh).
"""

from __future__ import annotations

import dataclasses
import fcntl
import functools
import hashlib
import json
import os
import sqlite3
import threading
from collections import OrderedDict
from contextlib import contextmanager
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from estimator.cells import Cell, CellEstimate, StagePlan
from slurm_ext.slurm_client import JobUpdate, SlurmJob

# Journal action kinds.
START = "start"          # update a pending held job to its Cell, then release it
RESCALE = "rescale"      # signal → requeued held → update → release
SUSPEND = "suspend"      # signal → requeued held, stays held
RELEASE = "release"      # a job the daemon will not manage: release it as submitted
ANNOTATE = "annotate"    # AdminComment only
KINDS = (START, RESCALE, SUSPEND, RELEASE, ANNOTATE)

INTENDED, DONE, FAILED, ABANDONED = "intended", "done", "failed", "abandoned"

# Where an open rescale or suspension stands (its note), so that a restarted daemon
# goes on from there: USR1 sent; requeue forced after the timeout; seen requeued held.
SIGNALLED, FORCED, CAME_BACK = "signalled", "requeue forced", "requeued held"

# Recovery steps.
REAPPLY = "reapply"      # write the entry's update again, then release
RELEASE_ONLY = "release"
CLOSE = "close"
KEEP = "keep"            # a rescale still under way: the rounds finish it

_SCHEMA = """
CREATE TABLE IF NOT EXISTS specs (
    job_id INTEGER PRIMARY KEY, spec_json TEXT, error TEXT, seen_s REAL NOT NULL);
CREATE TABLE IF NOT EXISTS submit_times (
    job_id INTEGER PRIMARY KEY, submit_s REAL NOT NULL);
CREATE TABLE IF NOT EXISTS progress (
    job_id INTEGER PRIMARY KEY, iterations_done REAL NOT NULL, updated_s REAL NOT NULL);
CREATE TABLE IF NOT EXISTS progress_credits (
    entry_id INTEGER PRIMARY KEY, job_id INTEGER NOT NULL, iterations REAL NOT NULL);
CREATE TABLE IF NOT EXISTS estimates (
    key TEXT PRIMARY KEY, value_json TEXT NOT NULL, created_s REAL NOT NULL);
CREATE TABLE IF NOT EXISTS journal (
    id INTEGER PRIMARY KEY AUTOINCREMENT, job_id INTEGER NOT NULL, kind TEXT NOT NULL,
    payload_json TEXT NOT NULL, state TEXT NOT NULL, note TEXT NOT NULL DEFAULT '',
    created_s REAL NOT NULL, updated_s REAL NOT NULL);
CREATE INDEX IF NOT EXISTS journal_open ON journal (state);
CREATE INDEX IF NOT EXISTS journal_job ON journal (job_id, id);
CREATE TABLE IF NOT EXISTS refit_observations (
    job_id INTEGER NOT NULL, plan TEXT NOT NULL, gpu_type TEXT NOT NULL,
    observation_json TEXT NOT NULL, seen_s REAL NOT NULL, PRIMARY KEY (job_id, plan));
CREATE TABLE IF NOT EXISTS refit_times (gpu_type TEXT PRIMARY KEY, refit_s REAL NOT NULL);
CREATE TABLE IF NOT EXISTS gpu_caps (job_id INTEGER PRIMARY KEY, gpus INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS gpu_types_seen (gpu_type TEXT PRIMARY KEY, seen_s REAL NOT NULL);
"""
# A GPU type not seen in Slurm's nodes for this long is taken to be gone for good.
GPU_TYPE_MEMORY_S = 30 * 86400.0
# A type still seen is written again at most this often: against a memory of 30 days an
# hour's staleness is nothing, and a write every round was a commit every round.
GPU_TYPE_NOTE_EVERY_S = 3600.0


@dataclass(frozen=True)
class JournalEntry:
    """One action on one job as written to the journal.

    Attributes:
        entry_id: the journal row id.
        job_id: the Slurm job id.
        kind: one of ``KINDS``.
        update: the pending-job update the action applies (None for release-only kinds).
        state: ``intended``, ``done``, ``failed`` or ``abandoned``.
        note: why it was closed, or the failure's message; while a rescale is open, where
            it stands (``SIGNALLED``, ``FORCED``, ``CAME_BACK``).
        created_s: when it was written (Unix seconds).
        updated_s: when it was last marked or closed (Unix seconds).
    """

    entry_id: int
    job_id: int
    kind: str
    update: JobUpdate | None
    state: str
    note: str
    created_s: float
    updated_s: float = 0.0


@dataclass(frozen=True)
class RecoveryStep:
    """What to do about one open journal entry: ``reapply``, ``release`` or ``close``."""

    entry: JournalEntry
    step: str
    why: str


def _update_to_json(update: JobUpdate | None) -> str:
    """Every field (an entry re-applied after a restart is the update as it was meant);
    a field added later reads back as its default from older rows."""
    return "null" if update is None else json.dumps(dataclasses.asdict(update))


def _update_from_json(text: str) -> JobUpdate | None:
    raw = json.loads(text)
    if raw is None:
        return None
    if raw.get("required_nodes") is not None:
        raw["required_nodes"] = tuple(raw["required_nodes"])
    return JobUpdate(**raw)


class StateFileBusy(OSError):
    """Another process holds the state file's lock (a daemon acts on it)."""


def lock_state_file(path: str | Path) -> int:
    """Take the lock of the state file at ``path`` (``PATH.lock``, with this process's id in
    it) for as long as this process lives, and return its descriptor: two daemons acting
    on one state file would signal, release and journal the same jobs twice.

    Raises:
        StateFileBusy: another process holds it (its id in the message).
        OSError: the lock file cannot be made.
    """
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(f"{path}.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise StateFileBusy(f"another slurm-ext daemon (pid {holder}) acts on {path}") from None
    except OSError:
        os.close(fd)
        raise
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


class Store:
    """The daemon's SQLite state. One connection, used from one thread at a time.

    Args:
        path: the database file (created with its parent directory), or ``:memory:``.
        read_only: open an existing file for reading only (no schema is written).
    """

    def __init__(self, path: str | Path, read_only: bool = False):
        self._lock = threading.RLock()
        if read_only:  # a reader (``slurm-ext explain``) that may not write the daemon's file
            self._db = sqlite3.connect(f"{Path(path).absolute().as_uri()}?mode=ro", uri=True,
                                       check_same_thread=False)
            return
        if str(path) != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        # isolation_level=None: autocommit; each write is durable once the call returns,
        # which is what write-ahead journaling needs.
        self._db = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.executescript(_SCHEMA)

    def close(self) -> None:
        self._db.close()

    def _exec(self, sql: str, args: Iterable = ()) -> sqlite3.Cursor:
        with self._lock:
            return self._db.execute(sql, tuple(args))

    @contextmanager
    def transaction(self):
        """The writes inside are made together or not at all (a crash between two of them
        leaves neither)."""
        with self._lock:
            self._db.execute("BEGIN")
            try:
                yield self
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise

    def _many(self, sql: str, rows: list[tuple]) -> None:
        with self._lock:
            self._db.execute("BEGIN")
            try:
                self._db.executemany(sql, rows)
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise

    # -- specs --------------------------------------------------------------------------
    def put_spec(self, job_id: int, spec_json: dict | None, error: str | None, now_s: float) -> None:
        """Remember a job's parsed spec, or the error its spec raised."""
        self._exec("INSERT OR REPLACE INTO specs VALUES (?, ?, ?, ?)",
                   (job_id, None if spec_json is None else json.dumps(spec_json), error, now_s))

    def spec(self, job_id: int) -> tuple[dict | None, str | None] | None:
        """(spec JSON, error) of a job, or None when never seen."""
        row = self._exec("SELECT spec_json, error FROM specs WHERE job_id = ?", (job_id,)).fetchone()
        if row is None:
            return None
        return (None if row[0] is None else json.loads(row[0]), row[1])

    def specs(self) -> dict[int, tuple[dict | None, str | None]]:
        """Every remembered spec, by job id."""
        rows = self._exec("SELECT job_id, spec_json, error FROM specs").fetchall()
        return {r[0]: (None if r[1] is None else json.loads(r[1]), r[2]) for r in rows}

    # -- original submit times ----------------------------------------------------------
    def submit_times(self, jobs: Mapping[int, float]) -> dict[int, float]:
        """Record first-seen submit times and return the original one of every job given.

        Args:
            jobs: job id → the submit time Slurm reports now (reset by a requeue).
        """
        if not jobs:
            return {}
        self._many("INSERT OR IGNORE INTO submit_times VALUES (?, ?)",
                   [(j, float(s)) for j, s in jobs.items()])
        known = dict(self._exec("SELECT job_id, submit_s FROM submit_times").fetchall())
        return {j: known.get(j, float(s)) for j, s in jobs.items()}

    # -- progress -----------------------------------------------------------------------
    def add_progress(self, job_id: int, iterations: float, now_s: float, entry_id: int | None = None) -> None:
        """Add iterations a run completed (called when the run is stopped for a rescale,
        the journal ``entry_id`` of which can take them back: ``take_back_progress``)."""
        self._exec("INSERT INTO progress VALUES (?, ?, ?) ON CONFLICT(job_id) DO UPDATE SET "
                   "iterations_done = iterations_done + excluded.iterations_done, "
                   "updated_s = excluded.updated_s", (job_id, float(iterations), now_s))
        if entry_id is not None:
            self._exec("INSERT OR REPLACE INTO progress_credits VALUES (?, ?, ?)",
                       (entry_id, job_id, float(iterations)))

    def take_back_progress(self, entry_id: int, now_s: float) -> None:
        """A rescale failed and the run it meant to stop goes on: the iterations credited
        when it was signalled are counted by that run again, not as an earlier run's."""
        row = self._exec("SELECT job_id, iterations FROM progress_credits WHERE entry_id = ?", (entry_id,)).fetchone()
        if row is not None:
            self.add_progress(row[0], -row[1], now_s)
            self._exec("DELETE FROM progress_credits WHERE entry_id = ?", (entry_id,))

    def progress(self) -> dict[int, float]:
        """Job id → iterations completed in earlier runs."""
        return dict(self._exec("SELECT job_id, iterations_done FROM progress").fetchall())

    # -- estimates cache ----------------------------------------------------------------
    def get_estimate(self, key: str) -> object | None:
        row = self._exec("SELECT value_json FROM estimates WHERE key = ?", (key,)).fetchone()
        return None if row is None else json.loads(row[0])

    def put_estimate(self, key: str, value: object, now_s: float) -> None:
        self._exec("INSERT OR REPLACE INTO estimates VALUES (?, ?, ?)",
                   (key, json.dumps(value), now_s))

    # -- online refit ---------------------------------------------------------------------
    # Finished jobs' observations stay (forget_jobs_except leaves them): a refit fits every
    # measurement of a GPU type seen so far, not only the running jobs'.
    def put_refit_observation(self, job_id: int, plan: str, gpu_type: str, observation: dict,
                              now_s: float, keep: int) -> None:
        """Record a job's measured speed of one plan (replacing its earlier measurement of
        that plan), keeping the newest ``keep`` observations of the GPU type."""
        self._exec("INSERT OR REPLACE INTO refit_observations VALUES (?, ?, ?, ?, ?)",
                   (job_id, plan, gpu_type, json.dumps(observation), now_s))
        self._exec("DELETE FROM refit_observations WHERE gpu_type = ? AND rowid NOT IN (SELECT rowid "
                   "FROM refit_observations WHERE gpu_type = ? ORDER BY seen_s DESC LIMIT ?)",
                   (gpu_type, gpu_type, keep))

    def refit_observations(self, gpu_type: str, limit: int) -> list[dict]:
        """The newest ``limit`` observations of a GPU type, newest first."""
        rows = self._exec("SELECT observation_json FROM refit_observations WHERE gpu_type = ? "
                          "ORDER BY seen_s DESC LIMIT ?", (gpu_type, limit)).fetchall()
        return [json.loads(r[0]) for r in rows]

    def put_refit_time(self, gpu_type: str, now_s: float) -> None:
        self._exec("INSERT OR REPLACE INTO refit_times VALUES (?, ?)", (gpu_type, now_s))

    def refit_times(self) -> dict[str, float]:
        """GPU type → when it was last refitted (Unix seconds)."""
        return dict(self._exec("SELECT gpu_type, refit_s FROM refit_times").fetchall())

    def put_gpu_cap(self, job_id: int, gpus: int) -> None:
        """The most GPUs a per-job limit of its account or QOS lets the job have."""
        self._exec("INSERT OR REPLACE INTO gpu_caps VALUES (?, ?)", (job_id, gpus))

    def gpu_caps(self) -> dict[int, int]:
        """Job → the most GPUs Slurm lets it have (it refused more)."""
        return dict(self._exec("SELECT job_id, gpus FROM gpu_caps").fetchall())

    def note_gpu_types(self, gpu_types: Iterable[str], now_s: float) -> None:
        """The GPU types Slurm's nodes show now."""
        self._many("INSERT OR REPLACE INTO gpu_types_seen VALUES (?, ?)", [(t, now_s) for t in gpu_types])

    def gpu_types_seen(self, now_s: float) -> set[str]:
        """The GPU types Slurm's nodes showed in the last ``GPU_TYPE_MEMORY_S``, in this
        daemon's rounds or an earlier one's (nodes powered down or being replaced go
        missing from a listing)."""
        rows = self._exec("SELECT gpu_type FROM gpu_types_seen WHERE seen_s >= ?", (now_s - GPU_TYPE_MEMORY_S,))
        return {t for (t,) in rows.fetchall()}

    # -- forgetting finished jobs --------------------------------------------------------
    def forget_jobs_except(self, active_job_ids: Iterable[int]) -> int:
        """Drop specs, submit times, progress and GPU caps of jobs no longer active; returns
        rows dropped.

        Open journal entries are kept: recovery closes them.
        """
        keep = set(active_job_ids)
        dropped = 0
        for table in ("specs", "submit_times", "progress", "progress_credits", "gpu_caps"):
            ids = [r[0] for r in self._exec(f"SELECT job_id FROM {table}").fetchall() if r[0] not in keep]
            if ids:
                self._many(f"DELETE FROM {table} WHERE job_id = ?", [(i,) for i in ids])
                dropped += len(ids)
        return dropped

    # -- journal ------------------------------------------------------------------------
    def intend(self, job_id: int, kind: str, update: JobUpdate | None, now_s: float) -> int:
        """Write an action before taking it; returns the entry id."""
        if kind not in KINDS:
            raise ValueError(f"journal kind {kind!r}: use one of {', '.join(KINDS)}")
        cur = self._exec("INSERT INTO journal (job_id, kind, payload_json, state, created_s, updated_s) "
                         "VALUES (?, ?, ?, ?, ?, ?)",
                         (job_id, kind, _update_to_json(update), INTENDED, now_s, now_s))
        return int(cur.lastrowid)

    def close_entry(self, entry_id: int, state: str, now_s: float, note: str = "") -> None:
        """Mark an entry ``done``, ``failed`` or ``abandoned``."""
        if state not in (DONE, FAILED, ABANDONED):
            raise ValueError(f"journal state {state!r}: use done, failed or abandoned")
        self._exec("UPDATE journal SET state = ?, note = ?, updated_s = ? WHERE id = ?",
                   (state, note[:500], now_s, entry_id))

    def mark_entry(self, entry_id: int, note: str, now_s: float) -> None:
        """Say where an open entry stands (a rescale's phase), as of ``now_s``."""
        self._exec("UPDATE journal SET note = ?, updated_s = ? WHERE id = ? AND state = ?",
                   (note, now_s, entry_id, INTENDED))

    def open_entries(self) -> tuple[JournalEntry, ...]:
        """Entries written but not closed, oldest first."""
        return self._entries("WHERE state = ? ORDER BY id", (INTENDED,))

    def newest_entry_ids(self) -> dict[int, int]:
        """Each job's newest entry id, whatever its state."""
        return dict(self._exec("SELECT job_id, MAX(id) FROM journal GROUP BY job_id", ()).fetchall())

    def entries(self, job_id: int | None = None) -> tuple[JournalEntry, ...]:
        """All entries (of one job), oldest first."""
        if job_id is None:
            return self._entries("ORDER BY id", ())
        return self._entries("WHERE job_id = ? ORDER BY id", (job_id,))

    def jobs_with_failed(self, kind: str) -> set[int]:
        """Jobs with a failed entry of ``kind`` (one query, where each job's would be one each)."""
        return {r[0] for r in self._exec("SELECT DISTINCT job_id FROM journal WHERE kind = ? AND state = ?",
                                         (kind, FAILED)).fetchall()}

    def _entries(self, where: str, args: tuple) -> tuple[JournalEntry, ...]:
        rows = self._exec("SELECT id, job_id, kind, payload_json, state, note, created_s, updated_s "
                          f"FROM journal {where}", args).fetchall()
        return tuple(JournalEntry(r[0], r[1], r[2], _update_from_json(r[3]), r[4], r[5], r[6], r[7])
                     for r in rows)

    def suspended_times(self) -> dict[int, float]:
        """Job id → when its last completed suspension finished (what a held job's wait counts from)."""
        return dict(self._exec("SELECT job_id, MAX(updated_s) FROM journal WHERE kind = ? AND state = ? "
                               "GROUP BY job_id", (SUSPEND, DONE)).fetchall())

    def prune(self, older_than_s: float) -> int:
        """Delete closed journal entries and cached estimates written before
        ``older_than_s`` (an estimate still in use is made again once); returns how many."""
        cur = self._exec("DELETE FROM journal WHERE state != ? AND created_s < ?",
                         (INTENDED, older_than_s))
        return cur.rowcount + self._exec("DELETE FROM estimates WHERE created_s < ?", (older_than_s,)).rowcount


# A job whose run is ending (processes exiting, being requeued): not yet held again.
ENDING_STATES = frozenset({"COMPLETING", "REQUEUED", "REQUEUE_FED", "STAGE_OUT", "SIGNALING", "EXPEDITING"})


def plan_recovery(entries: Iterable[JournalEntry], jobs: Mapping[int, SlurmJob],
                  newest: Mapping[int, int] | None = None) -> tuple[RecoveryStep, ...]:
    """What to do about open journal entries, given the jobs as Slurm shows them now
    (``newest``: each job's newest entry id, closed ones included).

    Rules (the daemon may have died anywhere between writing an entry and closing it):

    - the job is gone or finished: close the entry;
    - a later entry of the same job, open or closed, supersedes an earlier one: close the
      earlier (an open start the rounds went on past would be applied again, over what
      they did since);
    - ``start`` / ``rescale`` and the job is held: the update may be half-written and the
      release missing, so write the update again and release;
    - ``release`` / ``annotate`` and the job is held: release it (annotate entries only
      write AdminComment, so a held job was held for another reason: leave it and close);
    - ``suspend`` and the job is held: that is the intended end state; close;
    - ``rescale`` / ``suspend`` and the job still runs, or its run is ending
      (``ENDING_STATES``): the rescale is under way (its checkpoint, or the forced requeue
      after the timeout); keep it open for the rounds;
    - the job is pending and not held, or running: the action completed; close.
    """
    open_entries = sorted(entries, key=lambda e: e.entry_id)
    latest: dict[int, int] = dict(newest or {})
    for e in open_entries:
        latest[e.job_id] = max(e.entry_id, latest.get(e.job_id, 0))
    steps: list[RecoveryStep] = []
    for e in open_entries:
        job = jobs.get(e.job_id)
        if latest[e.job_id] != e.entry_id:
            steps.append(RecoveryStep(e, CLOSE, "superseded by a later entry"))
        elif job is None or not job.is_active:
            steps.append(RecoveryStep(e, CLOSE, "job no longer active"))
        elif e.kind in (RESCALE, SUSPEND) and (job.is_running or job.state in ENDING_STATES):
            # Still running, or its run ending (exit 86 under way): held only once it has
            # ended, and released no sooner than REQUEUE_SETTLE_S after, by the rounds.
            steps.append(RecoveryStep(e, KEEP, f"signalled and {job.state.lower()}: the rounds finish it"))
        elif not job.is_held:
            steps.append(RecoveryStep(e, CLOSE, f"job is {job.state.lower()} and not held"))
        elif e.kind in (START, RESCALE) and e.update is not None:
            steps.append(RecoveryStep(e, REAPPLY, "held with the update unfinished"))
        elif e.kind == RELEASE:
            steps.append(RecoveryStep(e, RELEASE_ONLY, "held; release it as submitted"))
        elif e.kind == SUSPEND:
            steps.append(RecoveryStep(e, CLOSE, "suspended and held, as intended"))
        else:
            steps.append(RecoveryStep(e, CLOSE, "nothing to redo"))
    return tuple(steps)


# CellEstimate's fields written as they are (the cell and stages have their own forms).
_ESTIMATE_FIELDS = ("micro_batches", "iteration_time_s", "samples_per_s", "peak_memory_gb", "feasible",
                    "reason", "fidelity", "comm_source", "memory_fidelity", "remat", "zero_level",
                    "offload", "host_memory_gb", "runnable", "plan")


def estimate_to_json(e: CellEstimate) -> dict:
    """A CellEstimate as plain JSON (every field, unlike the rounded CLI form)."""
    c = e.cell
    return {"cell": [c.gpu_type, c.num_gpus, c.gpus_per_node, c.num_stages],
            "stages": [s.as_row() for s in e.stages], **{f: getattr(e, f) for f in _ESTIMATE_FIELDS}}


def estimate_from_json(raw: dict) -> CellEstimate:
    """The inverse of :func:`estimate_to_json` (fields a row lacks take their defaults)."""
    return CellEstimate(Cell(*raw["cell"]), tuple(StagePlan(*s) for s in raw["stages"]),
                        **{f: raw[f] for f in _ESTIMATE_FIELDS if f in raw})


@functools.lru_cache(maxsize=4)
def estimator_version(root: Path = Path(__file__).resolve().parent.parent / "estimator") -> str:
    """A digest of the estimator's code and data: estimates cached by another version (an
    upgrade, a new collectives table) are made anew rather than read back. Read once per
    process: the version of the code this process runs."""
    digest = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.is_file() and p.suffix in (".py", ".csv", ".json", ".yaml")):
        digest.update(str(path.relative_to(root)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


# Estimates kept in memory: every spec of a busy queue, twice (two plan spaces), with room.
MEMO_KEYS = 4096


class EstimateCache:
    """Cell estimates by key, in memory and in the store (they survive a restart).

    Args:
        store: the state store.
        version: the estimator's (default: this one's).
        read_only: keep new estimates in memory only (a dry run beside the service, maybe
            of other code, must not rewrite the service's rows).
    """

    def __init__(self, store: Store, version: str | None = None, read_only: bool = False):
        self.store = store
        self.version = version or estimator_version()
        self.read_only = read_only
        self._memo: OrderedDict[str, tuple[CellEstimate, ...]] = OrderedDict()  # least recently used first
        self.hits = 0
        self.misses = 0

    def get(self, key: str, compute, now_s: float) -> tuple[CellEstimate, ...]:
        """The estimates under ``key``; ``compute()`` makes them on a miss."""
        if key in self._memo:
            self.hits += 1
            self._memo.move_to_end(key)
            return self._memo[key]
        raw = self.store.get_estimate(key)
        if isinstance(raw, dict) and raw.get("version") == self.version:
            self.hits += 1
            value = tuple(estimate_from_json(r) for r in raw["estimates"])
        else:
            # Not cached, or cached by another version of the estimator.
            self.misses += 1
            value = tuple(compute())
            if not self.read_only:
                self.store.put_estimate(key, {"version": self.version,
                                              "estimates": [estimate_to_json(e) for e in value]}, now_s)
        self._memo[key] = value
        while len(self._memo) > MEMO_KEYS:  # a refit or a new profile makes every key anew
            self._memo.popitem(last=False)
        return value
