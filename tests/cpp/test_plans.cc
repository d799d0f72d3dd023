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
// ragged_all_to_all's plans, built from random offset/size vectors (any index
// type, several slices per peer, empty slices, gaps), are checked alike: every
// output row is written once, from the sender row the vectors name; each
// rank's bytes read and written are its send and receive sizes' sums; the
// lanes and moves cover every transfer's span once. Bad vectors are errors.
// The model times them from that plan: per-lane and staged bytes as the
// runtime moves them, and a uniform exchange exactly as an all_to_all.
// MoE dispatch's plans, built from the slots random routings get (with
// drops), are checked against the routing: every expert row is written once,
// filled rows from the token that fills them, empty ones zeroed; each
// transfer with sources carries to one rank (DeepEP's rule), so the rows
// carried are the distinct (token, rank) pairs and the rest are local copies.
// MoE combine's two plans (the owners' partials, the tokens' sums), built
// from random routings' slots and weights, are run on the host as the runtime
// runs them (fused, and staged through scratch) and checked bit for bit
// against combine's documented order computed here; each token's rows reach
// its rank once per owner, and the plans' bytes are the pairs'.
// Run by tests/test_cpp_plans.py (which builds it); exits non-zero on any
// failure, naming the plan.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <map>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "../../xla_ffi/algorithms/moe_backward_plan.h"
#include "../../xla_ffi/algorithms/moe_combine_plan.h"
#include "../../xla_ffi/algorithms/moe_plan.h"
#include "../../xla_ffi/algorithms/op_registry.h"
#include "../../xla_ffi/algorithms/ragged_all_to_all.h"
#include "../../xla_ffi/model/model.h"
#include "../../xla_ffi/runtime/collective.h"
#include "../../xla_ffi/runtime/plan.h"
#include "../../xla_ffi/runtime/reduce_isa.h"

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

// PlanPartition's split by NPU, as PlanJob runs it (NPUs on different
// threads, in any order), gives Partition's plan piece for piece: an NPU's
// split reads and writes only its own share of the state.
bool SamePieces(const Piece& a, const Piece& b) {
  return a.transfer == b.transfer && a.executor == b.executor && a.col_begin == b.col_begin && a.col_end == b.col_end;
}
bool SameTasks(const LaneTask& a, const LaneTask& b) {
  return a.npu == b.npu && a.lane == b.lane && a.piece_begin == b.piece_begin && a.piece_end == b.piece_end &&
         a.bytes == b.bytes;
}
bool SameMoves(const Move& a, const Move& b) {
  return a.src_rank == b.src_rank && a.src_block == b.src_block && a.dst_rank == b.dst_rank &&
         a.dst_block == b.dst_block && a.col == b.col && a.len == b.len && a.count == b.count &&
         a.src_rank_step == b.src_rank_step && a.src_block_step == b.src_block_step &&
         a.dst_rank_step == b.dst_rank_step && a.dst_block_step == b.dst_block_step;
}
template <typename T, typename Eq>
bool SameList(const std::vector<T>& a, const std::vector<T>& b, Eq eq) {
  return a.size() == b.size() && std::equal(a.begin(), a.end(), b.begin(), eq);
}

// PartitionCredit of a plan gives what Partition's tasks and chunks credit:
// the same lanes with the same bytes, in the same order, and the same bytes
// by kind (the runtime credits plans it runs in its own order this way).
void CheckCredit(const Plan& partitioned, int lanes, Planner planner, int64_t align = 64) {
  LaneCredit credit;
  PartitionCredit(partitioned, lanes, planner, &credit, align);
  std::vector<std::tuple<int32_t, int32_t, int64_t>> want, got;
  for (const LaneTask& t : partitioned.tasks) want.emplace_back(t.npu, t.lane, t.bytes);
  for (const LaneTask& t : credit.tasks) got.emplace_back(t.npu, t.lane, t.bytes);
  ChunkBytes sum;
  for (const ChunkBytes& b : partitioned.chunk_bytes) {
    sum.carried += b.carried;
    sum.local += b.local;
    sum.written += b.written;
  }
  CHECK(got == want, "PartitionCredit's lanes differ from Partition's: " << got.size() << " tasks vs " << want.size());
  CHECK(credit.bytes.carried == sum.carried && credit.bytes.local == sum.local && credit.bytes.written == sum.written,
        "PartitionCredit's bytes by kind differ from Partition's chunks: carried " << credit.bytes.carried << " vs "
                                                                              << sum.carried << ", local "
                                                                              << credit.bytes.local << " vs " << sum.local);
  CHECK(credit.lanes_per_npu == partitioned.lanes_per_npu && credit.on_sdma == partitioned.on_sdma,
        "PartitionCredit's lanes per NPU or engines differ from Partition's");
}

void CheckSplitByNpu(const Plan& partitioned, int lanes, Planner planner) {
  Plan split = partitioned;
  PlanPartition steps(&split, lanes, planner);
  int64_t want_bytes = 0;
  for (const LaneTask& t : partitioned.tasks) want_bytes += t.bytes;
  CHECK(steps.bytes() == want_bytes, "PlanPartition::bytes " << steps.bytes() << ", the tasks' " << want_bytes);
  // Odd NPUs on a thread of their own, even ones here from the last down.
  std::thread odd([&] {
    for (int npu = 1; npu < split.num_ranks; npu += 2) steps.Npu(npu);
  });
  for (int npu = (split.num_ranks - 1) / 2 * 2; npu >= 0; npu -= 2) steps.Npu(npu);
  odd.join();
  steps.Finish();
  const auto same_chunk_bytes = [](const ChunkBytes& a, const ChunkBytes& b) {
    return a.carried == b.carried && a.local == b.local;
  };
  CHECK(split.lanes_per_npu == partitioned.lanes_per_npu && SameList(split.pieces, partitioned.pieces, SamePieces) &&
            SameList(split.tasks, partitioned.tasks, SameTasks) && split.chunk_starts == partitioned.chunk_starts &&
            SameList(split.chunk_bytes, partitioned.chunk_bytes, same_chunk_bytes) &&
            SameList(split.moves, partitioned.moves, SameMoves) && split.move_starts == partitioned.move_starts,
        "split by NPU on two threads differs from Partition: " << split.pieces.size() << " pieces, "
                                                              << split.tasks.size() << " tasks vs "
                                                              << partitioned.pieces.size() << ", "
                                                              << partitioned.tasks.size());
  CheckCredit(partitioned, lanes, planner);
}

void CheckPlan(const Case& c) {
  g_context = Describe(c);
  const OpParams p = ParamsOf(c);
  const Plan plan = BuildPartitionedPlan(p);
  if (c.lanes == 3) CheckSplitByNpu(plan, c.lanes, c.planner);
  else CheckCredit(plan, c.lanes, c.planner);
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
    // The runtime's name is the API's: strata.all_reduce, strata.moe.dispatch.
    std::string api = def.name;
    if (api.rfind("moe_", 0) == 0) api[3] = '.';
    CHECK(std::string(def.builder.name) == "strata." + api, "runtime name " << def.builder.name);
    // Fixed-plan ops first, each with its transfers; the rest are planned at
    // the rendezvous (their blocks are rows, counted at run time).
    const bool fixed = static_cast<int32_t>(i) < kFixedPlanOpCount;
    CHECK(def.PlannedAtRendezvous() == !fixed, "builder " << (fixed ? "missing" : "given to a rendezvous-planned op"));
    CHECK(fixed == (def.in_blocks != Blocks::kPerRow && def.out_blocks != Blocks::kPerRow), "blocks");
    CHECK(FindCollective(def.name) == &def && FindCollective(def.builder.code) == &def, "lookup");
    for (int n : {1, 2, 3, 8, 384}) {
      // nccl-tests' busbw / algbw: all_reduce moves 2(n-1)/n of the message over a rank's links,
      // the per-peer ops (n-1)/n, broadcast and ppermute the message.
      const double want = def.kind == OpKind::kAllReduce ? 2.0 * (n - 1) / n
                          : def.in_blocks != Blocks::kOne || def.out_blocks != Blocks::kOne
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

// Byte ranges [begin, end) that do not overlap and add up to `total`.
bool DisjointWithTotal(std::vector<std::pair<int64_t, int64_t>> spans, int64_t total) {
  std::sort(spans.begin(), spans.end());
  int64_t at = 0, sum = 0;
  for (const auto& [b, e] : spans) {
    if (b < at || e <= b) return false;
    at = e;
    sum += e - b;
  }
  return sum == total;
}

// One random ragged exchange: each rank's four vectors as int64, and where
// each receiver's rows come from (-1: nobody writes it).
struct RaggedCase {
  int n, k;
  int64_t in_rows, out_rows;
  std::vector<std::vector<int64_t>> input_offsets, send_sizes, output_offsets, recv_sizes;  // [rank][entry]
  std::vector<std::vector<Ref>> source;  // [rank][output row] -> (sender, operand row)
};

RaggedCase MakeRaggedCase(std::mt19937_64& rng, int n, int k, int64_t in_rows, int64_t max_size) {
  RaggedCase c{n, k, in_rows, 0, {}, {}, {}, {}, {}};
  auto uniform = [&rng](int64_t lo, int64_t hi) { return std::uniform_int_distribution<int64_t>(lo, hi)(rng); };
  const int entries = n * k;
  c.send_sizes.assign(n, std::vector<int64_t>(entries));
  c.input_offsets = c.output_offsets = c.recv_sizes = c.send_sizes;
  for (int s = 0; s < n; ++s)
    for (int i = 0; i < entries; ++i) {
      const int64_t size = uniform(0, 3) == 0 ? 0 : uniform(0, max_size);  // plenty of empty slices
      c.send_sizes[s][i] = size;
      c.input_offsets[s][i] = uniform(0, in_rows - size);  // reads may overlap
      c.recv_sizes[i / k][s * k + i % k] = size;
    }
  // Each receiver lays its slices out in sender order with random gaps.
  std::vector<int64_t> cursor(n, 0);
  for (int s = 0; s < n; ++s)
    for (int i = 0; i < entries; ++i) {
      const int d = i / k;
      cursor[d] += uniform(0, 2);
      c.output_offsets[s][i] = cursor[d];
      cursor[d] += c.send_sizes[s][i];
    }
  c.out_rows = *std::max_element(cursor.begin(), cursor.end()) + uniform(1, 3);
  c.source.assign(n, std::vector<Ref>(c.out_rows, Ref{-1, -1}));
  for (int s = 0; s < n; ++s)
    for (int i = 0; i < entries; ++i)
      for (int64_t j = 0; j < c.send_sizes[s][i]; ++j)
        c.source[i / k][c.output_offsets[s][i] + j] = {s, static_cast<int32_t>(c.input_offsets[s][i] + j)};
  return c;
}

// The case's vectors in `type`, as a rank publishes them.
struct PublishedVectors {
  std::vector<std::vector<int64_t>> s64;
  std::vector<std::vector<int32_t>> s32;
  std::vector<RaggedVectors> ranks;
};

PublishedVectors Publish(const RaggedCase& c, IndexType type) {
  PublishedVectors v;
  v.ranks.resize(c.n);
  const std::vector<int64_t>* per_vector[4] = {nullptr};
  for (int r = 0; r < c.n; ++r) {
    per_vector[0] = &c.input_offsets[r], per_vector[1] = &c.send_sizes[r];
    per_vector[2] = &c.output_offsets[r], per_vector[3] = &c.recv_sizes[r];
    for (int j = 0; j < 4; ++j) {
      if (type == IndexType::S64) v.s64.push_back(*per_vector[j]);
      else v.s32.emplace_back(per_vector[j]->begin(), per_vector[j]->end());
    }
  }
  // Pointers once the vectors no longer move.
  for (int r = 0; r < c.n; ++r)
    for (int j = 0; j < 4; ++j)
      v.ranks[r][j] = type == IndexType::S64 ? static_cast<const void*>(v.s64[r * 4 + j].data())
                                             : static_cast<const void*>(v.s32[r * 4 + j].data());
  return v;
}

RaggedParams RaggedParamsOf(const RaggedCase& c, IndexType type, int64_t row_bytes, DType dtype) {
  RaggedParams p;
  p.group_size = c.n;
  p.slices_per_peer = c.k;
  p.operand_rows = c.in_rows;
  p.output_rows = c.out_rows;
  p.row_bytes = row_bytes;
  p.dtype = dtype;
  for (IndexType& t : p.index_types) t = type;
  return p;
}

void CheckRaggedPlan(const RaggedCase& c, IndexType type, int64_t row_bytes, DType dtype, int lanes, Planner planner) {
  std::ostringstream name;
  name << "ragged_all_to_all n=" << c.n << " k=" << c.k << " rows " << c.in_rows << " -> " << c.out_rows
       << " row_bytes=" << row_bytes << " index_type=" << static_cast<int>(type) << " lanes=" << lanes
       << " planner=" << PlannerName(planner);
  g_context = name.str();
  const PublishedVectors published = Publish(c, type);
  Plan plan;
  const Status st = BuildRaggedPlan(RaggedParamsOf(c, type, row_bytes, dtype), published.ranks, &plan);
  CHECK(st.ok, "refused: " << st.message);
  if (!st.ok) return;
  Partition(plan, lanes, planner);
  CheckSplitByNpu(plan, lanes, planner);
  const int64_t B = row_bytes;
  CHECK(plan.num_ranks == c.n && plan.in_blocks == c.in_rows && plan.out_blocks == c.out_rows && plan.block_bytes == B &&
            !plan.is_reduction(),
        "layout");

  // Transfers: each output row once, from the sender row the vectors name.
  std::vector<std::vector<int>> writes(c.n, std::vector<int>(c.out_rows, 0));
  for (const Transfer& t : plan.transfers) {
    CHECK(t.src_count == 1 && t.dst_count == 1 && t.span >= 1, "a transfer is not one run of rows");
    if (t.src_count != 1 || t.dst_count != 1) continue;
    const BlockRef& s = plan.refs[t.src_begin];
    const BlockRef& d = plan.refs[t.dst_begin];
    for (uint32_t j = 0; j < t.span; ++j) {
      const int64_t row = d.block + static_cast<int64_t>(j);
      CHECK(d.rank >= 0 && d.rank < c.n && row < c.out_rows, "writes row " << row << " of rank " << d.rank);
      if (d.rank < 0 || d.rank >= c.n || row >= c.out_rows) continue;
      ++writes[d.rank][row];
      CHECK(c.source[d.rank][row] == Ref(s.rank, s.block + static_cast<int32_t>(j)),
            "row " << row << " of rank " << d.rank << " comes from row " << s.block + j << " of rank " << s.rank);
    }
  }
  for (int r = 0; r < c.n; ++r)
    for (int64_t row = 0; row < c.out_rows; ++row)
      CHECK(writes[r][row] == (c.source[r][row].first >= 0 ? 1 : 0),
            "row " << row << " of rank " << r << " is written " << writes[r][row] << " times");

  // Lanes: every transfer's span once; each rank's bytes are its sizes' sums.
  std::vector<std::vector<std::pair<int64_t, int64_t>>> columns(plan.transfers.size());
  std::vector<int64_t> read_from(c.n, 0), written_to(c.n, 0);
  int64_t task_total = 0;
  for (const LaneTask& task : plan.tasks) {
    int64_t bytes = 0;
    CHECK(task.lane >= 0 && task.lane < lanes, "lane " << task.lane);
    for (uint32_t i = task.piece_begin; i < task.piece_end; ++i) {
      const Piece& piece = plan.pieces[i];
      const Transfer& t = plan.transfers[piece.transfer];
      const int64_t len = piece.col_end - piece.col_begin;
      CHECK(piece.executor == task.npu && plan.refs[t.dst_begin].rank == piece.executor,
            "piece " << i << " does not run on the rank it writes");
      CHECK(piece.col_begin % DTypeSize(dtype) == 0 && piece.col_end % DTypeSize(dtype) == 0, "piece cuts an element");
      columns[piece.transfer].push_back({piece.col_begin, piece.col_end});
      read_from[plan.refs[t.src_begin].rank] += len;
      written_to[plan.refs[t.dst_begin].rank] += len;
      bytes += 2 * len;
    }
    CHECK(task.bytes == bytes, "task counts " << task.bytes << " bytes, its pieces move " << bytes);
    task_total += bytes;
  }
  int64_t rows_moved = 0;
  for (uint32_t ti = 0; ti < plan.transfers.size(); ++ti)
    CHECK(TilesExactly(columns[ti], plan.Columns(plan.transfers[ti])),
          "transfer " << ti << "'s pieces do not cover its " << plan.Columns(plan.transfers[ti]) << " columns once");
  for (int r = 0; r < c.n; ++r) {
    int64_t sent = 0, received = 0;
    for (int i = 0; i < c.n * c.k; ++i) sent += c.send_sizes[r][i], received += c.recv_sizes[r][i];
    CHECK(read_from[r] == sent * B, "rank " << r << " is read " << read_from[r] << " bytes, sends " << sent * B);
    CHECK(written_to[r] == received * B, "rank " << r << " is written " << written_to[r] << " bytes, receives " << received * B);
    rows_moved += sent;
  }
  CHECK(task_total == 2 * rows_moved * B, "lane tasks move " << task_total << " bytes, the exchange " << 2 * rows_moved * B);

  // The host's moves: every written byte once, from the right sender row.
  if (plan.transfers.empty()) return;
  CHECK(!plan.moves.empty() && plan.move_starts.size() == plan.chunk_starts.size() &&
            plan.move_starts.back() == plan.moves.size(),
        "a copy-only plan without moves split over its host chunks");
  std::vector<std::vector<std::pair<int64_t, int64_t>>> written(c.n);  // bytes of each rank's output
  for (const Move& m : plan.moves)
    for (int32_t k = 0; k < m.count; ++k) {
      const int32_t sr = m.src_rank + k * m.src_rank_step, dr = m.dst_rank + k * m.dst_rank_step;
      const int64_t src_at = (m.src_block + k * m.src_block_step) * B + m.col;
      const int64_t dst_at = (m.dst_block + k * m.dst_block_step) * B + m.col;
      CHECK(dst_at >= 0 && dst_at + m.len <= c.out_rows * B && src_at >= 0 && src_at + m.len <= c.in_rows * B,
            "a move runs outside the buffers");
      if (dst_at < 0 || dst_at + m.len > c.out_rows * B) continue;
      written[dr].push_back({dst_at, dst_at + m.len});
      CHECK(src_at % B == dst_at % B, "a move shifts bytes within a row");
      for (int64_t row = dst_at / B; row * B < dst_at + m.len; ++row)
        CHECK(c.source[dr][row] == Ref(sr, static_cast<int32_t>(row + (src_at - dst_at) / B)),
              "a move writes row " << row << " of rank " << dr << " from rank " << sr);
    }
  for (int r = 0; r < c.n; ++r) {
    int64_t received = 0;
    for (int i = 0; i < c.n * c.k; ++i) received += c.recv_sizes[r][i];
    CHECK(DisjointWithTotal(written[r], received * B), "the moves do not write rank " << r << "'s received rows once");
  }
}

// Vectors that disagree or leave the buffers are refused, naming the rank.
void CheckRaggedErrors(std::mt19937_64& rng) {
  g_context = "ragged_all_to_all errors";
  RaggedCase c = MakeRaggedCase(rng, 4, 1, 9, 3);
  auto refused = [&](const RaggedCase& bad, const std::string& want) {
    const PublishedVectors published = Publish(bad, IndexType::S64);
    Plan plan;
    const Status st = BuildRaggedPlan(RaggedParamsOf(bad, IndexType::S64, 8, DType::F32), published.ranks, &plan);
    CHECK(!st.ok && st.message.find(want) != std::string::npos, "message \"" << st.message << "\" lacks \"" << want << "\"");
  };
  RaggedCase bad = c;
  bad.recv_sizes[3][1] += 1;
  refused(bad, "strata.ragged_all_to_all: rank 1 sends send_sizes[3]=");
  bad = c;
  bad.send_sizes[2][0] = bad.recv_sizes[0][2] = -1;
  refused(bad, "rank 2 sends a negative size send_sizes[0]=-1");
  bad = c;
  bad.send_sizes[2][1] = bad.recv_sizes[1][2] = 1;
  bad.input_offsets[2][1] = 9;
  refused(bad, "rank 2: input_offsets[1]=9 + send_sizes[1]=1 is outside its operand's 9 rows");
  bad = c;
  bad.send_sizes[0][3] = bad.recv_sizes[3][0] = 2;
  bad.output_offsets[0][3] = bad.out_rows - 1;
  refused(bad, "is outside rank 3's output of");
}

// The model times a ragged exchange from the plan BuildRaggedPlan builds, as
// PlanJob runs it: each rank's lanes read + write the rows it receives
// (exactly, in both modes); buffer_centric stages the rows each rank sends
// and receives (merged where slices overlap), once per round; and a uniform
// exchange is an all_to_all (the same pieces, the same modeled time).
void CheckRaggedModel(const RaggedCase& c, int64_t row_bytes, Mode mode, int64_t comm_buffer_bytes) {
  std::ostringstream name;
  name << "ragged model n=" << c.n << " k=" << c.k << " row_bytes=" << row_bytes << " mode=" << ModeName(mode)
       << " comm_buffer_bytes=" << comm_buffer_bytes;
  g_context = name.str();
  const PublishedVectors published = Publish(c, IndexType::S64);
  RaggedParams p = RaggedParamsOf(c, IndexType::S64, row_bytes, DType::F32);
  p.mode = mode;
  p.cores = 5;
  p.engines = 2;
  p.comm_buffer_bytes = comm_buffer_bytes;
  Plan plan;
  const Status st = BuildRaggedPlan(p, published.ranks, &plan);
  CHECK(st.ok, "refused: " << st.message);
  if (!st.ok) return;
  const model::Machine m;
  const model::Program prog = model::PlanProgram(plan, RaggedRunParams(p), m);
  const model::Result r = model::Simulate(prog, m);
  const int lanes = p.cores + p.engines;
  for (int rank = 0; rank < c.n; ++rank) {
    int64_t received = 0, lane_total = 0;
    for (int i = 0; i < c.n * c.k; ++i) received += c.recv_sizes[rank][i];
    for (int l = 0; l < lanes; ++l) lane_total += r.lane_bytes[rank * lanes + l];
    CHECK(lane_total == 2 * received * row_bytes, "rank " << rank << "'s lanes move " << lane_total << " bytes, "
                                                          << "it receives " << received * row_bytes);
    int64_t staged_rows = 0;
    if (mode == Mode::kBufferCentric) {
      std::vector<bool> read(c.in_rows, false), written(c.out_rows, false);
      for (int i = 0; i < c.n * c.k; ++i)
        for (int64_t j = 0; j < c.send_sizes[rank][i]; ++j) read[c.input_offsets[rank][i] + j] = true;
      for (int64_t row = 0; row < c.out_rows; ++row) written[row] = c.source[rank][row].first >= 0;
      staged_rows = std::count(read.begin(), read.end(), true) + std::count(written.begin(), written.end(), true);
    }
    CHECK(r.staged_bytes[rank] == staged_rows * row_bytes,
          "rank " << rank << " stages " << r.staged_bytes[rank] << " bytes, not " << staged_rows * row_bytes);
  }
}

void CheckUniformRaggedIsAllToAll() {
  g_context = "uniform ragged model vs all_to_all";
  const int n = 8;
  const int64_t rows = 3, row_bytes = 4096;
  RaggedCase c{n, 1, n * rows, n * rows, {}, {}, {}, {}, {}};
  c.send_sizes.assign(n, std::vector<int64_t>(n, rows));
  c.recv_sizes = c.input_offsets = c.output_offsets = c.send_sizes;
  for (int r = 0; r < n; ++r)
    for (int i = 0; i < n; ++i) c.input_offsets[r][i] = c.output_offsets[r][i] = i * rows;
  for (int r = 0; r < n; ++r)  // rank s's slice lands at rows [s * rows, +rows) of every receiver
    for (int i = 0; i < n; ++i) c.output_offsets[r][i] = r * rows;
  const PublishedVectors published = Publish(c, IndexType::S64);
  RaggedParams p = RaggedParamsOf(c, IndexType::S64, row_bytes, DType::F32);
  p.cores = 48;
  p.engines = 16;
  Plan plan;
  CHECK(BuildRaggedPlan(p, published.ranks, &plan).ok, "refused");
  const model::Machine m;
  const model::Result ragged = model::Simulate(model::PlanProgram(plan, RaggedRunParams(p), m), m);
  const OpParams a2a = MakeOpParams(Collective(OpKind::kAllToAll), static_cast<int>(DType::F32), 4, 0, {}, n,
                                    rows * row_bytes, 1, 0, 48, 16, 0, p.comm_buffer_bytes);
  const model::Result all_to_all = model::Simulate(model::CollectiveProgram(a2a, m), m);
  CHECK(ragged.lane_bytes == all_to_all.lane_bytes, "lane bytes differ");
  // Equal up to the order of floating-point sums (a span of rows vs one block).
  CHECK(std::abs(ragged.time_us - all_to_all.time_us) <= 1e-12 * all_to_all.time_us && all_to_all.time_us > 0,
        "ragged " << ragged.time_us << " us, all_to_all " << all_to_all.time_us);
}

// Random routings: top_k distinct experts per token, slots as the runtime
// assigns them (full experts drop pairs).
std::vector<std::vector<int32_t>> RandomSlots(std::mt19937_64& rng, int n, int experts, int64_t tokens, int64_t topk,
                                              int64_t capacity) {
  model::MoeShape shape;
  shape.ranks = n;
  shape.experts = experts;
  shape.capacity = capacity;
  std::vector<std::vector<int32_t>> idx(n, std::vector<int32_t>(tokens * topk));
  for (auto& rank : idx)
    for (int64_t t = 0; t < tokens; ++t) {
      std::vector<int32_t> all(experts);
      for (int e = 0; e < experts; ++e) all[e] = e;
      std::shuffle(all.begin(), all.end(), rng);
      for (int64_t k = 0; k < topk; ++k) rank[t * topk + k] = all[k];
    }
  return model::MoePairSlots(shape, idx);
}

// MoE dispatch: the plan of random routings' slots against the routing itself.
void CheckMoeDispatchPlan(std::mt19937_64& rng, int n, int experts, int64_t tokens, int64_t topk, int64_t capacity,
                          int lanes) {
  const auto slots = RandomSlots(rng, n, experts, tokens, topk, capacity);
  MoeOpShape p;
  p.group_size = n;
  p.num_experts = experts;
  p.capacity = capacity;
  p.tokens = tokens;
  p.topk = topk;
  p.hidden = 3;
  p.dtype = DType::F32;
  std::vector<const int32_t*> ptrs;
  for (const auto& r : slots) ptrs.push_back(r.data());
  Plan plan;
  const Status st = BuildMoeDispatchPlan(p, ptrs, &plan);
  std::ostringstream name;
  name << "moe_dispatch n=" << n << " E=" << experts << " T=" << tokens << " K=" << topk << " C=" << capacity;
  CHECK(st.ok, name.str() << ": refused: " << st.message);
  if (!st.ok) return;
  const int64_t per_rank = experts / n * capacity;
  // What each expert row must hold: (rank, token) or empty; and the pairs.
  std::vector<int64_t> want(n * per_rank, -1);
  int64_t accepted = 0, distinct = 0;
  for (int r = 0; r < n; ++r)
    for (int64_t t = 0; t < tokens; ++t) {
      std::vector<int64_t> owners;
      for (int64_t k = 0; k < topk; ++k) {
        const int32_t slot = slots[r][t * topk + k];
        if (slot < 0) continue;
        want[slot] = r * tokens + t;
        ++accepted;
        if (std::find(owners.begin(), owners.end(), slot / per_rank) == owners.end()) owners.push_back(slot / per_rank);
      }
      distinct += static_cast<int64_t>(owners.size());
    }
  std::vector<int64_t> got(n * per_rank, -2);  // -2: never written
  std::vector<int> writes(n * per_rank, 0);
  int64_t carried = 0, local = 0;
  for (const Transfer& t : plan.transfers) {
    CHECK(t.src_count <= 1, name.str() << ": a transfer with " << t.src_count << " sources");
    if (t.src_count == 1) {
      CHECK(t.dst_count - t.local_copies == 1, name.str() << ": a token carried to " << t.dst_count - t.local_copies << " ranks at once");
      carried += t.span;
      local += static_cast<int64_t>(t.local_copies) * t.span;
    }
    for (uint32_t d = 0; d < t.dst_count; ++d) {
      const BlockRef& dst = plan.refs[t.dst_begin + d];
      for (uint32_t i = 0; i < t.span; ++i) {
        const int64_t slot = dst.rank * per_rank + dst.block + i;
        writes[slot]++;
        if (t.src_count == 0) {
          got[slot] = -1;
        } else {
          const BlockRef& src = plan.refs[t.src_begin];
          got[slot] = src.rank * tokens + src.block + (t.dst_count == 1 ? i : 0);
        }
      }
    }
  }
  for (int64_t slot = 0; slot < n * per_rank; ++slot) {
    CHECK(writes[slot] == 1, name.str() << ": row " << slot << " written " << writes[slot] << " times");
    CHECK(got[slot] == want[slot], name.str() << ": row " << slot << " gets " << got[slot] << ", wants " << want[slot]);
  }
  CHECK(carried == distinct && carried + local == accepted,
        name.str() << ": carried " << carried << " local " << local << ", want " << distinct << " and " << accepted - distinct);
  // The builder's steps in another order (as the runtime's phases may run
  // them) give the same plan, and the busiest rank's bytes PlanMovesOnSdma
  // would find.
  {
    MoeDispatchPlanBuilder builder(p);
    for (int r = n - 1; r >= 0; --r) builder.Sources(r, ptrs[r]);
    for (int o = n - 1; o >= 0; --o) builder.Owner(o);
    Plan again;
    CHECK(builder.Finish(ptrs, &again).ok, name.str() << ": the builder's steps refused");
    bool same = again.transfers.size() == plan.transfers.size() && again.refs.size() == plan.refs.size();
    for (size_t i = 0; same && i < plan.transfers.size(); ++i) {
      const Transfer &a = again.transfers[i], &b = plan.transfers[i];
      same = a.src_count == b.src_count && a.dst_count == b.dst_count && a.span == b.span &&
             a.local_copies == b.local_copies;
      for (uint32_t k = 0; same && k < a.src_count + a.dst_count; ++k)
        same = again.refs[a.src_begin + k].rank == plan.refs[b.src_begin + k].rank &&
               again.refs[a.src_begin + k].block == plan.refs[b.src_begin + k].block;
    }
    CHECK(same, name.str() << ": the builder's steps out of order gave another plan");
    std::vector<int64_t> rank_bytes(n, 0);
    for (const Transfer& t : plan.transfers)
      for (uint32_t k = 0; k < t.src_count + t.dst_count; ++k) rank_bytes[plan.refs[t.src_begin + k].rank] += plan.Columns(t);
    const int64_t busiest = *std::max_element(rank_bytes.begin(), rank_bytes.end());
    CHECK(builder.BusiestRankBytes() == busiest,
          name.str() << ": busiest rank bytes " << builder.BusiestRankBytes() << ", the plan's " << busiest);
    // Strata mode runs and credits the owners' plans as they are: together
    // they credit the lanes as the joined plan partitioned does, owner o's
    // on NPU o, lane for lane and byte for byte.
    for (Planner planner : {Planner::kBalanced, Planner::kNaive}) {
      LaneCredit joined, owner;
      PartitionCredit(again, lanes, planner, &joined);
      std::vector<std::tuple<int32_t, int32_t, int64_t>> want, got;
      for (const LaneTask& t : joined.tasks) want.emplace_back(t.npu, t.lane, t.bytes);
      ChunkBytes sum;
      int64_t transfers = 0;
      for (int o = 0; o < n; ++o) {
        const Plan& mine = builder.OwnerPlan(o);
        transfers += static_cast<int64_t>(mine.transfers.size());
        CHECK(mine.num_ranks == n && mine.in_blocks == tokens && mine.out_blocks == per_rank &&
                  mine.block_bytes == p.row_bytes(),
              name.str() << ": owner " << o << "'s plan has another shape than the group's");
        PartitionCredit(mine, lanes, planner, &owner);
        for (const LaneTask& t : owner.tasks) {
          CHECK(t.npu == o, name.str() << ": owner " << o << "'s plan credits NPU " << t.npu);
          got.emplace_back(t.npu, t.lane, t.bytes);
        }
        sum.carried += owner.bytes.carried, sum.local += owner.bytes.local, sum.written += owner.bytes.written;
      }
      CHECK(transfers == static_cast<int64_t>(again.transfers.size()) && got == want &&
                sum.carried == joined.bytes.carried && sum.local == joined.bytes.local &&
                sum.written == joined.bytes.written,
            name.str() << ": the owners' plans credit " << got.size() << " lanes, the joined plan " << want.size());
    }
    // And run as strata mode runs them (OrderedPlanPhase: an owner's plan
    // whole, or in runs of a few transfers), every row gets its token's x
    // row, an empty one zeros.
    std::vector<std::vector<float>> x(n, std::vector<float>(tokens * p.hidden));
    std::uniform_real_distribution<float> value(-1.0f, 1.0f);
    for (auto& xr : x)
      for (float& e : xr) e = value(rng);
    for (const uint32_t run : {0u, 2u}) {
      std::vector<std::vector<float>> out(n, std::vector<float>(per_rank * p.hidden, std::nanf("")));
      PlanGroup group;
      for (int o = 0; o < n; ++o) {
        const std::shared_ptr<void> unowned;  // the builder outlives the phase
        group.plans.push_back({std::shared_ptr<const Plan>(unowned, &builder.OwnerPlan(o)), nullptr, nullptr});
        group.buffers.in.push_back(x[o].data());
        group.buffers.out.push_back(out[o].data());
      }
      const uint64_t tasks = run == 0 ? n : static_cast<uint64_t>(n) * (per_rank / run + 1);
      const Phase phase = OrderedPlanPhase({std::move(group)}, tasks, [&](uint64_t task, const TransferRunner& runner) {
        if (run == 0) return runner.RunAll(0, task);
        const uint64_t per_owner = static_cast<uint64_t>(per_rank / run + 1);
        runner.RunRange(0, task / per_owner, static_cast<uint32_t>(task % per_owner) * run,
                        static_cast<uint32_t>(task % per_owner + 1) * run);
      });
      for (uint64_t i = phase.count; i-- > 0;) phase.run(i);  // in any order
      int64_t wrong = 0;
      for (int64_t slot = 0; slot < n * per_rank; ++slot)
        for (int64_t e = 0; e < p.hidden; ++e) {
          const float have = out[slot / per_rank][(slot % per_rank) * p.hidden + e];
          const float expect = want[slot] < 0 ? 0.0f : x[want[slot] / tokens][(want[slot] % tokens) * p.hidden + e];
          wrong += std::memcmp(&have, &expect, sizeof(float)) != 0;
        }
      CHECK(wrong == 0, name.str() << ": " << wrong << " values wrong running the owners' plans"
                                   << (run ? " a few transfers at a time" : " whole"));
    }
  }
  // Partitioned as the runtime does it: the chunks' carried/local bytes are the plan's.
  Partition(plan, lanes, Planner::kBalanced);
  CheckSplitByNpu(plan, lanes, Planner::kBalanced);
  Plan naive = plan;
  Partition(naive, 48, Planner::kNaive);
  CheckSplitByNpu(naive, 48, Planner::kNaive);
  int64_t chunk_carried = 0, chunk_local = 0;
  for (const ChunkBytes& b : plan.chunk_bytes) chunk_carried += b.carried, chunk_local += b.local;
  CHECK(chunk_carried == carried * p.row_bytes() && chunk_local == local * p.row_bytes(),
        name.str() << ": chunks carry " << chunk_carried << " and copy " << chunk_local);
}

void CheckMoeDispatchPlans(int64_t* plans) {
  std::mt19937_64 rng(28);
  for (int n : {1, 2, 3, 8})
    for (int64_t capacity : {1, 5, 64})
      for (int64_t topk : {1, 4}) {
        CheckMoeDispatchPlan(rng, n, 4 * n, 17, topk, capacity, 3);
        ++*plans;
      }
  // Bad slots are errors naming the rank and the pair.
  MoeOpShape p;
  p.group_size = 2, p.num_experts = 2, p.capacity = 2, p.tokens = 1, p.topk = 2, p.hidden = 1;
  const int32_t out_of_range[2] = {0, 4}, twice[2] = {1, 1}, fine[2] = {-1, 3}, takes_3[2] = {3, -1};
  for (const auto& [rank0, want] : {std::pair<const int32_t*, std::string>{out_of_range, "outside [-1, 4)"},
                                    std::pair<const int32_t*, std::string>{twice, "another pair fills too"}}) {
    Plan plan;
    const Status st = BuildMoeDispatchPlan(p, {rank0, fine}, &plan);
    CHECK(!st.ok && st.message.find(want) != std::string::npos && st.message.find("rank 0") != std::string::npos,
          "moe_dispatch bad slots: " << st.message);
  }
  // Two ranks filling one slot: the later rank's pair is named, whichever
  // rank's step claimed the slot first.
  for (bool rank1_first : {false, true}) {
    MoeDispatchPlanBuilder builder(p);
    const std::vector<const int32_t*> both = {takes_3, fine};
    if (rank1_first) builder.Sources(1, fine);
    builder.Sources(0, takes_3);
    if (!rank1_first) builder.Sources(1, fine);
    for (int o = 0; o < 2; ++o) builder.Owner(o);
    Plan plan;
    const Status st = builder.Finish(both, &plan);
    CHECK(!st.ok && st.message.find("rank 1's pair (token 0, k=1)") != std::string::npos,
          "moe_dispatch slot filled by two ranks: " << st.message);
  }
}

// MoE combine: plans of a random routing, run as the runtime runs them,
// against the order algorithms/moe.h documents, in float32.
void CheckMoeCombinePlan(std::mt19937_64& rng, int n, int experts, int64_t tokens, int64_t topk, int64_t capacity,
                         int64_t hidden, int lanes, bool stage_all) {
  const auto slots = RandomSlots(rng, n, experts, tokens, topk, capacity);
  const int64_t per_rank = experts / n * capacity;
  MoeOpShape p;
  p.group_size = n;
  p.num_experts = experts;
  p.capacity = capacity;
  p.tokens = tokens;
  p.topk = topk;
  p.hidden = hidden;
  p.dtype = DType::F32;
  std::normal_distribution<float> normal;
  std::vector<std::vector<float>> rows(n, std::vector<float>(per_rank * hidden)), w(n, std::vector<float>(tokens * topk));
  for (auto& r : rows)
    for (float& v : r) v = normal(rng);
  for (auto& r : w)
    for (float& v : r) v = normal(rng);
  std::vector<const int32_t*> slot_ptrs;
  std::vector<const void*> w_ptrs;
  for (int r = 0; r < n; ++r) slot_ptrs.push_back(slots[r].data()), w_ptrs.push_back(w[r].data());
  std::ostringstream name;
  name << "moe_combine n=" << n << " E=" << experts << " T=" << tokens << " K=" << topk << " C=" << capacity
       << " H=" << hidden << " lanes=" << lanes << (stage_all ? " staged" : "");
  g_context = name.str();
  MoeCombinePlans plans;
  const Status st = BuildMoeCombinePlans(p, slot_ptrs, w_ptrs, stage_all, &plans);
  CHECK(st.ok, name.str() << ": refused: " << st.message);
  if (!st.ok) return;
  const Plan &partials = plans.partials, &sums = plans.sums;

  // The documented order, and what crosses: per token, owners ascending.
  std::vector<std::vector<float>> want(n, std::vector<float>(tokens * hidden, 0.0f));
  int64_t accepted = 0, distinct = 0, lone = 0;
  for (int r = 0; r < n; ++r)
    for (int64_t t = 0; t < tokens; ++t) {
      std::map<int64_t, std::vector<int64_t>> by_owner;  // owner -> k ascending
      for (int64_t k = 0; k < topk; ++k)
        if (slots[r][t * topk + k] >= 0) by_owner[slots[r][t * topk + k] / per_rank].push_back(k), ++accepted;
      distinct += static_cast<int64_t>(by_owner.size());
      for (int64_t j = 0; j < hidden; ++j) {
        float acc = 0.0f;
        for (const auto& [owner, ks] : by_owner) {
          auto row = [&](int64_t k) { return rows[owner][(slots[r][t * topk + k] % per_rank) * hidden + j]; };
          if (ks.size() == 1) {
            const float prod = w[r][t * topk + ks[0]] * row(ks[0]);
            acc = acc + prod;
            continue;
          }
          float part = 0.0f;
          for (int64_t k : ks) {
            const float prod = w[r][t * topk + k] * row(k);
            part = part + prod;
          }
          acc = acc + part;
        }
        want[r][t * hidden + j] = acc;
      }
      for (const auto& [owner, ks] : by_owner) lone += ks.size() == 1;
    }

  // Structure: every y row written once; a partial's sources and its block
  // on its owner; one source per (token, owner) in the sums.
  std::vector<int> writes(n * tokens, 0);
  int64_t sum_sources = 0, partial_sources = 0;
  for (const Transfer& t : sums.transfers) {
    CHECK(t.dst_count == 1, name.str() << ": a sum with " << t.dst_count << " destinations");
    const BlockRef& y = sums.refs[t.dst_begin];
    for (uint32_t i = 0; i < t.span; ++i) writes[y.rank * tokens + y.block + i]++;
    CHECK(t.src_count == 0 || t.span == 1, name.str() << ": a sum spanning " << t.span << " rows");
    sum_sources += t.src_count;
    for (uint32_t k = 0; k < t.src_count; ++k) {
      const BlockRef& src = sums.refs[t.src_begin + k];
      CHECK(!stage_all || src.block >= per_rank, name.str() << ": staged, yet a sum reads an expert row");
      CHECK(k == 0 || sums.refs[t.src_begin + k - 1].rank < src.rank, name.str() << ": owners not ascending");
    }
  }
  for (int64_t i = 0; i < n * tokens; ++i)
    CHECK(writes[i] == 1, name.str() << ": y row " << i << " written " << writes[i] << " times");
  CHECK(sum_sources == distinct, name.str() << ": sums read " << sum_sources << " rows, want " << distinct);
  for (int o = 0; o < n; ++o) {
    const uint32_t end = o + 1 < n ? plans.first_partial[o + 1] : static_cast<uint32_t>(partials.transfers.size());
    for (uint32_t i = plans.first_partial[o]; i < end; ++i) {
      const Transfer& t = partials.transfers[i];
      const BlockRef& d = partials.refs[t.dst_begin];
      CHECK(t.dst_count == 1 && d.rank == o && d.block == static_cast<int32_t>(i - plans.first_partial[o]),
            name.str() << ": partial " << i << " writes (" << d.rank << ", " << d.block << ")");
      partial_sources += t.src_count;
      for (uint32_t k = 0; k < t.src_count; ++k)
        CHECK(partials.refs[t.src_begin + k].rank == o, name.str() << ": a partial sums another rank's row");
    }
  }
  CHECK(partial_sources == (stage_all ? accepted : accepted - lone),
        name.str() << ": partials read " << partial_sources << " rows");

  // Run as the runtime does; y must be the documented order's, bit for bit.
  auto partitioned_partials = std::make_shared<Plan>(partials);
  auto partitioned_sums = std::make_shared<Plan>(sums);
  Partition(*partitioned_partials, lanes, Planner::kBalanced);
  Partition(*partitioned_sums, lanes, Planner::kBalanced);
  CheckCredit(*partitioned_partials, lanes, Planner::kBalanced);  // strata mode credits the partials so
  std::vector<std::vector<float>> scratch(n, std::vector<float>(per_rank * hidden, std::nanf(""))),
      y(n, std::vector<float>(tokens * hidden, std::nanf("")));
  PlanBuffers stage, sum;
  for (int r = 0; r < n; ++r) {
    stage.in.push_back(rows[r].data());
    stage.out.push_back(scratch[r].data());
    sum.in.push_back(rows[r].data());
    sum.scratch.push_back(scratch[r].data());
    sum.out.push_back(y[r].data());
  }
  std::vector<int32_t> devices(n);
  for (int r = 0; r < n; ++r) devices[r] = r;
  std::vector<Phase> phases;
  if (stage_all) {
    phases.push_back(PlanPhase(partitioned_partials, stage, devices, false, true));
    phases.push_back(PlanPhase(partitioned_sums, sum, devices, false));
  } else {
    sum.scratch.clear();  // fused: nothing reads the scratch
    phases.push_back(PlanPhase(partitioned_sums, sum, devices, true, false, partitioned_partials,
                               plans.first_partial));
  }
  for (const Phase& phase : phases)
    for (uint64_t i = 0; i < phase.count; ++i) phase.run(i);
  int64_t mismatches = 0;
  for (int r = 0; r < n; ++r)
    for (int64_t i = 0; i < tokens * hidden; ++i) mismatches += std::memcmp(&y[r][i], &want[r][i], 4) != 0;
  CHECK(mismatches == 0, name.str() << ": " << mismatches << " elements of y differ from the documented order");

  // Bytes: each (token, owner)'s row crosses once; rows summed where they live are local.
  const int64_t rb = p.row_bytes();
  int64_t carried = 0, local = 0, written = 0;
  for (const auto* plan : {partitioned_partials.get(), partitioned_sums.get()})
    for (const ChunkBytes& b : plan->chunk_bytes) carried += b.carried, local += b.local;
  for (const ChunkBytes& b : partitioned_partials->chunk_bytes) written += b.written;
  CHECK(carried == distinct * rb && local == (stage_all ? accepted : accepted - lone) * rb,
        name.str() << ": carried " << carried << " local " << local);
  CHECK(written == static_cast<int64_t>(partials.transfers.size()) * rb, name.str() << ": partials wrote " << written);
  if (stage_all) return;

  // The runtime's strata path: each rank's share run whole transfers in
  // order, fused with its own partials (algorithms/moe.cc), gives y's bits
  // in any order of its tasks, and its lane credit is every NPU's lanes of
  // the joined plan's tasks.
  std::vector<std::shared_ptr<const MoeCombineShare>> shares;
  for (int r = 0; r < n; ++r) {
    auto share = std::make_shared<MoeCombineShare>();
    const Status built = BuildMoeCombineShare(p, false, r, slot_ptrs[r], w_ptrs[r], share.get());
    CHECK(built.ok, name.str() << ": share " << r << " refused: " << built.message);
    PartitionCredit(share->sums, lanes, Planner::kBalanced, &share->sums_credit);
    shares.push_back(share);
  }
  std::vector<std::vector<float>> y_shares(n, std::vector<float>(tokens * hidden, std::nanf("")));
  PlanBuffers by_share;
  for (int r = 0; r < n; ++r) {
    by_share.in.push_back(rows[r].data());
    by_share.out.push_back(y_shares[r].data());
  }
  // Whole shares a task (this size's default), and a few transfers a task.
  for (const int64_t per_task : {int64_t{0}, int64_t{3}}) {
    for (auto& y_r : y_shares) std::fill(y_r.begin(), y_r.end(), std::nanf(""));
    const Phase shared = MoeCombineSharesPhase(p, shares, by_share, per_task);
    for (uint64_t i = shared.count; i-- > 0;) shared.run(i);  // in any order
    mismatches = 0;
    for (int r = 0; r < n; ++r)
      for (int64_t i = 0; i < tokens * hidden; ++i) mismatches += std::memcmp(&y_shares[r][i], &want[r][i], 4) != 0;
    CHECK(mismatches == 0, name.str() << ": " << mismatches << " elements of y differ run share by share, "
                                      << per_task << " transfers a task (" << shared.count << " tasks)");
  }
  ChunkBytes credited{};
  for (int r = 0; r < n; ++r) {
    std::vector<std::pair<int32_t, int64_t>> joined, alone;
    for (const LaneTask& t : partitioned_sums->tasks)
      if (t.npu == r) joined.push_back({t.lane, t.bytes});
    for (const LaneTask& t : shares[r]->sums_credit.tasks) {
      CHECK(t.npu == r, name.str() << ": rank " << r << "'s share has work on NPU " << t.npu);
      alone.push_back({t.lane, t.bytes});
    }
    CHECK(joined == alone, name.str() << ": rank " << r << "'s lanes differ between its share and the joined sums");
    credited.carried += shares[r]->sums_credit.bytes.carried;
    credited.local += shares[r]->sums_credit.bytes.local;
  }
  int64_t sums_carried = 0, sums_local = 0;
  for (const ChunkBytes& b : partitioned_sums->chunk_bytes) sums_carried += b.carried, sums_local += b.local;
  CHECK(credited.carried == sums_carried && credited.local == sums_local,
        name.str() << ": the shares credit " << credited.carried << " carried, " << credited.local
                   << " local bytes; the joined sums " << sums_carried << ", " << sums_local);
}

void CheckMoeCombinePlans(int64_t* plans) {
  std::mt19937_64 rng(29);
  for (int n : {1, 2, 3, 8})
    for (int64_t capacity : {1, 5, 64})
      // top-k up to 8 is grouped by a sorting network, above by counting.
      for (int64_t topk : {1, 4, 7, 8, 12})
        for (bool stage_all : {false, true}) {
          if (topk > 4 * n) continue;
          // hidden 3: columns of one element; 300: lanes cut inside rows.
          for (int64_t hidden : {3, 300}) {
            CheckMoeCombinePlan(rng, n, 4 * n, 17, topk, capacity, hidden, 3, stage_all);
            ++*plans;
          }
        }
  MoeOpShape p;
  p.group_size = 2, p.num_experts = 2, p.capacity = 2, p.tokens = 1, p.topk = 2, p.hidden = 1;
  const int32_t out_of_range[2] = {0, 4}, fine[2] = {-1, 3};
  MoeCombinePlans bad;
  const Status st = BuildMoeCombinePlans(p, {fine, out_of_range}, {}, false, &bad);
  CHECK(!st.ok && st.message.find("rank 1's pair (token 0, k=1)") != std::string::npos &&
            st.message.find("outside [-1, 4)") != std::string::npos,
        "moe_combine bad slots: " << st.message);
}

// MoE combine's backward: plans of a random routing, run as the runtime
// runs them (the carry fused into its readers) and as the NPUs would (the
// carry into scratch first), against numpy's arithmetic done here by hand:
// d_expert_y[slot] = w x ct_y[token] (one float product), d_weights[pair] =
// <ct_y[token], expert row> (float32 accumulation: within a bound of the
// exact dot), zeros for empty slots and dropped pairs.
void CheckMoeBackwardPlan(std::mt19937_64& rng, int n, int experts, int64_t tokens, int64_t topk, int64_t capacity,
                          int64_t hidden, Planner planner, bool staged) {
  const auto slots = RandomSlots(rng, n, experts, tokens, topk, capacity);
  const int64_t per_rank = experts / n * capacity, pairs = tokens * topk;
  MoeOpShape p;
  p.group_size = n;
  p.num_experts = experts;
  p.capacity = capacity;
  p.tokens = tokens;
  p.topk = topk;
  p.hidden = hidden;
  p.dtype = DType::F32;
  p.cores = 3;
  p.engines = 2;
  p.planner = planner;
  std::normal_distribution<float> normal;
  auto random = [&](int64_t count) {
    std::vector<std::vector<float>> out(n, std::vector<float>(count));
    for (auto& r : out)
      for (float& v : r) v = normal(rng);
    return out;
  };
  const auto ct = random(tokens * hidden), ey = random(per_rank * hidden), w = random(pairs);
  std::vector<const int32_t*> slot_ptrs, source_ptrs;
  std::vector<const void*> w_ptrs;
  for (int r = 0; r < n; ++r) slot_ptrs.push_back(slots[r].data()), w_ptrs.push_back(w[r].data());
  std::vector<std::vector<int32_t>> sources;
  CHECK(MoeSlotSources(p, slot_ptrs, &sources).ok, "moe_combine_backward: slot_source refused");
  for (int r = 0; r < n; ++r) source_ptrs.push_back(sources[r].data());
  std::ostringstream name;
  name << "moe_combine_backward n=" << n << " E=" << experts << " T=" << tokens << " K=" << topk << " C=" << capacity
       << " H=" << hidden << " " << PlannerName(planner) << (staged ? " staged" : "");
  g_context = name.str();
  auto plans = std::make_shared<MoeBackwardPlans>();
  const Status st = BuildMoeBackwardPlans(p, slot_ptrs, source_ptrs, w_ptrs, plans.get());
  CHECK(st.ok, name.str() << ": refused: " << st.message);
  if (!st.ok) return;
  PartitionMoeBackwardPlans(p, plans.get());

  // Structure: one carried row per (token, owner) with kept pairs, pulled
  // by the owner into its scratch block first_carry[o] + j; every product
  // run by the owner of its expert row.
  int64_t accepted = 0, distinct = 0;
  for (int r = 0; r < n; ++r)
    for (int64_t t = 0; t < tokens; ++t) {
      std::map<int64_t, int> owners;
      for (int64_t k = 0; k < topk; ++k)
        if (slots[r][t * topk + k] >= 0) owners[slots[r][t * topk + k] / per_rank]++, ++accepted;
      distinct += static_cast<int64_t>(owners.size());
    }
  const Plan &carry = plans->carry, &scale = plans->scale, &dots = plans->dots;
  CHECK(static_cast<int64_t>(carry.transfers.size()) == distinct,
        name.str() << ": " << carry.transfers.size() << " rows carried, want " << distinct);
  for (int o = 0; o < n; ++o) {
    const uint32_t end = o + 1 < n ? plans->first_carry[o + 1] : static_cast<uint32_t>(carry.transfers.size());
    for (uint32_t i = plans->first_carry[o]; i < end; ++i) {
      const BlockRef& d = carry.refs[carry.transfers[i].dst_begin];
      CHECK(d.rank == o && d.block == static_cast<int32_t>(i - plans->first_carry[o]),
            name.str() << ": carry " << i << " writes (" << d.rank << ", " << d.block << ")");
    }
  }
  for (const Piece& piece : dots.pieces) {
    const Transfer& t = dots.transfers[piece.transfer];
    const int32_t want = t.src_count ? dots.refs[t.src_begin + 1].rank : dots.refs[t.dst_begin].rank;
    CHECK(piece.executor == want, name.str() << ": a dot run by " << piece.executor << ", want " << want);
    CHECK(t.src_count == 0 || (piece.col_begin == 0 && piece.col_end == dots.block_bytes),
          name.str() << ": a lane splits a dot product");
  }

  // Run as the runtime does.
  std::vector<std::vector<float>> scratch(n, std::vector<float>(per_rank * hidden, std::nanf(""))),
      d_ey(n, std::vector<float>(per_rank * hidden, std::nanf(""))), d_w(n, std::vector<float>(pairs, std::nanf("")));
  auto shared = [&](const Plan* plan) { return std::shared_ptr<const Plan>(plans, plan); };
  PlanBuffers to_carry, to_scale, to_dot;
  for (int r = 0; r < n; ++r) {
    to_carry.in.push_back(ct[r].data());
    to_carry.out.push_back(scratch[r].data());
    to_scale.out.push_back(d_ey[r].data());
    to_dot.in.push_back(ey[r].data());
    to_dot.out.push_back(d_w[r].data());
  }
  std::vector<int32_t> devices(n);
  for (int r = 0; r < n; ++r) devices[r] = r;
  std::vector<Phase> phases;
  if (staged) {
    for (int r = 0; r < n; ++r) to_scale.scratch.push_back(scratch[r].data()), to_dot.scratch.push_back(scratch[r].data());
    phases.push_back(PlanPhase(shared(&carry), to_carry, devices, false));
    phases.push_back(Together(PlanPhase(shared(&scale), to_scale, devices, false),
                              PlanPhase(shared(&dots), to_dot, devices, false)));
  } else {
    to_scale.producer_in = to_dot.producer_in = to_carry.in;
    phases.push_back(Together(
        PlanPhase(shared(&scale), to_scale, devices, true, false, shared(&carry), plans->first_carry),
        PlanPhase(shared(&dots), to_dot, devices, true, false, shared(&carry), plans->first_carry, false)));
  }
  for (const Phase& phase : phases)
    for (uint64_t i = 0; i < phase.count; ++i) phase.run(i);

  int64_t bad_rows = 0, bad_dots = 0;
  for (int o = 0; o < n; ++o)
    for (int64_t row = 0; row < per_rank; ++row) {
      const int32_t src = sources[o][row];
      for (int64_t j = 0; j < hidden; ++j) {
        const float want = src < 0 ? 0.0f : w[src / pairs][src % pairs] * ct[src / pairs][(src % pairs) / topk * hidden + j];
        bad_rows += !(d_ey[o][row * hidden + j] == want);
      }
    }
  for (int r = 0; r < n; ++r)
    for (int64_t i = 0; i < pairs; ++i) {
      const int32_t slot = slots[r][i];
      double exact = 0, bound = 0;
      for (int64_t j = 0; slot >= 0 && j < hidden; ++j) {
        const double prod = static_cast<double>(ct[r][i / topk * hidden + j]) * ey[slot / per_rank][(slot % per_rank) * hidden + j];
        exact += prod;
        bound += std::fabs(prod);
      }
      bad_dots += !(std::fabs(d_w[r][i] - exact) <= bound * hidden * 6e-8 + 1e-30) || (slot < 0 && d_w[r][i] != 0.0f);
    }
  CHECK(bad_rows == 0, name.str() << ": " << bad_rows << " elements of d_expert_y differ from w x ct_y");
  CHECK(bad_dots == 0, name.str() << ": " << bad_dots << " d_weights values off the dot products");

  // Bytes: each (token, owner)'s row crosses once and a value per pair comes
  // back; every accepted row is scaled where the crossed row landed.
  const int64_t rb = p.row_bytes();
  int64_t carried = 0, local = 0;
  for (const Plan* plan : {&carry, &scale, &dots})
    for (const ChunkBytes& b : plan->chunk_bytes) carried += b.carried, local += b.local;
  CHECK(carried == distinct * rb + accepted * 4 && local == accepted * rb,
        name.str() << ": carried " << carried << " local " << local);
  if (staged) return;

  // The runtime's strata path: each owner's share, built from its own fields
  // alone, weights filled in and partitioned alone, run token by token across
  // the owners, each fused with its own carry (algorithms/moe.cc), its tasks
  // in any order, gives the joined run's bits,
  // and every NPU's lanes the joined plans' tasks (the carry's on the lanes
  // chosen over all shares).
  std::vector<MoeBackwardShare> shares(n);
  std::vector<const MoeBackwardShare*> views;
  for (int o = 0; o < n; ++o) {
    const Status built = BuildMoeBackwardShare(p, o, slot_ptrs[o], source_ptrs[o], &shares[o]);
    CHECK(built.ok, name.str() << ": share " << o << " refused: " << built.message);
    FillMoeBackwardWeights(p, w_ptrs, &shares[o]);
    PartitionCredit(shares[o].scale, p.cores, p.planner, &shares[o].scale_credit);
    PartitionCredit(shares[o].dots, p.cores, p.planner, &shares[o].dots_credit, shares[o].dots.block_bytes);
    views.push_back(&shares[o]);
  }
  const bool on_sdma = MoeBackwardCarryOnSdma(p, views);
  CHECK(on_sdma == carry.on_sdma, name.str() << ": the shares' carry lanes differ from the joined carry's");
  std::vector<std::shared_ptr<const MoeBackwardShare>> owned;
  for (int o = 0; o < n; ++o) {
    shares[o].carry.on_sdma = on_sdma;
    PartitionCredit(shares[o].carry, on_sdma ? p.engines : p.cores, p.planner, &shares[o].carry_credit);
    owned.push_back(std::shared_ptr<const MoeBackwardShare>(std::shared_ptr<void>(), &shares[o]));  // they outlive the phase
  }
  std::vector<std::vector<float>> d_ey_shares(n, std::vector<float>(per_rank * hidden, std::nanf(""))),
      d_w_shares(n, std::vector<float>(pairs, std::nanf("")));
  PlanBuffers share_scale, share_dot;
  for (int r = 0; r < n; ++r) {
    share_scale.out.push_back(d_ey_shares[r].data());
    share_dot.in.push_back(ey[r].data());
    share_dot.out.push_back(d_w_shares[r].data());
  }
  share_scale.producer_in = share_dot.producer_in = to_carry.in;
  const Phase by_share = MoeBackwardSharesPhase(p, owned, slot_ptrs, share_scale, share_dot);
  for (uint64_t i = by_share.count; i-- > 0;) by_share.run(i);
  int64_t differ = 0;
  for (int r = 0; r < n; ++r) {
    differ += std::memcmp(d_ey_shares[r].data(), d_ey[r].data(), d_ey[r].size() * 4) != 0;
    differ += std::memcmp(d_w_shares[r].data(), d_w[r].data(), d_w[r].size() * 4) != 0;
  }
  CHECK(differ == 0, name.str() << ": " << differ << " ranks' results differ run share by share");
  for (int o = 0; o < n; ++o)
    for (int which = 0; which < 3; ++which) {
      const Plan& whole = which == 0 ? carry : which == 1 ? scale : dots;
      const LaneCredit& part = which == 0   ? shares[o].carry_credit
                               : which == 1 ? shares[o].scale_credit
                                            : shares[o].dots_credit;
      std::vector<std::pair<int32_t, int64_t>> joined, alone;
      for (const LaneTask& t : whole.tasks)
        if (t.npu == o) joined.push_back({t.lane, t.bytes});
      CHECK(part.on_sdma == whole.on_sdma && part.lanes_per_npu == whole.lanes_per_npu,
            name.str() << ": owner " << o << "'s plan " << which << " credits other lanes than the joined plan's");
      for (const LaneTask& t : part.tasks) {
        CHECK(t.npu == o, name.str() << ": owner " << o << "'s share has work on NPU " << t.npu);
        alone.push_back({t.lane, t.bytes});
      }
      CHECK(joined == alone, name.str() << ": owner " << o << "'s lanes of plan " << which
                                        << " differ between its share and the joined plan");
    }
}

void CheckMoeBackwardPlans(int64_t* plans) {
  std::mt19937_64 rng(31);
  for (int n : {1, 2, 3, 8})
    for (int64_t capacity : {1, 5, 64})
      for (int64_t topk : {1, 4})
        for (bool staged : {false, true})
          for (Planner planner : {Planner::kBalanced, Planner::kNaive})
            // hidden 3: rows of one 64-byte column; 300: dots cut no lane.
            for (int64_t hidden : {3, 300}) {
              CheckMoeBackwardPlan(rng, n, 4 * n, 17, topk, capacity, hidden, planner, staged);
              ++*plans;
            }
  // Sources past 2^16 (n x tokens x topk = 80000): the shares sort them by
  // three bytes.
  CheckMoeBackwardPlan(rng, 4, 16, 5000, 4, 4096, 3, Planner::kBalanced, false);
  ++*plans;
  // A slot whose source is another pair: refused, naming the op.
  MoeOpShape p;
  p.group_size = 1, p.num_experts = 1, p.capacity = 2, p.tokens = 2, p.topk = 1, p.hidden = 1;
  const int32_t slots[2] = {0, 1}, swapped[2] = {1, 0};
  MoeBackwardPlans bad;
  const Status st = BuildMoeBackwardPlans(p, {slots}, {swapped}, {}, &bad);
  CHECK(!st.ok && st.message.find("strata.moe.combine (backward)") != std::string::npos &&
            st.message.find("mixes two dispatches") != std::string::npos,
        "moe_combine_backward mismatched layout: " << st.message);
  // A slot claiming a dropped pair: every kept pair points back, but the
  // counts differ.
  const int32_t kept_one[2] = {0, -1}, claims_two[2] = {0, 1};
  const Status counts = BuildMoeBackwardPlans(p, {kept_one}, {claims_two}, {}, &bad);
  CHECK(!counts.ok && counts.message.find("1 pairs have a slot but 2 slots have a source") != std::string::npos,
        "moe_combine_backward slot without its pair: " << counts.message);
}

float Bf16Value(const std::vector<uint8_t>& bytes, int64_t i) {
  uint16_t h;
  std::memcpy(&h, bytes.data() + 2 * i, 2);
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}
// The MoE backward's row kernels in every variant this CPU runs: ScaleRow
// stores what AxpyRow into a zeroed accumulator and NarrowRow store (the
// weighted plans' general path), DotRow gives the same value in every
// variant; over random bit patterns (NaNs, infinities, subnormals, signed
// zeros) and odd lengths. A NaN need only meet a NaN (which payload an add
// keeps is the compiler's choice of operand order).
void CheckRowKernels() {
  g_context = "row kernels";
  std::mt19937_64 rng(37);
  auto same = [](double a, double b) { return (std::isnan(a) && std::isnan(b)) || std::memcmp(&a, &b, 8) == 0; };
  auto value = [](DType dt, const std::vector<uint8_t>& bytes, int64_t i) -> double {
    switch (dt) {
      case DType::F64: { double v; std::memcpy(&v, bytes.data() + 8 * i, 8); return v; }
      case DType::F32: { float v; std::memcpy(&v, bytes.data() + 4 * i, 4); return v; }
      default: { uint16_t h; std::memcpy(&h, bytes.data() + 2 * i, 2); return h; }  // bits: exact compare
    }
  };
  const std::vector<std::string> isas = ReduceIsasAvailable();
  for (DType dt : {DType::F32, DType::F64, DType::BF16, DType::F16})
    for (int64_t n : {0, 1, 7, 8, 9, 1001}) {
      const size_t es = DTypeSize(dt);
      std::vector<uint8_t> a(n * es), b(n * es);
      for (auto* v : {&a, &b})
        for (size_t i = 0; i < v->size(); ++i) (*v)[i] = static_cast<uint8_t>(rng());
      // Mostly ordinary values: a sum of random bit patterns is almost always NaN.
      for (int64_t i = 0; i < n; ++i)
        if (rng() % 4 != 0)
          for (auto* v : {&a, &b}) {
            const float f = std::normal_distribution<float>()(rng);
            if (dt == DType::F32) std::memcpy(v->data() + 4 * i, &f, 4);
            if (dt == DType::F64) { const double d = f; std::memcpy(v->data() + 8 * i, &d, 8); }
            if (dt == DType::BF16) { uint32_t bits; std::memcpy(&bits, &f, 4); const uint16_t h = bits >> 16; std::memcpy(v->data() + 2 * i, &h, 2); }
          }
      const double w = std::normal_distribution<float>()(rng);
      double first_dot = 0;
      std::vector<uint8_t> first_scale;
      for (size_t k = 0; k < isas.size(); ++k) {
        SetReduceIsa(isas[k]);
        const std::string where = std::string(DTypeName(dt)) + " n=" + std::to_string(n) + " " + isas[k];
        const double dot = DotRow(dt, a.data(), b.data(), n);
        if (k == 0) first_dot = dot;
        CHECK(same(dot, first_dot), "DotRow " << where << ": " << dot << " vs " << first_dot);
        {
          // StartSumRow: the same accumulator as zeroing it and AxpyRow (F16 too).
          const DType acc_dt = dt == DType::F64 ? DType::F64 : DType::F32;
          std::vector<uint8_t> started(n * DTypeSize(acc_dt), 0xA5), added(n * DTypeSize(acc_dt), 0);
          StartSumRow(dt, started.data(), a.data(), w, n);
          AxpyRow(dt, added.data(), a.data(), w, n);
          for (int64_t i = 0; i < n; ++i)
            CHECK(same(value(acc_dt, started, i), value(acc_dt, added, i)),
                  "StartSumRow " << where << " element " << i << " differs from zeros + AxpyRow");
        }
        if (dt == DType::F16) continue;  // no ScaleRow: StoreSum's own conversion
        std::vector<uint8_t> scaled(n * es, 0xA5), general(n * es, 0x5A);
        std::vector<double> acc(n, 0.0);
        ScaleRow(dt, scaled.data(), a.data(), w, n);
        AxpyRow(dt, acc.data(), a.data(), w, n);
        NarrowRow(dt, general.data(), acc.data(), n);
        if (k == 0) first_scale = scaled;
        for (int64_t i = 0; i < n; ++i) {
          CHECK(same(value(dt, scaled, i), value(dt, general, i)) ||
                    (dt == DType::BF16 && std::isnan(Bf16Value(scaled, i)) && std::isnan(Bf16Value(general, i))),
                "ScaleRow " << where << " element " << i << " differs from AxpyRow + NarrowRow");
          CHECK(same(value(dt, scaled, i), value(dt, first_scale, i)) ||
                    (dt == DType::BF16 && std::isnan(Bf16Value(scaled, i)) && std::isnan(Bf16Value(first_scale, i))),
                "ScaleRow " << where << " element " << i << " differs from " << isas[0]);
        }
      }
      SetReduceIsa("auto");
    }
}

// Rounding to bfloat16 in every variant this CPU runs (the avx512 one lets
// the CPU round, vcvtneps2bf16, and rounds the denormal inputs it takes as
// zero by the integer rule): NarrowRow and AxpyAddRoundedRow against the
// scalar rule (nearest even, a NaN quieted), on every float32 exponent with
// its mantissa's edges and random ones (denormals, ties, infinities, NaNs),
// in runs of 1003 (vectors and a tail).
uint16_t Bf16Rounded(uint32_t bits) {
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40u);
  return static_cast<uint16_t>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}
void CheckBf16Rounding() {
  g_context = "bfloat16 rounding";
  std::mt19937_64 rng(41);
  std::vector<uint32_t> patterns;
  for (uint32_t sign : {0u, 0x80000000u})
    for (uint32_t exponent = 0; exponent < 256; ++exponent)
      for (uint32_t mantissa : {0u, 1u, 0x7fffu, 0x8000u, 0x8001u, 0x17fffu, 0x18000u, 0x3fffffu, 0x400000u,
                                0x7f7fffu, 0x7f8000u, 0x7fffffu}) {
        patterns.push_back(sign | exponent << 23 | mantissa);
        for (int r = 0; r < 8; ++r) patterns.push_back(sign | exponent << 23 | static_cast<uint32_t>(rng() & 0x7fffffu));
      }
  const int64_t n = static_cast<int64_t>(patterns.size());
  std::vector<float> values(n), zeros(n, 0.0f);
  std::memcpy(values.data(), patterns.data(), 4 * n);
  const std::vector<uint16_t> zero_rows(n, 0);  // bfloat16 zeros: part + 1 x 0 is part
  for (const std::string& isa : ReduceIsasAvailable()) {
    SetReduceIsa(isa);
    for (int64_t begin = 0; begin < n; begin += 1003) {
      const int64_t len = std::min<int64_t>(1003, n - begin);
      std::vector<uint16_t> narrowed(len);
      NarrowRow(DType::BF16, narrowed.data(), values.data() + begin, len);
      std::vector<float> acc(len, 0.0f);
      AxpyAddRoundedRow(DType::BF16, acc.data(), values.data() + begin, zero_rows.data(), 1.0, len);
      for (int64_t i = 0; i < len; ++i) {
        const uint32_t bits = patterns[begin + i];
        CHECK(narrowed[i] == Bf16Rounded(bits),
              "NarrowRow " << isa << " of " << std::hex << bits << ": " << narrowed[i] << std::dec);
        // acc = 0 + (part + 1 x 0, rounded): a -0 either way becomes +0.
        const uint32_t sum_bits = bits == 0x80000000u ? 0u : bits;
        const uint32_t rounded_bits = static_cast<uint32_t>(Bf16Rounded(sum_bits)) << 16;
        float rounded;
        std::memcpy(&rounded, &rounded_bits, 4);
        const float added = 0.0f + rounded;
        uint32_t want, got;
        std::memcpy(&want, &added, 4);
        std::memcpy(&got, &acc[i], 4);
        const bool nan = (want & 0x7fffffffu) > 0x7f800000u;
        CHECK(got == want || (nan && (got & 0x7fffffffu) > 0x7f800000u),
              "AxpyAddRoundedRow " << isa << " of " << std::hex << bits << ": " << got << " want " << want << std::dec);
      }
    }
  }
  SetReduceIsa("auto");
}

void CheckRaggedPlans(int64_t* plans) {
  std::mt19937_64 rng(28);
  CheckRaggedErrors(rng);
  for (int n : {1, 2, 3, 8})
    for (int k : {1, 2})
      for (IndexType type : {IndexType::S32, IndexType::S64}) {
        const RaggedCase c = MakeRaggedCase(rng, n, k, 40, 9);
        for (const auto& [row_bytes, dtype] : std::vector<std::pair<int64_t, DType>>{
                 {4, DType::F32}, {12, DType::F32}, {14336, DType::BF16}, {4112, DType::C128}})
          for (int lanes : {1, 3, 48})
            for (Planner planner : {Planner::kBalanced, Planner::kNaive}) {
              CheckRaggedPlan(c, type, row_bytes, dtype, lanes, planner);
              ++*plans;
            }
      }
  // Past one host chunk per rank: 8 ranks, 512 rows of 7 KiB each.
  const RaggedCase big = MakeRaggedCase(rng, 8, 1, 512, 64);
  CheckRaggedPlan(big, IndexType::S32, 7168, DType::BF16, 48, Planner::kBalanced);
  ++*plans;
  for (int k : {1, 2}) {
    const RaggedCase c = MakeRaggedCase(rng, 8, k, 40, 9);
    for (Mode mode : {Mode::kStrata, Mode::kBufferCentric})
      for (int64_t comm_buffer_bytes : {int64_t{200} << 20, c.out_rows * int64_t{64}}) {  // fits; 3 rounds
        CheckRaggedModel(c, 160, mode, comm_buffer_bytes);
        ++*plans;
      }
  }
  CheckUniformRaggedIsAllToAll();
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
  const std::vector<CollectiveDef> fixed(Collectives().begin(), Collectives().begin() + kFixedPlanOpCount);
  for (const CollectiveDef& def : fixed)
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
  for (const CollectiveDef& def : fixed)
    for (int64_t block_bytes : {4, 4096 * 384}) {
      if (block_bytes > 4 && def.OutBlocks(384) * def.InBlocks(384) > 1) continue;  // keep it quick
      Case c{&def, 384, DType::F32, block_bytes, 48, Planner::kBalanced, 0, {}};
      if (def.kind == OpKind::kPermute) c.perm = Permutations(384)[0];
      CheckPlan(c);
      ++plans;
    }
  CheckRaggedPlans(&plans);
  CheckMoeDispatchPlans(&plans);
  CheckMoeCombinePlans(&plans);
  CheckMoeBackwardPlans(&plans);
  CheckRowKernels();
  CheckBf16Rounding();
  std::printf("test_plans: %lld plans, %lld checks, %lld failures\n", static_cast<long long>(plans),
              static_cast<long long>(g_checks), static_cast<long long>(g_failures));
  return g_failures == 0 ? 0 : 1;
}
