"""Parse Slurm's output into `SlurmJob` / `SlurmNode` (pure functions, no Slurm needed).

Defensive about the JSON shapes of several Slurm versions:

- 22.05 (OpenAPI v0.0.38): numbers are plain, ``job_state`` a string, node ``state`` a
  lower-case string plus ``state_flags``, ``exit_code`` the raw wait status.
- 23.02 (v0.0.39): numbers become ``{"set": bool, "infinite": bool, "number": N}``.
- 23.11+ (v0.0.40+): ``job_state`` (and node ``state``) become lists such as
  ``["PENDING", "REQUEUED"]``; ``exit_code`` an object with ``return_code``; features lists.

Unknown or missing fields become defaults; text that cannot be read at all raises
`SlurmParseError` quoting it.
"""

import functools
import json
import logging
import re
from collections.abc import Iterable, Mapping

from slurm_ext.errors import SlurmParseError
from estimator.contract import is_elastic
from slurm_ext.slurm_client import Gres, SlurmJob, SlurmNode

log = logging.getLogger(__name__)

JOB_BASE_STATES = frozenset({
    "PENDING", "RUNNING", "SUSPENDED", "COMPLETE", "COMPLETED", "CANCELLED", "FAILED",
    "TIMEOUT", "NODE_FAIL", "PREEMPTED", "BOOT_FAIL", "DEADLINE", "OUT_OF_MEMORY",
    # Shown instead of the base state by squeue while the flag is set:
    "SPECIAL_EXIT", "REQUEUE_HOLD", "REQUEUED", "COMPLETING", "CONFIGURING", "RESIZING",
    "SIGNALING", "STAGE_OUT", "STOPPED", "REQUEUE_FED", "REVOKED",
})
NODE_BASE_STATES = frozenset({
    "idle", "down", "allocated", "alloc", "mixed", "mix", "error", "future", "unknown",
    "drained", "draining", "drain", "fail", "failing", "maint", "reserved", "completing",
    "inval", "planned", "reboot", "power_down", "powered_down", "powering_up",
})


# ---- small values -------------------------------------------------------------------------

def is_number(text_: str) -> bool:
    """Whether ``text_`` is a whole number in ASCII digits (``str.isdigit`` also takes ``²``,
    which ``int`` refuses: a user's comment must not stop a round)."""
    return text_.isascii() and text_.isdigit()


def number(value: object, default: int | None = None) -> int | None:
    """A Slurm number: a plain int/float, or 23.02+'s ``{"set", "infinite", "number"}``.

    Returns ``default`` when unset or infinite (or missing).
    """
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, (int, float)):
        return int(value)
    if isinstance(value, Mapping):
        if not value.get("set", True) or value.get("infinite", False):
            return default
        return number(value.get("number"), default)
    if isinstance(value, str) and is_number(value.strip().lstrip("-")):
        return int(value)
    return default


def text(value: object) -> str:
    """A string field ('' for null)."""
    if value is None:
        return ""
    if isinstance(value, list):
        return ",".join(text(v) for v in value)
    return str(value)


def string_list(value: object) -> tuple[str, ...]:
    """A list field that older Slurm prints as comma-separated text."""
    if value is None:
        return ()
    if isinstance(value, str):
        return tuple(v.strip() for v in value.split(",") if v.strip())
    if isinstance(value, list):
        return tuple(str(v) for v in value if str(v))
    return (str(value),)


def state_and_flags(value: object, base_states: frozenset[str]) -> tuple[str, tuple[str, ...]]:
    """A state that is a string (22.05) or a list of strings (23.11+) → (base, flags).

    The base is the first element that is a known base state (else the first element).
    """
    items = list(string_list(value)) if not isinstance(value, str) else [value]
    items = [i for i in items if i]
    if not items:
        return "", ()
    base = next((i for i in items if i in base_states), items[0])
    flags = tuple(i for i in items if i != base)
    return base, flags


# The state flags squeue prints instead of the base state, in Slurm's order (the first one
# set wins; job_state_string in slurm_protocol_defs.c).
SHOWN_JOB_FLAGS = ("COMPLETING", "STAGE_OUT", "CONFIGURING", "EXPEDITING", "RESIZING", "REQUEUED",
                   "REQUEUE_FED", "REQUEUE_HOLD", "SPECIAL_EXIT", "STOPPED", "REVOKED",
                   "RESV_DEL_HOLD", "SIGNALING")


def job_state(value: object) -> tuple[str, tuple[str, ...]]:
    """A job's state as squeue's listing and the C API name it, and the rest as flags: a
    23.11+ list ``["PENDING", "SPECIAL_EXIT"]`` reads as SPECIAL_EXIT with flag PENDING, as
    ``squeue -O State`` prints it."""
    base, flags = state_and_flags(value, JOB_BASE_STATES)
    shown = next((f for f in SHOWN_JOB_FLAGS if f in flags), None)
    if shown is None:
        return base, flags
    return shown, tuple(i for i in (base, *flags) if i != shown)


def exit_code(value: object) -> int | None:
    """The batch script's exit status: 22.05 prints the raw wait status, 23.11 an object.

    A signal death reads as 128 + signal, as shells report it.
    """
    if value is None:
        return None
    if isinstance(value, Mapping) and ("return_code" in value or "signal" in value):
        rc = number(value.get("return_code"), 0)
        sig = number((value.get("signal") or {}).get("id") if isinstance(value.get("signal"), Mapping)
                     else value.get("signal"), 0)
        return 128 + sig if sig else rc
    raw = number(value)
    if raw is None:
        return None
    if raw & 0x7F:
        return 128 + (raw & 0x7F)
    return (raw >> 8) & 0xFF


# ---- hostlists and gres -------------------------------------------------------------------

_BRACKET = re.compile(r"^(.*?)\[([^\]]+)\](.*)$")


def _split_top(text_: str) -> list[str]:
    """Split on commas outside brackets and parentheses."""
    parts, depth, cur = [], 0, []
    for ch in text_:
        if ch in "[(":
            depth += 1
        elif ch in "])":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    parts.append("".join(cur))
    return [p.strip() for p in parts if p.strip()]


def expand_hostlist(hostlist: str) -> tuple[str, ...]:
    """``a100-[1-2],h100-1`` → ``("a100-1", "a100-2", "h100-1")`` (zero padding kept).

    Raises:
        SlurmParseError: a bracket range that is not numeric.
    """
    names: list[str] = []
    for item in _split_top(hostlist or ""):
        m = _BRACKET.match(item)
        if not m:
            names.append(item)
            continue
        prefix, ranges, suffix = m.groups()
        for rng in ranges.split(","):
            lo, _, hi = rng.partition("-")
            if not is_number(lo) or (hi and not is_number(hi)):
                raise SlurmParseError("hostlist", hostlist)
            width = len(lo)
            for i in range(int(lo), int(hi or lo) + 1):
                names.extend(expand_hostlist(f"{prefix}{i:0{width}d}{suffix}"))
    return tuple(names)


_COUNT = re.compile(r"^(\d+)([KMG]?)$")


def _count(token: str) -> int | None:
    m = _COUNT.match(token)
    if not m:
        return None
    return int(m.group(1)) * {"": 1, "K": 1024, "M": 1024**2, "G": 1024**3}[m.group(2)]


def parse_gres_item(item: str) -> Gres | None:
    """One gres entry: ``gpu:a100:4(S:0-1)``, ``gres:gpu:4``, ``gres/gpu:a100=4``, ``gpu``.

    Returns None for empty / ``(null)`` / ``N/A`` text.
    """
    item = item.strip()
    if not item or item in ("(null)", "N/A", "none"):
        return None
    item = item.split("(", 1)[0]
    for prefix in ("gres:", "gres/"):
        if item.startswith(prefix):
            item = item[len(prefix):]
    item = item.replace("=", ":")
    parts = [p for p in item.split(":") if p != ""]
    if not parts:
        return None
    name, rest = parts[0], parts[1:]
    count = 1
    if rest and _count(rest[-1]) is not None:
        count = _count(rest[-1])
        rest = rest[:-1]
    gtype = rest[0] if rest else None
    return Gres(name, gtype, count)


def parse_gres(text_: object) -> tuple[Gres, ...]:
    """A comma-separated gres string (node ``gres``/``gres_used``, ``tres_per_node``)."""
    if isinstance(text_, list):
        text_ = ",".join(str(t) for t in text_)
    items = (parse_gres_item(i) for i in _split_top(text(text_)))
    return tuple(g for g in items if g is not None)


def gpus_of(gres: Iterable[Gres]) -> tuple[int, str | None]:
    """Total GPUs in some gres entries, and their type (None if untyped or mixed)."""
    count, types = 0, set()
    for g in gres:
        if g.name == "gpu":
            count += g.count
            types.add(g.type)
    gtype = types.pop() if len(types) == 1 else None
    return count, gtype


def parse_gres_detail(detail: object) -> tuple[tuple[int, ...], str | None]:
    """``["gpu:v100:3(IDX:0-2)", ...]`` (one per node) → ((3, ...), "v100")."""
    counts, types = [], set()
    for per_node in string_list(detail) if isinstance(detail, str) else (detail or []):
        n, gtype = gpus_of(parse_gres(per_node))
        counts.append(n)
        if n:
            types.add(gtype)
    return tuple(counts), (types.pop() if len(types) == 1 else None)


# ---- documents ----------------------------------------------------------------------------

class GroupedSinfoError(SlurmParseError):
    """``sinfo --json`` of Slurm 23.11 and later: node groups by partition and state (under
    ``sinfo``), not one object per node; ``scontrol show nodes --json`` gives those."""


def load_document(raw: str, what: str, key: str) -> list[Mapping]:
    """The list under `key` of a Slurm JSON document; empty output is an empty list.

    Raises:
        GroupedSinfoError: a newer ``sinfo --json`` asked for ``nodes``.
        SlurmParseError: not JSON, or Slurm reported errors and no `key`.
    """
    if not raw or not raw.strip():
        return []
    try:
        doc = json.loads(raw)
    except json.JSONDecodeError:
        raise SlurmParseError(what, raw) from None
    if not isinstance(doc, Mapping):
        raise SlurmParseError(what, raw)
    errors = [e for e in doc.get("errors") or [] if e]
    items = doc.get(key)
    if items is None:
        if key == "nodes" and "sinfo" in doc:
            raise GroupedSinfoError(what, raw[:200])
        if errors:
            raise SlurmParseError(f"{what} (Slurm reported errors)", errors)
        return []
    if errors:
        log.warning("%s reported errors: %s", what, errors)
    if not isinstance(items, list):
        raise SlurmParseError(f"{what}: {key}", items)
    return items


# slurmctld gives a running job without a time limit an end a year after its start
# (job_mgr.c); squeue's listing and pyslurm show none.
UNLIMITED_RUN_S = 365 * 24 * 3600


def _end_time(start_s: int, end_s: int, state: str) -> int:
    """A job's end time in Slurm, 0 for a running job without a time limit."""
    return 0 if state == "RUNNING" and start_s and end_s - start_s == UNLIMITED_RUN_S else end_s


def parse_job(raw: Mapping, where: str = "job") -> SlurmJob:
    """One job object of ``squeue --json`` (any supported version)."""
    job_id = number(raw.get("job_id"))
    if job_id is None:
        raise SlurmParseError(f"{where}.job_id", raw.get("job_id"))
    state, flags = job_state(raw.get("job_state"))
    requested = parse_gres(raw.get("tres_per_node") or raw.get("gres") or "")
    gpus_per_node, gpu_type = gpus_of(requested)
    gpus_per_job, job_gpu_type = gpus_of(parse_gres(raw.get("tres_per_job") or ""))
    gpu_type = gpu_type or job_gpu_type  # --gpus=a100:8 names its type per job
    granted, granted_type = parse_gres_detail(raw.get("gres_detail"))
    array_job_id = number(raw.get("array_job_id"), 0) or None
    array_task_id = number(raw.get("array_task_id")) if array_job_id else None
    restarts = number(raw.get("restart_cnt"), 0)
    reason = text(raw.get("state_reason"))
    user = text(raw.get("user_name")) or text(raw.get("user") if isinstance(raw.get("user"), str) else "")
    if not user and number(raw.get("user_id")) is not None:
        user = str(number(raw.get("user_id")))
    return SlurmJob(
        job_id=job_id,
        user=user,
        name=text(raw.get("name")),
        state=state,
        state_flags=flags,
        reason="" if reason == "None" else reason,
        partition=text(raw.get("partition")),
        comment=text(raw.get("comment")),
        admin_comment=text(raw.get("admin_comment")),
        gpus_per_node=gpus_per_node,
        gpu_type_requested=gpu_type,
        gpus_per_job=gpus_per_job,
        granted_gpus_per_node=granted,
        granted_gpu_type=granted_type,
        nodes=expand_hostlist(text(raw.get("nodes"))),
        node_count=number(raw.get("node_count"), 0),
        restart_count=restarts,
        submit_time_s=number(raw.get("submit_time"), 0),
        start_time_s=number(raw.get("start_time"), 0),
        end_time_s=_end_time(number(raw.get("start_time"), 0), number(raw.get("end_time"), 0), state),
        priority=number(raw.get("priority"), 0),
        batch=bool(number(raw.get("batch_flag"), 1)),
        requeue=bool(number(raw.get("requeue"), 0)),
        array_job_id=array_job_id,
        array_task_id=array_task_id,
        array_task_spec=text(raw.get("array_task_string")) if array_job_id else "",
        # A job that never ended reports 0: only trust the code once a run has ended.
        exit_code=exit_code(raw.get("exit_code"))
        if state not in ("PENDING", "RUNNING") or restarts else None,
        account=text(raw.get("account")),
        qos=text(raw.get("qos")),
    )


def parse_jobs(raw: str) -> tuple[SlurmJob, ...]:
    """``squeue --json`` output → jobs, in Slurm's order (empty output → ())."""
    items = load_document(raw, "squeue --json", "jobs")
    return tuple(parse_job(j, f"jobs[{i}]") for i, j in enumerate(items))


def parse_node(raw: Mapping, where: str = "node") -> SlurmNode:
    """One node object of ``sinfo --json`` (any supported version)."""
    name = text(raw.get("name"))
    if not name:
        raise SlurmParseError(f"{where}.name", raw.get("name"))
    state_raw = raw.get("state")
    base, flags = state_and_flags(
        [s.lower() for s in string_list(state_raw)] if not isinstance(state_raw, str)
        else state_raw.lower(), NODE_BASE_STATES)
    flags = tuple(f.upper() for f in flags) + tuple(
        f.upper() for f in string_list(raw.get("state_flags")))
    features = raw.get("active_features", raw.get("features"))
    return SlurmNode(
        name=name,
        state=base,
        state_flags=flags,
        partitions=string_list(raw.get("partitions")),
        features=string_list(features),
        gres=parse_gres(raw.get("gres")),
        gres_used=parse_gres(raw.get("gres_used")),
        cpus=number(raw.get("cpus"), 0),
        real_memory_mb=number(raw.get("real_memory"), 0),
    )


def parse_nodes(raw: str) -> tuple[SlurmNode, ...]:
    """``sinfo --json`` (22.05) or ``scontrol show nodes --json`` output → nodes (empty
    output → ()).

    Raises:
        GroupedSinfoError: ``sinfo --json`` of 23.11 or later (read the scontrol one).
    """
    items = load_document(raw, "sinfo --json", "nodes")
    nodes = []
    seen = set()
    for i, n in enumerate(items):
        # 23.x sinfo may list a node once per partition; keep the first.
        node = parse_node(n, f"nodes[{i}]")
        if node.name not in seen:
            seen.add(node.name)
            nodes.append(node)
    return tuple(nodes)


def parse_reservation_nodes(text_: str) -> tuple[str, ...]:
    """``scontrol -o show reservation NAME`` → its nodes (``Nodes=a100-[1-2]``)."""
    m = re.search(r"(?:^|\s)Nodes=(\S*)", text_)
    if not m:
        raise SlurmParseError("scontrol show reservation: Nodes", text_)
    return () if m.group(1) in _UNSET else expand_hostlist(m.group(1))


def parse_sbatch_parsable(out: str) -> int:
    """``sbatch --parsable`` prints ``JOBID`` or ``JOBID;CLUSTER``."""
    first = out.strip().split(";", 1)[0]
    if not is_number(first):
        raise SlurmParseError("sbatch --parsable output", out)
    return int(first)


# ---- the cheap listing (squeue -h -O 'Field:|,...') ---------------------------------------
#
# ``squeue -O`` with a ``|`` suffix and no width prints each field untruncated and 15 times
# faster than ``--json``. Free text (Comment, AdminComment, Name) may itself hold ``|`` or a
# newline, so each listing carries exactly one free-text field, last, and only the job id
# before it is trusted to start a record. Times are epoch seconds (SLURM_TIME_FORMAT=%s).

LISTING_FIELDS = ("JobID", "ArrayJobID", "ArrayTaskID", "State", "Reason", "Partition",
                  "UserName", "tres-per-node", "tres-per-job", "NodeList", "NumNodes",
                  "RestartCnt", "SubmitTime", "StartTime", "EndTime", "PriorityLong",
                  "BatchFlag", "Requeue", "exit_code", "Account", "QOS", "Comment")
ADMIN_COMMENT_FIELDS = ("JobID", "admin_comment")
NAME_FIELDS = ("JobID", "Name")
_UNSET = ("", "N/A", "(null)", "Unknown", "None", "NONE")


@functools.lru_cache(maxsize=1024)
def _gpus_of_text(gres: str) -> tuple[int, str | None]:
    # Thousands of queued jobs share a handful of request strings: parse each once.
    return gpus_of(parse_gres(gres))


_hosts = functools.lru_cache(maxsize=4096)(expand_hostlist)


def listing_records(text_: str, fields: int) -> dict[int, list[str]]:
    """Records of a ``|``-separated listing whose last field is free text → job id → fields.

    A line that does not start like a record (a job id, then enough fields) continues the
    previous record's free text (a newline in a comment). A job id seen twice means some
    free text imitates a record: the listing cannot be trusted.

    Raises:
        SlurmParseError: a repeated job id (quoted).
    """
    records: dict[int, list[str]] = {}
    last: list[str] | None = None
    lines = text_.split("\n")
    if lines and not lines[-1]:
        lines.pop()  # the listing's own last newline
    for line in lines:
        head, sep, _ = line.partition("|")
        parts = line.split("|", fields - 1) if sep and is_number(head) else None
        if parts is not None and len(parts) == fields:
            job_id = int(head)
            if job_id in records:
                raise SlurmParseError("squeue listing: job id listed twice", line)
            records[job_id] = parts
            last = parts
        elif last is not None:  # an empty line too: a blank line of the free text
            last[-1] = f"{last[-1]}\n{line}"
    for parts in records.values():  # the free text ends with the field's own suffix '|'
        if parts[-1].endswith("|"):
            parts[-1] = parts[-1][:-1]
    return records


def _listing_int(value: str) -> int:
    value = value.strip()
    if value in _UNSET:
        return 0
    try:
        return int(value)
    except ValueError:
        try:
            return int(float(value))
        except ValueError:
            raise SlurmParseError("squeue listing: number", value) from None


def listing_exit_code(value: str) -> int:
    """``exit_code`` of the listing: ``status:signal`` or a raw wait status → shell's code."""
    value = value.strip()
    if ":" in value:
        status, _, sig = value.partition(":")
        return 128 + _listing_int(sig) if _listing_int(sig) else _listing_int(status)
    return exit_code(_listing_int(value))


def parse_job_listing(main: str, admin_comments: str, names: str,
                      memo: dict | None = None) -> tuple[SlurmJob, ...]:
    """The three cheap listings (`LISTING_FIELDS`, `ADMIN_COMMENT_FIELDS`, `NAME_FIELDS`) → jobs.

    A job is kept only when it is in the main and the AdminComment listings (which the
    daemon writes and users cannot: a record forged inside a comment has no counterpart
    there). Granted GPUs per node are not in any listing: ``granted_*`` stay empty.

    Args:
        main, admin_comments, names: the three listings' output.
        memo: kept by the caller between calls: a job whose three records did not change
            since the last call is the same `SlurmJob` again, not parsed anew (most of a
            long queue does not change between two rounds).

    Raises:
        SlurmParseError: a listing that cannot be read unambiguously.
    """
    rows = listing_records(main, len(LISTING_FIELDS))
    admin = listing_records(admin_comments, len(ADMIN_COMMENT_FIELDS))
    name_of = listing_records(names, len(NAME_FIELDS))
    seen = {} if memo is None else memo
    jobs = []
    fresh: dict = {}
    for job_id, f in rows.items():
        if job_id not in admin:
            continue
        raw = (tuple(f), admin[job_id][1], name_of[job_id][1] if job_id in name_of else "")
        hit = seen.get(job_id)
        if hit is not None and hit[0] == raw:
            jobs.append(hit[1])
            fresh[job_id] = hit
            continue
        (_, array_job, array_task, state_, reason, partition, user, per_node, per_job,
         nodelist, node_count, restarts, submit, start, end, priority, batch, requeue,
         exit_raw, account, qos, comment) = f
        state, flags = state_and_flags(state_.strip(), JOB_BASE_STATES)
        gpus_per_node, gpu_type = _gpus_of_text(per_node)
        gpus_per_job, job_gpu_type = _gpus_of_text(per_job)
        gpu_type = gpu_type or job_gpu_type
        array_task = array_task.strip()
        is_array = array_task not in _UNSET
        restart_count = _listing_int(restarts)
        jobs.append(SlurmJob(
            job_id=job_id,
            user=user.strip(),
            name=name_of[job_id][1] if job_id in name_of else "",
            state=state,
            state_flags=flags,
            reason="" if reason.strip() in _UNSET else reason.strip(),
            partition=partition.strip(),
            comment="" if comment == "(null)" else comment,
            admin_comment="" if admin[job_id][1] == "(null)" else admin[job_id][1],
            gpus_per_node=gpus_per_node,
            gpu_type_requested=gpu_type,
            gpus_per_job=gpus_per_job,
            nodes=_hosts(nodelist.strip()) if nodelist.strip() not in _UNSET else (),
            node_count=_listing_int(node_count),
            restart_count=restart_count,
            submit_time_s=_listing_int(submit),
            start_time_s=_listing_int(start),
            end_time_s=_listing_int(end),
            priority=_listing_int(priority),
            batch=bool(_listing_int(batch)),
            requeue=bool(_listing_int(requeue)),
            array_job_id=_listing_int(array_job) if is_array else None,
            array_task_id=int(array_task) if is_array and is_number(array_task) else None,
            array_task_spec=array_task if is_array and not is_number(array_task) else "",
            exit_code=listing_exit_code(exit_raw)
            if state not in ("PENDING", "RUNNING") or restart_count else None,
            account="" if account.strip() in _UNSET else account.strip(),
            qos="" if qos.strip() in _UNSET else qos.strip(),
        ))
        fresh[job_id] = (raw, jobs[-1])
    if memo is not None:
        memo.clear()
        memo.update(fresh)
    return tuple(jobs)


# ---- granted GPUs of running jobs (scontrol -d -o show job) -------------------------------

_DETAIL = re.compile(r" JOB_GRES=\S*((?:\s+Nodes=\S+ CPU_IDs=\S+ Mem=\S+ GRES=\S*)+)")
_DETAIL_HEAD = re.compile(r"JobId=(\d+) (?:(?:ArrayJobId|ArrayTaskId|ArrayTaskThrottle|HetJobId|HetJobOffset)=\S+ )*JobName=")
_DETAIL_ITEM = re.compile(r"Nodes=(\S+) CPU_IDs=\S+ Mem=\S+ GRES=(\S*)")


def parse_job_detail(text_: str, names: Mapping[int, str]
                     ) -> dict[int, dict[str, tuple[int, str | None]]]:
    """``scontrol -d -o show job`` → job id → node → (GPUs granted there, their type).

    Only jobs in ``names`` (job id → job name, from the listing) are read, and only when
    their line starts with exactly that id and name: the name is the one free text before
    the per-node detail, so a name imitating the detail cannot shift it. A comment with a
    newline can imitate a whole line: a job with two lines is left out (ask for it alone,
    where its own line comes first).
    """
    out: dict[int, dict[str, tuple[int, str | None]]] = {}
    seen: set[int] = set()
    twice: set[int] = set()
    for line in text_.splitlines():
        head = _DETAIL_HEAD.match(line)
        if head is None or int(head.group(1)) not in names:
            continue
        job_id = int(head.group(1))
        if job_id in seen:
            twice.add(job_id)
            continue
        seen.add(job_id)
        prefix = line[:head.end()] + names[job_id] + " "
        if not line.startswith(prefix):
            continue
        m = _DETAIL.search(line, len(prefix) - 1)
        if m is None:
            continue
        per_node: dict[str, tuple[int, str | None]] = {}
        for hosts, gres in _DETAIL_ITEM.findall(m.group(1)):
            granted = gpus_of(parse_gres(gres))
            for host in expand_hostlist(hosts):
                per_node[host] = granted
        out[job_id] = per_node
    return {j: v for j, v in out.items() if j not in twice}


# Columns of the cheap pending-jobs listing (``squeue -O``; the builder is in cli_backend).
PENDING_LISTING_FIELDS = "JobID:|,Comment:|"


def parse_pending_listing(text: str) -> list[int]:
    """Job ids of the elastic jobs in a pending-jobs listing (``PENDING_LISTING_FIELDS``),
    ascending; a comment's later lines belong to it (``listing_records``), never a job."""
    return sorted(job_id for job_id, (_, comment) in listing_records(text, 2).items() if is_elastic(comment))
