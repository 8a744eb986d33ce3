"""Device profiles: memory, matmul peak, and link bandwidth / latency the cost model divides by.

DEVICES holds common accelerators from their vendors' datasheets (dense, i.e. without 2:4 sparsity), each
figure with its source; "cpu" is a conservative placeholder for a laptop/server core pair, to be replaced by a
measured profile (python -m pipetrain.plan --calibrate). load_profile(name_or_path) returns a table entry or
reads a JSON profile written by calibrate.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import asdict, dataclass

from pipetrain.config import ConfigError, clip

GB = 1e9
GIB = 2 ** 30


@dataclass(frozen=True)
class DeviceProfile:
    name: str
    memory_bytes: float        # usable device memory per rank
    bf16_flops: float          # dense matmul peak, FLOP/s
    fp32_flops: float          # dense fp32 matmul peak (TF32 tensor cores where the vendor lists them)
    intra_bw: float            # bytes/s one rank sends to a peer inside a node (per direction)
    intra_latency: float       # seconds per message inside a node
    inter_bw: float            # bytes/s per rank across nodes
    inter_latency: float       # seconds per message across nodes
    efficiency: float = 0.5    # achieved fraction of the matmul peak on transformer layers (MFU-like)
    op_overhead: float = 10e-6  # seconds of dispatch per operator call (kernel launch on GPUs, eager overhead on CPU)
    cores: int = 0             # CPU cores the ranks of one node share (0: one device per rank, as GPUs)
    mem_bw: float = 20e9       # bytes/s of memory bandwidth one rank gets (the optimizer step is bound by it)
    # a reduce-scatter's and an all-gather's time over what a ring at the all-reduce's bandwidth takes (half an
    # all-reduce); 1 for NCCL's rings, measured on gloo, whose reduce-scatter takes longer than an all-reduce
    reduce_scatter_ratio: float = 1.0
    all_gather_ratio: float = 1.0
    source: str = ""

    @property
    def staged_collectives(self) -> bool:
        """A CPU profile runs gloo, whose all-gather stages its output through a flat copy (plan/memory.py):
        a calibrated one (cores > 0) or the "cpu" placeholder a CPU launch plans from (plan.auto.launch_profile),
        so parallel.auto's estimate is the pre-flight check's."""
        return self.cores > 0 or self.name == "cpu"

    @property
    def device_type(self) -> str:
        """The device kind whose ops the memory model counts: "cpu" for a CPU profile (the torch references),
        else "cuda" (the GPUs' profiles: the Triton kernels, plan/precision.py)."""
        return "cpu" if self.staged_collectives else "cuda"

    def flops(self, precision: str) -> float:
        """The matmul peak a run of train.precision computes at: fp8 runs every matmul but its fp8 linears' under
        bf16 autocast (and those at least as fast), so bf16's; fp32 the fp32 (TF32) one."""
        return self.bf16_flops if precision in ("bf16", "fp8") else self.fp32_flops

    def as_dict(self) -> dict:
        return asdict(self)


# Inter-node: one 400 Gb/s InfiniBand NDR / 200 Gb/s HDR NIC per GPU (DGX H100 / DGX A100 reference designs).
_NDR_PER_GPU = 50 * GB   # NVIDIA ConnectX-7 datasheet: 400 Gb/s per port
_HDR_PER_GPU = 25 * GB   # NVIDIA ConnectX-6 datasheet: 200 Gb/s per port
_ETH_100G = 12.5 * GB    # a 100 GbE NIC shared by a PCIe box

DEVICES: dict[str, DeviceProfile] = {
    # NVIDIA H100 Tensor Core GPU datasheet (SXM5): 80 GB HBM3, BF16 989 TFLOPS dense (1979 with sparsity),
    # TF32 494.5 dense, NVLink 900 GB/s total bidirectional -> 450 GB/s per direction.
    "h100-sxm-80gb": DeviceProfile("h100-sxm-80gb", 80 * GB, 989e12, 494.5e12, 450 * GB, 3e-6, _NDR_PER_GPU, 8e-6,
                                   mem_bw=3.35e12, source="NVIDIA H100 datasheet (SXM5): 3.35 TB/s; ConnectX-7 400Gb/s per GPU"),
    # NVIDIA H200 Tensor Core GPU datasheet (SXM): 141 GB HBM3e at 4.8 TB/s, BF16 989 TFLOPS dense (1,979 with
    # sparsity), TF32 494.5 dense; NVLink 900 GB/s bidirectional -> 450 GB/s per direction. Also the GPU of a
    # GH200 (the same Hopper compute; launch_profile caps the memory at what the card reports).
    "h200-141gb": DeviceProfile("h200-141gb", 141 * GB, 989e12, 494.5e12, 450 * GB, 3e-6, _NDR_PER_GPU, 8e-6,
                                mem_bw=4.8e12,
                                source="NVIDIA H200 datasheet (SXM): 4.8 TB/s; ConnectX-7 400Gb/s per GPU"),
    # Same datasheet (PCIe): 80 GB HBM2e, BF16 756 TFLOPS dense, TF32 378; PCIe Gen5 128 GB/s bidirectional.
    "h100-pcie-80gb": DeviceProfile("h100-pcie-80gb", 80 * GB, 756e12, 378e12, 64 * GB, 5e-6, _NDR_PER_GPU, 8e-6,
                                    mem_bw=2.0e12, source="NVIDIA H100 datasheet (PCIe): 2 TB/s"),
    # NVIDIA A100 Tensor Core GPU datasheet: BF16 312 TFLOPS dense, TF32 156; NVLink 600 GB/s bidirectional.
    "a100-80gb": DeviceProfile("a100-80gb", 80 * GB, 312e12, 156e12, 300 * GB, 3e-6, _HDR_PER_GPU, 8e-6,
                               mem_bw=2.039e12,
                               source="NVIDIA A100 datasheet (SXM4 80GB): 2,039 GB/s; ConnectX-6 200Gb/s per GPU"),
    "a100-40gb": DeviceProfile("a100-40gb", 40 * GB, 312e12, 156e12, 300 * GB, 3e-6, _HDR_PER_GPU, 8e-6,
                               mem_bw=1.555e12, source="NVIDIA A100 datasheet (SXM4 40GB): 1,555 GB/s"),
    # NVIDIA L4 datasheet: 24 GB GDDR6, BF16 121 TFLOPS dense (242 sparse), TF32 60; PCIe Gen4 x16 64 GB/s.
    "l4": DeviceProfile("l4", 24 * GB, 121e12, 60e12, 32 * GB, 10e-6, _ETH_100G, 20e-6,
                        mem_bw=300e9, source="NVIDIA L4 datasheet: 300 GB/s; PCIe Gen4 x16"),
    # NVIDIA L40S datasheet: 48 GB GDDR6 at 864 GB/s, BF16 362.05 TFLOPS dense (733 sparse), TF32 183; PCIe Gen4 x16.
    "l40s": DeviceProfile("l40s", 48 * GB, 362.05e12, 183e12, 32 * GB, 10e-6, _ETH_100G, 20e-6,
                          mem_bw=864e9, source="NVIDIA L40S datasheet: 864 GB/s; PCIe Gen4 x16"),
    # NVIDIA Ada Lovelace GPU architecture whitepaper (RTX 4090): 24 GB GDDR6X, BF16 tensor 165.2 TFLOPS dense
    # with FP32 accumulate (330.3 is FP16 accumulate), TF32 82.6; no NVLink, PCIe Gen4 x16.
    "rtx-4090": DeviceProfile("rtx-4090", 24 * GB, 165.2e12, 82.6e12, 32 * GB, 10e-6, _ETH_100G, 20e-6,
                              mem_bw=1008e9, source="NVIDIA Ada Lovelace GPU architecture whitepaper, RTX 4090: 1008 GB/s"),
    # AMD Instinct MI300X datasheet: 192 GB HBM3, BF16 1307.4 TFLOPS dense, TF32 653.7; Infinity Fabric
    # 128 GB/s per link per direction, 7 links to peers (896 GB/s aggregate in an 8-GPU platform).
    "mi300x": DeviceProfile("mi300x", 192 * GB, 1307.4e12, 653.7e12, 128 * GB, 4e-6, _NDR_PER_GPU, 8e-6,
                            mem_bw=5.3e12, source="AMD Instinct MI300X datasheet: 5.3 TB/s; 400Gb/s NIC per GPU"),
    # Placeholder for two CPU cores with gloo over loopback; calibrate measures the real figures.
    "cpu": DeviceProfile("cpu", 8 * GIB, 50e9, 50e9, 2 * GB, 50e-6, 1 * GB, 100e-6, efficiency=0.5,
                         source="placeholder; run python -m pipetrain.plan --calibrate"),
}


def _finite(value) -> bool:
    """A finite int or float, not a bool; an integer past a float's range (400 digits) is not one."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def load_profile(name_or_path: str, where: str = "--device") -> DeviceProfile:
    """A DEVICES entry by name, or a JSON profile file written by --calibrate. where: what named it (the flag,
    or the PIPETRAIN_DEVICE variable), for errors."""
    if name_or_path in DEVICES:
        return DEVICES[name_or_path]
    if not os.path.isfile(name_or_path):
        raise ConfigError(f"{where}: unknown device, got {name_or_path!r}; use one of {', '.join(DEVICES)} "
                          "or a JSON file from --calibrate")
    fix = "write one with python -m pipetrain.plan --calibrate"
    try:
        with open(name_or_path, "rb") as f:
            data = json.loads(f.read(1 << 20))
        profile = DeviceProfile(**data)
    except (ValueError, TypeError, RecursionError) as exc:  # not JSON (or UTF-8, or too deep), not a mapping, fields
        raise ConfigError(f"{where} {name_or_path}: not a device profile ({str(exc)[:150]}); {fix}") from None
    numbers = {f.name: getattr(profile, f.name) for f in dataclasses.fields(profile)
               if f.name not in ("name", "source")}
    bad = [k for k, v in numbers.items() if not _finite(v) or v < 0]
    bad += [k for k in ("memory_bytes", "bf16_flops", "fp32_flops", "intra_bw", "inter_bw", "efficiency", "mem_bw")
            if k not in bad and numbers[k] <= 0]
    if bad or not isinstance(profile.name, str):
        shown = ", ".join(f"{k}={clip(repr(numbers[k]))}" for k in bad[:3]) or f"name={clip(repr(profile.name))}"
        raise ConfigError(f"{where} {name_or_path}: not a device profile ({shown}: each must be a finite number, "
                          f"rates and sizes > 0); {fix}")
    return profile
