#include "op_registry.h"

#include <cstring>

#include "algorithms.h"

namespace strata {

namespace {

double AllReduceBusFactor(int n) { return 2.0 * (n - 1) / n; }
double PeerBusFactor(int n) { return static_cast<double>(n - 1) / n; }  // each rank's (n-1)/n leaves it
double WholeBusFactor(int) { return 1.0; }

// `qualified`: the name errors and traces use, "strata.<name>".
CollectiveDef Def(OpKind kind, const char* name, const char* qualified,
                  void (*add_transfers)(const OpParams&, Plan&), Blocks in, Blocks out,
                  double (*bus_factor)(int)) {
  return {kind, name, {static_cast<int32_t>(kind), qualified, add_transfers}, in, out, bus_factor};
}

}  // namespace

const std::vector<CollectiveDef>& Collectives() {
  using B = Blocks;
  // One row per op, in OpKind order (an op's code indexes this table).
  static const std::vector<CollectiveDef> defs = {
      Def(OpKind::kAllReduce, "all_reduce", "strata.all_reduce", BuildAllReducePlan,
          B::kOne, B::kOne, AllReduceBusFactor),
      Def(OpKind::kAllGather, "all_gather", "strata.all_gather", BuildAllGatherPlan,
          B::kOne, B::kPerRank, PeerBusFactor),
      Def(OpKind::kReduceScatter, "reduce_scatter", "strata.reduce_scatter", BuildReduceScatterPlan,
          B::kPerRank, B::kOne, PeerBusFactor),
      Def(OpKind::kAllToAll, "all_to_all", "strata.all_to_all", BuildAllToAllPlan,
          B::kPerRank, B::kPerRank, PeerBusFactor),
      Def(OpKind::kBroadcast, "broadcast", "strata.broadcast", BuildBroadcastPlan,
          B::kOne, B::kOne, WholeBusFactor),
      Def(OpKind::kPermute, "ppermute", "strata.ppermute", BuildPermutePlan,
          B::kOne, B::kOne, WholeBusFactor),
      // Its plan: BuildRaggedPlan from every rank's offsets and sizes. Uniform
      // sizes are an all_to_all's traffic, hence its bus factor.
      Def(OpKind::kRaggedAllToAll, "ragged_all_to_all", "strata.ragged_all_to_all", nullptr,
          B::kPerRow, B::kPerRow, PeerBusFactor),
      // Its plan: BuildMoeDispatchPlan from the slots the routing got (blocks:
      // token rows in, expert rows out). Each rank's tokens leave it as in an
      // all_to_all, hence its bus factor.
      Def(OpKind::kMoeDispatch, "moe_dispatch", "strata.moe.dispatch", nullptr,
          B::kPerRow, B::kPerRow, PeerBusFactor),
  };
  return defs;
}

const CollectiveDef& Collective(OpKind kind) { return Collectives()[static_cast<size_t>(kind)]; }

const CollectiveDef* FindCollective(int code) {
  const auto& defs = Collectives();
  return code >= 0 && static_cast<size_t>(code) < defs.size() ? &defs[code] : nullptr;
}

const CollectiveDef* FindCollective(const char* name) {
  for (const CollectiveDef& def : Collectives())
    if (std::strcmp(def.name, name) == 0) return &def;
  return nullptr;
}

OpParams MakeOpParams(const CollectiveDef& def, int dtype, int reduce_op, int root,
                      std::vector<int32_t> perm, int group_size, int64_t block_bytes, int64_t rows,
                      int mode, int cores, int engines, int planner, int64_t comm_buffer_bytes) {
  OpParams p;
  p.builder = &def.builder;
  p.dtype = static_cast<DType>(dtype);
  p.op = static_cast<ReduceOp>(reduce_op);
  p.root = root;
  p.perm = std::move(perm);
  p.group_size = group_size;
  p.in_blocks = def.InBlocks(group_size);
  p.out_blocks = def.OutBlocks(group_size);
  p.block_bytes = block_bytes;
  p.rows = rows;
  p.mode = static_cast<Mode>(mode);
  p.cores = cores;
  p.engines = engines;
  p.planner = static_cast<Planner>(planner);
  p.comm_buffer_bytes = comm_buffer_bytes;
  return p;
}

}  // namespace strata
