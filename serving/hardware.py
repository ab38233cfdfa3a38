"""Hardware table for the serving cost models: one row per GPU class, each number with its source.

Conventions (every consumer relies on these):
- FLOPs are **dense** peak (vendor datasheets print sparse numbers at 2x; those are halved here).
- Bandwidths are bytes/s **per GPU, per direction**. NVLink figures on datasheets are bidirectional
  totals (e.g. "900 GB/s"), so the per-direction value is half of that.
- Inter-node bandwidth is the GPU's own NIC share: one 400 Gb/s NIC per GPU = 50 GB/s per direction.
- ``memory_bytes`` is HBM capacity per GPU in bytes (GB = 1e9, as datasheets count).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Hardware", "HARDWARE", "get_hardware"]

TERA = 1e12
GIGA = 1e9


@dataclass(frozen=True)
class Hardware:
    """One GPU class and its node.

    Arguments:
        name: key in ``HARDWARE``.
        peak_flops_fp8: dense FP8 (or 8-bit) tensor-core peak, FLOP/s per GPU.
        peak_flops_bf16: dense BF16 tensor-core peak, FLOP/s per GPU.
        hbm_bytes_per_s: HBM bandwidth per GPU, bytes/s.
        memory_bytes: HBM capacity per GPU, bytes.
        intra_node_bytes_per_s: GPU-to-GPU bandwidth inside a node, per GPU per direction, bytes/s.
        inter_node_bytes_per_s: network bandwidth per GPU per direction, bytes/s.
        gpus_per_node: GPUs in one node.
    """

    name: str
    peak_flops_fp8: float
    peak_flops_bf16: float
    hbm_bytes_per_s: float
    memory_bytes: float
    intra_node_bytes_per_s: float
    inter_node_bytes_per_s: float
    gpus_per_node: int

    def __post_init__(self) -> None:
        for field in ("peak_flops_fp8", "peak_flops_bf16", "hbm_bytes_per_s", "memory_bytes",
                      "intra_node_bytes_per_s", "inter_node_bytes_per_s"):
            if not getattr(self, field) > 0:
                raise ValueError(f"Hardware {self.name!r}: {field}={getattr(self, field)!r} must be > 0")
        if self.gpus_per_node < 1:
            raise ValueError(f"Hardware {self.name!r}: gpus_per_node={self.gpus_per_node} must be >= 1")


HARDWARE: dict[str, Hardware] = {
    # NVIDIA H100 SXM5 datasheet: FP8 3,958 TFLOPS and BF16 1,979 TFLOPS *with sparsity*
    # -> 1,979 / 989 dense; HBM3 3.35 TB/s, 80 GB; NVLink 4 900 GB/s bidirectional -> 450 per
    # direction; DGX H100: 8 GPUs, one ConnectX-7 400 Gb/s NDR port per GPU -> 50 GB/s.
    "H100": Hardware("H100", 1979 * TERA, 989 * TERA, 3.35 * TERA, 80 * GIGA,
                     450 * GIGA, 50 * GIGA, 8),
    # NVIDIA H200 SXM datasheet: same tensor cores as H100 (1,979 / 989 dense); HBM3e 4.8 TB/s,
    # 141 GB; NVLink 900 GB/s bidirectional -> 450; HGX H200 with 400 Gb/s per GPU -> 50 GB/s.
    "H200": Hardware("H200", 1979 * TERA, 989 * TERA, 4.8 * TERA, 141 * GIGA,
                     450 * GIGA, 50 * GIGA, 8),
    # NVIDIA H800 SXM (China export variant of H100): same compute and HBM as H100 SXM; NVLink cut to
    # 400 GB/s bidirectional -> 200 per direction (DeepSeek-V3 report measures ~160 GB/s usable);
    # DeepSeek-V3 report: one 400 Gb/s InfiniBand NIC per GPU -> 50 GB/s.
    "H800": Hardware("H800", 1979 * TERA, 989 * TERA, 3.35 * TERA, 80 * GIGA,
                     200 * GIGA, 50 * GIGA, 8),
    # NVIDIA H20 (China export variant): FP8 296 TFLOPS, BF16 148 TFLOPS dense; HBM3 4.0 TB/s, 96 GB;
    # NVLink 900 GB/s bidirectional -> 450; 400 Gb/s per GPU assumed -> 50 GB/s.
    "H20": Hardware("H20", 296 * TERA, 148 * TERA, 4.0 * TERA, 96 * GIGA,
                    450 * GIGA, 50 * GIGA, 8),
    # Generic "B-class 64 GB" card: RCSD's environment B (seed 000 §5: 8 x 64 GB per node, a
    # "high-speed interconnect module", RoCEv2 with 8 x 200G NICs per node -> 200 Gb/s = 25 GB/s
    # per GPU). The seed gives no FLOPs or HBM figures; the values below are a 910B-class estimate
    # (public spec sheets: ~320 TFLOPS FP16 dense, ~640 TOPS INT8 used as the 8-bit rate, ~1.6 TB/s
    # HBM2e, 7 x 28 GB/s HCCS per direction ~ 196 GB/s) and are fitted, not quoted, in serving.plan.
    "B64": Hardware("B64", 640 * TERA, 320 * TERA, 1.6 * TERA, 64 * GIGA,
                    196 * GIGA, 25 * GIGA, 8),
}


def get_hardware(name: str) -> Hardware:
    """Look up ``name`` in ``HARDWARE``; raise ``KeyError`` naming the valid keys otherwise."""
    try:
        return HARDWARE[name]
    except KeyError:
        raise KeyError(f"unknown hardware {name!r}; known: {', '.join(sorted(HARDWARE))}") from None
