"""A pipeline stage's communication time: its tensor-parallel all-reduces, MoE
all-to-alls, BatchNorm sums, sends to the next stage and data-parallel gradient sync,
each from the measured collectives table (or a site's profile) over the devices and
nodes the group spans (``estimator.comm.collective_time``), or a compiled program's own
collectives.

``ctx`` is the estimator's per-Cell context (``estimator.estimate``): its Cell, node
group, collectives table, efficiency and options.
"""

from estimator.cells import StagePlan
from estimator.comm import collective_time

# Compiled collective kinds → the measured table's ops.
COMPILED_OPS = {"all-reduce": "all-reduce", "all-gather": "all-gather", "reduce-scatter": "reduce-scatter",
                "all-to-all": "all-to-all", "collective-permute": "send"}


def span_nodes(first_device: int, count: int, stride: int, gpus_per_node: int) -> int:
    """Nodes touched by devices first, first+stride, … (count of them)."""
    return len({(first_device + k * stride) // gpus_per_node for k in range(count)})


def dp_groups_per_node(plan: StagePlan, gpus_per_node: int) -> int:
    """A stage's data-parallel groups (one per tensor-parallel rank) with members on one
    node: they run their collectives at once."""
    return max(1, min(plan.tp, gpus_per_node))


def collective_s(ctx, op: str, group: int, span: int, nbytes: float, groups_per_node: int = 1) -> tuple[float, str]:
    """Seconds of one collective; ``groups_per_node``: how many such groups run at once
    with members on one node (sharing its network when they cross nodes)."""
    t = collective_time(ctx.table, op, group, span, nbytes, ctx.cell.gpu_type,
                        ctx.group.network.kind, ctx.group.network.bandwidth_gbytes_s, groups_per_node)
    if span > 1:
        return t.seconds / ctx.eff.inter_node_frac, t.source
    return t.seconds, t.source


def compiled_collective_s(ctx, compiled, axis: str, group: int, span: int,
                          groups_per_node: int = 1) -> tuple[float, set[str]]:
    """Seconds of a compiled program's collectives over one mesh axis (table or model)."""
    total, sources = 0.0, set()
    for c in compiled.collectives:
        if c.axis != axis or not c.count:
            continue
        t, src = collective_s(ctx, COMPILED_OPS.get(c.kind, "all-reduce"), group, span, c.bytes / c.count,
                              groups_per_node)
        total += c.count * t
        sources.add(src)
    return total, sources


def alltoall_group(ctx, plan: StagePlan, first_device: int, gpn: int) -> tuple[int, int, float]:
    """Where a MoE stage's expert all-to-alls run: (group size, nodes spanned, share of
    the layer's all-to-all bytes each GPU sends).

    Alpa's program (GShard's layout) runs one all-to-all over the GPUs the experts are
    split over: tp, or dp × tp under expert parallelism. The runner sums tp-split experts'
    outputs by the tp all-reduce, with no all-to-all; under expert parallelism each tp
    rank sends its block of experts' tokens (1/tp of them) over its dp group."""
    dp, tp = plan.dp, plan.tp
    if ctx.options.memory.program != "runner":
        group = dp * tp if plan.ep else tp
        return group, span_nodes(first_device, group, 1, gpn), 1.0
    if not plan.ep:
        return 1, 1, 0.0
    return dp, span_nodes(first_device, dp, tp, gpn), 1.0 / tp


def stage_collectives_s(ctx, layers, plan: StagePlan, first_device: int, micro: float,
                        comm_passes: float, compiled, sources: set[str]) -> float:
    """Seconds of a stage's collectives inside its passes: tensor-parallel all-reduces and
    all-to-alls, and BatchNorm's data-parallel sums; their figures' sources go to ``sources``."""
    gpn = min(ctx.cell.gpus_per_node, ctx.cell.num_gpus)
    dp, tp = plan.dp, plan.tp
    comm_s = 0.0
    # A model's blocks repeat: look each distinct collective up once.
    seen: dict[tuple, tuple[float, str]] = {}

    def once(*key) -> float:
        if key not in seen:
            seen[key] = collective_s(ctx, *key)
            sources.add(seen[key][1])
        return seen[key][0]

    if tp > 1 and compiled is not None:
        comm_s, srcs = compiled_collective_s(ctx, compiled, "tp", tp, span_nodes(first_device, tp, 1, gpn))
        sources |= srcs
    elif tp > 1 or plan.ep:
        tp_span = span_nodes(first_device, tp, 1, gpn)
        group, span, share = alltoall_group(ctx, plan, first_device, gpn)
        for layer in layers:
            if layer.tp_allreduce_bytes and tp > 1:
                comm_s += comm_passes * once("all-reduce", tp, tp_span, layer.tp_allreduce_bytes * micro)
            if layer.alltoall_bytes and group > 1:
                comm_s += comm_passes * once("all-to-all", group, span, layer.alltoall_bytes * micro * share)
    if dp > 1:
        # Batch statistics are global under SPMD data parallelism: every BatchNorm all-reduces
        # its per-channel sums across the data-parallel group, forward and backward.
        dp_span = span_nodes(first_device, dp, tp, gpn)
        for layer in layers:
            if layer.batch_stat_syncs:
                comm_s += comm_passes * layer.batch_stat_syncs * once("all-reduce", dp, dp_span,
                                                                     layer.batch_stat_bytes,
                                                                     dp_groups_per_node(plan, gpn))
    return comm_s


def stage_send_s(ctx, index: int, layers, plan: StagePlan, first_device: int, micro: float,
                 sources: set[str]) -> float:
    """Seconds a stage spends sending one micro-batch's activations to the next stage and
    receiving their gradients back (0 for the last stage)."""
    if index >= ctx.cell.num_stages - 1:
        return 0.0
    gpn = min(ctx.cell.gpus_per_node, ctx.cell.num_gpus)
    # Activations forward and their gradients back, each replica to its counterpart.
    nbytes = layers[-1].output_bytes * micro
    n = plan.num_gpus
    crosses = (first_device + n - 1) // gpn != (first_device + n) // gpn
    t, src = collective_s(ctx, "send", 2, 2 if crosses else 1, nbytes)
    # Replicas of a node share its NIC; the runner sends from every device of the stage
    # (each tp rank its copy of its replica's activations), Alpa from each replica.
    senders = plan.num_gpus if ctx.options.memory.program == "runner" else plan.dp
    sharing = min(senders, gpn) if crosses else 1
    sources.add(src)
    return 2.0 * t * sharing


def gradient_sync_s(ctx, plan: StagePlan, first_device: int, grad_bytes: float, compiled,
                    sources: set[str]) -> float:
    """Seconds of a stage's data-parallel gradient all-reduce, once per iteration
    (``grad_bytes``: one replica's gradients as the program sums them)."""
    if plan.dp <= 1:
        return 0.0
    gpn = min(ctx.cell.gpus_per_node, ctx.cell.num_gpus)
    dp_span = span_nodes(first_device, plan.dp, plan.tp, gpn)
    sharing = dp_groups_per_node(plan, gpn)
    # The compiled stage is one micro-batch's program: the runner's ZeRO-2 and 3 collectives
    # per micro-batch are not in it, so they are counted here whatever the fidelity.
    if compiled is not None and not (ctx.options.memory.runner_zero2 or ctx.options.memory.runner_zero3):
        sync_s, srcs = compiled_collective_s(ctx, compiled, "dp", plan.dp, dp_span, sharing)
        sources |= srcs
        return sync_s
    if ctx.options.memory.runner_zero2:
        # The runner's ZeRO-2 all-reduces every micro-batch's gradients and keeps its chunk
        # (a pipeline's idle ticks sum nothing), then all-gathers the new weights once
        # (``job_scripts.flat_optimizer``).
        ar, src = collective_s(ctx, "all-reduce", plan.dp, dp_span, grad_bytes, sharing)
        ag, src2 = collective_s(ctx, "all-gather", plan.dp, dp_span, grad_bytes, sharing)
        sources.update((src, src2))
        return ctx.micro_batches * ar + ag
    if ctx.options.memory.runner_zero3:
        # The runner's ZeRO-3 reduce-scatters each micro-batch's gradients, layer by layer;
        # its weights stay split (``job_scripts.zero3``).
        rs, src = collective_s(ctx, "reduce-scatter", plan.dp, dp_span, grad_bytes, sharing)
        sources.add(src)
        return ctx.micro_batches * rs
    t, src = collective_s(ctx, "all-reduce", plan.dp, dp_span, grad_bytes, sharing)
    sources.add(src)
    return t
