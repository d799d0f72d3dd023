// The supernode model: what an op's plan would take on the machine described
// by a Machine (the Python SupernodeSpec, with its sources, fills it in).
//
// Vocabulary. A program is a sequence of phases; a phase is a set of pieces;
// a piece is one lane's (one vector core's or one SDMA engine's) share of
// work on one rank: bytes it reads from some ranks' HBM and writes to some
// ranks' HBM. Collectives' pieces come from the runtime's partitioned plan
// (plan.h: each Piece of a LaneTask, its transfer's sources and
// destinations); MoE pieces are the runtime's expert-row and token tasks,
// built from the real routing. Staging copies of the buffer_centric mode are
// pieces too (read and write the rank's own HBM).
//
// Timing. Every resource is a FIFO queue that serves at its bandwidth: each
// rank's HBM, its UB egress and ingress, the path between each ordered pair
// of ranks (one stream's measured bandwidth), and each lane. A lane works
// through its pieces in order; a piece becomes ready when the lane finished
// the previous one, then reserves every resource it touches for bytes /
// bandwidth, each from the moment that resource is free; the lane itself is
// busy for its bytes at its rate plus a fixed issue cost per message (each
// leg of a piece, each row of an MoE task, is one DataCopy or descriptor:
// a message of m bytes runs at m / (m / B + o)). The lane moves on when the
// last reservation ends, and the piece's data lands one path latency later
// (a lane keeps several requests in flight, so latency is paid once per
// piece but does not stall the lane).
// Pieces are served in order of readiness (a heap over lanes). A phase
// starts when the previous one has ended on every rank, after a group sync
// where the phase needs peers: every rank signals each peer the plan pairs it
// with (a flag write: one message on a lane of the phase's kind, the signals
// spread over the rank's lanes, then one path latency). An op that uses SDMA
// engines first submits their descriptor chains (once per op, all engines in
// parallel).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "../runtime/collective.h"
#include "../runtime/moe_shape.h"
#include "../runtime/plan.h"

namespace strata::model {

struct Machine {
  int32_t npus_per_node = 8;
  int32_t ranks_per_npu = 1;  // 2: a rank is one die, dies of an NPU pair up
  // One stream between two ranks: latency (us) and bandwidth (GB/s = 1e3 B/us).
  double die_latency_us = 0.2, intra_latency_us = 0.7, inter_latency_us = 2.1;
  double die_gbps = 210, intra_gbps = 170, inter_gbps = 150;
  double egress_gbps = 392, ingress_gbps = 392;  // UB per rank, unidirectional
  double hbm_gbps = 3200;                         // per rank, reads + writes
  double core_copy_gbps = 15.5, core_reduce_gbps = 15.5, sdma_gbps = kSdmaGbps;  // per lane
  double sdma_descriptor_us = kSdmaDescriptorUs;  // once per op that uses SDMA
  // Issue cost of one message (a DataCopy, a descriptor, a signal) on the
  // lane that sends it, per kind of lane.
  double core_message_us = 0.0586, sdma_message_us = 0.0430;
};

enum LaneKind : int32_t { kCore = 0, kSdma = 1 };

struct IO {
  int32_t rank;
  int32_t write;  // 0: read from rank's HBM, 1: write to it
  int64_t bytes;
  int64_t msgs = 1;  // messages (DataCopies / descriptors) the bytes take
};

struct ModelPiece {
  int32_t rank, lane;
  // Either explicit io [io_begin, io_end) of the phase, or (transfer >= 0)
  // the plan transfer's sources (read) and destinations (written), each
  // `bytes` long.
  int32_t transfer = -1;
  int64_t bytes = 0;
  uint32_t io_begin = 0, io_end = 0;
  // The plan `transfer` names when not the phase's (a phase running two
  // plans' pieces side by side: MoE backward's scale and dots).
  const Plan* plan = nullptr;
};

enum PhaseKind : int32_t { kExchange = 0, kStageIn = 1, kStageOut = 2 };

struct ModelPhase {
  PhaseKind kind = kExchange;
  LaneKind lanes = kCore;
  bool reduce = false;   // pieces are reductions (core reduce throughput)
  bool sync_before = false;
  // Identical back-to-back instances (buffer_centric rounds of one window
  // width): phases never overlap, so each instance takes the same time; it is
  // simulated once and counted `repeat` times (slices show the first).
  int64_t repeat = 1;
  const Plan* plan = nullptr;  // for pieces that name a transfer
  std::vector<ModelPiece> pieces;
  std::vector<IO> io;
};

struct Program {
  int32_t num_ranks = 0;
  int32_t cores = 1, engines = 1;
  std::vector<int32_t> rank_npu;  // physical position of each rank (default: identity)
  std::vector<ModelPhase> phases;
  bool sync_end = true;          // the completion signal to the group
  std::vector<Plan> plans;       // owned plans the phases point into (reserved: stable)
};

struct Slice {  // one piece on the modeled timeline
  int32_t rank, kind, lane, phase;
  double start_us, end_us;
  int64_t bytes;
};

struct Result {
  double time_us = 0;
  double sync_us = 0, exchange_us = 0, stage_us = 0, latency_us = 0, descriptor_us = 0;
  // The busiest lane's message issue time (part of its busy time).
  double busiest_message_us = 0;
  bool on_sdma = false;  // some phase ran on SDMA engines
  // The busiest resource of each class: total time it served.
  double busiest_lane_us = 0, busiest_hbm_us = 0, busiest_egress_us = 0,
         busiest_ingress_us = 0, busiest_path_us = 0;
  // Per rank: core lanes then SDMA lanes, time each was busy (ready to end).
  std::vector<double> lane_busy_us;
  // Per rank: UB bytes out and in (for lower bounds).
  std::vector<int64_t> egress_bytes, ingress_bytes;
  // Per rank, core lanes then SDMA lanes: bytes each lane read + wrote in
  // exchange phases (the runtime's stats core_bytes / sdma_bytes count the
  // same), every repeat included.
  std::vector<int64_t> lane_bytes;
  // Per rank: bytes its stage phases copied (the runtime's staged_bytes).
  std::vector<int64_t> staged_bytes;
  std::vector<Slice> slices;
  double min_remote_latency_us = 0;  // smallest path latency of any remote byte
};

// Latency and bandwidth of the path between ranks a and b (a != b).
void PathOf(const Machine& m, const Program& prog, int a, int b, double* lat_us, double* gbps);

Result Simulate(const Program& prog, const Machine& m, bool keep_slices = false,
                size_t max_slices = 200000);

// The collective's program as the runtime would execute it: strata mode is
// one exchange phase over the user buffers; buffer_centric stages in rounds
// of the comm buffer's window (runtime/collective.h: CommWindowBytes).
// Pure movement goes to cores or SDMA by the runtime's rule (collective.h,
// MovesOnSdma) with the machine's descriptor cost and engine bandwidth.
Program CollectiveProgram(const OpParams& p, const Machine& m);

// An op whose plan is built from its ranks' data (ragged_all_to_all:
// algorithms' BuildRaggedPlan, called by the caller), as the runtime's
// PlanJob runs it: `plan` unpartitioned, `p` its layout, mode and lanes.
Program PlanProgram(Plan plan, const OpParams& p, const Machine& m);

// MoE combine's two plans (algorithms/moe_combine_plan.h, built by the
// caller from the routing, unpartitioned), as the runtime runs them on `p`'s
// cores and planner: in strata mode the owners' partials, then the tokens'
// sums, each an exchange; in buffer_centric the partials are the staging in
// (owners write what crosses into their comm buffers), the sums the exchange
// between comm buffers, then each rank's y is copied out.
Program MoeCombineProgram(Plan partials, Plan sums, const MoeOpShape& p, const Machine& m);

// Combine's backward from its three plans (algorithms/moe_backward_plan.h,
// partitioned by PartitionMoeBackwardPlans with this machine's figures), as
// the runtime runs them: the owners pull the carried ct_y rows, then scale
// them into d_expert_y and take the dots into d_weights; buffer_centric
// stages ct_y and the expert rows in and both results out.
Program MoeCombineBackwardProgram(Plan carry, Plan scale, Plan dots, const MoeOpShape& p, const Machine& m);

// MoE routing, for MoePairSlots. pair_slot[rank][t*K+k] = e*capacity + row,
// or -1 (dropped), as the runtime computes it (moe.h).
struct MoeShape {
  int32_t ranks = 1, experts = 1;
  int64_t capacity = 1;
};
// The runtime's slot assignment from every rank's routing (ranks in order,
// tokens in order, k in order; full experts drop the pair).
std::vector<std::vector<int32_t>> MoePairSlots(const MoeShape& s,
                                               const std::vector<std::vector<int32_t>>& topk_idx);

}  // namespace strata::model
