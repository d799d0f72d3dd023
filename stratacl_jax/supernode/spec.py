"""The supernode's description: `SupernodeSpec` (shape, links, memory, lanes,
compute, each figure with its source) and the presets, the input of every
model in this package."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, fields

import numpy as np


# Where each figure comes from. "derived" and "assumed" figures are not
# published: they are parameters, and say how they were obtained. Nothing here
# was fitted to make a modeled result match a published one.
CM384 = "CloudMatrix384, arXiv 2506.12708"
STRATACL_T1 = "StrataCL, arXiv 2607.26444, Table 1 (one stream, unidirectional)"
STRATACL = "StrataCL, arXiv 2607.26444 (published notes on it)"
HCCL_DOCS = "HCCL docs (HCCL_BUFFSIZE default)"
ASCENDC_BP = ("Ascend C best practices (hiascend.com, 'Transferring a Large Data Block at a Time': "
              "one DataCopy of >= 16 KB reaches near-peak bandwidth)")


def _message_us(lane_gbps: float) -> float:
    """Issue cost o of one message on a lane of `lane_gbps`, from the efficient size.

    A lane moves a leg of m bytes in m / (2 B) (reads and writes stream at 2 B together) plus o,
    so a message runs at m / (m / 2B + o). Ascend C's guidance puts near-peak at 16 KB; taking
    near-peak as 90 % there: o = (16384 / 2B) (1 / 0.9 - 1) = 16384 / (18 B)."""
    return round(16384 / (18 * lane_gbps * 1e3), 4)


def _f(default, unit: str, source: str):
    return field(default=default, metadata={"unit": unit, "source": source})


@dataclass(frozen=True)
class SupernodeSpec:
    """A supernode: its shape, links, memory and lanes, the input of the
    supernode model (``strata.emulator.model``). One rank of a collective is
    one NPU (``ranks_per_npu=1``) or one die (2). ``sources()`` lists where
    every figure comes from; the docs (docs/supernode_model.md) show the table.
    """

    name: str = _f("cloudmatrix384", "", "")
    # What one rank is decides every per-rank figure: with ranks_per_npu=1 (the default) a rank
    # is a 910C package (2 dies: 96 AIV + 48 AIC cores, 752 TFLOPS BF16, 3.2 TB/s HBM, 392 GB/s
    # of UB each way); with 2 it is one die, and gets half of each.
    num_npus: int = _f(384, "NPUs", CM384 + ": 384 Ascend 910C")
    npus_per_node: int = _f(8, "NPUs", CM384 + ": 48 nodes x 8 NPUs")
    dies_per_npu: int = _f(2, "dies", CM384 + ": each 910C is 2 dies")
    ranks_per_npu: int = _f(1, "ranks", "modeling choice: a rank is one NPU package")
    vector_cores_per_die: int = _f(48, "AIV cores", CM384 + ": 48 AIV per die")
    cube_cores_per_die: int = _f(24, "AIC cores", CM384 + ": 24 AIC per die")
    # Unified Bus paths between two ranks: one stream's latency and bandwidth.
    die_latency_us: float = _f(0.2, "us", STRATACL_T1 + ", die<->die")
    die_gbps: float = _f(210.0, "GB/s", STRATACL_T1 + ", die<->die")
    intra_node_latency_us: float = _f(0.7, "us", STRATACL_T1 + ", intra-node")
    intra_node_gbps: float = _f(170.0, "GB/s", STRATACL_T1 + ", intra-node")
    inter_node_latency_us: float = _f(2.1, "us", STRATACL_T1 + ", inter-node")
    inter_node_gbps: float = _f(150.0, "GB/s", STRATACL_T1 + ", inter-node")
    # Per-NPU UB ports. The L1 (7 chips per node) and L2 (7 planes x 16 chips)
    # switch tiers are non-blocking, so the model has no switch resource; the
    # < 1 us they add across nodes is in the inter-node path's latency.
    ub_egress_gbps: float = _f(392.0, "GB/s", CM384 + ": > 392 GB/s unidirectional per NPU")
    ub_ingress_gbps: float = _f(392.0, "GB/s", CM384 + ": same, the other direction")
    ub_links_per_die: int = _f(7, "links", CM384)
    l1_switches_per_node: int = _f(7, "chips", CM384)
    l2_planes: int = _f(7, "planes", CM384)
    l2_switches_per_plane: int = _f(16, "chips", CM384)
    rdma_gbps_per_npu: float = _f(50.0, "GB/s", CM384 + ": RoCE plane up to 400 Gb/s (not modeled: beyond the supernode)")
    hbm_gbytes_per_die: float = _f(64.0, "GB", CM384)
    hbm_gbps_per_die: float = _f(1600.0, "GB/s", CM384 + ": 1.6 TB/s per die (3.2 TB/s package)")
    # Lanes.
    core_copy_gbps: float = _f(round(0.95 * 392.0 / 24, 2), "GB/s",
                               "derived: " + STRATACL + " says ~95 % of peak UB (392 GB/s) takes 24 AIV "
                               "cores, so one core copies 0.95 * 392 / 24")
    core_reduce_gbps: float = _f(round(0.95 * 392.0 / 24, 2), "GB/s",
                                 "assumed: equal to the copy rate (a streaming reduction is bound by the "
                                 "core's memory traffic, not its ALUs); not published")
    sdma_engines_per_die: int = _f(16, "engines", "assumed: not published (the runtime's default)")
    sdma_gbps: float = _f(round(0.91 * 24 * (0.95 * 392.0 / 24) / 16, 2), "GB/s",
                          "derived: " + STRATACL + " says SDMA offload runs ~9 % slower than the cores "
                          "(24 cores at 95 % of peak), spread over the assumed 16 engines")
    sdma_descriptor_us: float = _f(90.0, "us", STRATACL + ": descriptor submission ~90 us; charged "
                                   "once per op that uses the engines, all engines in parallel (how often is not published)")
    # Per-message issue cost (a DataCopy, a descriptor, a signal) on the lane that sends it.
    core_message_us: float = _f(_message_us(round(0.95 * 392.0 / 24, 2)), "us",
                                "derived: " + ASCENDC_BP + "; near-peak taken as 90 % at 16 KB on one core "
                                "(the 90 % is assumed, not published): o = 16 KiB / (18 x core_copy_gbps)")
    sdma_message_us: float = _f(_message_us(round(0.91 * 24 * (0.95 * 392.0 / 24) / 16, 2)), "us",
                                "assumed: the cores' 16 KB efficient size holds for an SDMA descriptor too "
                                "(not published for SDMA): o = 16 KiB / (18 x sdma_gbps)")
    ccl_buffer_bytes: int = _f(200 * 1024 * 1024, "B", HCCL_DOCS + ": 200 MB, two per communicator")
    # Compute (the step model, strata.emulator.simulate). Peak rates per die; a rank gets
    # dies_per_npu / ranks_per_npu dies' worth of each, like its HBM, cores and UB ports.
    cube_tflops_bf16_per_die: float = _f(376.0, "TFLOPS", CM384 + ": 752 TFLOPS dense BF16 per 910C "
                                         "package, two dies")
    cube_tflops_fp16_per_die: float = _f(376.0, "TFLOPS", CM384 + ": 752 TFLOPS dense FP16/BF16 per package")
    cube_tops_int8_per_die: float = _f(752.0, "TOPS", "INT8 commonly given as twice the BF16 rate "
                                       "(~1.5 POPS per 910C package; summaries of " + CM384 + ")")
    cube_tflops_fp32_per_die: float = _f(94.0, "TFLOPS", "assumed: a quarter of the BF16 rate "
                                         "(not published; the modeled workloads run no fp32 matmul)")
    vector_tflops_fp16_per_die: float = _f(22.0, "TFLOPS", "a public Ascend simulator's figure for "
                                           "vector-unit FP16 per die (an order below the cube rate)")
    vector_tflops_fp32_per_die: float = _f(11.0, "TFLOPS", "assumed: half the vector FP16 rate "
                                           "(two fp16 lanes per fp32 lane; not published)")
    compute_efficiency: float = _f(0.7, "fraction", "assumed: share of peak a large kernel sustains "
                                   "(vendor GEMM benchmarks on accelerators reach 60-80 %); not published, "
                                   "not fitted: docs/step_model.md shows results at 0.5 and 0.9")
    hbm_efficiency: float = _f(0.8, "fraction", "assumed: share of HBM peak a streaming kernel "
                               "sustains (STREAM-like benchmarks on HBM devices reach 75-90 %); not published")
    kernel_launch_us: float = _f(2.0, "us", "assumed: per-kernel task dispatch on the NPU with the "
                                 "step captured as a graph (no host launch per kernel); not published, "
                                 "docs/step_model.md shows results at 0 and 5 us")

    @property
    def num_nodes(self) -> int:
        return self.num_npus // self.npus_per_node

    @property
    def num_ranks(self) -> int:
        return self.num_npus * self.ranks_per_npu

    @property
    def dies_per_rank(self) -> float:
        """How much of a package one rank is: 2 dies (rank = package) or 1."""
        return self.dies_per_npu / self.ranks_per_npu

    @property
    def ub_egress_gbps_per_rank(self) -> float:
        return self.ub_egress_gbps / self.ranks_per_npu

    @property
    def ub_ingress_gbps_per_rank(self) -> float:
        return self.ub_ingress_gbps / self.ranks_per_npu

    @property
    def vector_cores_per_rank(self) -> int:
        return int(self.vector_cores_per_die * self.dies_per_rank)

    @property
    def cube_cores_per_rank(self) -> int:
        return int(self.cube_cores_per_die * self.dies_per_rank)

    def cube_tflops_per_rank(self, dtype) -> float:
        """Peak matmul rate of one rank for operands of `dtype` (numpy/jax dtype or name)."""
        name = np.dtype(dtype).name if not isinstance(dtype, str) else dtype
        per_die = {"bfloat16": self.cube_tflops_bf16_per_die, "float16": self.cube_tflops_fp16_per_die,
                   "int8": self.cube_tops_int8_per_die, "uint8": self.cube_tops_int8_per_die,
                   "int4": self.cube_tops_int8_per_die * 2}.get(name, self.cube_tflops_fp32_per_die)
        return per_die * self.dies_per_rank

    def vector_tflops_per_rank(self, dtype) -> float:
        name = np.dtype(dtype).name if not isinstance(dtype, str) else dtype
        wide = name in ("float32", "float64", "int32", "int64", "uint32", "complex64", "complex128")
        per_die = self.vector_tflops_fp32_per_die if wide else self.vector_tflops_fp16_per_die
        return per_die * self.dies_per_rank

    @property
    def hbm_gbps_per_rank(self) -> float:
        return self.hbm_gbps_per_die * self.dies_per_npu / self.ranks_per_npu

    @property
    def hbm_bytes_per_rank(self) -> float:
        return self.hbm_gbytes_per_die * 1e9 * self.dies_per_npu / self.ranks_per_npu

    def machine(self) -> dict:
        """The figures the C++ model reads (xla_ffi/model/model.h, Machine)."""
        return {
            "npus_per_node": self.npus_per_node, "ranks_per_npu": self.ranks_per_npu,
            "die_latency_us": self.die_latency_us, "intra_latency_us": self.intra_node_latency_us,
            "inter_latency_us": self.inter_node_latency_us, "die_gbps": self.die_gbps,
            "intra_gbps": self.intra_node_gbps, "inter_gbps": self.inter_node_gbps,
            "egress_gbps": self.ub_egress_gbps_per_rank, "ingress_gbps": self.ub_ingress_gbps_per_rank,
            "hbm_gbps": self.hbm_gbps_per_rank, "core_copy_gbps": self.core_copy_gbps,
            "core_reduce_gbps": self.core_reduce_gbps, "sdma_gbps": self.sdma_gbps,
            "sdma_descriptor_us": self.sdma_descriptor_us,
            "core_message_us": self.core_message_us, "sdma_message_us": self.sdma_message_us,
        }

    def sources(self) -> list[tuple[str, object, str, str]]:
        """(field, value, unit, source) for every figure."""
        return [(f.name, getattr(self, f.name), f.metadata.get("unit", ""), f.metadata.get("source", ""))
                for f in fields(self) if f.name != "name"]

    def replace(self, **changes) -> "SupernodeSpec":
        return dataclasses.replace(self, **changes)


CLOUDMATRIX384 = SupernodeSpec()

# One CloudMatrix node: the 8-NPU slice the benchmarks run by default.
CLOUDMATRIX_NODE = SupernodeSpec(name="cloudmatrix_node", num_npus=8)

# CloudMatrix384 with a rank per die (768 ranks; die pairs share an NPU).
CLOUDMATRIX384_DIES = SupernodeSpec(name="cloudmatrix384_dies", ranks_per_npu=2)

PRESETS = {spec.name: spec for spec in (CLOUDMATRIX384, CLOUDMATRIX_NODE, CLOUDMATRIX384_DIES)}


def preset(name) -> SupernodeSpec:
    if isinstance(name, SupernodeSpec):
        return name
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown supernode preset {name!r}; known: {sorted(PRESETS)}") from None

