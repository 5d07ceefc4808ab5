"""The profiling job: measure a partition's collectives and compute into a profile store.

Started by `slurm-ext profile` as one process per node (``srun --ntasks-per-node=1``), or
by hand as one process outside Slurm::

    python -m job_scripts.profile --profile-db profiles.sqlite --gpu-type h100 --model gpt-1.3b

mpi4py gives the processes their ranks, the barriers between measurements, the
broadcast of the jax.distributed coordinator and the gather of every process's devices
and versions to rank 0; the devices themselves are measured through JAX (NCCL on GPUs,
gloo between CPU processes). Rank 0 fits the GPU type's efficiency parameters and writes
everything into the store (``estimator.profile_store``), printing ``profile:`` progress
lines as it goes. One process needs no MPI: without mpi4py it runs alone.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import platform as _platform
import sys
import time
from dataclasses import dataclass, replace

from estimator.errors import SpecError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Settings:
    """How much to measure (defaults per platform: CPU stand-ins get a token amount)."""

    collective_bytes: tuple[int, ...]
    matmul_sizes: tuple[int, ...]
    copy_bytes: tuple[int, ...]
    samples: tuple[int, ...]
    repeats: int
    compute_dtype: str


# Layer shares at 1, 4 and 16 samples per device: each count is two programs to compile and
# autotune, and interpolating 2 and 8 from these moves the whole-model forward+backward by a
# median of 3.3 % (`benchmarks/profile_samples.py`); `--samples 1 2 4 8 16` measures them.
GPU_SETTINGS = Settings(tuple(1 << k for k in range(12, 29, 2)), (256, 512, 1024, 2048, 4096, 8192),
                        tuple(1 << k for k in range(22, 31, 2)), (1, 4, 16), 5, "bf16")
CPU_SETTINGS = Settings(tuple(1 << k for k in range(12, 21, 4)), (128, 256, 512),
                        (1 << 20, 1 << 22, 1 << 24), (1,), 1, "bf16")


class World:
    """mpi4py's COMM_WORLD, or this process alone when there is one process and no mpi4py."""

    def __init__(self, env):
        try:
            from mpi4py import MPI
        except (ImportError, RuntimeError, OSError):  # no mpi4py, or no MPI library behind it
            if int(env.get("SLURM_NTASKS", "1") or 1) > 1:
                raise SpecError("mpi4py", None, "not importable, and this step has several tasks: "
                                                "install the extra `mpi` (pip install 'slurm-ext[mpi]')") from None
            self.comm, self.mpi_version = None, "none (one process)"
            self.rank, self.size = 0, 1
            return
        self.comm = MPI.COMM_WORLD
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()
        self.mpi_version = MPI.Get_library_version().replace("\x00", "").strip().splitlines()[0]
        self._max = MPI.MAX
        tasks = int(env.get("SLURM_NTASKS", "0") or 0) if env.get("SLURM_STEP_ID") else 0
        if tasks and tasks != self.size:
            # srun without the MPI's plugin starts every task as rank 0 of 1.
            raise SpecError("mpi", f"{self.size} rank(s) in a step of {tasks} tasks",
                            "launch with srun's --mpi plugin of this MPI (pmi2 for MPICH)")

    def barrier(self) -> None:
        if self.comm is not None:
            self.comm.Barrier()

    def bcast(self, value):
        return value if self.comm is None else self.comm.bcast(value, root=0)

    def gather(self, value) -> list | None:
        return [value] if self.comm is None else self.comm.gather(value, root=0)

    def max(self, value: float) -> float:
        return value if self.comm is None else self.comm.allreduce(value, op=self._max)


def _progress(world: World, text: str) -> None:
    if world.rank == 0:
        print(f"profile: {text}", flush=True)


NVIDIA_DEVICE = "/dev/nvidiactl"


def _configure(world: World, env, devices_per_node: int | None) -> str:
    """Platform, CPU device count and jax.distributed, before any computation."""
    import jax

    from job_scripts.runtime import gpu_available, host_resolves
    from job_scripts.slurm_env import allocation_from_env, coordinator_address
    alloc = allocation_from_env(env)
    platform = "gpu" if gpu_available() else "cpu"
    if platform == "cpu" and os.path.exists(NVIDIA_DEVICE):
        # A CPU profile would be stored as the GPU type's, 10^4 times too slow.
        raise SpecError("platform", "cpu", "this node has NVIDIA GPUs but JAX here has no CUDA plugin: install "
                                           "jax[cuda12] into the Python that runs the profile (SLURM_EXT_PYTHON)")
    if platform == "cpu":
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", devices_per_node or alloc.gpus_per_node or 1)
        if world.size > 1:
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if world.size > 1:
        address = None
        if world.rank == 0:
            address = coordinator_address(alloc, env.get("SLURM_EXT_COORDINATOR"),
                                          host_resolves(alloc.node_names[0] if alloc.node_names else ""))
        address = world.bcast(address)
        jax.distributed.initialize(address, world.size, world.rank)
    return platform


def _collectives(world: World, settings: Settings, gpus_per_node: int):
    """Every op over every power-of-two group within a node (rank 0's devices) and, with
    several processes, across nodes (the same number of devices from each)."""
    import jax

    from estimator.profile_store import CollectiveRow
    from job_scripts import profile_measure as pm
    local = jax.local_devices()
    by_process: dict[int, list] = {}
    for d in jax.devices():
        by_process.setdefault(d.process_index, []).append(d)
    layouts = []  # (devices, node count, replica group as global indices)
    g = 2
    while g <= len(local):
        layouts.append((by_process[0][:g], 1, list(range(g))))
        g *= 2
    n = world.size
    per = 1
    while n > 1 and per <= min(len(v) for v in by_process.values()):
        devs = [d for p in sorted(by_process) for d in by_process[p][:per]]
        layouts.append((devs, n, [p * gpus_per_node + i for p in sorted(by_process) for i in range(per)]))
        per *= 2
    rows = []
    total = sum(len(settings.collective_bytes) * sum(1 for op in pm.COLLECTIVE_OPS
                                                     if op != "send" or len(dv) == 2)
                for dv, _, _ in layouts)
    done, last = 0, time.monotonic()
    for devices, nodes, group in layouts:
        mine = any(d.process_index == jax.process_index() for d in devices)
        for op in pm.COLLECTIVE_OPS:
            if op == "send" and len(devices) != 2:
                continue
            for nbytes in settings.collective_bytes:
                seconds = 0.0
                if mine:
                    fn, args = pm.collective_program(op, devices, nbytes)
                    seconds = pm.time_call(fn, args, settings.repeats).median_s
                seconds = world.max(seconds) if nodes > 1 else seconds
                rows.append(CollectiveRow(op, len(devices), nodes, gpus_per_node, json.dumps([group]),
                                          nbytes, seconds))
                done += 1
                if time.monotonic() - last > 5 or done == total:
                    _progress(world, f"collectives {done}/{total} ({op}, {len(devices)} devices on "
                                     f"{nodes} node{'s' if nodes > 1 else ''})")
                    last = time.monotonic()
            world.barrier()
    return tuple(r for r in rows if r.seconds > 0 or r.num_nodes > 1)


def _kernels(world: World, settings: Settings, workers: int):
    import jax

    from estimator.profile_store import KernelRow
    from job_scripts import profile_measure as pm
    start = time.monotonic()
    kernels = pm.calibration_kernels(jax.local_devices()[0], settings.compute_dtype, settings.matmul_sizes,
                                     settings.copy_bytes)
    compiled = pm.compile_all([(k.fn, k.args) for k in kernels], workers)
    rows = []
    for k, (fn, _) in zip(kernels, compiled):
        t = pm.time_call(fn, k.args, settings.repeats, min_total_s=0.05)
        rows.append(KernelRow(k.kernel, k.dtype, k.shape, k.flops, k.bytes, t.median_s))
    _progress(world, f"calibration kernels {len(rows)} in {time.monotonic() - start:.0f} s")
    return tuple(rows)


def _layers(world: World, settings: Settings, model_name: str, max_tp: int, workers: int,
            deadline: float | None = None) -> tuple[tuple, int]:
    """One device's share of each distinct layer of a model, per tp and sample count, and
    how many shares were left untimed because ``deadline`` (``time.monotonic()``) passed.

    The tp degrees go outermost and the budget is checked before each, so a cut profile
    keeps whole degrees (tp 1 first): a stage at a degree it covers is profiled
    throughout, the rest falls back to the roofline. All programs of one degree (every
    layer kind at every sample count) are compiled together on ``workers`` threads.
    """
    import jax

    from estimator.jax_models import arch_from_model
    from estimator.models import load_model
    from estimator.profile_store import LayerRow, model_fingerprint
    from job_scripts import profile_measure as pm
    spec = load_model(model_name)
    arch = arch_from_model(spec)
    fp = model_fingerprint(spec)
    device = jax.local_devices()[0]
    groups = pm.distinct_layers(arch)
    tps = [t for t in (1, 2, 4, 8, 16, 32, 64) if t <= max_tp]
    rows, skipped, start = [], 0, time.monotonic()
    for tp in tps:
        if deadline is not None and time.monotonic() >= deadline:
            skipped += len(groups) * len(settings.samples)
            continue
        shares = []  # (signature, layer indices, inputs per sample count, lowered programs)
        for sig, indices in groups.items():
            try:
                share = pm.layer_share(arch, indices[0], tp, device)
                if share is None:
                    continue
                inputs = [share.inputs(s) for s in settings.samples]
                # forward and forward+backward at each sample count, traced here so that a
                # layer that does not trace is left out alone
                shares.append((sig, indices, inputs, [program.lower(*args) for args in inputs
                                                      for program in (share.forward, share.backward)]))
            except (SpecError, ValueError, TypeError) as e:
                log.info("layer %d tp %d not profiled: %s", indices[0], tp, e)
        compiled = iter(pm.compile_lowered([lo for *_, lowered in shares for lo in lowered], workers))
        for sig, indices, inputs, _ in shares:
            for samples, args in zip(settings.samples, inputs):
                (forward, _), (backward, temp_bytes) = next(compiled), next(compiled)
                f = pm.time_call(forward, args, settings.repeats).median_s
                fb = pm.time_call(backward, args, settings.repeats).median_s
                rows.extend(LayerRow(spec.name, fp, i, sig[0], tp, samples, f, fb, temp_bytes) for i in indices)
        del shares, compiled  # free the degree's device buffers before the next
        _progress(world, f"{model_name}: tp {tp} of {len(groups)} layer kind{'s' if len(groups) > 1 else ''} "
                         f"after {time.monotonic() - start:.0f} s"
                         + (f", {skipped} share(s) left untimed: time budget spent" if skipped else ""))
    return tuple(rows), skipped


def run(args: argparse.Namespace, env) -> dict:
    world = World(env)
    platform = _configure(world, env, args.devices_per_node)
    import jax

    from estimator.gpus import gpu_type
    from estimator.models import load_model
    from estimator.profile_fit import fingerprints, fit_efficiency
    from estimator.profile_store import Profile, ProfileInfo, write_profile
    from job_scripts.slurm_env import allocation_from_env
    alloc = allocation_from_env(env)
    gpu = gpu_type(args.gpu_type)
    settings = GPU_SETTINGS if platform == "gpu" else CPU_SETTINGS
    if not gpu.bf16_tensor_cores:  # calibrate the tensor cores in the dtype they take (Volta: fp16)
        settings = replace(settings, compute_dtype="fp16")
    if args.samples:
        if min(args.samples) < 1:
            raise SpecError("samples", min(args.samples), "give counts of 1 or more samples per device")
        settings = Settings(settings.collective_bytes, settings.matmul_sizes, settings.copy_bytes,
                            tuple(sorted(set(args.samples))), settings.repeats, settings.compute_dtype)
    gpus_per_node = jax.local_device_count()
    facts = world.gather({"host": _platform.node(), "devices": jax.local_device_count(),
                          "kind": jax.local_devices()[0].device_kind})
    _progress(world, f"{world.size} process(es), {jax.device_count()} {platform} devices "
                     f"({jax.local_devices()[0].device_kind}), MPI: {world.mpi_version}")
    started = time.monotonic()
    collectives = () if args.skip_collectives else _collectives(world, settings, gpus_per_node)
    world.barrier()
    parts_s = {"collectives": round(time.monotonic() - started, 1)}
    kernels, layers, untimed = (), (), 0
    deadline = None if args.budget_s is None else started + args.budget_s
    if world.rank == 0:
        t0 = time.monotonic()
        kernels = _kernels(world, settings, args.compile_workers)
        parts_s["kernels"] = round(time.monotonic() - t0, 1)
        max_tp = args.max_tp or jax.device_count()
        for m in args.model:
            t0 = time.monotonic()
            model_layers, skipped = _layers(world, settings, m, max_tp, args.compile_workers, deadline)
            layers, untimed = layers + model_layers, untimed + skipped
            parts_s[f"model {m}"] = round(time.monotonic() - t0, 1)
    world.barrier()
    if world.rank != 0:
        return {}
    if len({f["devices"] for f in facts}) > 1 or len({f["kind"] for f in facts}) > 1:
        log.warning("nodes differ: %s", facts)
    eff, err = fit_efficiency(gpu, settings.compute_dtype, kernels, layers,
                              fingerprints(load_model(m) for m in args.model))
    versions = {"jax": jax.__version__, "python": sys.version.split()[0], "mpi": world.mpi_version,
                "slurm": args.slurm_version or env.get("SLURM_EXT_SLURM_VERSION") or None}
    try:
        import jaxlib
        versions["jaxlib"] = jaxlib.__version__
    except (ImportError, AttributeError):
        pass
    info = ProfileInfo(gpu.name, world.size, gpus_per_node, platform,
                       datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                       alloc.job_id, args.partition or alloc.partition,
                       alloc.node_names or tuple(f["host"] for f in facts),
                       jax.local_devices()[0].device_kind, versions)
    profile_id = write_profile(args.profile_db, Profile(info, collectives, kernels, layers, eff, err))
    summary = {"profile_id": profile_id, "profile_db": str(args.profile_db), "gpu_type": gpu.name,
               "platform": platform, "nodes": world.size, "gpus_per_node": gpus_per_node,
               "collectives": len(collectives), "kernels": len(kernels), "layers": len(layers),
               "layer_shares_untimed": untimed,
               "efficiency": eff.__dict__, "fit_median_rel_error": err,
               "seconds": round(time.monotonic() - started, 1), "seconds_by_part": parts_s}
    _progress(world, "done " + json.dumps(summary, sort_keys=True))
    return summary


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m job_scripts.profile", description=__doc__.split("\n\n")[0])
    p.add_argument("--profile-db", required=True, help="the SQLite profile store (created when missing)")
    p.add_argument("--gpu-type", required=True, help="catalog GPU type of these devices (h100, a100, ...)")
    p.add_argument("--partition", help="the partition profiled (recorded)")
    p.add_argument("--model", action="append", default=[], help="time one device's share of each layer "
                                                                "of this model (repeatable)")
    p.add_argument("--samples", type=int, nargs="+", help="samples per device to time each layer at "
                                                             "(default: 1 4 16 on GPUs, 1 on CPU stand-ins)")
    p.add_argument("--max-tp", type=int, help="largest tensor-parallel degree of a layer share "
                                              "(default: every device of the job)")
    p.add_argument("--devices-per-node", type=int, help="CPU stand-ins: devices per process")
    p.add_argument("--skip-collectives", action="store_true", help="measure compute only")
    p.add_argument("--budget-s", type=float, help="seconds from the first measurement after which no more "
                                                  "layer shares are timed; what was measured is still "
                                                  "fitted and written (default: no limit)")
    p.add_argument("--compile-workers", type=int, default=os.cpu_count() or 1,
                   help="threads compiling at once (default: this machine's CPUs; 1: one by one)")
    p.add_argument("--slurm-version", help="recorded with the profile")
    return p.parse_args(argv)


def unique_models(names: list[str]) -> list[str]:
    """``names`` without repeats of one model (the same name, or another file of the same
    architecture): each would be timed again for nothing."""
    from estimator.models import load_model
    from estimator.profile_store import model_fingerprint
    seen, out = set(), []
    for name in names:
        fp = model_fingerprint(load_model(name))
        if fp not in seen:
            seen.add(fp)
            out.append(name)
    return out


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO if os.environ.get("SLURM_EXT_DEBUG") else logging.WARNING,
                        stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = parse_args(argv)
    try:
        args.model = unique_models(args.model)
        run(args, dict(os.environ))
    except SpecError as e:
        print(f"profile: error: {e}", file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
