"""HLO collective parsing, the compile cache, and compiled costs of a stage."""

import json
from pathlib import Path
from dataclasses import replace

import pytest

from estimator.hlo import HloParseError, classify_axis, parse_collectives, parse_replica_groups

# Recorded from compiled.as_text() of sharded training steps (JAX 0.10.2, 4 CPU devices as
# a (dp=2, tp=2) mesh): a gpt-1.3b block and a tiny MoE stage. Metadata trimmed.
RECORDED = """\
  %param.1 = f16[4,1024,2048]{2,1,0} parameter(1), sharding={devices=[2,1,1,2]<=[4] last_tile_dim_replicate}
GPT
MOE
  ROOT %tuple = (f32[2]{0}) tuple(%x)
"""
RECORDED = RECORDED.replace("GPT", """%all-reduce.17 = (f32[2048]{0}, f32[2048]{0}, f32[2048]{0}, f32[2048]{0}) all-reduce(%ynn_fusion.8, %ynn_fusion.7, %ynn_fusion.6, %ynn_fusion.5), channel_id=8, replica_groups=mesh['axis_0'=2,'axis_1'=1,'axis_2'=1,'axis_3'=2] {'axis_0'}, use_global_device_ids=true, to_apply=%region_26.0.clone
%all-reduce.15 = f16[4,1024,2048]{2,1,0} all-reduce(%convert_bitcast_fusion), channel_id=16, replica_groups=[2,2]<=[4], use_global_device_ids=true, to_apply=%add.7.clone""").replace("MOE", """%all-reduce = f32[2,64,64]{2,1,0} all-reduce(%bitcast_select_fusion), channel_id=5, replica_groups=[2,2]<=[4], use_global_device_ids=true, to_apply=%add.1.clone
%all-reduce.2 = f32[2,64]{1,0} all-reduce(%bitcast_reduce_fusion), channel_id=7, replica_groups=mesh['axis_0'=2,'axis_1'=1,'axis_2'=2] {'axis_2'}, use_global_device_ids=true, to_apply=%region_8.9.clone
%all-gather = f32[2,64,2]{1,0,2} all-gather(%bitcast.23), channel_id=9, replica_groups=[2,2]<=[4], dimensions={2}, use_global_device_ids=true
%all-reduce.39 = (f32[64]{0}, f32[64]{0}, f32[64,64]{1,0}, f32[64,64]{1,0}, f32[64]{0}, /*index=5*/f32[3,2,16]{2,1,0}, f32[64]{0}, f32[64]{0}, f32[64]{0}, f32[64]{0}, /*index=10*/f32[2,64]{1,0}, f32[2,128,64]{2,1,0}, f32[64,2,16]{2,1,0}, f32[2,64,128]{2,1,0}, f32[3,2,16,64]{3,2,1,0}) all-reduce(%ynn_fusion.21, %ynn_fusion.20, %ynn_fusion.16, %wrapped_scatter.1, %ynn_fusion.13, /*index=5*/%ynn_fusion.12, %ynn_fusion.11, %ynn_fusion.10, %ynn_fusion.9, %ynn_fusion.8, /*index=10*/%ynn_fusion.7, %ynn_fusion.6, %bitcast.82, %ynn_fusion.3, %bitcast.85), channel_id=24, replica_groups=mesh['axis_0'=2,'axis_1'=1,'axis_2'=1,'axis_3'=2] {'axis_0'}, use_global_device_ids=true, to_apply=%region_41.42.clone
%all-reduce.40 = (f32[], f32[], f32[], f32[], f32[], /*index=5*/f32[], f32[]) all-reduce(%ynn_fusion.14, %multiply_reduce_fusion, %wrapped_reduce.2, %wrapped_reduce.3, %wrapped_reduce.4, /*index=5*/%wrapped_reduce.5, %wrapped_reduce.6), channel_id=32, replica_groups=mesh['axis_0'=2,'axis_1'=1,'axis_2'=2], device_ids=([2,2]T(1,0)) {'axis_0'}, use_global_device_ids=true, to_apply=%region_57.58.clone""")

# Not produced by the CPU compiles above; spelled as XLA prints them for GPU programs.
XLA_SYNTAX = """\
%reduce-scatter.1 = f32[128,64]{1,0} reduce-scatter(f32[512,64]{1,0} %p), channel_id=3, replica_groups={{0,1,2,3}}, dimensions={0}, to_apply=%add
%all-to-all.2 = bf16[8,256]{1,0} all-to-all(bf16[8,256]{1,0} %q), channel_id=4, replica_groups={{0,2},{1,3}}, dimensions={0}
%collective-permute.3 = f16[16,32]{1,0} collective-permute(f16[16,32]{1,0} %r), channel_id=5, source_target_pairs={{0,1},{1,2},{2,3}}
%all-gather-start = (f32[4,8]{1,0}, f32[16,8]{1,0}) all-gather-start(f32[4,8]{1,0} %s), channel_id=6, replica_groups=[1,4]<=[4], dimensions={0}, use_global_device_ids=true
%all-gather-done = f32[16,8]{1,0} all-gather-done((f32[4,8]{1,0}, f32[16,8]{1,0}) %all-gather-start)
%all-reduce-start = f32[1024]{0} all-reduce-start(f32[1024]{0} %t), channel_id=7, replica_groups={}, to_apply=%add
%all-reduce-done = f32[1024]{0} all-reduce-done(f32[1024]{0} %all-reduce-start)
"""


def test_recorded_collectives_bytes_groups_and_axes():
    colls = {c.name: c for c in parse_collectives(RECORDED, 4)}
    assert len(colls) == 7  # parameters and tuples are not collectives
    # A tuple all-reduce sums its members: four fp32 vectors of 2048.
    assert colls["all-reduce.17"].bytes == 4 * 2048 * 4
    assert classify_axis(colls["all-reduce.17"].groups, 2, 2) == "dp"
    # Megatron's per-layer activation all-reduce: fp16 [4,1024,2048] over tp.
    assert colls["all-reduce.15"].bytes == 4 * 1024 * 2048 * 2
    assert colls["all-reduce.15"].groups == ((0, 1), (2, 3))
    assert classify_axis(colls["all-reduce.15"].groups, 2, 2) == "tp"
    assert colls["all-reduce.2"].groups == ((0, 1), (2, 3))  # mesh form over the last axis
    assert colls["all-gather"].kind == "all-gather" and colls["all-gather"].bytes == 2 * 64 * 2 * 4
    # /*index=5*/ comments inside a tuple shape are skipped, every member counted.
    assert colls["all-reduce.39"].bytes > 64 * 64 * 4 * 2
    assert classify_axis(colls["all-reduce.39"].groups, 2, 2) == "dp"
    # Scalars count 4 bytes each; device_ids=([2,2]T(1,0)) permutes the mesh positions.
    assert colls["all-reduce.40"].bytes == 7 * 4
    assert colls["all-reduce.40"].groups == ((0, 1), (2, 3))


def test_xla_syntax_kinds_async_and_byte_conventions():
    colls = {c.name: c for c in parse_collectives(XLA_SYNTAX, 4)}
    assert set(colls) == {"reduce-scatter.1", "all-to-all.2", "collective-permute.3",
                          "all-gather-start", "all-reduce-start"}  # -done halves not counted twice
    assert colls["reduce-scatter.1"].bytes == 512 * 64 * 4  # the input: result × group size
    assert colls["all-to-all.2"].bytes == 8 * 256 * 2 and colls["all-to-all.2"].group_size == 2
    assert classify_axis(colls["all-to-all.2"].groups, 2, 2) == "dp"
    assert colls["collective-permute.3"].groups == ((0, 1), (1, 2), (2, 3))
    assert colls["all-gather-start"].bytes == 16 * 8 * 4  # the gathered result
    assert colls["all-reduce-start"].group_size == 4  # {} = every device


def test_replica_group_spellings_agree():
    explicit = parse_replica_groups("{{0,2},{1,3}}")
    assert parse_replica_groups("[2,2]<=[2,2]T(1,0)") == explicit
    assert parse_replica_groups("mesh['dp'=2,'tp'=2] {'dp'}") == explicit
    assert parse_replica_groups("mesh['dp'=2,'tp'=2] {'tp'}") == ((0, 1), (2, 3))
    assert parse_replica_groups("mesh['a'=2,'b'=2,'c'=2] {'a','c'}") == (
        (0, 1, 4, 5), (2, 3, 6, 7))


def test_malformed_collective_lines_raise_with_the_line():
    with pytest.raises(HloParseError, match="q7"):
        parse_collectives("%x = q7[4]{0} all-reduce(%y), replica_groups={{0,1}}")
    with pytest.raises(HloParseError, match="all devices"):
        parse_collectives("%x = f32[4]{0} all-reduce(%y), replica_groups={}")


# --------------------------------------------------------------------------- cache

def _request(**changes):
    from estimator.compiled import StageRequest
    from estimator.jax_models import Arch
    arch = Arch("gpt", hidden=64, num_blocks=2, heads=4, vocab=128, seq_len=32, compute_dtype="fp32")
    base = dict(model="tiny", arch=arch, layer_start=1, layer_end=3, dp=2, tp=2, micro_batch=4,
                remat=False, target="cpu")
    base.update(changes)
    return StageRequest(**base)


def test_cache_key_changes_with_every_input():
    from dataclasses import replace

    from estimator.compiled import cache_key
    base = _request()
    variants = [
        _request(model="other"), _request(layer_start=0), _request(layer_end=4),
        _request(dp=4, micro_batch=8), _request(dp=1), _request(tp=1), _request(micro_batch=8),
        _request(remat=True), _request(target="h100"),
        _request(arch=replace(base.arch, compute_dtype="bf16")),
        _request(arch=replace(base.arch, hidden=128)),
    ]
    keys = {cache_key(base, "0.10.2")} | {cache_key(v, "0.10.2") for v in variants}
    assert len(keys) == len(variants) + 1
    assert cache_key(base, "0.10.2") != cache_key(base, "0.10.3")
    assert cache_key(base, "0.10.2") == cache_key(_request(), "0.10.2")  # deterministic
    assert cache_key(base, "0.10.2", "code-a") != cache_key(base, "0.10.2", "code-b")


def test_another_version_of_the_compile_code_is_another_cache_entry(tmp_path):
    import shutil

    from estimator import compiled
    source = Path(compiled.__file__).parent
    for name in compiled.COMPILE_CODE:
        shutil.copy(source / name, tmp_path / name)
    assert compiled.code_digest(tmp_path) == compiled.code_digest()
    for name in compiled.COMPILE_CODE:  # a change to any one of them
        original = (tmp_path / name).read_text()
        (tmp_path / name).write_text(original + "\n# changed\n")
        assert compiled.code_digest(tmp_path) != compiled.code_digest()
        (tmp_path / name).write_text(original)


def test_cached_result_is_returned_without_compiling(tmp_path):
    from estimator.compiled import (CollectiveTotal, CompiledStage, cache_key, compile_stages,
                                    installed_jax_version)
    req = _request()
    key = cache_key(req, installed_jax_version())
    stored = CompiledStage(key, 1.5e9, 2.0e8, 1e6, (CollectiveTotal("all-reduce", "tp", 3, 4096),),
                           None, "cpu", 0.5, installed_jax_version())
    path = tmp_path / "compiled" / f"{key}.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(stored.to_json()))
    # The cached entry comes back as is (a real compile would give other numbers).
    assert compile_stages([req], tmp_path) == [stored]
    assert stored.collective_bytes("tp") == {"all-reduce": 4096}
    assert stored.collective_bytes("dp") == {}


def test_request_validation_quotes_bad_values():
    from estimator.errors import SpecError
    with pytest.raises(SpecError, match="micro_batch=3"):
        _request(micro_batch=3)  # not a multiple of dp=2
    with pytest.raises(SpecError, match="target='tpu'"):
        _request(target="tpu")


# --------------------------------------------------------------------------- compiling


SMALL_YAML = "hidden: 512\nlayers: 2\nheads: 8\nsequence: 128\nvocab: 512\ndtype: fp32\n"


def test_compiled_flops_match_analytic_and_collectives_follow_the_plan(tmp_path):
    from estimator.compiled import StageRequest, compile_stages
    from estimator.jax_models import arch_from_model
    from estimator.models import load_model
    model_path = tmp_path / "small.yaml"
    model_path.write_text(SMALL_YAML)
    spec = load_model(str(model_path))
    arch = arch_from_model(spec)
    reqs = [StageRequest("small", arch, 1, 3, dp, tp, 8, False) for dp, tp in ((1, 1), (2, 2), (4, 1))]
    # This process may already run JAX on one device: the compiles go to a spawn worker.
    one, hybrid, dp4 = compile_stages(reqs, tmp_path / "cache")
    fwd_per_sample = sum(layer.flops_fwd for layer in spec.layers[1:3])
    for c, dp, tp in ((one, 1, 1), (hybrid, 2, 2), (dp4, 4, 1)):
        analytic = 3 * fwd_per_sample * 8 / dp / tp  # forward + backward, no remat
        assert abs(c.flops_per_device / analytic - 1) < 0.05, (dp, tp, c.flops_per_device, analytic)
    assert one.collectives == ()
    # tp: per-layer activation all-reduces (fp32 [micro/dp, s, h]); dp: the gradient sync.
    tp_bytes = hybrid.collective_bytes("tp")["all-reduce"]
    assert tp_bytes >= 2 * 2 * (8 // 2) * 128 * 512 * 4  # ≥ 2 per layer forward, 2 layers
    grads = sum(layer.params for layer in spec.layers[1:3]) * 4
    assert abs(dp4.collective_bytes("dp")["all-reduce"] / grads - 1) < 0.05
    assert "tp" not in {c.axis for c in dp4.collectives}
    # The results were cached under the caller's directory.
    assert len(list((tmp_path / "cache" / "compiled").glob("*.json"))) == 3


# The fields of XLA's H100 SXM target spec (xla/backends/gpu/target_config/specs/
# h100_sxm.txtpb, Apache-2.0) that a compile needs.
H100_SPEC = """gpu_device_info {
  threads_per_block_limit: 1024 threads_per_warp: 32 shared_memory_per_block: 49152
  shared_memory_per_core: 233472 threads_per_core_limit: 2048 core_count: 132
  fpus_per_core: 128 block_dim_limit_x: 2147483647 block_dim_limit_y: 65535
  block_dim_limit_z: 65535 memory_bandwidth: 3352320000000 l2_cache_size: 52428800
  clock_rate_ghz: 1.98 device_memory_size: 84942979072 shared_memory_per_block_optin: 232448
  cuda_compute_capability { major: 9 }
  registers_per_core_limit: 65536 registers_per_block_limit: 65536
}
platform_name: "CUDA"
dnn_version_info { major: 8 minor: 9 patch: 4 }
device_description_str: "NVIDIA H100 80GB HBM3"
"""


def test_gpu_target_memory_when_the_extra_is_installed(tmp_path):
    from estimator.compiled import gpu_target_available
    if not gpu_target_available():
        pytest.skip("the gpu-target extra (jax-cuda12-plugin) is not installed")
    from estimator.compiled import GPU_TARGET_SPECS, compile_stages
    (tmp_path / GPU_TARGET_SPECS["h100"]).write_text(H100_SPEC)
    cpu_only, with_gpu = compile_stages([_request(), _request(target="h100")], None, tmp_path)
    assert cpu_only.memory_bytes is None
    # fp32 weights, AdamW moments and gradients of two tp-sharded blocks at least.
    from estimator.jax_models import count_params
    state = count_params(_request().arch, range(1, 3)) / 2 * 4 * 4
    assert with_gpu.memory_bytes > state
    assert with_gpu.flops_per_device == pytest.approx(cpu_only.flops_per_device)


def test_a_gpu_target_that_gave_no_memory_is_not_cached(tmp_path):
    """Without the GPU-target plugin or its spec file the compile is the CPU one with no
    memory: cached, it would be returned once the set-up works, under the same key."""
    from estimator.compiled import compile_stages
    specs = tmp_path / "specs"
    specs.mkdir()  # no spec file in it
    (gpu,) = compile_stages([_request(target="h100")], tmp_path / "cache", specs)
    assert gpu.memory_bytes is None and not list((tmp_path / "cache").rglob("*.json"))
    compile_stages([_request()], tmp_path / "cache")
    assert len(list((tmp_path / "cache").rglob("*.json"))) == 1  # the CPU target's is kept


def test_a_compile_worker_that_dies_is_an_error_not_a_hang(tmp_path, monkeypatch):
    """XLA ends a process whose XLA_FLAGS it does not know (as an out-of-memory kill or a
    failed check would): the caller gets an error, and the estimate keeps its formulas."""
    from concurrent.futures.process import BrokenProcessPool

    from estimator.compiled import _compile_in_child, cache_key, installed_jax_version
    monkeypatch.setenv("XLA_FLAGS", "--xla_no_such_flag_at_all=1")
    req = _request()
    with pytest.raises(BrokenProcessPool):
        _compile_in_child([(req, cache_key(req, installed_jax_version()), None)], 4)


def _stub_compiles(monkeypatch, memory_bytes, refuse=lambda request: False, flops=1e12):
    """compile_stages giving a set per-device FLOPs and peak (what a GPU-target compile
    gives), refusing the requests ``refuse`` names (as XLA does a variant it cannot split)."""
    import estimator.compiled as compiled

    def compile_stages(requests, cache_dir=None, gpu_specs_dir=None):
        if any(refuse(r) for r in requests):
            raise RuntimeError("XLA cannot partition this variant")
        return [compiled.CompiledStage("k", flops, 1e11, 0, (), memory_bytes, r.target, 1.0, "0.10.2")
                for r in requests]
    monkeypatch.setattr(compiled, "compile_stages", compile_stages)


def test_compiled_memory_stands_for_replicated_states_and_one_gradient_buffer(monkeypatch):
    """The compiled step holds ZeRO-0 states and one micro-batch's gradients: under ZeRO or
    offload the formulas' memory stands, and accumulating adds the second buffer."""
    from estimator.cells import Cell
    from estimator.cluster import load_cluster
    from estimator.estimate import EstimateOptions, estimate_cell
    from estimator.jobs import JobSpec
    from estimator.memory import MemoryOptions
    _stub_compiles(monkeypatch, 70e9)
    crius, cell = load_cluster("crius-1280"), Cell("a100", 8, 8, 1)
    for memory in (MemoryOptions(zero_level=3), MemoryOptions(offload=True)):
        options = EstimateOptions(memory=memory, runnable_only=False)
        analytic = estimate_cell(JobSpec("gpt-6.7b", 128), cell, crius, options)
        compiled = estimate_cell(JobSpec("gpt-6.7b", 128), cell, crius, replace(options, fidelity="compiled"))
        assert analytic.feasible and compiled.feasible and compiled.memory_fidelity == "analytic"
    _stub_compiles(monkeypatch, 10e9)
    one, many = (estimate_cell(JobSpec("gpt-1.3b", 64), Cell("a100", 1, 1, 1), crius,
                               EstimateOptions(fidelity="compiled", micro_batches=b)) for b in (1, 16))
    from estimator.models import load_model
    assert one.memory_fidelity == many.memory_fidelity == "compiled" and many.stages == one.stages
    params = sum(layer.params for layer in load_model("gpt-1.3b").layers)
    assert many.peak_memory_gb - one.peak_memory_gb == pytest.approx(params * 4 / 1e9, rel=0.05)  # fp32


def test_a_cell_whose_chosen_stages_kept_the_formulas_is_not_called_compiled(monkeypatch):
    from estimator.cells import Cell
    from estimator.cluster import load_cluster
    from estimator.estimate import EstimateOptions, estimate_cell
    from estimator.jobs import JobSpec
    # Data-parallel variants refused, tensor-parallel ones slow: the formulas' dp stages win.
    _stub_compiles(monkeypatch, None, refuse=lambda r: r.tp == 1, flops=1e16)
    est = estimate_cell(JobSpec("gpt-1.3b", 256), Cell("a100", 8, 8, 2), load_cluster("crius-1280"),
                        EstimateOptions(fidelity="compiled"))
    assert any(s.tp == 1 for s in est.stages) and est.fidelity == "analytic"


def test_moe_groups_stay_on_one_data_parallel_device(tmp_path):
    """One sample per dp device, fewer tokens than a group: each device routes its own
    tokens (as the runner does), so the compiled step has the gradient sync over dp and
    no collectives over other device groups."""
    from estimator.compiled import StageRequest, compile_stages
    from estimator.jax_models import Arch
    arch = Arch("moe", hidden=64, num_blocks=2, heads=4, vocab=128, seq_len=32, experts=4, expert_group=64,
                compute_dtype="fp32", optimizer="adafactor")
    one, two = compile_stages([StageRequest("tiny-moe", arch, 1, 3, 4, 1, micro, False) for micro in (4, 8)],
                              tmp_path)
    assert {c.axis for c in one.collectives if c.bytes} <= {"dp"}
    assert one.collective_bytes("dp") == two.collective_bytes("dp")  # the same gradients
