"""Collectives of a compiled XLA program, read from its HLO text.

Pure text parsing, no JAX: ``parse_collectives(hlo_text)`` lists every all-reduce,
all-gather, reduce-scatter, all-to-all and collective-permute (synchronous or as an
async ``-start``/``-done`` pair, counted once) with its payload bytes and device groups.

Byte convention (what one NCCL call of that kind moves, as the measured tables count it):
the full buffer of the group. all-reduce, all-to-all, collective-permute: the result size;
all-gather: the gathered (result) size; reduce-scatter: the input size, i.e. the result
size times the group size.

Replica groups come in three spellings, all handled: explicit ``{{0,1},{2,3}}``, iota
``[2,2]<=[4]`` (optionally with ``T(1,0)``), and the mesh form of newer XLA,
``mesh['axis_0'=2,'axis_1'=2] {'axis_0'}``.
"""

import math
import re
from dataclasses import dataclass

import numpy as np

COLLECTIVE_KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all",
                    "collective-permute")

DTYPE_BYTES = {
    "pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4,
    "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
    "f8e4m3fn": 1, "f8e5m2": 1, "s4": 1, "u4": 1,
}

_OP_RE = re.compile(
    r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<shape>.+?)\s+"
    r"(?P<op>all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)"
    r"(?P<start>-start)?\(")
_ARRAY_RE = re.compile(r"\b([a-z]+\d*[a-z0-9]*)\[([\d,]*)\]")
_IOTA = r"\[[\d,]+\](?:<=\[[\d,]+\])?(?:T\([\d,]+\))?"
_GROUPS_RE = re.compile(r"replica_groups=(\{\{[\d,{}\s]*\}\}|\{\}|\[[\d,]+\]<=\[[\d,]+\](?:T\([\d,]+\))?"
                        r"|mesh\[[^\]]*\](?:,\s*device_ids=\((?:" + _IOTA + r"|[\d,\s]+)\))?\s*\{[^}]*\})")
_PAIRS_RE = re.compile(r"source_target_pairs=\{([\d,{}\s]*)\}")


class HloParseError(ValueError):
    """A collective line whose shape or groups cannot be read; quotes the line."""

    def __init__(self, line: str, why: str):
        super().__init__(f"cannot parse HLO collective ({why}): {line.strip()[:300]!r}")


@dataclass(frozen=True)
class Collective:
    """One collective of the per-device program.

    Attributes:
        kind: one of ``COLLECTIVE_KINDS``.
        name: the HLO instruction name.
        bytes: payload bytes (see the module docstring for the convention).
        group_size: devices in each group (2 for a collective-permute pair).
        groups: the device groups (for collective-permute, the source-target pairs).
        repeats: executions per program run: the product of the known trip counts of the
            while loops (``lax.scan`` bodies) around it; 1 outside loops.
    """

    kind: str
    name: str
    bytes: int
    group_size: int
    groups: tuple[tuple[int, ...], ...]
    repeats: int = 1


def _shape_bytes(shape_text: str, line: str) -> int:
    """Bytes of an HLO shape, a tuple summed; ``/*index=5*/`` comments are ignored."""
    arrays = _ARRAY_RE.findall(re.sub(r"/\*.*?\*/", "", shape_text))
    if not arrays:
        raise HloParseError(line, f"no array shape in {shape_text!r}")
    total = 0
    for dtype, dims in arrays:
        if dtype not in DTYPE_BYTES:
            raise HloParseError(line, f"unknown element type {dtype!r}")
        total += DTYPE_BYTES[dtype] * math.prod(int(d) for d in dims.split(",") if d)
    return total


def parse_replica_groups(text: str) -> tuple[tuple[int, ...], ...]:
    """Expand any of the three replica-group spellings into explicit device groups.

    ``{}`` (all devices, count unknown here) returns an empty tuple.
    """
    text = text.strip()
    if text.startswith("{"):
        inner = re.findall(r"\{([\d,\s]*)\}", text[1:-1])
        return tuple(tuple(int(v) for v in g.split(",") if v.strip()) for g in inner if g.strip())
    if text.startswith("["):
        m = re.fullmatch(r"\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", text)
        if not m:
            raise HloParseError(text, "bad iota replica groups")
        out_shape = [int(v) for v in m.group(1).split(",")]
        src_shape = [int(v) for v in m.group(2).split(",")]
        ids = np.arange(math.prod(src_shape)).reshape(src_shape)
        if m.group(3):
            ids = ids.transpose([int(v) for v in m.group(3).split(",")])
        ids = ids.reshape(out_shape)
        return tuple(tuple(int(v) for v in row) for row in ids.reshape(out_shape[0], -1))
    m = re.fullmatch(r"mesh\[([^\]]*)\](?:,\s*device_ids=\((.*)\))?\s*\{([^}]*)\}", text)
    if not m:
        raise HloParseError(text, "unknown replica-group spelling")
    axes = re.findall(r"'([^']+)'\s*=\s*(\d+)", m.group(1))
    names = [a for a, _ in axes]
    sizes = [int(s) for _, s in axes]
    chosen = re.findall(r"'([^']+)'", m.group(3))
    if any(c not in names for c in chosen):
        raise HloParseError(text, f"group axes {chosen} not in mesh axes {names}")
    # Mesh positions are row-major over the axes; device_ids (default: the identity) says
    # which device sits at each position. A group varies the chosen axes.
    ids = _device_ids(m.group(2), math.prod(sizes), text).reshape(sizes)
    keep = [i for i, n in enumerate(names) if n not in chosen]
    vary = [names.index(c) for c in chosen]
    ids = ids.transpose(keep + vary)
    group = math.prod(sizes[i] for i in vary)
    return tuple(tuple(int(v) for v in row) for row in ids.reshape(-1, group))


def _device_ids(spec: str | None, count: int, text: str) -> "np.ndarray":
    """The device at each mesh position: an iota ``[2,2]T(1,0)`` or an explicit list."""
    if spec is None:
        return np.arange(count)
    spec = spec.strip()
    m = re.fullmatch(r"\[([\d,]+)\](?:<=\[([\d,]+)\])?(?:T\(([\d,]+)\))?", spec)
    if m:
        shape = [int(v) for v in (m.group(2) or m.group(1)).split(",")]
        ids = np.arange(math.prod(shape)).reshape(shape)
        if m.group(3):
            ids = ids.transpose([int(v) for v in m.group(3).split(",")])
        ids = ids.reshape(-1)
    else:
        ids = np.array([int(v) for v in spec.split(",") if v.strip()])
    if ids.size != count:
        raise HloParseError(text, f"device_ids lists {ids.size} devices for a mesh of {count}")
    return ids


_COMP_RE = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s+\(.*\)\s*->\s*.*\{\s*$")
_WHILE_RE = re.compile(r"\swhile\(.*?body=%?([\w.\-]+)")
_TRIP_RE = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"(\d+)"')


def _instructions(hlo_text: str):
    """(name of the enclosing computation or None, line) for every line that does not open
    a computation."""
    current = None
    for line in hlo_text.splitlines():
        m = _COMP_RE.match(line)
        if m:
            current = m.group(1)
        else:
            yield current, line


def loop_repeats(hlo_text: str) -> dict[str, int]:
    """Executions per run of every computation that is a while-loop body (nested loops
    multiply). Loops without a known trip count count once."""
    parent_of: dict[str, tuple[str, int]] = {}
    for current, line in _instructions(hlo_text):
        w = _WHILE_RE.search(line)
        if w and current is not None:
            t = _TRIP_RE.search(line)
            parent_of[w.group(1)] = (current, int(t.group(1)) if t else 1)

    def repeats(comp: str, depth: int = 0) -> int:
        if comp not in parent_of or depth > 64:
            return 1
        parent, n = parent_of[comp]
        return n * repeats(parent, depth + 1)

    return {body: repeats(body) for body in parent_of}


def parse_collectives(hlo_text: str, num_devices: int | None = None) -> tuple[Collective, ...]:
    """Every collective in ``hlo_text`` (as printed by ``compiled.as_text()``), with how
    many times it runs (inside ``lax.scan`` loops: the trip count).

    Args:
        hlo_text: optimized per-device HLO module text.
        num_devices: devices of the program, used when groups are written ``{}``.

    Raises:
        HloParseError: a collective line whose shape or groups cannot be read.
    """
    out = []
    loops = loop_repeats(hlo_text)
    for current, line in _instructions(hlo_text):
        m = _OP_RE.match(line)
        if not m:
            continue
        reps = loops.get(current, 1)
        kind, shape_text = m.group("op"), m.group("shape")
        if m.group("start"):
            # An async start returns (operands..., results..., scratch): count the results.
            shape_text = _async_result_shape(shape_text, kind)
        size = _shape_bytes(shape_text, line)
        if kind == "collective-permute":
            pm = _PAIRS_RE.search(line)
            groups = parse_replica_groups("{" + pm.group(1) + "}") if pm else ()
            out.append(Collective(kind, m.group("name"), size, 2, groups, reps))
            continue
        gm = _GROUPS_RE.search(line)
        groups = parse_replica_groups(gm.group(1)) if gm else ()
        if groups:
            group_size = len(groups[0])
        elif num_devices:
            group_size, groups = num_devices, (tuple(range(num_devices)),)
        else:
            raise HloParseError(line, "replica groups span all devices; pass num_devices")
        if kind == "reduce-scatter":
            size *= group_size
        out.append(Collective(kind, m.group("name"), size, group_size, groups, reps))
    return tuple(out)


def _async_result_shape(shape_text: str, kind: str) -> str:
    """The result part of an async collective's tuple shape."""
    inner = shape_text.strip()
    if not inner.startswith("("):
        return inner
    parts, depth, cur = [], 0, ""
    for ch in inner[1:-1]:
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
            continue
        depth += ch in "([{"
        depth -= ch in ")]}"
        cur += ch
    parts.append(cur)
    if kind == "all-reduce":
        return inner  # all-reduce-start's shape is its result
    # all-gather-start / collective-permute-start: (operand, result[, contexts...]).
    return parts[1] if len(parts) >= 2 else parts[0]


def classify_axis(groups: tuple[tuple[int, ...], ...], dp: int, tp: int) -> str:
    """Which mesh axis a collective's groups span on a (dp, tp) mesh numbered row-major.

    Returns ``tp`` (groups of consecutive devices), ``dp`` (strided by tp), ``all`` (every
    device in one group) or ``other``.
    """
    if not groups:
        return "other"
    def as_set(gs):
        return {frozenset(g) for g in gs}
    grid = np.arange(dp * tp).reshape(dp, tp)
    if as_set(groups) == as_set(grid.tolist()):
        return "tp"
    if as_set(groups) == as_set(grid.T.tolist()):
        return "dp"
    if len(groups) == 1 and len(groups[0]) == dp * tp:
        return "all"
    return "other"


def bytes_by_kind(collectives: tuple[Collective, ...]) -> dict[str, int]:
    """Total payload bytes per program run, per collective kind (kinds absent are 0)."""
    totals = {k: 0 for k in COLLECTIVE_KINDS}
    for c in collectives:
        totals[c.kind] += c.bytes * c.repeats
    return totals
