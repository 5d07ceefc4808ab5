"""The GPU catalog: datasheet figures of each GPU type the estimator knows.

Rates are dense (no structured sparsity). Sources, vendor datasheets:
  a100: NVIDIA A100 Tensor Core GPU datasheet (SXM4 40 GB): FP16/BF16 tensor 312 TFLOPS,
        TF32 156, FP32 19.5, HBM2 1,555 GB/s, NVLink 3 600 GB/s.
  v100: NVIDIA V100 datasheet (SXM2 32 GB): tensor 125 TFLOPS (fp16; no TF32 or BF16),
        FP32 15.7, HBM2 900 GB/s, NVLink 2 300 GB/s.
  a40:  NVIDIA A40 datasheet: FP16 tensor 149.7 TFLOPS, TF32 74.8, FP32 37.4,
        GDDR6 696 GB/s, PCIe Gen4 64 GB/s (NVLink bridge pairs 112.5 GB/s).
  a10:  NVIDIA A10 datasheet: FP16 tensor 125 TFLOPS, TF32 62.5, FP32 31.2,
        GDDR6 600 GB/s, PCIe Gen4 64 GB/s.
  h100: NVIDIA H100 datasheet (SXM5 80 GB): BF16 989 TFLOPS, TF32 494.7, FP32 67,
        HBM3 3,350 GB/s, NVLink 4 900 GB/s.
  l20:  NVIDIA L20 product brief (48 GB): FP16 tensor 119.5 TFLOPS, FP32 59.8,
        GDDR6 864 GB/s, PCIe Gen4 64 GB/s.
  h200: NVIDIA H200 datasheet (SXM 141 GB): BF16 989 TFLOPS, TF32 494.7, FP32 67,
        HBM3e 4,800 GB/s, NVLink 4 900 GB/s.
Streaming multiprocessors (SMs), from the same datasheets and the architecture whitepapers
(GA100, GV100, GA102, GH100, AD102): a100 108, v100 80, a40 84, a10 72, h100 132, l20 92,
h200 132. fp32 issue: on GA102/AD102 (a40, a10, l20) half of each SM's 128 fp32 lanes
share their datapath with integer work (NVIDIA Ampere GA102 whitepaper, "2x FP32"); the
datasheet counts all 128, while fp32 convolutions and matmuls, whose address and loop
arithmetic is integer work, issue on about half: ``fp32_issue_frac`` 0.5. GA100, GV100 and
GH100 have separate integer units (1.0).
Memory sizes are the datasheets' binary gigabytes (GiB); the GDDR6 boards (a40, a10, l20)
lose a sixteenth of theirs to inline ECC (``GpuType.device_memory_gb``).
Link bandwidths are the unidirectional per-GPU figures (half the bidirectional totals
vendors print). Usual GPUs per node follow the clusters the measured tables come from
(a100 4, v100 16 in a DGX-2, a40 and a10 2) and common servers for the rest (8).
"""

from dataclasses import dataclass

from estimator.errors import SpecError


@dataclass(frozen=True)
class GpuType:
    """One GPU model's datasheet figures."""

    name: str
    memory_gb: float
    fp16_tflops: float  # dense fp16 tensor-core rate (bf16's too, where the cores take bf16)
    tf32_tflops: float  # rate XLA uses for fp32 matmuls/convs by default (TF32 where present)
    fp32_tflops: float  # plain fp32 (CUDA cores)
    memory_bandwidth_gbytes_s: float  # GB/s of device memory
    intra_node_link_gbytes_s: float  # GB/s per GPU, one direction, to its node peers
    gpus_per_node: int
    pcie_only: bool  # no NVLink/NVSwitch between all GPUs of a node
    sm_count: int  # streaming multiprocessors: how much parallel work fills the GPU
    fp32_issue_frac: float  # share of the datasheet fp32 rate fp32 convs/matmuls can issue
    # GDDR6 boards (a40, a10, l20) keep ECC inline in the memory itself: with ECC on (data
    # centre default) 1/16 of it holds check bits. HBM carries ECC beside the data.
    ecc_inline: bool = False
    # Tensor cores that take bf16 (Ampere and later). Volta's take fp16 only: XLA runs a
    # bf16 matmul there in fp32 on the CUDA cores, so an fp16 model trains in fp16 there.
    bf16_tensor_cores: bool = True

    @property
    def device_memory_gb(self) -> float:
        """Bytes (in GB, 1e9) the device offers a program: datasheets count memory in
        binary units (40 GB = 40 GiB), less inline ECC's sixteenth where the board has it.
        Matches the totals the measured clusters' devices report (MODELS.md,
        ``device_infos.json``: a100 40,370 MiB, v100 32,501, a40 45,487) to within 1.5 %,
        the rest being the driver's reserve."""
        return self.memory_gb * 2**30 / 1e9 * (15 / 16 if self.ecc_inline else 1.0)

    def peak_tflops(self, dtype: str) -> float:
        """Peak dense rate for matmul-class work in ``dtype`` (fp16, bf16, fp32)."""
        if dtype == "fp16" or (dtype == "bf16" and self.bf16_tensor_cores):
            return self.fp16_tflops
        if dtype == "bf16":
            return self.fp32_tflops
        if dtype == "fp32":
            return self.tf32_tflops
        raise SpecError("dtype", dtype, "use fp16, bf16 or fp32")


CATALOG: dict[str, GpuType] = {
    g.name: g
    for g in (
        GpuType("a100", 40, 312.0, 156.0, 19.5, 1555, 300, 4, False, 108, 1.0),
        GpuType("v100", 32, 125.0, 15.7, 15.7, 900, 150, 16, False, 80, 1.0, bf16_tensor_cores=False),
        GpuType("a40", 48, 149.7, 74.8, 37.4, 696, 32, 2, True, 84, 0.5, True),
        GpuType("a10", 24, 125.0, 62.5, 31.2, 600, 32, 2, True, 72, 0.5, True),
        GpuType("h100", 80, 989.0, 494.7, 67.0, 3350, 450, 8, False, 132, 1.0),
        GpuType("l20", 48, 119.5, 59.8, 59.8, 864, 32, 8, True, 92, 0.5, True),
        GpuType("h200", 141, 989.0, 494.7, 67.0, 4800, 450, 8, False, 132, 1.0),
    )
}


def gpu_type(name: str) -> GpuType:
    """The catalog entry for ``name`` (case-insensitive)."""
    key = name.strip().lower()
    if key not in CATALOG:
        raise SpecError("gpu_type", name, f"unknown GPU type; known: {', '.join(CATALOG)}")
    return CATALOG[key]
