// Unit tests of the collectives' plans (algorithms/ + runtime/plan.cc), against
// closed forms: every op of the registry over group sizes 1 to 384, block
// sizes from one element to past a host chunk, 1 to 48 lanes, both planners.
// For each plan:
//   - its transfers say what the op means: every output block is written by
//     exactly one transfer, from exactly the input blocks the op defines
//     (a reduction folds each input once, in rank order);
//   - its pieces cover every transfer's columns exactly once, cut on whole
//     elements, each run by one of the transfer's destination ranks;
//   - the bytes read from and written to each rank's buffers are the op's
//     minimum (each input byte read once, each output byte written once), and
//     the lane tasks' byte counts add up to them; with blocks that split
//     evenly, every rank executes the same share;
//   - a copy-only plan's host moves write every output byte exactly once,
//     from the right source.
// Run by tests/test_cpp_plans.py (which builds it); exits non-zero on any
// failure, naming the plan.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <map>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "../../xla_ffi/algorithms/op_registry.h"
#include "../../xla_ffi/runtime/collective.h"
#include "../../xla_ffi/runtime/plan.h"

namespace strata {
namespace {

int64_t g_checks = 0, g_failures = 0;
std::string g_context;  // the plan being checked, for messages

#define CHECK(cond, ...)                                                              \
  do {                                                                                \
    ++g_checks;                                                                       \
    if (!(cond)) {                                                                    \
      if (++g_failures <= 50) {                                                       \
        std::ostringstream why;                                                       \
        why << __VA_ARGS__;                                                           \
        std::fprintf(stderr, "FAIL %s:%d: %s [%s] %s\n", __FILE__, __LINE__, #cond,   \
                     g_context.c_str(), why.str().c_str());                            \
      }                                                                               \
    }                                                                                 \
  } while (0)

using Ref = std::pair<int32_t, int32_t>;  // (rank, block)

// One plan to build: the op and how it is laid out and split.
struct Case {
  const CollectiveDef* def;
  int n;
  DType dtype;
  int64_t block_bytes;
  int lanes;
  Planner planner;
  int root = 0;
  std::vector<int32_t> perm;  // ppermute: flattened (source, destination) pairs
};

std::string Describe(const Case& c) {
  std::ostringstream os;
  os << c.def->name << " n=" << c.n << " dtype=" << DTypeName(c.dtype) << " block_bytes=" << c.block_bytes
     << " lanes=" << c.lanes << " planner=" << PlannerName(c.planner) << " root=" << c.root << " perm=[";
  for (int32_t v : c.perm) os << v << ',';
  return os.str() + "]";
}

bool Reduces(const CollectiveDef& def) {
  return def.kind == OpKind::kAllReduce || def.kind == OpKind::kReduceScatter;
}

OpParams ParamsOf(const Case& c, int64_t rows = 1) {
  const int reduce_op = static_cast<int>(Reduces(*c.def) ? ReduceOp::kSum : ReduceOp::kNone);
  return MakeOpParams(*c.def, static_cast<int>(c.dtype), reduce_op, c.root, c.perm, c.n, c.block_bytes, rows,
                      static_cast<int>(Mode::kStrata), c.lanes, c.lanes, static_cast<int>(c.planner),
                      200 << 20);
}

// The input blocks output block `out` of a rank is made of, in fold order
// (empty: zero-filled), from the op's definition.
std::vector<Ref> ExpectedSources(const Case& c, Ref out) {
  const auto [rank, block] = out;
  std::vector<Ref> srcs;
  switch (c.def->kind) {
    case OpKind::kAllReduce:
      for (int s = 0; s < c.n; ++s) srcs.push_back({s, 0});
      break;
    case OpKind::kAllGather: srcs.push_back({block, 0}); break;
    case OpKind::kReduceScatter:
      for (int s = 0; s < c.n; ++s) srcs.push_back({s, rank});
      break;
    case OpKind::kAllToAll: srcs.push_back({block, rank}); break;
    case OpKind::kBroadcast: srcs.push_back({c.root, 0}); break;
    case OpKind::kPermute:
      for (size_t i = 0; i + 1 < c.perm.size(); i += 2)
        if (c.perm[i + 1] == rank) srcs.push_back({c.perm[i], 0});
      break;
  }
  return srcs;
}

// Bytes the op must read from and write to rank r's buffers: each input byte
// that feeds some output read once, each output byte written once.
std::pair<int64_t, int64_t> MinimalTraffic(const Case& c, int r) {
  const int64_t b = c.block_bytes, in = c.def->InBlocks(c.n), out = c.def->OutBlocks(c.n);
  switch (c.def->kind) {
    case OpKind::kBroadcast: return {r == c.root ? b : 0, b};
    case OpKind::kPermute: {
      int64_t sent = 0;
      for (size_t i = 0; i + 1 < c.perm.size(); i += 2) sent += c.perm[i] == r;
      return {sent * b, b};
    }
    default: return {in * b, out * b};
  }
}

// [begin, end) intervals cover [0, total) exactly once.
bool TilesExactly(std::vector<std::pair<int64_t, int64_t>> spans, int64_t total) {
  std::sort(spans.begin(), spans.end());
  int64_t at = 0;
  for (const auto& [b, e] : spans) {
    if (b != at || e <= b) return false;
    at = e;
  }
  return at == total;
}

void CheckPlan(const Case& c) {
  g_context = Describe(c);
  const OpParams p = ParamsOf(c);
  const Plan plan = BuildPartitionedPlan(p);
  const int n = c.n;
  const int64_t B = c.block_bytes, esize = static_cast<int64_t>(DTypeSize(c.dtype));
  const int64_t in_blocks = c.def->InBlocks(n), out_blocks = c.def->OutBlocks(n);

  CHECK(plan.num_ranks == n && plan.in_blocks == in_blocks && plan.out_blocks == out_blocks &&
            plan.block_bytes == B,
        "layout " << plan.num_ranks << " ranks, " << plan.in_blocks << " -> " << plan.out_blocks << " blocks");
  CHECK(plan.is_reduction() == Reduces(*c.def), "reduction flag");
  CHECK(!(plan.is_reduction() && plan.on_sdma), "a reduction was put on the SDMA engines");

  // What the transfers mean.
  std::map<Ref, std::vector<uint32_t>> writers;  // output block -> transfers writing it
  for (uint32_t ti = 0; ti < plan.transfers.size(); ++ti) {
    const Transfer& t = plan.transfers[ti];
    CHECK(plan.is_reduction() || t.src_count <= 1, "transfer " << ti << " copies from " << t.src_count << " sources");
    for (uint32_t k = 0; k < t.src_count; ++k) {
      const BlockRef& s = plan.refs[t.src_begin + k];
      CHECK(s.rank >= 0 && s.rank < n && s.block >= 0 && s.block < in_blocks,
            "transfer " << ti << " reads block " << s.block << " of rank " << s.rank);
    }
    for (uint32_t k = 0; k < t.dst_count; ++k) {
      const BlockRef& d = plan.refs[t.dst_begin + k];
      CHECK(d.rank >= 0 && d.rank < n && d.block >= 0 && d.block < out_blocks,
            "transfer " << ti << " writes block " << d.block << " of rank " << d.rank);
      writers[{d.rank, d.block}].push_back(ti);
    }
  }
  for (int r = 0; r < n; ++r)
    for (int b = 0; b < out_blocks; ++b) {
      const auto it = writers.find({r, b});
      const size_t count = it == writers.end() ? 0 : it->second.size();
      CHECK(count == 1, "output block " << b << " of rank " << r << " is written by " << count << " transfers");
      if (count != 1) continue;
      const Transfer& t = plan.transfers[it->second[0]];
      std::vector<Ref> got;
      for (uint32_t k = 0; k < t.src_count; ++k)
        got.push_back({plan.refs[t.src_begin + k].rank, plan.refs[t.src_begin + k].block});
      // The exact list: a reduction folds every input once, in rank order (every rank gets the same bits).
      CHECK(got == ExpectedSources(c, {r, b}), "output block " << b << " of rank " << r << " has the wrong sources");
    }
  CHECK(writers.size() == static_cast<size_t>(n * out_blocks), "transfers write blocks outside the outputs");

  // The pieces: every transfer's columns once, on whole elements, by a destination rank.
  std::vector<std::vector<std::pair<int64_t, int64_t>>> columns(plan.transfers.size());
  std::vector<int64_t> read_from(n, 0), written_to(n, 0), executed(n, 0);
  uint32_t next_piece = 0;
  std::map<std::pair<int32_t, int32_t>, int> lanes_seen;
  int64_t task_total = 0;
  for (const LaneTask& task : plan.tasks) {
    CHECK(task.piece_begin == next_piece && task.piece_end > task.piece_begin,
          "lane tasks do not take the pieces in order, each at least one");
    next_piece = task.piece_end;
    CHECK(task.npu >= 0 && task.npu < n && task.lane >= 0 && task.lane < plan.lanes_per_npu,
          "task on NPU " << task.npu << " lane " << task.lane);
    const int tasks_on_lane = ++lanes_seen[std::make_pair(task.npu, task.lane)];
    CHECK(tasks_on_lane == 1, "two tasks for lane " << task.lane << " of NPU " << task.npu);
    int64_t bytes = 0;
    for (uint32_t i = task.piece_begin; i < task.piece_end && i < plan.pieces.size(); ++i) {
      const Piece& piece = plan.pieces[i];
      const Transfer& t = plan.transfers[piece.transfer];
      const int64_t len = piece.col_end - piece.col_begin;
      CHECK(piece.executor == task.npu, "piece " << i << " runs on NPU " << piece.executor << " in a task of NPU " << task.npu);
      CHECK(piece.col_begin % esize == 0 && piece.col_end % esize == 0,
            "piece " << i << " cuts an element: [" << piece.col_begin << ", " << piece.col_end << ")");
      bool by_destination = false;
      for (uint32_t k = 0; k < t.dst_count; ++k) by_destination |= plan.refs[t.dst_begin + k].rank == piece.executor;
      CHECK(by_destination, "piece " << i << " of transfer " << piece.transfer << " runs on NPU " << piece.executor
                                     << ", not one of the ranks it writes");
      columns[piece.transfer].push_back({piece.col_begin, piece.col_end});
      for (uint32_t k = 0; k < t.src_count; ++k) read_from[plan.refs[t.src_begin + k].rank] += len;
      for (uint32_t k = 0; k < t.dst_count; ++k) written_to[plan.refs[t.dst_begin + k].rank] += len;
      bytes += len * (t.src_count + t.dst_count);
    }
    CHECK(task.bytes == bytes, "task of NPU " << task.npu << " lane " << task.lane << " counts " << task.bytes
                                              << " bytes, its pieces move " << bytes);
    executed[task.npu] += bytes;
    task_total += bytes;
  }
  CHECK(next_piece == plan.pieces.size(), "pieces outside every lane task");
  for (uint32_t ti = 0; ti < plan.transfers.size(); ++ti)
    CHECK(TilesExactly(columns[ti], plan.transfers[ti].dst_count > 0 ? B : 0),
          "transfer " << ti << "'s pieces do not cover its " << B << " columns exactly once");

  // Traffic per rank's buffers: the op's minimum.
  int64_t minimal_total = 0;
  for (int r = 0; r < n; ++r) {
    const auto [reads, writes] = MinimalTraffic(c, r);
    CHECK(read_from[r] == reads, "rank " << r << "'s input is read " << read_from[r] << " bytes, the op needs " << reads);
    CHECK(written_to[r] == writes, "rank " << r << "'s output is written " << written_to[r] << " bytes, not " << writes);
    minimal_total += reads + writes;
  }
  CHECK(task_total == minimal_total, "lane tasks move " << task_total << " bytes, the op " << minimal_total);
  // Blocks that split into whole aligned shares of at least 4 KiB per rank
  // (plan.cc's minimum share): every rank executes the same bytes.
  const bool even_shares = B % (64 * n) == 0 && B / n >= 4096;
  const bool symmetric = c.def->kind != OpKind::kPermute && c.def->kind != OpKind::kBroadcast;
  if (even_shares && symmetric)
    for (int r = 0; r < n; ++r)
      CHECK(executed[r] * n == minimal_total, "rank " << r << " executes " << executed[r] << " of " << minimal_total << " bytes");

  // Host chunks run the tasks in order, all of them.
  CHECK(!plan.chunk_starts.empty() && plan.chunk_starts.front() == 0 && plan.chunk_starts.back() == plan.tasks.size() &&
            std::is_sorted(plan.chunk_starts.begin(), plan.chunk_starts.end()),
        "host chunks do not split the tasks in order");

  // The host's moves of a copy-only plan: every output byte once, from its source.
  if (!plan.moves.empty()) {
    CHECK(plan.move_starts.size() == plan.chunk_starts.size() && plan.move_starts.back() == plan.moves.size(),
          "moves are not split over the host chunks");
    std::map<Ref, std::vector<std::pair<int64_t, int64_t>>> written;
    for (const Move& m : plan.moves)
      for (int32_t k = 0; k < m.count; ++k) {
        const Ref src{m.src_rank + k * m.src_rank_step, m.src_block + k * m.src_block_step};
        const Ref dst{m.dst_rank + k * m.dst_rank_step, m.dst_block + k * m.dst_block_step};
        const std::vector<Ref> want = ExpectedSources(c, dst);
        CHECK(want.size() == 1 && want[0] == src, "a move copies block " << src.second << " of rank " << src.first
                                                      << " to block " << dst.second << " of rank " << dst.first);
        written[dst].push_back({m.col, m.col + m.len});
      }
    for (auto& [dst, spans] : written)
      CHECK(TilesExactly(spans, B), "the moves do not write block " << dst.second << " of rank " << dst.first
                                                                   << " exactly once");
    int64_t sourced_blocks = 0;
    for (int r = 0; r < n; ++r)
      for (int b = 0; b < out_blocks; ++b) sourced_blocks += !ExpectedSources(c, {r, b}).empty();
    CHECK(static_cast<int64_t>(written.size()) == sourced_blocks, "the moves write " << written.size()
                                                                                      << " blocks, the op " << sourced_blocks);
  }
}

// One plan serves every batch size: rows change no transfer, piece or task.
void CheckRowsIndependent(const Case& c) {
  g_context = Describe(c) + " rows 1 vs 7";
  OpParams one = ParamsOf(c, 1), seven = ParamsOf(c, 7);
  one.movement_lanes = seven.movement_lanes = 0;  // rows may tip the SDMA rule; compare on cores
  const Plan a = BuildPartitionedPlan(one), b = BuildPartitionedPlan(seven);
  bool same = a.transfers.size() == b.transfers.size() && a.pieces.size() == b.pieces.size() &&
              a.tasks.size() == b.tasks.size();
  for (size_t i = 0; same && i < a.pieces.size(); ++i)
    same = a.pieces[i].transfer == b.pieces[i].transfer && a.pieces[i].col_begin == b.pieces[i].col_begin &&
           a.pieces[i].col_end == b.pieces[i].col_end && a.pieces[i].executor == b.pieces[i].executor;
  CHECK(same, "the plan depends on rows");
}

// buffer_centric's rounds: the window's columns of every block fit the comm buffer.
void CheckCommWindow(const Case& c) {
  for (int64_t buffer : {int64_t{1} << 10, int64_t{1} << 20, int64_t{200} << 20}) {
    for (int64_t rows : {1, 3}) {
      g_context = Describe(c) + " comm_buffer_bytes=" + std::to_string(buffer) + " rows=" + std::to_string(rows);
      OpParams p = ParamsOf(c, rows);
      p.comm_buffer_bytes = buffer;
      const int64_t window = CommWindowBytes(p), blocks = std::max(p.in_blocks, p.out_blocks);
      const int64_t esize = static_cast<int64_t>(DTypeSize(c.dtype));
      if (window <= 0) {
        CHECK(buffer < rows * blocks * esize, "no window although one element of every block fits");
        continue;
      }
      CHECK(window * rows * blocks <= buffer, "window " << window << " overflows the buffer");
      CHECK(window % esize == 0, "window " << window << " cuts an element");
      CHECK(window >= std::min<int64_t>(64, buffer / (rows * blocks) / esize * esize),
            "window " << window << " smaller than the buffer allows");
    }
  }
}

void CheckRegistry() {
  g_context = "registry";
  const auto& defs = Collectives();
  CHECK(static_cast<int32_t>(defs.size()) == kOpKindCount, defs.size() << " entries for " << kOpKindCount << " kinds");
  for (size_t i = 0; i < defs.size(); ++i) {
    const CollectiveDef& def = defs[i];
    g_context = std::string("registry ") + def.name;
    CHECK(static_cast<size_t>(def.kind) == i && def.builder.code == static_cast<int32_t>(i),
          "entry " << i << " has kind " << static_cast<int>(def.kind) << ", code " << def.builder.code);
    CHECK(std::string(def.builder.name) == std::string("strata.") + def.name, "runtime name " << def.builder.name);
    CHECK(def.builder.add_transfers != nullptr, "no transfers");
    CHECK(FindCollective(def.name) == &def && FindCollective(def.builder.code) == &def, "lookup");
    for (int n : {1, 2, 3, 8, 384}) {
      // nccl-tests' busbw / algbw: all_reduce moves 2(n-1)/n of the message over a rank's links,
      // the per-peer ops (n-1)/n, broadcast and ppermute the message.
      const double want = def.kind == OpKind::kAllReduce ? 2.0 * (n - 1) / n
                          : def.in_blocks == Blocks::kPerRank || def.out_blocks == Blocks::kPerRank
                              ? static_cast<double>(n - 1) / n
                              : 1.0;
      CHECK(def.bus_factor(n) == want, "bus factor " << def.bus_factor(n) << " at n=" << n);
    }
  }
  CHECK(FindCollective(kOpKindCount) == nullptr && FindCollective(-1) == nullptr && FindCollective("psum") == nullptr,
        "lookup of an unknown op");
}

// Permutations of n ranks lax.ppermute accepts: a ring, its reverse, a
// partial one (ranks that receive nothing get zeros), none, the identity.
std::vector<std::vector<int32_t>> Permutations(int n) {
  std::vector<std::vector<int32_t>> perms(5);
  for (int i = 0; i < n; ++i) {
    perms[0].insert(perms[0].end(), {i, (i + 1) % n});
    perms[1].insert(perms[1].end(), {i, (i + n - 1) % n});
    if (i % 2 == 0) perms[2].insert(perms[2].end(), {i, n - 1 - i});
    perms[4].insert(perms[4].end(), {i, i});
  }
  return perms;
}

}  // namespace
}  // namespace strata

int main() {
  using namespace strata;
  CheckRegistry();
  int64_t plans = 0;
  struct Sizes {
    DType dtype;
    std::vector<int64_t> block_bytes;
  };
  // One element, odd sizes, 4 KiB shares, sizes that split over 8 ranks'
  // 64-byte columns, and past one host chunk (1 MiB).
  const std::vector<Sizes> sizes = {
      {DType::F32, {0, 4, 100, 4096, 12352, 65536, (1 << 20) + 192}},
      {DType::BF16, {2, 130, 32768}},
      {DType::C128, {16, 4112}},
  };
  for (const CollectiveDef& def : Collectives())
    for (int n : {1, 2, 3, 5, 8, 13})
      for (const Sizes& s : sizes)
        for (int64_t block_bytes : s.block_bytes)
          for (int lanes : {1, 3, 48})
            for (Planner planner : {Planner::kBalanced, Planner::kNaive}) {
              Case c{&def, n, s.dtype, block_bytes, lanes, planner, 0, {}};
              std::vector<std::vector<int32_t>> perms = {{}};
              if (def.kind == OpKind::kPermute) perms = Permutations(n);
              for (int root : def.kind == OpKind::kBroadcast ? std::vector<int>{0, n - 1} : std::vector<int>{0})
                for (const auto& perm : perms) {
                  c.root = root;
                  c.perm = perm;
                  CheckPlan(c);
                  ++plans;
                }
              if (lanes == 3 && planner == Planner::kBalanced) {
                CheckRowsIndependent(c);
                CheckCommWindow(c);
              }
            }
  // A supernode's group: many tiny transfers (all_to_all of one float per peer: 147k).
  for (const CollectiveDef& def : Collectives())
    for (int64_t block_bytes : {4, 4096 * 384}) {
      if (block_bytes > 4 && def.OutBlocks(384) * def.InBlocks(384) > 1) continue;  // keep it quick
      Case c{&def, 384, DType::F32, block_bytes, 48, Planner::kBalanced, 0, {}};
      if (def.kind == OpKind::kPermute) c.perm = Permutations(384)[0];
      CheckPlan(c);
      ++plans;
    }
  std::printf("test_plans: %lld plans, %lld checks, %lld failures\n", static_cast<long long>(plans),
              static_cast<long long>(g_checks), static_cast<long long>(g_failures));
  return g_failures == 0 ? 0 : 1;
}
