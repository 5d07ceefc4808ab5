"""The profile store: what `slurm-ext profile` measured on a site's own devices (SQLite).

One file, written by the profiling job's rank 0 and read by the estimator
(``slurm-ext estimate --profile-db FILE``, the daemon's ``profile_db``). Schema
(``docs/profiling.md`` explains each column):

- ``profiles``: one row per profiling run: the Slurm job, partition, GPU type, node
  layout, device kind, platform, date and software versions.
- ``collectives``: seconds of one collective (all-reduce, all-gather, reduce-scatter,
  all-to-all, send) over a replica group, for a message size; ``num_nodes`` is the nodes
  the measurement involved. The columns are the measured-collectives CSV's, so the rows
  become curves of ``estimator.comm`` as they are.
- ``kernels``: calibration kernels (matmuls at several shapes and dtypes, a memory-bound
  copy, an empty launch) with their FLOPs, bytes and seconds.
- ``layers``: one device's share of one layer of a model (Crius's single-device
  profiling): forward and forward+backward seconds at ``samples`` samples per device and
  tensor-parallel degree ``tp`` (the layer's weights cut to 1/tp, no collectives), and
  the forward+backward program's temporary bytes as XLA compiled it
  (``backward_temp_bytes``: the layer's activations and workspace; schema version 2).
- ``efficiency``: the GPU type's efficiency parameters fitted from the kernels and
  layers (``estimator.profile_fit``), with the fit's median relative error.
- ``refits``: online refits from running jobs' measured speeds (Rubick), with the error
  before and after.

The estimator reads the newest profile of each GPU type (``load_profile_view``); older
rows stay for history.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import sqlite3
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field, fields
from functools import lru_cache
from pathlib import Path

from estimator.comm import valid_groups
from estimator.compute import Efficiency
from estimator.errors import SpecError

log = logging.getLogger(__name__)

SCHEMA_VERSION = 2  # 2: layers.backward_temp_bytes (a version-1 store is upgraded when opened)
_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS profiles (
    id INTEGER PRIMARY KEY AUTOINCREMENT, job_id TEXT, partition TEXT, gpu_type TEXT NOT NULL,
    num_nodes INTEGER NOT NULL, gpus_per_node INTEGER NOT NULL, node_names TEXT,
    platform TEXT NOT NULL, device_kind TEXT, created_utc TEXT NOT NULL, versions_json TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS collectives (
    profile_id INTEGER NOT NULL REFERENCES profiles(id), op TEXT NOT NULL,
    group_size INTEGER NOT NULL, num_nodes INTEGER NOT NULL, gpus_per_node INTEGER NOT NULL,
    replica_groups TEXT NOT NULL, bytes INTEGER NOT NULL, seconds REAL NOT NULL);
CREATE TABLE IF NOT EXISTS kernels (
    profile_id INTEGER NOT NULL REFERENCES profiles(id), kernel TEXT NOT NULL, dtype TEXT NOT NULL,
    shape TEXT NOT NULL, flops REAL NOT NULL, bytes REAL NOT NULL, seconds REAL NOT NULL);
CREATE TABLE IF NOT EXISTS layers (
    profile_id INTEGER NOT NULL REFERENCES profiles(id), model TEXT NOT NULL,
    model_fingerprint TEXT NOT NULL, layer_index INTEGER NOT NULL, layer_kind TEXT NOT NULL,
    tp INTEGER NOT NULL, samples INTEGER NOT NULL, forward_s REAL NOT NULL,
    forward_backward_s REAL NOT NULL, backward_temp_bytes INTEGER);
CREATE TABLE IF NOT EXISTS efficiency (
    profile_id INTEGER NOT NULL REFERENCES profiles(id), gpu_type TEXT NOT NULL,
    params_json TEXT NOT NULL, median_rel_error REAL, rows INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS refits (
    id INTEGER PRIMARY KEY AUTOINCREMENT, gpu_type TEXT NOT NULL, created_utc TEXT NOT NULL,
    params_json TEXT NOT NULL, measurements INTEGER NOT NULL, median_error_before REAL NOT NULL,
    median_error_after REAL NOT NULL, trigger TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS layers_lookup ON layers (model_fingerprint, tp);
"""


@dataclass(frozen=True)
class ProfileInfo:
    """Where and with what a profile was taken."""

    gpu_type: str
    num_nodes: int
    gpus_per_node: int
    platform: str  # cpu | gpu
    created_utc: str
    job_id: str | None = None
    partition: str | None = None
    node_names: tuple[str, ...] = ()
    device_kind: str | None = None
    versions: dict = field(default_factory=dict, hash=False, compare=False)


@dataclass(frozen=True)
class CollectiveRow:
    op: str
    group_size: int
    num_nodes: int
    gpus_per_node: int
    replica_groups: str  # e.g. "[[0, 1], [2, 3]]", global device indices node-major
    bytes: int
    seconds: float


@dataclass(frozen=True)
class KernelRow:
    kernel: str  # matmul | copy | launch
    dtype: str
    shape: str  # "m,k,n" for matmuls, "elements" for copies
    flops: float
    bytes: float
    seconds: float


@dataclass(frozen=True)
class LayerRow:
    model: str
    model_fingerprint: str
    layer_index: int
    layer_kind: str
    tp: int
    samples: int
    forward_s: float
    forward_backward_s: float
    backward_temp_bytes: int | None = None


@dataclass(frozen=True)
class Profile:
    """One profiling run's measurements, as written by the profiling job."""

    info: ProfileInfo
    collectives: tuple[CollectiveRow, ...] = ()
    kernels: tuple[KernelRow, ...] = ()
    layers: tuple[LayerRow, ...] = ()
    efficiency: Efficiency | None = None
    fit_median_rel_error: float | None = None


@dataclass(frozen=True)
class LayerTiming:
    """One layer's profiled share on one device at increasing sample counts."""

    samples: tuple[int, ...]
    forward_s: tuple[float, ...]
    forward_backward_s: tuple[float, ...]
    backward_temp_bytes: tuple[int | None, ...] = ()

    def activation_bytes_per_sample(self) -> float | None:
        """Bytes the layer's forward+backward holds per sample: the least-squares slope of
        its temporary bytes over the sample counts (the intercept is workspace that does
        not grow with the batch); with one count, bytes over samples; None unmeasured."""
        pts = [(s, b) for s, b in zip(self.samples, self.backward_temp_bytes) if b is not None]
        if not pts:
            return None
        if len({s for s, _ in pts}) < 2:
            return max(b / s for s, b in pts)
        ms = sum(s for s, _ in pts) / len(pts)
        mb = sum(b for _, b in pts) / len(pts)
        slope = sum((s - ms) * (b - mb) for s, b in pts) / sum((s - ms) ** 2 for s, _ in pts)
        return max(slope, 0.0)


@dataclass(frozen=True)
class ProfileView:
    """What the estimator takes from a store: per GPU type the newest profile's fitted
    efficiency, collectives and layer timings (keyed by model fingerprint, layer, tp)."""

    path: str
    efficiencies: dict[str, Efficiency] = field(default_factory=dict, hash=False, compare=False)
    collectives: dict[str, tuple[CollectiveRow, ...]] = field(default_factory=dict, hash=False,
                                                              compare=False)
    layers: dict[tuple[str, str, int, int], LayerTiming] = field(default_factory=dict, hash=False,
                                                                compare=False)
    # The newest profile's fit per type, without the online refits made since.
    fitted: dict[str, Efficiency] = field(default_factory=dict, hash=False, compare=False)

    def layer_timing(self, gpu_type: str, fingerprint: str, layer_index: int, tp: int) -> LayerTiming | None:
        return self.layers.get((gpu_type, fingerprint, layer_index, tp))

    @property
    def gpu_types(self) -> tuple[str, ...]:
        return tuple(sorted(set(self.efficiencies) | set(self.collectives)
                            | {k[0] for k in self.layers}))


# Fields ``LayerSpec`` gained after stores were first written: left out of the fingerprint
# while at their defaults, so a store profiled before them still matches its models.
LATER_LAYER_FIELDS = ("experts", "expert_params")
# Fields that model what the runner keeps for its backward pass, added after stores were
# first written: always left out, so refining that model keeps every store's models matching.
RUNNER_MEMORY_FIELDS = ("residual_bytes", "residual_bytes_tp_shared", "input_bytes")
# Fields derived from a layer's shape for the cost model, added later: left out too (the
# shape is in the other fields), so a store profiled before still matches.
COST_MODEL_FIELDS = ("kernels", "tp_split")


def model_fingerprint(model) -> str:
    """A stable hash of an ``estimator.models.ModelSpec``: every layer's costs and the
    dtype, so a YAML model that keeps its name but changes shape is profiled anew."""
    layers = [_layer_text(layer) for layer in model.layers]
    layers_text = f"({', '.join(layers)}{',' if len(layers) == 1 else ''})"
    text = f"({model.family!r}, {model.dtype!r}, {model.sequence!r}, {model.hidden!r}, {model.heads!r}, {layers_text})"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _layer_text(layer) -> str:
    """The layer's dataclass repr without the later fields that are at their defaults."""
    shown = [f"{f.name}={getattr(layer, f.name)!r}" for f in fields(layer)
             if f.name not in RUNNER_MEMORY_FIELDS and f.name not in COST_MODEL_FIELDS
             and not (f.name in LATER_LAYER_FIELDS and getattr(layer, f.name) == f.default)]
    return f"{type(layer).__name__}({', '.join(shown)})"


def connect(path: str | Path, create: bool = False) -> sqlite3.Connection:
    """Open a profile store; ``create`` makes the file and its tables when missing.

    Raises:
        SpecError: the file is missing (and not to be created) or is not a profile store.
    """
    p = Path(path)
    if not create and not p.is_file():
        raise SpecError("profile_db", str(p), "no such file; run `slurm-ext profile` first")
    try:
        if create:
            if p.parent.exists() and not p.parent.is_dir():
                raise SpecError("profile_db", str(p), f"{p.parent} is not a directory")
            p.parent.mkdir(parents=True, exist_ok=True)
        conn = sqlite3.connect(str(p), timeout=30.0)
    except (OSError, sqlite3.Error) as e:
        raise SpecError("profile_db", str(p), f"cannot open: {getattr(e, 'strerror', None) or e}") from None
    try:
        if create:
            _create(conn, p)
        version = conn.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
    except sqlite3.DatabaseError as e:
        conn.close()
        raise SpecError("profile_db", str(p), f"not a profile store ({e})") from None
    except SpecError:
        conn.close()
        raise
    if version is not None and not str(version[0]).strip().isdigit():
        conn.close()
        raise SpecError("profile_db", str(p), f"schema version {version[0]!r} is not a number: not a profile store "
                                              "this program wrote")
    if version is not None and int(version[0]) == 1:
        try:
            version = _upgrade_from_1(conn)
        except sqlite3.DatabaseError as e:
            conn.rollback()
            conn.close()
            raise SpecError("profile_db", str(p), f"schema version 1 and cannot upgrade it ({e}); "
                                                  "make it writable once") from None
    if version is None or int(version[0]) != SCHEMA_VERSION:
        conn.close()
        raise SpecError("profile_db", str(p), f"schema version {version and version[0]}, "
                                              f"expected {SCHEMA_VERSION}")
    return conn


def _create(conn: sqlite3.Connection, path: Path) -> None:
    """Make the store's tables in ``conn``'s file, in one transaction (a reader never sees
    half a store); a file of another program's tables is refused, not added to."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        tables = {name for (name,) in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        if tables and "meta" not in tables:
            raise SpecError("profile_db", str(path), "a SQLite file of something else (tables: "
                                                     f"{', '.join(sorted(tables)[:5])}): not a profile store")
        for statement in filter(str.strip, _SCHEMA.split(";")):
            conn.execute(statement)
        conn.execute("INSERT OR IGNORE INTO meta VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),))
        conn.commit()
    except BaseException:
        conn.rollback()
        raise


def _upgrade_from_1(conn: sqlite3.Connection) -> tuple[str]:
    """Version 1 → 2 (the layers' temporary bytes, unknown for old rows) in one
    transaction, the version read again inside it (another process may have upgraded)."""
    conn.execute("BEGIN IMMEDIATE")
    (version,) = conn.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
    if int(version) == 1:
        columns = {row[1] for row in conn.execute("PRAGMA table_info(layers)")}
        if "backward_temp_bytes" not in columns:
            conn.execute("ALTER TABLE layers ADD COLUMN backward_temp_bytes INTEGER")
        conn.execute("UPDATE meta SET value=? WHERE key='schema_version'", (str(SCHEMA_VERSION),))
    conn.commit()
    return (str(SCHEMA_VERSION),)


def write_profile(path: str | Path, profile: Profile) -> int:
    """Add one profiling run to the store (created when missing); returns its id."""
    info = profile.info
    with connect(path, create=True) as conn:
        cur = conn.execute(
            "INSERT INTO profiles (job_id, partition, gpu_type, num_nodes, gpus_per_node, node_names, "
            "platform, device_kind, created_utc, versions_json) VALUES (?,?,?,?,?,?,?,?,?,?)",
            (info.job_id, info.partition, info.gpu_type, info.num_nodes, info.gpus_per_node,
             ",".join(info.node_names), info.platform, info.device_kind, info.created_utc,
             json.dumps(info.versions, sort_keys=True)))
        pid = cur.lastrowid
        conn.executemany("INSERT INTO collectives VALUES (?,?,?,?,?,?,?,?)",
                         [(pid, r.op, r.group_size, r.num_nodes, r.gpus_per_node, r.replica_groups,
                           r.bytes, r.seconds) for r in profile.collectives])
        conn.executemany("INSERT INTO kernels VALUES (?,?,?,?,?,?,?)",
                         [(pid, r.kernel, r.dtype, r.shape, r.flops, r.bytes, r.seconds)
                          for r in profile.kernels])
        conn.executemany("INSERT INTO layers VALUES (?,?,?,?,?,?,?,?,?,?)",
                         [(pid, r.model, r.model_fingerprint, r.layer_index, r.layer_kind, r.tp,
                           r.samples, r.forward_s, r.forward_backward_s, r.backward_temp_bytes)
                          for r in profile.layers])
        if profile.efficiency is not None:
            conn.execute("INSERT INTO efficiency VALUES (?,?,?,?,?)",
                         (pid, info.gpu_type, json.dumps(asdict(profile.efficiency)),
                          profile.fit_median_rel_error, len(profile.kernels) + len(profile.layers)))
    conn.close()
    return pid


def write_refit(path: str | Path, gpu_type: str, eff: Efficiency, measurements: int,
                median_error_before: float, median_error_after: float, trigger: str,
                created_utc: str) -> None:
    """Record an online refit; the estimator prefers it over the fit of a profile taken before it."""
    with connect(path, create=True) as conn:
        conn.execute("INSERT INTO refits (gpu_type, created_utc, params_json, measurements, "
                     "median_error_before, median_error_after, trigger) VALUES (?,?,?,?,?,?,?)",
                     (gpu_type, created_utc, json.dumps(asdict(eff)), measurements,
                      median_error_before, median_error_after, trigger))
    conn.close()


def profile_summaries(path: str | Path) -> list[dict]:
    """One dict per profiling run, newest first: id, job, partition, type, layout, date,
    and how many rows of each kind it holds (for `slurm-ext profile --json`)."""
    conn = connect(path)
    try:
        rows = conn.execute(
            "SELECT p.id, p.job_id, p.partition, p.gpu_type, p.num_nodes, p.gpus_per_node, p.platform, "
            "p.device_kind, p.created_utc, "
            "(SELECT COUNT(*) FROM collectives c WHERE c.profile_id=p.id), "
            "(SELECT COUNT(*) FROM kernels k WHERE k.profile_id=p.id), "
            "(SELECT COUNT(*) FROM layers l WHERE l.profile_id=p.id) "
            "FROM profiles p ORDER BY p.id DESC").fetchall()
    finally:
        conn.close()
    keys = ("id", "job_id", "partition", "gpu_type", "num_nodes", "gpus_per_node", "platform",
            "device_kind", "created_utc", "collectives", "kernels", "layers")
    return [dict(zip(keys, r)) for r in rows]


def read_profile(path: str | Path, profile_id: int) -> Profile:
    """One profiling run, whole."""
    conn = connect(path)
    try:
        p = conn.execute("SELECT gpu_type, num_nodes, gpus_per_node, platform, created_utc, job_id, "
                         "partition, node_names, device_kind, versions_json FROM profiles WHERE id=?",
                         (profile_id,)).fetchone()
        if p is None:
            raise SpecError("profile_id", profile_id, f"not in {path}")
        info = ProfileInfo(p[0], p[1], p[2], p[3], p[4], p[5], p[6],
                           tuple(n for n in (p[7] or "").split(",") if n), p[8], _versions(p[9]))
        coll = tuple(CollectiveRow(*r) for r in conn.execute(
            "SELECT op, group_size, num_nodes, gpus_per_node, replica_groups, bytes, seconds "
            "FROM collectives WHERE profile_id=?", (profile_id,)))
        kern = tuple(KernelRow(*r) for r in conn.execute(
            "SELECT kernel, dtype, shape, flops, bytes, seconds FROM kernels WHERE profile_id=?",
            (profile_id,)))
        lay = tuple(LayerRow(*r) for r in conn.execute(
            "SELECT model, model_fingerprint, layer_index, layer_kind, tp, samples, forward_s, "
            "forward_backward_s, backward_temp_bytes FROM layers WHERE profile_id=?", (profile_id,)))
        e = conn.execute("SELECT params_json, median_rel_error FROM efficiency WHERE profile_id=?",
                         (profile_id,)).fetchone()
    finally:
        conn.close()
    eff = usable_efficiency(e[0]) if e else None
    return Profile(info, coll, kern, lay, eff, e[1] if e else None)


def _versions(text: object) -> dict:
    """A profile's software versions; an unreadable record of them (an edit by hand) is none."""
    try:
        versions = json.loads(text)
    except (TypeError, ValueError):
        versions = None
    return versions if isinstance(versions, dict) else {}


def store_version(path: str) -> tuple[str, int, int]:
    """The store's path and version (modification time, size): what its caches key on."""
    try:
        st = Path(path).stat()
    except OSError:
        raise SpecError("profile_db", path, "no such file; run `slurm-ext profile` first") from None
    return path, st.st_mtime_ns, st.st_size


@lru_cache(maxsize=4)
def cached_profile_view(version: tuple[str, int, int]) -> ProfileView:
    """The store's view (``load_profile_view``), read again only when the file changed
    (``store_version``): the estimator and the daemon's rounds read it often."""
    return load_profile_view(version[0])


def load_profile_view(path: str | Path) -> ProfileView:
    """The newest measurements of each GPU type in the store, for the estimator.

    - Efficiency: the newest profile's fit of the type, or an online refit made after it.
    - Collectives: per node count a measurement spans, the newest profile of the type
      that measured any (a one-node profile does not hide the cross-node curves of an
      earlier two-node one, nor do that one's curves within a node outvote its own).
    - Layers: per model, layer and tp degree, the newest profile of the type that timed
      it (a profile cut short by its budget after tp 1 keeps an earlier one's tp 2 to 8);
      a sample count timed twice in one profile (a model named twice) is averaged.
    """
    conn = connect(path)
    try:
        return _read_view(conn, path)
    except sqlite3.Error as e:  # a damaged file, a table or column missing
        raise SpecError("profile_db", str(path), f"cannot be read ({e})") from None
    finally:
        conn.close()


def _read_view(conn: sqlite3.Connection, path: str | Path) -> ProfileView:
    """``load_profile_view``'s reading, in one transaction."""
    skipped = 0
    conn.execute("BEGIN")  # one snapshot: a profile committed meanwhile is read whole or not at all
    profiles = {pid: (gpu, nodes, created) for pid, gpu, nodes, created in conn.execute(
        "SELECT id, gpu_type, num_nodes, created_utc FROM profiles")}
    fitted: dict[str, tuple[str, Efficiency]] = {}  # newest profile fit per type, by id
    for pid, params in conn.execute("SELECT profile_id, params_json FROM efficiency ORDER BY profile_id"):
        if pid not in profiles or (eff := usable_efficiency(params)) is None:
            skipped += 1
            continue
        gpu, _, created = profiles[pid]
        fitted[gpu] = (created, eff)
    effs = {gpu: eff for gpu, (_, eff) in fitted.items()}
    for gpu, created, params in conn.execute("SELECT gpu_type, created_utc, params_json FROM refits ORDER BY id"):
        if (eff := usable_efficiency(params)) is None:
            skipped += 1
        elif gpu not in fitted or _utc_key(created) >= _utc_key(fitted[gpu][0]):
            effs[gpu] = eff
    # Per type and nodes a measurement spans: a two-node profile's rows within a node do
    # not outvote a newer one-node profile's.
    newest_coll: dict[tuple[str, int], int] = {}
    for pid, spans in conn.execute(
            "SELECT DISTINCT profile_id, num_nodes FROM collectives ORDER BY profile_id"):
        if pid in profiles:
            newest_coll[(profiles[pid][0], spans)] = pid
    coll: dict[str, tuple[CollectiveRow, ...]] = {}
    for (gpu, spans), pid in sorted(newest_coll.items()):
        rows = [CollectiveRow(*r) for r in conn.execute(
            "SELECT op, group_size, num_nodes, gpus_per_node, replica_groups, bytes, seconds "
            "FROM collectives WHERE profile_id=? AND num_nodes=?", (pid, spans))]
        good = tuple(r for r in rows if _usable_collective(r))
        skipped += len(rows) - len(good)
        if good:
            coll[gpu] = coll.get(gpu, ()) + good
    newest_layer: dict[tuple[str, str, int, int], int] = {}
    for pid, fp, idx, tp in conn.execute(
            "SELECT DISTINCT profile_id, model_fingerprint, layer_index, tp FROM layers ORDER BY profile_id"):
        if pid in profiles:
            newest_layer[(profiles[pid][0], fp, idx, tp)] = pid
    points: dict[tuple[str, str, int, int], dict[int, list[tuple[float, float, int | None]]]] = {}
    for pid, fp, idx, tp, samples, f, fb, temp in conn.execute(
            "SELECT profile_id, model_fingerprint, layer_index, tp, samples, forward_s, forward_backward_s, "
            "backward_temp_bytes FROM layers"):
        key = (profiles[pid][0], fp, idx, tp) if pid in profiles else None
        if key is None or newest_layer[key] != pid:
            continue
        if not _usable_layer(tp, samples, f, fb, temp):
            skipped += 1
            continue
        points.setdefault(key, {}).setdefault(samples, []).append((f, fb, temp))
    conn.execute("COMMIT")
    if skipped:
        log.warning("profile store %s: %d rows skipped (times, sizes or parameters that are not "
                    "positive finite numbers, malformed replica groups)", path, skipped)
    layers = {}
    for key, by_samples in points.items():
        counts = sorted(by_samples)
        means = [tuple(_mean(v) for v in zip(*by_samples[n])) for n in counts]
        layers[key] = LayerTiming(tuple(counts), tuple(m[0] for m in means), tuple(m[1] for m in means),
                                  tuple(None if m[2] is None else int(m[2]) for m in means))
    return ProfileView(str(path), effs, coll, layers, {gpu: eff for gpu, (_, eff) in fitted.items()})


def usable_efficiency(params_json: str) -> Efficiency | None:
    """Stored efficiency parameters, or None when they are not usable ones (malformed,
    a fraction of a peak that is not positive, a negative overhead)."""
    try:
        eff = Efficiency(**json.loads(params_json))
    except (TypeError, ValueError):
        return None
    if not all(_finite(getattr(eff, f.name)) for f in fields(eff)):
        return None
    if min(eff.matmul_frac, eff.conv_frac, eff.memory_frac, eff.inter_node_frac) <= 0:
        return None
    return eff if min(eff.layer_overhead_s, eff.half_rate_gflop, eff.conv_half_outputs) >= 0 else None


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _positive(*values) -> bool:
    return all(_finite(v) and v > 0 for v in values)


def _usable_collective(r: CollectiveRow) -> bool:
    """A measurement the estimator may use: whole counts ≥ 1, positive finite size and
    time (a negative time would win every comparison), readable replica groups."""
    return (all(isinstance(n, int) and n >= 1 for n in (r.group_size, r.num_nodes, r.gpus_per_node))
            and _positive(r.bytes, r.seconds) and (r.op == "send" or valid_groups(str(r.replica_groups))))


def _usable_layer(tp, samples, forward_s, forward_backward_s, temp_bytes) -> bool:
    return (isinstance(tp, int) and isinstance(samples, int) and tp >= 1 and samples >= 1
            and _positive(forward_s, forward_backward_s)
            and (temp_bytes is None or (_finite(temp_bytes) and temp_bytes >= 0)))


def _utc_key(text: str) -> str:
    """``YYYY-MM-DDTHH:MM:SS`` of a stored UTC time (written with ``Z`` or ``+00:00``)."""
    return text[:19]


def _mean(values: tuple) -> float | None:
    known = [v for v in values if v is not None]
    return sum(known) / len(known) if known else None


def collective_csv_rows(gpu_type: str, rows: Iterable[CollectiveRow]) -> list[dict]:
    """Collective rows in the measured-collectives CSV's columns (network ``profiled``)."""
    return [{"gpu_type": gpu_type, "num_nodes": r.num_nodes, "gpus_per_node": r.gpus_per_node,
             "network": "profiled", "op": r.op, "replica_groups": r.replica_groups,
             "group_size": r.group_size, "bytes": r.bytes, "seconds": r.seconds} for r in rows]
