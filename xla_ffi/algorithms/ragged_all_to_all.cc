#include "ragged_all_to_all.h"

#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "../runtime/copy.h"
#include "../runtime/executor.h"
#include "../runtime/stats.h"

namespace strata {
namespace {

constexpr const char* kName = "strata.ragged_all_to_all";

std::string Describe(const RaggedParams& p) {
  std::ostringstream os;
  os << kName << " dtype=" << DTypeName(p.dtype) << " group_size=" << p.group_size
     << " operand_rows=" << p.operand_rows << " output_rows=" << p.output_rows
     << " row_bytes=" << p.row_bytes << " slices_per_peer=" << p.slices_per_peer << " index_types=";
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

struct Copy {
  const char* src;
  char* dst;
  int64_t bytes;
};

// Every (sender, receiver) run of rows, after checking each against the
// buffers and the receiver's recv_sizes; the first bad one is the error.
Status PlanCopies(const RaggedParams& p, const Slot& s, std::vector<Copy>* copies) {
  const int n = s.n, k = p.slices_per_peer;
  // ptrs 2..5: input_offsets, send_sizes, output_offsets, recv_sizes.
  auto at = [&](int r, int v, int i) { return ReadIndex(s.ptrs[r][v], p.index_types[v - 2], i); };
  for (int src = 0; src < n; ++src) {
    for (int i = 0; i < n * k; ++i) {
      const int dst = i / k;
      const int64_t rows = at(src, 3, i), i0 = at(src, 2, i), o0 = at(src, 4, i);
      const int64_t expected = at(dst, 5, src * k + i % k);
      std::ostringstream os;
      if (rows < 0)
        os << "rank " << src << " sends a negative size send_sizes[" << i << "]=" << rows;
      else if (rows != expected)
        os << "rank " << src << " sends send_sizes[" << i << "]=" << rows << " rows to rank " << dst
           << ", whose recv_sizes[" << src * k + i % k << "] says " << expected;
      else if (rows > 0 && (i0 < 0 || rows > p.operand_rows || i0 > p.operand_rows - rows))
        os << "rank " << src << ": input_offsets[" << i << "]=" << i0 << " + send_sizes[" << i << "]="
           << rows << " is outside its operand's " << p.operand_rows << " rows";
      else if (rows > 0 && (o0 < 0 || rows > p.output_rows || o0 > p.output_rows - rows))
        os << "rank " << src << ": output_offsets[" << i << "]=" << o0 << " + send_sizes[" << i << "]="
           << rows << " is outside rank " << dst << "'s output of " << p.output_rows << " rows";
      if (!os.str().empty()) return Status::Error(std::string(kName) + ": " + os.str());
      if (rows == 0 || p.row_bytes == 0) continue;
      copies->push_back({static_cast<const char*>(s.ptrs[src][0]) + i0 * p.row_bytes,
                         static_cast<char*>(s.ptrs[dst][1]) + o0 * p.row_bytes, rows * p.row_bytes});
    }
  }
  return Status::Ok();
}

}  // namespace

void RaggedAllToAllAsync(const RaggedParams& p, const CallSite& c, const RaggedBuffers& b,
                         std::function<void(const Status&)> done) {
  if (c.rank < 0 || c.rank >= p.group_size)
    return done(Status::Error(std::string(kName) + ": rank " + std::to_string(c.rank) +
                              " is out of range for a group of " + std::to_string(p.group_size)));
  GlobalStats().ops++;
  PtrList ptrs = {const_cast<void*>(b.operand), b.out,
                  const_cast<void*>(b.input_offsets), const_cast<void*>(b.send_sizes),
                  const_cast<void*>(b.output_offsets), const_cast<void*>(b.recv_sizes)};
  JoinAsync(c.As(kName, p.group_size), ptrs, Signature::Of(Describe(p)), std::move(done),
            [p](Slot& s, std::shared_ptr<Job>* job) -> Status {
              auto copies = std::make_shared<std::vector<Copy>>();
              Status st = PlanCopies(p, s, copies.get());
              if (!st.ok) return st;
              int64_t total = 0;
              for (const Copy& k : *copies) total += k.bytes;
              GlobalStats().AddExchanged(total, /*direct=*/true);
              *job = std::make_shared<Job>();
              if (total <= kRaggedInlineGroupBytes) {
                for (const Copy& k : *copies) CopyBytes(k.dst, k.src, k.bytes, false);
                return Status::Ok();
              }
              Phase phase;
              phase.count = copies->size();
              phase.run = [copies](uint64_t i) {
                const Copy& k = (*copies)[i];
                CopyBytes(k.dst, k.src, k.bytes, false);
              };
              (*job)->phases.push_back(std::move(phase));
              return Status::Ok();
            });
}

}  // namespace strata
