// The entry point every FFI handler calls: one rank's part of one collective.
// It joins the group's other ranks (rendezvous) without waiting; the last to
// arrive checks they all asked for the same op and hands the op's plan to the
// host workers (executor.h) as a job, in "strata" (direct user-buffer) or
// "buffer_centric" (staged through pre-registered comm buffers) mode.
// Which op it is reaches the runtime as a PlanBuilder (defined per op by the
// algorithms layer, algorithms/op_registry.h): the runtime never names an op.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "dtypes.h"
#include "executor.h"
#include "plan.h"
#include "rendezvous.h"
#include "status.h"

namespace strata {

enum class Mode : int32_t { kStrata = 0, kBufferCentric = 1 };
inline constexpr int32_t kModeCount = 2;
const char* ModeName(Mode mode);  // "strata", "buffer_centric": strata.config's names

struct OpParams;

// How one collective becomes a plan: the algorithms layer defines one per op
// and every OpParams points at its op's, so the runtime builds, caches and
// runs plans without switching on which op it runs.
struct PlanBuilder {
  int32_t code = -1;           // the op's stable id: signatures and plan keys hold it
  const char* name = "strata"; // "strata.all_reduce": errors and traces name the op by it
  // Adds the op's transfers over p.group_size ranks to `plan` (whose layout
  // fields are already set from p).
  void (*add_transfers)(const OpParams& p, Plan& plan) = nullptr;
};

// What the op is. Identical on every rank of a group; checked at rendezvous.
struct OpParams {
  const PlanBuilder* builder = nullptr;  // never null once made (algorithms/op_registry.h)
  DType dtype = DType::F32;
  ReduceOp op = ReduceOp::kNone;
  int32_t root = 0;
  std::vector<int32_t> perm;  // ppermute: flattened (source, destination) pairs
  int32_t group_size = 1;
  int64_t in_blocks = 1, out_blocks = 1, block_bytes = 0, rows = 1;
  Mode mode = Mode::kStrata;
  int32_t cores = 1, engines = 1;
  Planner planner = Planner::kBalanced;
  int64_t comm_buffer_bytes = 200 << 20;
  // Which lanes a pure-movement plan runs on: -1 decides by MovesOnSdma(*this)
  // (below); 0 cores, 1 SDMA engines. buffer_centric rounds inherit the whole
  // op's choice (the descriptor cost is per op, not per round). Derived from
  // the other fields, so not part of the signature the ranks compare.
  int32_t movement_lanes = -1;

  const char* name() const { return builder ? builder->name : "strata.collective"; }
  std::string Describe() const;  // for mismatch errors
  Signature Sign() const;         // what the ranks compare (Describe on mismatch)
  void PlanKey(std::string* key) const;  // everything a plan depends on, as bytes in *key
};

// Who is calling, and with which buffers.
struct RankCall : CallSite {
  const void* in = nullptr;
  void* out = nullptr;
};

// Joins the group and returns at once; `done` is called exactly once, when
// the op has completed on every rank (or with the error every rank gets).
void RunCollectiveAsync(const OpParams& params, const RankCall& call,
                        std::function<void(const Status&)> done);

// The same, waiting for the result (threads-as-ranks tests and tools).
Status RunCollective(const OpParams& params, const RankCall& call);

// Whether the group's last rank runs the op on the spot: in strata mode, when
// the whole group moves (inputs + outputs of every rank) at most `limit`
// bytes, handing the op to the host workers would cost more than it buys.
inline bool RunsInline(Mode mode, int64_t bytes_per_rank, int64_t group_size, int64_t limit) {
  return mode == Mode::kStrata && bytes_per_rank * group_size <= limit;
}
// A collective: up to one host chunk (Partition's host_chunk_bytes), the most
// one worker task holds, so the workers would get a single task anyway.
bool RunsInline(const OpParams& params);

// The one rule that puts pure data movement on cores or on SDMA engines,
// used by the runtime (BuildPartitionedPlan, MoE dispatch) and by the
// supernode model (model.cc) alike. An op that uses the engines pays their
// descriptor submission once (StrataCL: ~90 us); the engines then stream the
// rank's bytes (read + written) at 2 x sdma_gbps each. The engines are used
// when that submission is amortised: when streaming the op's bytes on the
// engines takes at least as long as the submission, i.e.
//     bytes_per_rank >= descriptor_us x engines x 2 x sdma_gbps
// (61 MB with the defaults: 90 us, 16 engines, 21.18 GB/s). Below that the
// vector cores move it (no descriptor chain; a core's DataCopy is issued
// directly), as a vendor library picks AIV kernels for small messages.
// Pure timing would always pick the cores (48 cores copy faster than 16
// engines in the preset), but it does not value the cores the offload frees
// for compute; the rule keeps the offload for the ops where it costs at most
// as much again as the transfer. The defaults are the preset's figures
// (stratacl_jax/supernode/spec.py, SupernodeSpec: sdma_descriptor_us, sdma_gbps).
inline constexpr double kSdmaDescriptorUs = 90.0;
inline constexpr double kSdmaGbps = 21.18;
bool MovesOnSdma(int64_t bytes_per_rank, int engines, double descriptor_us = kSdmaDescriptorUs,
                 double sdma_gbps = kSdmaGbps);
// A collective: reductions run on cores; movement by the rule above, over
// the rank's input + output bytes (rows x (in_blocks + out_blocks) x block).
bool MovesOnSdma(const OpParams& p, double descriptor_us = kSdmaDescriptorUs,
                 double sdma_gbps = kSdmaGbps);

// The plan of an op, as the runtime would build it (for the model, tests and
// tools): the op's transfers (params.builder), their lanes and partition.
Plan BuildPartitionedPlan(const OpParams& params);

// A plan built at the rendezvous from the ranks' published data (a ragged
// exchange's sizes), run like a collective's: the job that moves it between
// the buffers in `s` (ptrs[r][0] in, [1] out) in p's mode, on p's lanes (the
// busiest rank's bytes read + written decide cores or SDMA engines) with p's
// planner. `plan` holds its transfers and layout, unpartitioned; p gives the
// same layout (in_blocks, out_blocks, block_bytes, rows). Not cached: such a
// plan changes with the data. buffer_centric stages only the blocks the plan
// reads and writes (others keep the output's values). In strata mode a small
// plan runs here, on the calling thread (RunsInline), leaving the job empty.
// p.movement_lanes >= 0 is the caller's PlanMovesOnSdma choice for `plan`
// (1: SDMA engines), made already; otherwise PlanJob makes it.
Status PlanJob(const Slot& s, Plan plan, OpParams p, std::shared_ptr<Job>* job);

// Where a plan's blocks live on each rank, for PlanPhase: its input, its
// scratch (Plan::scratch_blocks) and its output, one row each.
struct PlanBuffers {
  std::vector<const void*> in, scratch;
  std::vector<void*> out;
  // A fused producer's inputs (PlanPhase), when they are not `in`.
  std::vector<const void*> producer_in;
};
// A partitioned plan's exchange as a phase over `buffers` (one task per host
// chunk), crediting each lane its bytes and the stats the chunk's, as a
// collective's exchange does (`devices`: the NPU of each rank). `staging`:
// the plan writes the ranks' own comm buffers before the exchange
// (buffer_centric's staging in): what it writes is bytes_staged, and its
// lanes are not credited, as a staging copy's are not. With `producer`, whose
// transfer producer_first[r] + j writes block j of rank r's scratch, each
// scratch source is computed from that transfer as it is read (the host
// fuses the two passes the NPUs run one after the other: MoE combine's
// partials into the token's sum; MoE combine's backward reads the rows its
// copies carry where they come from), and the producer's lanes and bytes
// are credited as its own phase's would be, unless `credit_producer` is
// false (a second reader of the same producer).
Phase PlanPhase(std::shared_ptr<const Plan> plan, const PlanBuffers& buffers, std::vector<int32_t> devices,
                bool direct, bool staging = false, std::shared_ptr<const Plan> producer = nullptr,
                std::vector<uint32_t> producer_first = {}, bool credit_producer = true);

// A plan fused with `producer` (as PlanPhase's, producer_first = *first),
// or without one.
struct FusedPlan {
  std::shared_ptr<const Plan> plan, producer;
  std::shared_ptr<const std::vector<uint32_t>> first;
};

// Plans over the same buffers, for OrderedPlanPhase.
struct PlanGroup {
  std::vector<FusedPlan> plans;
  PlanBuffers buffers;
};
// What OrderedPlanPhase's order calls: Run(g, p, t) runs transfer t of
// group g's plan p, every column; RunRange(g, p, begin, end) its transfers
// [begin, end) in order (end past the last: to the last; a weighted or dot
// plan's next sources prefetched);
// RunAll(g, p) all of them.
class TransferRunner {
 public:
  virtual void Run(size_t group, size_t plan, uint32_t transfer) const = 0;
  virtual void RunRange(size_t group, size_t plan, uint32_t begin, uint32_t end) const = 0;
  virtual void RunAll(size_t group, size_t plan) const = 0;

 protected:
  ~TransferRunner() = default;
};
// Runs whole transfers of plans in the caller's order, the host's rather
// than the lanes': task i calls order(i, runner). MoE combine's backward
// runs its owners' shares a few tokens at a time across the owners, so a
// token's carried row comes from memory once for all its products, as a
// token loop reads it, where lane by lane each owner read it again. Nothing is
// credited: the caller credits the plans as partitioned (CreditLanes), the
// NPUs' split of the same transfers.
Phase OrderedPlanPhase(std::vector<PlanGroup> groups, uint64_t tasks,
                       std::function<void(uint64_t task, const TransferRunner& runner)> order);

// Credits a plan's lanes and bytes as running it would, without running it
// (a plan the host runs in its own order, or a producer fused into its
// readers), from its lane credit (PartitionCredit): what running the plan
// partitioned the same way credits.
void CreditLanes(const LaneCredit& credit, const std::vector<int32_t>& devices, bool direct);

// Adds to (*rank_bytes)[r] the bytes per row rank r reads + writes in
// `plan` (sized by the caller: a plan built in parts adds each part's).
void AddRankBytes(const Plan& plan, std::vector<int64_t>* rank_bytes);

// PlanJob's lanes for such a plan (the model's too): reductions on cores;
// movement by MovesOnSdma over the busiest rank's bytes read + written.
bool PlanMovesOnSdma(const Plan& plan, int64_t rows, int engines, double descriptor_us = kSdmaDescriptorUs,
                     double sdma_gbps = kSdmaGbps);

// buffer_centric's form of a plan (PlanJob's; the model's too): what crosses
// between comm buffers, and what each rank does on its own output after
// staging out, as a vendor library's copy-out does. A transfer's destinations
// on the rank before them (Transfer::local_copies: MoE dispatch's fan-out of a
// token to more of a rank's experts) are copied there from the one that
// crossed, and zero fills (MoE's empty expert rows) are written there: neither
// passes through the comm buffers, so the exchange carries one copy per rank
// and the copy-out only what crossed.
struct StagedRuns {
  // The blocks the exchange reads on each rank, as merged runs sorted by
  // start (what is staged in).
  std::vector<std::vector<BlockRun>> in;
  // The copy-out itself: every block of the rank's output that the plan
  // writes, in output order, as runs whose source is contiguous in the comm
  // buffer (src_block < 0: a zero fill). One ordered pass writes each output
  // block once, a local copy straight from the block that crossed (not
  // back out of the user buffer, which cost the cache misses of a second
  // pass over it).
  struct CopyOut {
    int64_t dst_block, src_block, span;
  };
  std::vector<std::vector<CopyOut>> copy_out;  // per rank
  // Per rank, in blocks: those that crossed (staged out), local copies, zero
  // fills (what stats and the model count; lists of them cost the serial
  // step between MoE dispatch's phases more than the rest of it).
  std::vector<int64_t> crossed, copied, zeroed;
};
// Fills `runs` and makes `plan` the plan the comm buffers exchange: its
// transfers without their local copies, zero fills left out (unpartitioned).
void PlanStagedRuns(Plan* plan, StagedRuns* runs);
// PlanStagedRuns in two steps, so the per-rank half may run in parallel
// (PlanJob: in each rank's staging-in task): MarkStagedRuns makes the plan
// the exchanged one and sizes `runs` (serial, one pass over the transfers);
// RankStagedRuns fills rank r's entries of `runs` from its marks (ranks are
// independent).
struct StagedMarks {
  static constexpr int64_t kUntouched = -1, kZero = -2;
  std::vector<std::vector<uint8_t>> read;    // per rank and input block: read by the exchange
  // Per rank and output block: its source block in the comm buffer, kZero or kUntouched.
  std::vector<std::vector<int64_t>> source;
};
StagedMarks MarkStagedRuns(Plan* plan, StagedRuns* runs);
void RankStagedRuns(const StagedMarks& marks, int r, StagedRuns* runs);

// buffer_centric mode: the columns of every block that fit the comm buffer at
// once (the op runs in rounds of this many); <= 0 when not even one fits.
int64_t CommWindowBytes(const OpParams& params);


}  // namespace strata
