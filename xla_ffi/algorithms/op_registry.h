// The collectives, each defined once: its name, the blocks its buffers hold,
// its plan builder and its bus factor. The bindings, the model's bindings,
// the Python layer (through _core) and the C++ tests read them from here.
#pragma once
#include <cstdint>
#include <vector>

#include "../runtime/collective.h"

namespace strata {

// Codes in registry order; Python passes them (from _core.op_names()).
enum class OpKind : int32_t { kAllReduce = 0, kAllGather, kReduceScatter, kAllToAll, kBroadcast, kPermute };
inline constexpr int32_t kOpKindCount = static_cast<int32_t>(OpKind::kPermute) + 1;

// How many blocks one rank's input or output holds over a group of n ranks.
enum class Blocks : int32_t {
  kOne,      // the whole buffer is one block
  kPerRank,  // one block per rank of the group (a rank's share or a peer's data)
};

struct CollectiveDef {
  OpKind kind;
  const char* name;     // "all_reduce": Python's and the model's name of the op
  PlanBuilder builder;  // what the runtime runs: code == kind, "strata.<name>", the transfers
  Blocks in_blocks, out_blocks;
  // nccl-tests' busbw / algbw over a group of n ranks (doc/PERFORMANCE.md).
  double (*bus_factor)(int n);

  int64_t InBlocks(int n) const { return in_blocks == Blocks::kPerRank ? n : 1; }
  int64_t OutBlocks(int n) const { return out_blocks == Blocks::kPerRank ? n : 1; }
};

// Every collective, in OpKind order.
const std::vector<CollectiveDef>& Collectives();
const CollectiveDef& Collective(OpKind kind);
// The op with this code or name, or nullptr.
const CollectiveDef* FindCollective(int code);
const CollectiveDef* FindCollective(const char* name);

// An op's parameters from the plain values bindings and tools pass (enums as
// ints): its builder and block counts from `def`, the rest as given.
OpParams MakeOpParams(const CollectiveDef& def, int dtype, int reduce_op, int root,
                      std::vector<int32_t> perm, int group_size, int64_t block_bytes, int64_t rows,
                      int mode, int cores, int engines, int planner, int64_t comm_buffer_bytes);

}  // namespace strata
