"""Compiled stage estimation: compile a stage's sharded training step and read its costs.

Compiling is measuring without a GPU. A stage (a contiguous range of layers) under a
(dp, tp) plan becomes one jitted training step — forward and backward of one micro-batch
plus the optimizer update — with Megatron-style tensor-parallel weight shardings and batch
sharding over ``dp`` (``estimator.jax_models``). It is lowered from abstract shapes
(``jax.ShapeDtypeStruct``, nothing allocated) and compiled for dp × tp CPU devices
(``--xla_force_host_platform_device_count``); ``cost_analysis()`` gives per-device FLOPs
and bytes, the optimized HLO lists every collective with its bytes (``estimator.hlo``).

Where the current process lacks the devices (JAX already initialised with fewer), the
compile runs in a ``multiprocessing`` spawn child whose XLA flags are set before it imports
JAX. With the optional GPU-target extra (``jax-cuda12-plugin``) and a directory of XLA GPU
target specs, the same step also compiles for the Cell's GPU type and ``memory_analysis()``
gives its peak memory; without them that part is skipped and ``memory_bytes`` is None.

Results are cached on disk as JSON, keyed by everything that changes them.
"""

import dataclasses
import hashlib
import importlib.util
import json
import logging
import math
import multiprocessing
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from estimator.errors import SpecError

log = logging.getLogger(__name__)

DEFAULT_CACHE_DIR = Path("~/.cache/slurm-ext").expanduser()
CACHE_FORMAT = 3
# The modules whose code decides what a compile measures: another version of any of them
# keys other cache entries (an upgrade never reads what the old code compiled).
COMPILE_CODE = ("compiled.py", "hlo.py", "jax_models.py", "jax_optim.py")
# XLA's GPU target specs (xla/backends/gpu/target_config/specs/) per catalog GPU type.
# a40 is a GA102 like the RTX A6000, the closest spec XLA ships.
GPU_TARGET_SPECS = {"a100": "a100_sxm_40.txtpb", "v100": "v100.txtpb", "h100": "h100_sxm.txtpb",
                    "h200": "h200.txtpb", "a40": "a6000.txtpb"}
# Only the SPMD partitioner's output matters here, not the CPU machine code: cheaper LLVM
# settings cut compile time without changing the HLO or its cost analysis.
FAST_CPU_FLAGS = ("--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true")


@dataclass(frozen=True)
class StageRequest:
    """What to compile: a stage of a model under a (dp, tp) plan.

    Attributes:
        model: the model's name (for the cache key and logs).
        arch: its ``jax_models.Arch``.
        layer_start, layer_end: the stage's layers [start, end).
        dp, tp: data- and tensor-parallel degrees (dp × tp devices).
        micro_batch: samples in one micro-batch of the stage (all dp replicas together).
        remat: layer-level rematerialization.
        target: ``cpu`` or a GPU type of ``GPU_TARGET_SPECS`` (CPU costs plus GPU memory).
    """

    model: str
    arch: object
    layer_start: int
    layer_end: int
    dp: int
    tp: int
    micro_batch: int
    remat: bool = True
    target: str = "cpu"

    def __post_init__(self):
        for name in ("dp", "tp", "micro_batch"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise SpecError(name, v, "give a positive integer")
        if self.micro_batch % self.dp:
            raise SpecError("micro_batch", self.micro_batch, f"must be a multiple of dp={self.dp}")
        if self.target != "cpu" and self.target not in GPU_TARGET_SPECS:
            raise SpecError("target", self.target, f"use cpu or one of {', '.join(GPU_TARGET_SPECS)}")

    @property
    def num_devices(self) -> int:
        return self.dp * self.tp


@dataclass(frozen=True)
class CollectiveTotal:
    """Collectives of one kind over one mesh axis: how many and their summed bytes."""

    kind: str
    axis: str  # dp | tp | all | other
    count: int
    bytes: int


@dataclass(frozen=True)
class CompiledStage:
    """Per-device costs of one micro-batch's training step of a stage.

    ``flops_per_device`` and ``bytes_accessed_per_device`` cover forward, backward (with
    recompute under remat) and one optimizer update. Collectives over ``tp`` repeat every
    micro-batch; those over ``dp`` are the gradient synchronisation, once per iteration.
    ``memory_bytes`` is the GPU-target peak per device, None without the GPU-target extra.
    """

    request_key: str
    flops_per_device: float
    bytes_accessed_per_device: float
    transcendentals_per_device: float
    collectives: tuple[CollectiveTotal, ...]
    memory_bytes: float | None
    target: str
    compile_s: float
    jax_version: str

    def collective_bytes(self, axis: str | None = None) -> dict[str, int]:
        """Summed bytes per collective kind, optionally only over one mesh axis."""
        out: dict[str, int] = {}
        for c in self.collectives:
            if axis is None or c.axis == axis:
                out[c.kind] = out.get(c.kind, 0) + c.bytes
        return out

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        d["collectives"] = [dataclasses.asdict(c) for c in self.collectives]
        return d

    @staticmethod
    def from_json(d: dict) -> "CompiledStage":
        d = dict(d)
        d["collectives"] = tuple(CollectiveTotal(**c) for c in d["collectives"])
        return CompiledStage(**d)


def code_digest(source_dir: Path = Path(__file__).resolve().parent) -> str:
    """A hash of the code that decides what a compile measures (``COMPILE_CODE``)."""
    digest = hashlib.sha256()
    for name in COMPILE_CODE:
        digest.update((source_dir / name).read_bytes())
    return digest.hexdigest()[:16]


def cache_key(request: StageRequest, jax_version: str, code: str | None = None) -> str:
    """A hash of everything that changes a compile's result (``code``: ``code_digest()``)."""
    payload = {
        "format": CACHE_FORMAT, "code": code or code_digest(), "model": request.model,
        "arch": dataclasses.asdict(request.arch),
        "layers": [request.layer_start, request.layer_end], "dp": request.dp, "tp": request.tp,
        "micro_batch": request.micro_batch, "dtype": request.arch.compute_dtype,
        "remat": request.remat, "target": request.target, "jax": jax_version,
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:32]


def installed_jax_version() -> str:
    """JAX's version without importing it (the cache is checked before any compile)."""
    from importlib.metadata import version
    return version("jax")


def gpu_target_available() -> bool:
    """Whether the CUDA plugin that compiles for GPU targets without a GPU is installed."""
    return importlib.util.find_spec("jax_plugins") is not None and any(
        importlib.util.find_spec(f"jax_plugins.{m}") is not None for m in ("xla_cuda12", "xla_cuda13"))


# --------------------------------------------------------------------------- cache


def _cache_path(cache_dir: Path, key: str) -> Path:
    return Path(cache_dir) / "compiled" / f"{key}.json"


def _cache_read(cache_dir: Path | None, key: str) -> CompiledStage | None:
    if cache_dir is None:
        return None
    path = _cache_path(cache_dir, key)
    try:
        return CompiledStage.from_json(json.loads(path.read_text()))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, TypeError, KeyError) as e:
        log.warning("ignoring unreadable cache entry %s: %s", path, e)
        return None


def _cache_write(cache_dir: Path | None, stage: CompiledStage) -> None:
    if cache_dir is None:
        return
    path = _cache_path(cache_dir, stage.request_key)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(stage.to_json(), sort_keys=True))
    tmp.replace(path)  # atomic: concurrent tuners never read half a file


# --------------------------------------------------------------------------- compiling


def compile_stages(requests: list[StageRequest], cache_dir: Path | None = DEFAULT_CACHE_DIR,
                   gpu_specs_dir: Path | None = None) -> list[CompiledStage]:
    """Compile each request (or read it from the cache), in order.

    Args:
        requests: the stage variants to compile.
        cache_dir: where results are kept as JSON; None disables the cache.
        gpu_specs_dir: a directory with XLA GPU target specs (``GPU_TARGET_SPECS`` names);
            needed for GPU targets, which are otherwise compiled for the CPU only.
    """
    version, code = installed_jax_version(), code_digest()
    keys = [cache_key(r, version, code) for r in requests]
    results: list[CompiledStage | None] = [_cache_read(cache_dir, k) for k in keys]
    todo = [i for i, r in enumerate(results) if r is None]
    if todo:
        need = max(requests[i].num_devices for i in todo)
        spec_dir = str(gpu_specs_dir) if gpu_specs_dir else None
        jobs = [(requests[i], keys[i], spec_dir) for i in todo]
        if _devices_here() >= need:
            _prepare_gpu_targets(jobs)  # only works if the CPU backend is not up yet
            fresh = [_compile_one(*job) for job in jobs]
        else:
            fresh = _compile_in_child(jobs, need)
        for i, d in zip(todo, fresh):
            results[i] = CompiledStage.from_json(d)
            # A GPU target that gave no memory (no plugin, no spec file) is tried again next
            # time, not remembered under the key a working set-up would use.
            if results[i].target == "cpu" or results[i].memory_bytes is not None:
                _cache_write(cache_dir, results[i])
    return [r for r in results if r is not None]


def _devices_here() -> int:
    """CPU devices this process can compile for without touching XLA's flags."""
    if "jax" not in sys.modules:
        return 0  # importing JAX here would fix its device count for the whole process
    import jax
    try:
        from jax._src import xla_bridge
        if not xla_bridge.backends_are_initialized():
            return 0  # initialising now would fix the count before a caller sets its flags
        return len(jax.devices("cpu"))
    except (ImportError, AttributeError, RuntimeError):
        return 0


def child_xla_flags(num_devices: int, base: str = "") -> str:
    """XLA_FLAGS for a compile worker: enough host devices and fast CPU codegen."""
    kept = [f for f in base.split() if not f.startswith("--xla_force_host_platform_device_count")]
    return " ".join(kept + [f"--xla_force_host_platform_device_count={num_devices}", *FAST_CPU_FLAGS])


def _worker_init(xla_flags: str) -> None:
    os.environ["XLA_FLAGS"] = xla_flags
    os.environ.setdefault("JAX_PLATFORMS", "cpu")


def _compile_many(jobs: list) -> list[dict]:
    _prepare_gpu_targets(jobs)
    return [_compile_one(*job) for job in jobs]


def _compile_in_child(jobs: list, num_devices: int) -> list[dict]:
    flags = child_xla_flags(num_devices, os.environ.get("XLA_FLAGS", ""))
    log.info("compiling %d stage variant(s) in a worker with %d CPU devices", len(jobs), num_devices)
    # An executor, not a Pool: a worker killed (out of memory, an XLA check) raises
    # BrokenProcessPool here, where a Pool's apply waits for ever.
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"), initializer=_worker_init,
                             initargs=(flags,)) as pool:
        return pool.submit(_compile_many, jobs).result()


def stage_mesh(devices, dp: int, tp: int):
    """A (dp, tp) mesh over the first dp × tp devices, tp varying fastest (within a node)."""
    import numpy as np
    from jax.sharding import Mesh
    if len(devices) < dp * tp:
        raise SpecError("devices", len(devices), f"dp×tp = {dp * tp} devices needed")
    return Mesh(np.array(devices[:dp * tp]).reshape(dp, tp), ("dp", "tp"))


def stage_specs(stage, optimizer, runs=None) -> dict:
    """PartitionSpec trees of a stage's params, optimizer state, model state and inputs.

    Per layer by default; per run (stacked repeated layers) with ``runs``.
    """
    from jax.sharding import PartitionSpec as P
    from estimator import jax_models as jm
    arch = stage.arch
    if runs is None:
        p_specs = [jm.layer_param_specs(arch, i) for i in stage.layers]
        p_shapes = jm.stage_param_shapes(stage)
        s_specs = [jm.layer_state_specs(arch, i) for i in stage.layers]
    else:
        p_specs = [jm.run_param_specs(arch, r) for r in runs]
        p_shapes = [jm.run_param_shapes(arch, r) for r in runs]
        s_specs = [jm.run_state_specs(arch, r) for r in runs]
    return {"params": p_specs, "opt": optimizer.specs(p_specs, p_shapes), "state": s_specs,
            "x": P("dp"), "target": P("dp")}


def build_stage_step(stage, mesh, donate: bool = True, scan: bool = True):
    """The jitted, sharded one-micro-batch training step of a stage and its abstract args.

    With ``scan`` repeated layers run under ``lax.scan`` (see ``jax_models.layer_runs``).
    Returns (jitted step, abstract args, runs).
    """
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P
    from estimator import jax_models as jm

    def named(tree):
        return jax.tree.map(lambda sp: NamedSharding(mesh, sp), tree,
                            is_leaf=lambda x: isinstance(x, P))

    arch, mb = stage.arch, stage.micro_batch
    runs = jm.layer_runs(arch, stage.layers) if scan else tuple((i, 1, 1) for i in stage.layers)
    from estimator.jax_optim import optimizer_for
    opt = optimizer_for(arch.optimizer)
    specs = stage_specs(stage, opt, runs)
    shard = {k: named(v) for k, v in specs.items()}
    batch = NamedSharding(mesh, P("dp"))
    ctx = jm.ShardCtx(act=lambda x: jax.lax.with_sharding_constraint(x, batch), dp_shards=mesh.shape["dp"])
    step = jm.stage_train_step(stage, opt, ctx, runs=runs)
    p_shapes = [jm.run_param_shapes(arch, r) for r in runs]
    o_shapes = jax.eval_shape(opt.init, p_shapes)
    s_shapes = [jm.run_state_shapes(arch, r) for r in runs]

    def abstract(shapes, shardings):
        return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                            shapes, shardings)

    x_shape, x_dtype = jm.activation_shape(arch, stage.layer_start, mb)
    if stage.is_last:
        t_shape, t_dtype = jm.label_shape(arch, mb), jnp.int32
    else:
        t_shape, t_dtype = jm.activation_shape(arch, stage.layer_end, mb)
    args = (abstract(p_shapes, shard["params"]), abstract(o_shapes, shard["opt"]),
            abstract(s_shapes, shard["state"]),
            jax.ShapeDtypeStruct(x_shape, x_dtype, sharding=batch),
            jax.ShapeDtypeStruct(t_shape, t_dtype, sharding=batch))
    replicated = NamedSharding(mesh, P())
    out = (shard["params"], shard["opt"], shard["state"],
           replicated if stage.is_last else None, None if stage.is_first else batch)
    jitted = jax.jit(step, out_shardings=out, donate_argnums=(0, 1, 2) if donate else ())
    return jitted, args, runs


# Forward + backward costs of one repeated unit, per (arch, unit, micro-batch, plan, remat):
# shared by every stage that repeats it, so each is compiled once per process.
_UNIT_COSTS: dict[tuple, tuple[float, float, float]] = {}


def _unit_costs(stage, run, mesh, dp: int, tp: int) -> tuple[float, float, float]:
    """(flops, bytes accessed, transcendentals) per device of one unit's forward+backward."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P
    from estimator import jax_models as jm
    arch, (first, period, _) = stage.arch, run
    key = (arch, tuple(jm.layer_signature(arch, first + j) for j in range(period)),
           stage.micro_batch, dp, tp, stage.remat)
    if key in _UNIT_COSTS:
        return _UNIT_COSTS[key]
    batch = NamedSharding(mesh, P("dp"))
    ctx = jm.ShardCtx(act=lambda x: jax.lax.with_sharding_constraint(x, batch), dp_shards=mesh.shape["dp"])

    def named(tree):
        return jax.tree.map(lambda sp: NamedSharding(mesh, sp), tree,
                            is_leaf=lambda x: isinstance(x, P))

    # The unit runs as a two-trip scan, as in the stage: under remat its backward then
    # recomputes its forward as in a real pipeline (a lone checkpointed layer whose
    # backward directly follows its forward would have the recompute folded away).
    two = (first, period, 2)
    p_sh, s_sh = named(jm.run_param_specs(arch, two)), named(jm.run_state_specs(arch, two))

    def abstract(shapes, shardings):
        return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                            shapes, shardings)

    x_shape, x_dtype = jm.activation_shape(arch, first, stage.micro_batch)
    unit = jm.Stage(arch, first, first + 2 * period, stage.micro_batch, stage.remat)

    def fwd_bwd(p, s, x, t):
        _, g, gx, _ = jm.stage_grad(unit, [p], [s], x, t, ctx, runs=(two,))
        return g, gx

    compiled = jax.jit(fwd_bwd, out_shardings=([p_sh], batch)).lower(
        abstract(jm.run_param_shapes(arch, two), p_sh), abstract(jm.run_state_shapes(arch, two), s_sh),
        jax.ShapeDtypeStruct(x_shape, x_dtype, sharding=batch),
        jax.ShapeDtypeStruct(x_shape, x_dtype, sharding=batch)).compile()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    # A loop body is counted once; if XLA unrolled the two trips, halve.
    per = 1.0 if " while(" in compiled.as_text() else 0.5
    cost = {k: per * float(v) for k, v in cost.items() if isinstance(v, (int, float))}
    _UNIT_COSTS[key] = (float(cost.get("flops", 0.0)), float(cost.get("bytes accessed", 0.0)),
                        float(cost.get("transcendentals", 0.0)))
    return _UNIT_COSTS[key]


# Compile-only GPU devices per GPU type, created before the CPU backend starts (after
# that the CUDA plugin no longer offers its topology); later requests take a prefix.
_GPU_TOPOLOGIES: dict[str, list] = {}


def _prepare_gpu_targets(jobs: list) -> None:
    """Create each GPU target's topology once, sized for the largest request."""
    sizes: dict[str, int] = {}
    spec_dirs: dict[str, str] = {}
    for request, _, spec_dir in jobs:
        if request.target != "cpu" and spec_dir:
            sizes[request.target] = max(sizes.get(request.target, 0), request.num_devices)
            spec_dirs[request.target] = spec_dir
    if not sizes or not gpu_target_available():
        return
    import jax
    from jax.experimental import topologies
    # The devices are compile-only: CPU is the only platform to run on, which also keeps
    # the CUDA plugin from demanding a CUDA runtime this machine may not have.
    jax.config.update("jax_platforms", "cpu")
    for gpu, n in sizes.items():
        if len(_GPU_TOPOLOGIES.get(gpu, ())) >= n:
            continue
        path = Path(spec_dirs[gpu]) / GPU_TARGET_SPECS[gpu]
        if not path.is_file():
            log.warning("no GPU target spec %s; skipping GPU-target memory", path)
            continue
        try:
            topo = topologies.get_topology_desc(platform="cuda", target_config=path.read_text(),
                                                topology=f"1x1x{n}")
        except (NotImplementedError, RuntimeError) as e:
            log.warning("GPU target %s unavailable (%s); skipping GPU-target memory", gpu, e)
            continue
        _GPU_TOPOLOGIES[gpu] = list(topo.devices)


def _gpu_target_devices(gpu: str, n: int):
    devices = _GPU_TOPOLOGIES.get(gpu, [])
    return devices[:n] if len(devices) >= n else None


def _compile_one(request: StageRequest, key: str, spec_dir: str | None) -> dict:
    """Compile one request in this process (its JAX must have the devices)."""
    import jax
    from estimator import hlo
    from estimator import jax_models as jm
    stage = jm.Stage(request.arch, request.layer_start, request.layer_end, request.micro_batch,
                     request.remat)
    # GPU-target devices first: once the CPU backend is up, the CUDA plugin's
    # compile-only topology is no longer offered.
    gpu_devices = None
    if request.target != "cpu":
        gpu_devices = _gpu_target_devices(request.target, request.num_devices)
    t0 = time.perf_counter()
    mesh = stage_mesh(jax.devices("cpu"), request.dp, request.tp)
    jitted, args, runs = build_stage_step(stage, mesh)
    compiled = jitted.lower(*args).compile()
    compile_s = time.perf_counter() - t0
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    flops, nbytes, trans = (float(cost.get(k, 0.0)) for k in ("flops", "bytes accessed", "transcendentals"))
    # XLA counts a scan body once: add the unit's other (repeats − 1) executions.
    for run in runs:
        if run[2] > 1:
            uf, ub, ut = _unit_costs(stage, run, mesh, request.dp, request.tp)
            flops += (run[2] - 1) * uf
            nbytes += (run[2] - 1) * ub
            trans += (run[2] - 1) * ut
    colls = hlo.parse_collectives(compiled.as_text(), request.num_devices)
    totals: dict[tuple[str, str], list[int]] = {}
    for c in colls:
        axis = hlo.classify_axis(c.groups, request.dp, request.tp)
        t = totals.setdefault((c.kind, axis), [0, 0])
        t[0] += c.repeats
        t[1] += c.bytes * c.repeats
    memory = None
    if gpu_devices is not None:
        g_jitted, g_args, _ = build_stage_step(stage, stage_mesh(gpu_devices, request.dp, request.tp))
        mem = g_jitted.lower(*g_args).compile().memory_analysis()
        memory = float(getattr(mem, "peak_memory_in_bytes", 0) or (
            mem.argument_size_in_bytes + mem.output_size_in_bytes
            + mem.temp_size_in_bytes - mem.alias_size_in_bytes))
    return CompiledStage(
        request_key=key, flops_per_device=flops, bytes_accessed_per_device=nbytes,
        transcendentals_per_device=trans,
        collectives=tuple(CollectiveTotal(k, a, n, b) for (k, a), (n, b) in sorted(totals.items())),
        memory_bytes=memory, target=request.target, compile_s=round(compile_s, 3),
        jax_version=jax.__version__).to_json()


def compiled_stage_costs(model: str, layer_start: int, layer_end: int, dp: int, tp: int,
                         micro_batch: int, remat: bool = True, gpu_type: str | None = None,
                         cache_dir: Path | None = DEFAULT_CACHE_DIR,
                         gpu_specs_dir: Path | None = None) -> CompiledStage:
    """Compiled costs of one stage variant of a model (built-in name or YAML path).

    ``micro_batch`` counts the samples of one micro-batch across the stage's dp replicas.
    ``gpu_type`` adds the GPU-target memory when the extra and specs are available.
    """
    from estimator.jax_models import arch_from_model
    from estimator.models import load_model
    spec = load_model(model)
    target = gpu_type if gpu_type in GPU_TARGET_SPECS and gpu_specs_dir else "cpu"
    request = StageRequest(spec.name, arch_from_model(spec), layer_start, layer_end, dp, tp,
                           micro_batch, remat, target)
    return compile_stages([request], cache_dir, gpu_specs_dir)[0]


def flops_ratio(compiled: CompiledStage, analytic_flops_per_device: float) -> float:
    """Compiled / analytic per-device FLOPs (1.0 is perfect agreement)."""
    return compiled.flops_per_device / analytic_flops_per_device if analytic_flops_per_device else math.inf


