"""Communication model: collective times from a measured table, else latency-bandwidth.

The table is a CSV of measured NCCL collectives (columns ``gpu_type, num_nodes,
gpus_per_node, network, op, replica_groups, group_size, bytes, seconds``, the format of the
profiles the product ships in ``estimator/data/``). A site replaces it with its own table
(``--comm-table`` on the command line) or, through ``slurm-ext profile``, its own profile
store (``profile_db`` in the daemon's config). Each row is filed
under a *curve*: (GPU type, network, op, group size, nodes one group spans); a query
interpolates its curve log-log in bytes. GPU types, group sizes or layouts the table does
not cover fall back to a latency-bandwidth model built from the GPU catalog and the
cluster's network, and the answer says which one it used. So do collectives across nodes
on a network kind the shipped table was not measured on (its ``default`` is the
artifact's clusters' own network; a site's table or profile is its own network). Where
the table has the type's curves across nodes on the cluster's network, the model's
bandwidth per node is the one those curves attain (``CommTable.inter_node_gbytes_s``),
not the network's nominal one: a layout past the table's then costs what its neighbours
in the table do.
"""

import ast
import bisect
import csv
import math
import statistics
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from estimator.errors import SpecError
from estimator.gpus import gpu_type as _gpu_type

OPS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "send")
DEFAULT_TABLE = Path(__file__).parent / "data" / "collectives_measured.csv"
LATENCY_INTRA_S = 10e-6
LATENCY_INTER_S = 30e-6


@dataclass(frozen=True)
class CurveKey:
    gpu_type: str
    network: str
    op: str
    group_size: int
    nodes_spanned: int


# A measured curve: sizes (bytes), times (s), and seconds per byte past its largest size.
Curve = tuple[tuple[float, ...], tuple[float, ...], float]


@dataclass(frozen=True)
class CommTime:
    seconds: float
    source: str  # "table", "profile" (a site's own profile) or "model"


class CommTable:
    """Measured collective curves, immutable after loading."""

    def __init__(self, curves: dict[CurveKey, dict[int, Curve]],
                 profiled_types: frozenset[str] = frozenset(), shipped: bool = False):
        self._curves = curves
        self.profiled_types = profiled_types  # GPU types whose curves a site's profile gave
        # The product's own table, measured on the clusters of the Crius/Arena artifact:
        # its curves across nodes hold for a cluster on the network they were measured on.
        self.shipped = shipped
        self._networks: dict[str, set[str]] = {}
        for key in curves:
            self._networks.setdefault(key.gpu_type, set()).add(key.network)
        self._attained = _attained_inter_node(curves)

    def inter_node_gbytes_s(self, gpu_type_name: str, network: str) -> float | None:
        """The bandwidth per node that the type's curves across nodes on ``network``
        attain at their largest messages, as the latency-bandwidth model counts it (the
        median over the curves of all-reduce, all-gather and reduce-scatter), or None."""
        return self._attained.get((gpu_type_name, network))

    @property
    def gpu_types(self) -> tuple[str, ...]:
        return tuple(sorted(self._networks))

    def curve(self, key: CurveKey, groups_per_node: int = 1) -> Curve | None:
        """The curve of ``key`` measured with ``groups_per_node`` such groups sharing a
        node's network, else the one measured with the nearest number."""
        by_sharing = self._curves.get(key)
        if not by_sharing:
            return None
        best = min(by_sharing, key=lambda k: (abs(math.log2(k / max(groups_per_node, 1))), k))
        return by_sharing[best]

    def network_for(self, gpu_type_name: str, network: str, nodes_spanned: int = 1) -> str | None:
        """The network column to read for a GPU type: the cluster's network kind where the
        table has it; else, within a node (no network crossed), a site's own table or
        profile, any (``default`` first). Across nodes the shipped table's curves of
        another network kind do not say what the cluster's does (None: the model)."""
        nets = self._networks.get(gpu_type_name)
        if not nets:
            return None
        if network in nets:
            return network
        if self.shipped and nodes_spanned > 1 and gpu_type_name not in self.profiled_types:
            return None
        return "default" if "default" in nets else sorted(nets)[0]


def _attained_inter_node(curves: dict[CurveKey, dict[int, Curve]]) -> dict[tuple[str, str], float]:
    """(GPU type, network) → the bandwidth per node ``model_time`` would need to give each
    curve across nodes its time at its largest message (median over the curves)."""
    implied: dict[tuple[str, str], list[float]] = {}
    for key, by_sharing in curves.items():
        if key.nodes_spanned < 2 or key.op not in ("all-reduce", "all-gather", "reduce-scatter"):
            continue
        steps = 2 * (key.group_size - 1) if key.op == "all-reduce" else key.group_size - 1
        for sharing, (sizes, times, _) in by_sharing.items():
            wire_s = times[-1] - LATENCY_INTER_S * steps
            if wire_s > 0:
                per_node = max(1, key.group_size // key.nodes_spanned) * max(1, sharing)
                implied.setdefault((key.gpu_type, key.network), []).append(
                    per_node * _algorithm_factor(key.op, key.group_size) * sizes[-1] / wire_s / 1e9)
    return {k: statistics.median(v) for k, v in implied.items()}


def _nodes_spanned(groups: list[list[int]], gpus_per_node: int, num_nodes: int, op: str) -> int:
    if op == "send":
        return min(2, num_nodes)
    return max(len({d // gpus_per_node for d in g}) for g in groups)


def _parse_groups(text: str) -> list[list[int]]:
    cleaned = text.replace("np.int64(", "").replace(")", "")
    return ast.literal_eval(cleaned)


@lru_cache(maxsize=4096)  # a table repeats a few layouts over thousands of rows
def valid_groups(text: str) -> bool:
    """Whether ``text`` reads as replica groups: a non-empty list of non-empty lists of ints."""
    try:
        groups = _parse_groups(text)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return False
    return isinstance(groups, list) and bool(groups) and all(
        isinstance(g, list) and g and all(isinstance(d, int) and d >= 0 for d in g) for g in groups)


COLUMNS = ("gpu_type", "num_nodes", "gpus_per_node", "network", "op", "replica_groups",
           "group_size", "bytes", "seconds")


@lru_cache(maxsize=4)
def load_comm_table(path: str | None = None) -> CommTable:
    """Load (once per path) a measured collectives CSV into curves."""
    p = Path(path) if path else DEFAULT_TABLE
    if not p.is_file():
        raise SpecError("comm_table", str(p), "give a readable CSV of measured collectives")
    try:
        with p.open(newline="", encoding="utf-8-sig") as f:  # a BOM (spreadsheets) is not a column
            reader = csv.reader(f)
            header = next(reader, [])
            if not set(COLUMNS) <= set(header):
                raise SpecError("comm_table", str(p), f"CSV needs columns {', '.join(COLUMNS)}")
            col = [header.index(name) for name in COLUMNS]
            curves = _curves(_checked_rows(reader, col, p))
            if not curves:  # every estimate would fall back to the model without a word
                raise SpecError("comm_table", str(p), "no measured collective in it (a header only, or no row "
                                                      f"of {', '.join(OPS)})")
            return CommTable(curves, shipped=p.resolve() == DEFAULT_TABLE.resolve())
    except UnicodeDecodeError as e:
        raise SpecError("comm_table", str(p), f"not UTF-8 text (byte {e.start}): give a CSV") from None
    except OSError as e:
        raise SpecError("comm_table", str(p), f"cannot read: {e.strerror or e}") from None


def _checked_rows(reader, col: list[int], path: Path):
    """The CSV's rows as ``COLUMNS`` texts, each checked: a short row, a count that is
    not a whole number ≥ 1, or a size or time that is not a positive finite number stops
    the load with the line that has it (a negative time would win every comparison)."""
    for line, row in enumerate(reader, start=2):
        if not row:
            continue
        if len(row) <= max(col):
            raise SpecError("comm_table", str(path), f"line {line}: {len(row)} fields, the header has {max(col) + 1}")
        values = [row[i] for i in col]
        named = dict(zip(COLUMNS, values))
        for key in ("num_nodes", "gpus_per_node", "group_size"):
            if not named[key].strip().isdigit() or int(named[key]) < 1:
                raise SpecError("comm_table", str(path), f"line {line}: {key}={named[key]!r} is not a whole number ≥ 1")
        if named["op"] != "send" and not valid_groups(named["replica_groups"]):
            raise SpecError("comm_table", str(path), f"line {line}: replica_groups={named['replica_groups']!r} is "
                                                     "not a list of lists of device numbers")
        for key in ("bytes", "seconds"):
            try:
                number = float(named[key])
            except ValueError:
                number = math.nan
            if not (math.isfinite(number) and number > 0):
                raise SpecError("comm_table", str(path), f"line {line}: {key}={named[key]!r} is not a positive number")
        yield values


def with_profiled(base: CommTable, rows: list[dict]) -> CommTable:
    """``base`` with the curves of the GPU types ``rows`` cover replaced by those rows
    (dicts with the CSV's columns: a site's own profile, ``estimator.profile_store``)."""
    profiled = frozenset(r["gpu_type"] for r in rows)
    curves = {k: v for k, v in base._curves.items() if k.gpu_type not in profiled}
    curves.update(_curves([str(r[c]) for c in COLUMNS] for r in rows))
    return CommTable(curves, base.profiled_types | profiled, base.shipped)


def _curves(rows) -> dict[CurveKey, dict[int, Curve]]:
    """Curves from rows of the CSV's columns (as text), in ``COLUMNS`` order, by the
    number of groups that share a node's network (``_groups_per_node``)."""
    points: dict[tuple, list[tuple[float, float]]] = {}
    group_cache: dict[tuple[str, str, str, str], tuple[int, int]] = {}
    for gpu, nn, gpn, net, op, groups, size, nbytes, seconds in rows:
        if op not in OPS:
            continue
        gkey = (groups, gpn, nn, op)
        layout = group_cache.get(gkey)
        if layout is None:
            parsed = _parse_groups(groups) if op != "send" else []
            layout = group_cache[gkey] = (_nodes_spanned(parsed, int(gpn), int(nn), op),
                                          _groups_per_node(parsed, int(gpn)))
        points.setdefault((gpu, net, op, size) + layout, []).append((float(nbytes), float(seconds)))
    curves: dict[CurveKey, dict[int, Curve]] = {}
    for (gpu, net, op, size, span, sharing), samples in points.items():
        by_size: dict[float, list[float]] = {}
        for nbytes, seconds in samples:
            by_size.setdefault(nbytes, []).append(seconds)
        sizes = sorted(by_size)
        # Several layouts can share a curve: keep the median time at each size.
        times = [sorted(by_size[x])[len(by_size[x]) // 2] for x in sizes]
        curves.setdefault(CurveKey(gpu, net, op, int(size), span), {})[sharing] = (
            tuple(sizes), tuple(times), _tail_s_per_byte(sizes, times))
    return curves


def _groups_per_node(groups: list[list[int]], gpus_per_node: int) -> int:
    """How many of the layout's groups that cross nodes have members on one node (the most
    on any node): they share that node's network link (1 for sends and within a node)."""
    per_node: dict[int, int] = {}
    for g in groups:
        nodes = {d // gpus_per_node for d in g}
        if len(nodes) > 1:
            for n in nodes:
                per_node[n] = per_node.get(n, 0) + 1
    return max(per_node.values(), default=1)


def _tail_s_per_byte(sizes: list[float], times: list[float]) -> float:
    """Seconds per byte past a curve's largest message: the least-squares slope over its
    top quarter of sizes (the bandwidth-bound end). Two neighbouring points alone are too
    noisy (a few % of jitter between sizes 0.4 % apart gives slopes from 0 to 3× the
    curve's bandwidth); with fewer than two points there, the largest's time ÷ bytes."""
    top = [(x, t) for x, t in zip(sizes, times) if x >= sizes[-1] / 4]
    if len(top) >= 2:
        mx = sum(x for x, _ in top) / len(top)
        mt = sum(t for _, t in top) / len(top)
        var = sum((x - mx) ** 2 for x, _ in top)
        slope = sum((x - mx) * (t - mt) for x, t in top) / var if var > 0 else 0.0
        if slope > 0:
            return slope
    return times[-1] / sizes[-1] if sizes[-1] > 0 else 0.0


def _interpolate(sizes: tuple[float, ...], times: tuple[float, ...], tail_s_per_byte: float,
                 nbytes: float) -> float:
    if nbytes <= sizes[0]:
        return times[0]
    if nbytes >= sizes[-1]:
        # Past the largest message: time grows at the curve's large-message rate.
        return times[-1] + tail_s_per_byte * (nbytes - sizes[-1])
    i = bisect.bisect_right(sizes, nbytes)
    x0, x1 = math.log(max(sizes[i - 1], 1.0)), math.log(sizes[i])
    y0, y1 = math.log(max(times[i - 1], 1e-9)), math.log(max(times[i], 1e-9))
    t = (math.log(nbytes) - x0) / (x1 - x0) if x1 > x0 else 0.0
    return math.exp(y0 + t * (y1 - y0))


def _algorithm_factor(op: str, n: int) -> float:
    """Bytes each GPU sends per byte of buffer, for ring algorithms."""
    if op == "all-reduce":
        return 2.0 * (n - 1) / n
    if op in ("all-gather", "reduce-scatter", "all-to-all"):
        return (n - 1) / n
    return 1.0


def model_time(op: str, group_size: int, nodes_spanned: int, nbytes: float, gpu_type_name: str,
               inter_node_gbytes_s: float, groups_per_node: int = 1) -> float:
    """Latency-bandwidth estimate: ring algorithms over the slowest link a group crosses."""
    if group_size <= 1 or nbytes <= 0:
        return 0.0
    gpu = _gpu_type(gpu_type_name)
    if nodes_spanned > 1:
        # A node's NIC is shared by the node's members of the group, and by the members of
        # the other groups that run at once with members there.
        per_node = max(1, group_size // nodes_spanned) * max(1, groups_per_node)
        bw = min(gpu.intra_node_link_gbytes_s, inter_node_gbytes_s / (per_node if op != "send" else 1))
        latency = LATENCY_INTER_S
    else:
        bw, latency = gpu.intra_node_link_gbytes_s, LATENCY_INTRA_S
    steps = 2 * (group_size - 1) if op == "all-reduce" else (group_size - 1 if op != "send" else 1)
    return latency * steps + _algorithm_factor(op, group_size) * nbytes / (bw * 1e9)


def collective_time(table: CommTable | None, op: str, group_size: int, nodes_spanned: int,
                    nbytes: float, gpu_type_name: str, network: str,
                    inter_node_gbytes_s: float, groups_per_node: int = 1) -> CommTime:
    """Seconds for one collective over ``nbytes`` (the full buffer) among ``group_size`` GPUs.

    Reads the measured curve for this GPU type, op, group size and span when the table has
    it; for another group size of the same span it rescales the nearest curve by the ring
    algorithm's bytes per GPU; otherwise it uses the latency-bandwidth model.
    """
    if op not in OPS:
        raise SpecError("op", op, f"use one of {', '.join(OPS)}")
    if group_size <= 1 or nbytes <= 0:
        return CommTime(0.0, "none")
    if table is not None:
        net = table.network_for(gpu_type_name, network, nodes_spanned)
        if net is not None:
            source = "profile" if gpu_type_name in table.profiled_types else "table"
            curve = table.curve(CurveKey(gpu_type_name, net, op, group_size, nodes_spanned), groups_per_node)
            if curve is not None:
                return CommTime(_interpolate(*curve, nbytes), source)
            if op != "send":
                near = _nearest_group(table, gpu_type_name, net, op, group_size, nodes_spanned, groups_per_node)
                if near is not None:
                    g, curve = near
                    scale = _algorithm_factor(op, group_size) / _algorithm_factor(op, g)
                    return CommTime(_interpolate(*curve, nbytes) * scale, source)
            inter_node_gbytes_s = table.inter_node_gbytes_s(gpu_type_name, net) or inter_node_gbytes_s
    return CommTime(model_time(op, group_size, nodes_spanned, nbytes, gpu_type_name, inter_node_gbytes_s,
                               groups_per_node), "model")


def _nearest_group(table: CommTable, gpu: str, net: str, op: str, group_size: int, span: int,
                   groups_per_node: int):
    best = None
    for g in (group_size // 2, group_size * 2, group_size // 4, group_size * 4):
        if g < 2:
            continue
        curve = table.curve(CurveKey(gpu, net, op, g, span), groups_per_node)
        if curve is not None and (best is None or abs(math.log2(g / group_size)) < abs(math.log2(best[0] / group_size))):
            best = (g, curve)
    return best
