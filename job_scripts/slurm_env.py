"""What Slurm granted this job, read from its environment (pure functions), and the
runner's one read of Slurm: its own job record (:func:`read_job_record`).

Inside an allocation Slurm describes the job through environment variables; these
functions turn a mapping of them (``os.environ`` at the entry point, a recorded sample in
tests) into one frozen :class:`SlurmAllocation`. Nothing here reads the environment on its
own. The plan the daemon chose sits in the job's AdminComment, read from
``scontrol show job`` output by :func:`admin_comment_from_scontrol`.

GPUs per node come from, in order: ``SLURM_GPUS_ON_NODE`` (a count), ``SLURM_JOB_GPUS``
or ``SLURM_STEP_GPUS`` (index lists), ``CUDA_VISIBLE_DEVICES`` (index or UUID list),
``SLURM_GPUS_PER_NODE`` (``4``, ``a100:4``, or summed over types: ``volta:3,kepler:1``).
The GPU type is the partition's name when that names a catalog GPU type (slurm-ext keeps
one partition per type).
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass

from estimator.errors import SpecError
from estimator.gpus import CATALOG

# Hostlists are small in practice; the cap keeps a malformed range from allocating GBs.
MAX_NODES = 1 << 16


@dataclass(frozen=True)
class SlurmAllocation:
    """The resources of this job as Slurm granted them.

    Attributes:
        job_id: SLURM_JOB_ID, or None outside Slurm.
        node_names: the job's nodes, expanded from SLURM_JOB_NODELIST.
        gpus_per_node: GPUs on each node (0 when none were granted).
        partition: SLURM_JOB_PARTITION, or None.
        gpu_type: catalog GPU type named by the partition, or None.
        restart_count: SLURM_RESTART_COUNT (0 on the first run).
        process_id: SLURM_PROCID (rank of this process; 0 in the batch script).
        num_processes: SLURM_NTASKS inside a step, else 1.
        in_step: True inside an ``srun`` step, False in the batch script itself.
        submit_dir: SLURM_SUBMIT_DIR, or None.
        launch_host: SLURM_LAUNCH_NODE_IPADDR inside a step (the address of the node that
            ran ``srun``: the batch node, which also runs process 0), else None.
    """

    job_id: str | None
    node_names: tuple[str, ...]
    gpus_per_node: int
    partition: str | None
    gpu_type: str | None
    restart_count: int
    process_id: int = 0
    num_processes: int = 1
    in_step: bool = False
    submit_dir: str | None = None
    launch_host: str | None = None

    @property
    def num_nodes(self) -> int:
        return max(1, len(self.node_names))

    @property
    def num_gpus(self) -> int:
        return self.num_nodes * self.gpus_per_node


def _split_top_level(text: str) -> list[str]:
    """Split on commas that are not inside brackets: ``a[1-2],b`` → ``a[1-2]``, ``b``."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise SpecError("SLURM_JOB_NODELIST", text, "unbalanced ']' in the hostlist")
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth != 0:
        raise SpecError("SLURM_JOB_NODELIST", text, "unbalanced '[' in the hostlist")
    parts.append(text[start:])
    return [p for p in parts if p]


def _expand_range(body: str, whole: str) -> list[str]:
    out: list[str] = []
    for item in body.split(","):
        lo, sep, hi = item.partition("-")
        if not (lo + hi).isascii() or not lo.isdigit() or (sep and not hi.isdigit()):
            raise SpecError("SLURM_JOB_NODELIST", whole, f"bad range {item!r}; expected N or N-M")
        if not sep:
            out.append(lo)
            continue
        a, b = int(lo), int(hi)
        if b < a or b - a >= MAX_NODES:
            raise SpecError("SLURM_JOB_NODELIST", whole, f"bad range {item!r}")
        width = len(lo)  # Slurm keeps zero padding: node[01-03]
        out.extend(str(n).zfill(width) for n in range(a, b + 1))
    return out


def expand_nodelist(nodelist: str) -> tuple[str, ...]:
    """Expand a Slurm hostlist such as ``a100-[1-2,4],h100-1`` or ``n[01-02]-g[1-2]``.

    Args:
        nodelist: the compressed hostlist (SLURM_JOB_NODELIST).

    Returns:
        Every host name, in Slurm's order.

    Raises:
        SpecError: malformed brackets or ranges (quoted).
    """
    names: list[str] = []
    for part in _split_top_level(nodelist.strip()):
        expanded = [""]
        for piece in re.split(r"(\[[^\]]*\])", part):
            if piece.startswith("["):
                choices = _expand_range(piece[1:-1], nodelist)
                expanded = [e + c for e in expanded for c in choices]
            else:
                expanded = [e + piece for e in expanded]
            if len(expanded) > MAX_NODES:
                raise SpecError("SLURM_JOB_NODELIST", nodelist, f"more than {MAX_NODES} nodes")
        names.extend(expanded)
    return tuple(names)


def int_var(env: Mapping[str, str], name: str, default: int) -> int:
    """The whole number ≥ 0 in variable ``name``, ``default`` when unset or blank.

    Raises:
        SpecError: anything else (quoted).
    """
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = int(raw.strip())
    except ValueError:
        raise SpecError(name, raw, "expected a non-negative integer") from None
    if value < 0:
        raise SpecError(name, raw, "expected a non-negative integer")
    return value


def _count_list(raw: str) -> int:
    items = [x.strip() for x in raw.split(",") if x.strip()]
    # Slurm writes NoDevFiles when GPUs were granted without device files.
    if items == ["NoDevFiles"]:
        return 0
    # CUDA stops at the first index that is no device (-1 hides every GPU).
    return next((k for k, x in enumerate(items) if x.startswith("-")), len(items))


def gpus_per_node_from_env(env: Mapping[str, str]) -> int:
    """GPUs on this node, from the first variable that says (see the module docstring)."""
    if env.get("SLURM_GPUS_ON_NODE", "").strip():
        return int_var(env, "SLURM_GPUS_ON_NODE", 0)
    for name in ("SLURM_JOB_GPUS", "SLURM_STEP_GPUS", "CUDA_VISIBLE_DEVICES"):
        raw = env.get(name)
        if raw is not None and raw.strip():
            return _count_list(raw)
    raw = env.get("SLURM_GPUS_PER_NODE", "").strip()
    return sum(_gpus_of_item(raw, item) for item in raw.split(",")) if raw else 0


def _gpus_of_item(raw: str, item: str) -> int:
    """GPUs of one item of ``--gpus-per-node``: ``N``, ``TYPE:N`` or ``TYPE`` (Slurm's
    count defaults to 1)."""
    count = item.strip().rsplit(":", 1)[-1].split("(")[0]
    if count.isascii() and count.isdigit():
        return int(count)
    if re.fullmatch(r"[A-Za-z][\w.-]*", count):
        return 1
    raise SpecError("SLURM_GPUS_PER_NODE", raw, "expected N, TYPE:N or TYPE, comma-separated")


def gpu_type_of_partition(partition: str | None) -> str | None:
    """The catalog GPU type a partition is named after (``a100``), else None."""
    if not partition:
        return None
    name = partition.split(",")[0].strip().lower()
    return name if name in CATALOG else None


def allocation_from_env(env: Mapping[str, str], stepd: str | None = None) -> SlurmAllocation:
    """Read the allocation from Slurm's variables.

    Outside Slurm (no SLURM_JOB_ID) this returns an allocation of one node, no job id and
    the GPUs CUDA_VISIBLE_DEVICES lists (often 0); the caller then decides the device count.

    Args:
        env: the environment (``os.environ`` or a recorded sample).
        stepd: the step of the ``slurmstepd`` this process runs under (``8.batch``, ``8.0``:
            `enclosing_step`), when known: the process is a task of an ``srun`` step only
            if that is a numbered step. sbatch exports the submitter's environment, so a
            job submitted from inside another job's step (an ``srun --pty bash`` session)
            carries that step's ``SLURM_STEP_ID`` into its batch script.

    Returns:
        The allocation.

    Raises:
        SpecError: a variable that is present but malformed (quoted).
    """
    job_id = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID") or None
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or ""
    nodes = expand_nodelist(nodelist) if nodelist.strip() else ()
    num_nodes = int_var(env, "SLURM_JOB_NUM_NODES", 0) or int_var(env, "SLURM_NNODES", 0)
    if nodes and num_nodes and num_nodes != len(nodes):
        raise SpecError("SLURM_NNODES", num_nodes,
                        f"disagrees with SLURM_JOB_NODELIST={nodelist!r} ({len(nodes)} nodes)")
    if not nodes and num_nodes:
        nodes = tuple(f"node{i}" for i in range(num_nodes))
    partition = env.get("SLURM_JOB_PARTITION") or None
    in_step = bool(env.get("SLURM_STEP_ID", "").strip()) and env.get("SLURM_STEP_ID") != "batch"
    if in_step and stepd is not None:
        in_step = stepd.rpartition(".")[2].partition("+")[0].isdigit()  # 8.0, or 8.0+1 of a het job
    return SlurmAllocation(
        job_id=job_id,
        node_names=nodes,
        gpus_per_node=gpus_per_node_from_env(env),
        partition=partition,
        gpu_type=gpu_type_of_partition(partition),
        restart_count=int_var(env, "SLURM_RESTART_COUNT", 0),
        process_id=int_var(env, "SLURM_PROCID", 0) if in_step else 0,
        num_processes=max(1, int_var(env, "SLURM_NTASKS", 1)) if in_step else 1,
        in_step=in_step,
        submit_dir=env.get("SLURM_SUBMIT_DIR") or None,
        launch_host=(env.get("SLURM_LAUNCH_NODE_IPADDR") or None) if in_step else None,
    )


COORDINATOR_ENV = "SLURM_EXT_COORDINATOR"
COORDINATOR_BASE_PORT = 20000
COORDINATOR_PORTS = 12000


def coordinator_port(job_id: str | None) -> int:
    """The port of process 0's jax.distributed service: derived from the job id, so every
    process of a job computes the same one and jobs sharing a node rarely collide; below
    Linux's ephemeral ports (32768 on), which another process's connection may hold."""
    return COORDINATOR_BASE_PORT + int(job_id or 0) % COORDINATOR_PORTS


def coordinator_address(alloc: SlurmAllocation, override: str | None,
                        first_node_resolves: bool) -> str:
    """``host:port`` where the processes of a multi-node step meet (process 0 listens).

    Process 0 runs on the job's first node. Its name is the host when it resolves (the
    usual case: node names are host names); otherwise (nodes named apart from their
    hosts, as in the lab cluster, where every node is localhost) the address of the node
    that ran ``srun``, which is the batch node, the first node again.

    Args:
        alloc: the allocation, read inside the step.
        override: ``SLURM_EXT_COORDINATOR`` (``host:port`` or ``host``), or None.
        first_node_resolves: whether the first node's name resolves to an address.

    Raises:
        SpecError: no address can be derived (quoted).
    """
    port = coordinator_port(alloc.job_id)
    if override:
        given = override.strip()
        if given.startswith("["):  # [IPv6]:port or [IPv6]
            host, _, rest = given[1:].partition("]")
            if not host or (rest and not (rest.startswith(":") and rest[1:].isdigit())):
                raise SpecError(COORDINATOR_ENV, override, "give host:port, host, [IPv6]:port or IPv6")
            return given if rest else f"[{host}]:{port}"
        if given.count(":") > 1:  # a bare IPv6 address: no port
            return f"[{given}]:{port}"
        host, sep, given_port = given.rpartition(":")
        if not sep:
            return f"{given}:{port}"
        if not host or not given_port.isdigit():
            raise SpecError(COORDINATOR_ENV, override, "give host:port, host, [IPv6]:port or IPv6")
        return given
    if alloc.node_names and first_node_resolves:
        return f"{alloc.node_names[0]}:{port}"
    if alloc.launch_host:  # Slurm writes an IPv6 address without brackets
        host = alloc.launch_host
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    raise SpecError("SLURM_JOB_NODELIST", ",".join(alloc.node_names),
                    f"the first node does not resolve and SLURM_LAUNCH_NODE_IPADDR is unset; "
                    f"set {COORDINATOR_ENV}=host:port")


def scontrol_show_job_argv(job_id: str) -> list[str]:
    """The command that prints a job's record, AdminComment included."""
    if not str(job_id).replace("_", "").isdigit():
        raise SpecError("job_id", job_id, "expected a numeric Slurm job id")
    return ["scontrol", "show", "job", str(job_id)]


def read_job_record(job_id: str, timeout_s: float = 30.0) -> str:
    """``scontrol show job`` of this job: the runner's one read of Slurm (its own record,
    for the AdminComment and Comment). The daemon reaches Slurm only through its client;
    the runner, inside the allocation, has just this.

    Raises:
        OSError, subprocess.SubprocessError: scontrol is missing, fails or times out.
    """
    return subprocess.run(scontrol_show_job_argv(job_id), capture_output=True, encoding="utf-8",
                          errors="replace", timeout=timeout_s, check=True).stdout


def line_field_from_scontrol(text: str, name: str) -> str | None:
    """A field that ``scontrol show job`` prints on a line of its own, or None when unset.

    Slurm prints ``AdminComment=``, ``SystemComment=`` and ``Comment=`` each on their own
    line (the value may contain spaces), so the value runs to the end of that line.
    """
    prefix = f"{name}="
    lines = text.split("\n")  # scontrol's own line breaks (not \v, \f, U+2028 ... in a value)
    for i, line in enumerate(lines):
        stripped = line.strip()
        if stripped.startswith(prefix):
            value = stripped[len(prefix):]
            # A value with a line break in it runs on to the next line that starts a field:
            # kept whole, so the reader refuses it as the daemon does.
            for more in lines[i + 1:]:
                if _FIELD_LINE.match(more):
                    break
                value += "\n" + more
            return value.strip() or None
    return None


_FIELD_LINE = re.compile(r"\s+[A-Za-z][A-Za-z0-9_/:]*=")


def admin_comment_from_scontrol(text: str) -> str | None:
    """The AdminComment (where the daemon writes the plan), or None when unset."""
    return line_field_from_scontrol(text, "AdminComment")


def comment_from_scontrol(text: str) -> str | None:
    """The Comment (``elastic key=value ...``), or None when unset."""
    return line_field_from_scontrol(text, "Comment")
