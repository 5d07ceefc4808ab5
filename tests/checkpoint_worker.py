"""A checkpoint test's worker process: train and save, or restore, under one plan.

``python tests/checkpoint_worker.py ROLE DIR PLAN STEPS [PROCESS COUNT PORT]``

- ``save``: train STEPS steps of the tiny GPT under PLAN (on this process's share of
  the devices when COUNT > 1, joined by jax.distributed on 127.0.0.1:PORT) and checkpoint
  the state after the last step in DIR/ckpt;
- ``reference``: the same in one process, writing the state to DIR/reference.npz;
- ``restore``: read the newest checkpoint of DIR/ckpt into PLAN, in one process, and
  write the restored state to DIR/restored.npz and the checkpoint's arrays read
  whole (by name, without any plan) to DIR/saved.npz;
- ``latest``: find the step to resume from in DIR (each process its own view), agreed
  with the other processes as the runner does; write it, or the refusal, to
  DIR.latest.json.

Each process fakes 4 / COUNT CPU devices.
"""

import os
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
TINY_GPT = ROOT / "tests" / "fixtures" / "runner" / "tiny-gpt.yaml"
GLOBAL_BATCH = 16


def main(role: str, directory: str, plan_text: str, steps: int, process: int = 0, count: int = 1,
         port: int = 0) -> None:
    import jax
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", 4 // count)
    if count > 1:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(f"127.0.0.1:{port}", count, process)

    if role == "latest":
        import json

        from job_scripts.checkpoint import CheckpointError, Checkpoints
        from job_scripts.runtime import max_over_processes
        try:
            saved = Checkpoints(directory).latest(max_over_processes)
            result = {"step": saved.step if saved else None}
        except CheckpointError as e:
            result = {"error": str(e)}
        Path(directory + ".latest.json").write_text(json.dumps(result))
        jax.distributed.shutdown()
        return

    from estimator import jax_models as jm
    from estimator.jax_optim import optimizer_for
    from estimator.models import load_model
    from estimator.plan_string import parse_plan
    from job_scripts import reshard
    from job_scripts.checkpoint import Checkpoints
    from job_scripts.data import stream_for
    from job_scripts.pipeline import Pipeline
    from job_scripts.plan import plan_from_string

    spec = load_model(str(TINY_GPT))
    arch = jm.arch_from_model(spec)
    n = parse_plan(plan_text).num_gpus
    plan = plan_from_string(plan_text, spec, arch, GLOBAL_BATCH, n)[0]
    pipe = Pipeline(arch, plan, jax.devices()[:n], GLOBAL_BATCH, optimizer_for(arch.optimizer))
    out = Path(directory)
    checkpoints = Checkpoints(out / "ckpt")
    if role in ("save", "reference"):
        state = pipe.init(0)
        stream = stream_for(arch, 0, GLOBAL_BATCH)
        for step in range(1, steps + 1):
            batch = stream.batch(step)
            state, _ = pipe.step(state, batch.inputs, batch.targets)
        if role == "reference":
            np.savez(out / "reference.npz", **pipe.host_arrays(state))
            return
        checkpoints.save(steps, reshard.saver(pipe)(state), {"layout": reshard.layout_json(pipe)})
        checkpoints.close()
        if count > 1:
            jax.distributed.shutdown()
        return
    saved = checkpoints.latest()
    reader = checkpoints.reader(saved.step)

    def read(kind, dtype, s, j, lo, hi):
        return reader.read((kind, dtype), (s, j, slice(lo, hi)))

    state = reshard.restore(pipe, saved.meta["layout"], read)
    np.savez(out / "restored.npz", **pipe.host_arrays(state))
    np.savez(out / "saved.npz", **reshard.logical_arrays(saved.meta["layout"], read))


if __name__ == "__main__":
    os.environ.pop("XLA_FLAGS", None)
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), *map(int, sys.argv[5:]))
