#include "ragged_all_to_all.h"

#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "../runtime/executor.h"
#include "../runtime/observer.h"
#include "../runtime/stats.h"
#include "op_registry.h"

namespace strata {
namespace {

// The registry's name of the op, "strata.ragged_all_to_all".
const char* const kName = Collective(OpKind::kRaggedAllToAll).builder.name;

std::string Describe(const RaggedParams& p) {
  std::ostringstream os;
  os << kName << " dtype=" << DTypeName(p.dtype) << " group_size=" << p.group_size
     << " operand_rows=" << p.operand_rows << " output_rows=" << p.output_rows
     << " row_bytes=" << p.row_bytes << " slices_per_peer=" << p.slices_per_peer << " mode=" << ModeName(p.mode)
     << " cores=" << p.cores << " engines=" << p.engines << " planner=" << PlannerName(p.planner)
     << " comm_buffer_bytes=" << p.comm_buffer_bytes << " index_types=";
  for (IndexType t : p.index_types) os << static_cast<int>(t);
  return os.str();
}

// Entry i of a vector of type t, exactly (a uint64 past int64's range reads
// as INT64_MAX: out of range either way).
int64_t ReadIndex(const void* v, IndexType t, int i) {
  switch (t) {
    case IndexType::S32: return static_cast<const int32_t*>(v)[i];
    case IndexType::S64: return static_cast<const int64_t*>(v)[i];
    case IndexType::U32: return static_cast<const uint32_t*>(v)[i];
    case IndexType::U64: {
      const uint64_t u = static_cast<const uint64_t*>(v)[i];
      return u > static_cast<uint64_t>(INT64_MAX) ? INT64_MAX : static_cast<int64_t>(u);
    }
  }
  return 0;
}

// One rank's vectors as int64, for an observer (only when one is installed).
RaggedRankSizes SizesOf(const RaggedParams& p, const RaggedBuffers& b) {
  RaggedRankSizes sizes;
  sizes.slices_per_peer = p.slices_per_peer;
  const int entries = p.group_size * p.slices_per_peer;
  const void* vectors[3] = {b.input_offsets, b.send_sizes, b.output_offsets};
  std::vector<int64_t>* into[3] = {&sizes.input_offsets, &sizes.send_sizes, &sizes.output_offsets};
  for (int v = 0; v < 3; ++v) {
    into[v]->resize(entries);
    for (int i = 0; i < entries; ++i) (*into[v])[i] = ReadIndex(vectors[v], p.index_types[v], i);
  }
  return sizes;
}

}  // namespace

OpParams RaggedRunParams(const RaggedParams& p) {
  OpParams o;
  // The registry's entry names the op (its plans are built at the
  // rendezvous: the entry has no transfers function).
  o.builder = &Collective(OpKind::kRaggedAllToAll).builder;
  o.dtype = p.dtype;
  o.group_size = p.group_size;
  o.in_blocks = p.operand_rows;
  o.out_blocks = p.output_rows;
  o.block_bytes = p.row_bytes;
  o.rows = 1;
  o.mode = p.mode;
  o.cores = p.cores;
  o.engines = p.engines;
  o.planner = p.planner;
  o.comm_buffer_bytes = p.comm_buffer_bytes;
  return o;
}

Status BuildRaggedPlan(const RaggedParams& p, const std::vector<RaggedVectors>& ranks, Plan* plan) {
  const int n = static_cast<int>(ranks.size()), k = p.slices_per_peer;
  // Plans name blocks (rows) by int32.
  if (p.operand_rows > INT32_MAX || p.output_rows > INT32_MAX)
    return Status::Error(std::string(kName) + ": more than " + std::to_string(INT32_MAX) +
                         " rows per buffer is not supported");
  plan->num_ranks = n;
  plan->in_blocks = p.operand_rows;
  plan->out_blocks = p.output_rows;
  plan->block_bytes = p.row_bytes;
  plan->dtype = p.dtype;
  plan->op = ReduceOp::kNone;
  auto at = [&](int r, int v, int i) { return ReadIndex(ranks[r][v], p.index_types[v], i); };
  for (int src = 0; src < n; ++src) {
    for (int i = 0; i < n * k; ++i) {
      const int dst = i / k;
      const int64_t rows = at(src, 1, i), i0 = at(src, 0, i), o0 = at(src, 2, i);
      const int64_t expected = at(dst, 3, src * k + i % k);
      const bool in_operand = rows == 0 || (i0 >= 0 && rows <= p.operand_rows && i0 <= p.operand_rows - rows);
      const bool in_output = rows == 0 || (o0 >= 0 && rows <= p.output_rows && o0 <= p.output_rows - rows);
      if (rows > 0 && rows == expected && in_operand && in_output) {
        plan->Add({{src, static_cast<int32_t>(i0)}}, {{dst, static_cast<int32_t>(o0)}}, static_cast<uint32_t>(rows));
        continue;
      }
      if (rows == 0 && expected == 0) continue;
      // The first bad entry, named; only it pays for formatting a message.
      std::ostringstream os;
      if (rows < 0)
        os << "rank " << src << " sends a negative size send_sizes[" << i << "]=" << rows;
      else if (rows != expected)
        os << "rank " << src << " sends send_sizes[" << i << "]=" << rows << " rows to rank " << dst
           << ", whose recv_sizes[" << src * k + i % k << "] says " << expected;
      else if (!in_operand)
        os << "rank " << src << ": input_offsets[" << i << "]=" << i0 << " + send_sizes[" << i << "]="
           << rows << " is outside its operand's " << p.operand_rows << " rows";
      else
        os << "rank " << src << ": output_offsets[" << i << "]=" << o0 << " + send_sizes[" << i << "]="
           << rows << " is outside rank " << dst << "'s output of " << p.output_rows << " rows";
      return Status::Error(std::string(kName) + ": " + os.str());
    }
  }
  return Status::Ok();
}

void RaggedAllToAllAsync(const RaggedParams& p, const CallSite& c, const RaggedBuffers& b,
                         std::function<void(const Status&)> done) {
  if (c.rank < 0 || c.rank >= p.group_size)
    return done(Status::Error(std::string(kName) + ": rank " + std::to_string(c.rank) +
                              " is out of range for a group of " + std::to_string(p.group_size)));
  if (OpObserver* observer = ActiveObserver())
    done = observer->OnRagged(RaggedRunParams(p), SizesOf(p, b), c, std::move(done));
  GlobalStats().ops++;
  PtrList ptrs = {const_cast<void*>(b.operand), b.out,
                  const_cast<void*>(b.input_offsets), const_cast<void*>(b.send_sizes),
                  const_cast<void*>(b.output_offsets), const_cast<void*>(b.recv_sizes)};
  JoinAsync(c.As(kName, p.group_size), ptrs, Signature::Of(Describe(p)), std::move(done),
            [p](Slot& s, std::shared_ptr<Job>* job) -> Status {
              std::vector<RaggedVectors> ranks(s.n);
              for (int r = 0; r < s.n; ++r) ranks[r] = {s.ptrs[r][2], s.ptrs[r][3], s.ptrs[r][4], s.ptrs[r][5]};
              Plan plan;
              Status st = BuildRaggedPlan(p, ranks, &plan);
              if (!st.ok) return st;
              return PlanJob(s, std::move(plan), RaggedRunParams(p), job);
            });
}

}  // namespace strata
