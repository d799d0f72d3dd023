#include "plan.h"

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace strata {

const char* PlannerName(Planner planner) {
  return planner == Planner::kNaive ? "naive" : "balanced";
}

void Plan::Add(const std::vector<BlockRef>& srcs, const std::vector<BlockRef>& dsts, uint32_t span) {
  Add(srcs.data(), static_cast<uint32_t>(srcs.size()), dsts.data(), static_cast<uint32_t>(dsts.size()), span);
}

void Plan::Add(const BlockRef* srcs, uint32_t src_count, const BlockRef* dsts, uint32_t dst_count,
               uint32_t span) {
  Transfer t;
  t.span = span;
  // push_back, not a range insert: plans built at run time (MoE's) add
  // tens of thousands of transfers of one or two refs, where the insert's
  // general path was a fifth of their build.
  t.src_begin = static_cast<uint32_t>(refs.size());
  t.src_count = src_count;
  for (uint32_t k = 0; k < src_count; ++k) refs.push_back(srcs[k]);
  t.dst_begin = static_cast<uint32_t>(refs.size());
  t.dst_count = dst_count;
  for (uint32_t k = 0; k < dst_count; ++k) refs.push_back(dsts[k]);
  for (uint32_t k = 1; k < dst_count; ++k) t.local_copies += dsts[k].rank == dsts[k - 1].rank;
  transfers.push_back(t);
  if (weighted)
    while (weights.size() < refs.size()) weights.push_back(1.0);
}

void Plan::Clear() {
  Plan fresh;
  // Every list moves over to `fresh` and back, emptied: what Plan gains later
  // is reset too, as long as it is listed in the swap below or a scalar.
  std::swap(fresh.refs, refs);
  std::swap(fresh.transfers, transfers);
  std::swap(fresh.weights, weights);
  std::swap(fresh.pieces, pieces);
  std::swap(fresh.tasks, tasks);
  std::swap(fresh.chunk_starts, chunk_starts);
  std::swap(fresh.chunk_bytes, chunk_bytes);
  std::swap(fresh.moves, moves);
  std::swap(fresh.move_starts, move_starts);
  *this = std::move(fresh);  // the scalars as constructed, the lists it held
  refs.clear();
  transfers.clear();
  weights.clear();
  pieces.clear();
  tasks.clear();
  chunk_starts.clear();
  chunk_bytes.clear();
  moves.clear();
  move_starts.clear();
}

void Plan::ClearKeepingElements() {
  std::vector<Transfer> kept_transfers;
  std::vector<BlockRef> kept_refs;
  std::vector<double> kept_weights;
  kept_transfers.swap(transfers);
  kept_refs.swap(refs);
  kept_weights.swap(weights);
  Clear();
  transfers.swap(kept_transfers);
  refs.swap(kept_refs);
  weights.swap(kept_weights);
}

void Plan::AddWeighted(const BlockRef* srcs, const double* w, uint32_t src_count, const BlockRef* dsts,
                       uint32_t dst_count, uint32_t span) {
  weighted = true;
  while (weights.size() < refs.size()) weights.push_back(1.0);
  for (uint32_t k = 0; k < src_count; ++k) weights.push_back(w[k]);
  Add(srcs, src_count, dsts, dst_count, span);
}

namespace {

inline int64_t AlignDown(int64_t v, int64_t a) { return v / a * a; }
inline int64_t AlignNearest(int64_t v, int64_t a) { return (v + a / 2) / a * a; }

// Bytes read + written per column of a transfer, for placing cuts (a dot
// plan's destinations hold a value per row of columns: its cuts fall on
// whole blocks, Partition's align, and its bytes are PieceBytes').
inline int64_t BytesPerColumn(const Plan& plan, const Transfer& t) {
  return plan.dot ? std::max<uint32_t>(1, t.src_count) : t.src_count + t.dst_count;
}

// Every share of the plan's transfers, to `emit(transfer, npu, col_begin,
// col_end)`: each transfer's columns are shared evenly by its destination
// ranks, in shares of at least kMinShareBytes: a block too small to split N
// ways (a 4 KB all_gather over 384 ranks) goes to fewer ranks, rotating with
// the transfer so every rank still gets its turn.
template <typename Emit>
void ForEachShare(const Plan& p, int64_t align_bytes, Emit&& emit) {
  constexpr int64_t kMinShareBytes = 4096;
  for (uint32_t ti = 0; ti < p.transfers.size(); ++ti) {
    const Transfer& t = p.transfers[ti];
    const int64_t cols = p.Columns(t);
    if (t.dst_count == 0 || cols <= 0) continue;
    if (t.dst_count == 1 || cols < 2 * kMinShareBytes) {
      // One share (MoE's rows, ragged runs): no divide per transfer, which
      // cost MoE dispatch's ten thousand transfers most of Partition's time.
      emit(ti, p.Executor(t, p.refs[t.dst_begin + (t.dst_count == 1 ? 0 : ti % t.dst_count)].rank), int64_t{0}, cols);
      continue;
    }
    const int64_t shares = std::max<int64_t>(1, std::min<int64_t>(t.dst_count, cols / kMinShareBytes));
    for (int64_t s = 0; s < shares; ++s) {
      int64_t c0 = std::min(cols, AlignDown(cols * s / shares, align_bytes));
      int64_t c1 = s + 1 == shares ? cols : std::min(cols, AlignDown(cols * (s + 1) / shares, align_bytes));
      if (c1 <= c0) continue;
      emit(ti, p.Executor(t, p.refs[t.dst_begin + (s + ti) % t.dst_count].rank), c0, c1);
    }
  }
}

// Folds `next` into `run` when it is the run's next copy: the same columns,
// its ranks and blocks one more step along (the first two copies set the step).
bool ExtendRun(Move& run, const Move& next) {
  if (next.col != run.col || next.len != run.len) return false;
  const int32_t s_rank = next.src_rank - run.src_rank, s_block = next.src_block - run.src_block;
  const int32_t d_rank = next.dst_rank - run.dst_rank, d_block = next.dst_block - run.dst_block;
  if (run.count == 1) {
    if (s_rank == 0 && s_block == 0) return false;  // not a stride: keep it a copy of its own
    run.src_rank_step = s_rank, run.src_block_step = s_block;
    run.dst_rank_step = d_rank, run.dst_block_step = d_block;
    run.count = 2;
    return true;
  }
  const int32_t k = run.count;
  if (s_rank != k * run.src_rank_step || s_block != k * run.src_block_step ||
      d_rank != k * run.dst_rank_step || d_block != k * run.dst_block_step)
    return false;
  run.count++;
  return true;
}

// A fan-out copy whose sources fit in cache (all_gather or broadcast of small
// blocks), as moves destination by destination: each output is written as
// one sequential run while the sources stay cached. Source by source (the
// pieces' order), a 1 KB all_gather over 384 ranks writes 1 KB into each of
// 384 outputs in turn: 22.8 ms per op chained, 15.5 pulled. The moves are
// dealt over the plan's host chunks by bytes, so the host's parallelism and
// the lanes' credits (per chunk) are unchanged.
void PullMoves(Plan& plan) {
  const int64_t m = plan.block_bytes;
  const uint64_t chunks = plan.chunk_starts.size() - 1;
  if (m <= 0 || chunks == 0) return;
  struct Copy {
    BlockRef dst, src;
    int64_t len;
  };
  std::vector<Copy> copies;
  int64_t total = 0;
  for (const Transfer& t : plan.transfers) {
    for (uint32_t k = 0; k < t.dst_count; ++k) {
      copies.push_back({plan.refs[t.dst_begin + k], plan.refs[t.src_begin], plan.Columns(t)});
      total += plan.Columns(t);
    }
  }
  std::stable_sort(copies.begin(), copies.end(), [](const Copy& a, const Copy& b) {
    return a.dst.rank != b.dst.rank ? a.dst.rank < b.dst.rank : a.dst.block < b.dst.block;
  });
  // Bytes per chunk: a run is cut there, so no chunk gets much more than its share.
  const int64_t share = std::max<int64_t>(m, (total + static_cast<int64_t>(chunks) - 1) / static_cast<int64_t>(chunks));
  int64_t in_chunk = share;  // the first copy opens chunk 0
  for (const Copy& c : copies) {
    const Move next{c.src.rank, c.src.block, c.dst.rank, c.dst.block, 0, c.len};
    if (in_chunk + c.len > share && plan.move_starts.size() < chunks) {
      plan.move_starts.push_back(static_cast<uint32_t>(plan.moves.size()));
      in_chunk = 0;
    } else if (ExtendRun(plan.moves.back(), next)) {
      in_chunk += c.len;
      continue;
    }
    plan.moves.push_back(next);
    in_chunk += c.len;
  }
  while (plan.move_starts.size() < chunks) plan.move_starts.push_back(static_cast<uint32_t>(plan.moves.size()));
  plan.move_starts.push_back(static_cast<uint32_t>(plan.moves.size()));
}

// Adds `cols` columns of transfer t to `bytes` by kind (ChunkBytes): what
// crosses to other ranks, what is copied or summed within one, what is
// written.
void AddBytesByKind(const Plan& plan, const Transfer& t, int64_t cols, ChunkBytes* bytes) {
  bytes->written += plan.OutBytes(cols) * t.dst_count;
  if (t.src_count == 0) return;
  if (plan.dot) {
    bytes->carried += plan.OutBytes(cols) * t.dst_count;  // the value goes to its rank
  } else if (plan.local_sums) {
    bytes->local += cols * t.src_count;
  } else if (plan.weighted) {
    bytes->carried += cols * t.src_count;
  } else {
    bytes->carried += cols * (t.dst_count - t.local_copies);
    bytes->local += cols * t.local_copies;
  }
}

// The naive planner's split of one NPU's shares: share i whole to lane
// i % lanes (the per-peer loop). kWrite false: only the tasks' npu, lane and
// bytes, as BalanceLanes'. The pieces go out of order, so `mine` must not
// be `pieces`' storage.
template <bool kWrite, typename Shares>
void NaiveLanes(const Plan& plan, int npu, int lanes, const Shares& mine, size_t count, Piece* pieces,
                LaneTask* tasks, size_t* used_out, size_t* made_out) {
  size_t used = 0, made = 0;
  for (int l = 0; l < lanes; ++l) {
    LaneTask task{npu, l, static_cast<uint32_t>(used), 0, 0};
    for (size_t i = static_cast<size_t>(l); i < count; i += static_cast<size_t>(lanes)) {
      const Piece piece = mine[i];
      task.bytes += plan.PieceBytes(plan.transfers[piece.transfer], piece.col_end - piece.col_begin);
      if (kWrite) pieces[used] = piece;
      ++used;
    }
    task.piece_end = static_cast<uint32_t>(used);
    if (task.piece_end > task.piece_begin) tasks[made++] = task;
  }
  *used_out = used;
  *made_out = made;
}

// The shares of a plan whose every transfer is one whole share on one NPU
// (a MoE share's plans: every row on its owner): share i is transfer i.
struct WholeTransfers {
  const Plan* plan;
  int32_t npu;
  Piece operator[](size_t i) const {
    return {static_cast<uint32_t>(i), npu, 0, plan->Columns(plan->transfers[i])};
  }
};

// In place: `mine` (the shares) starts `lanes` places after `pieces`, and the
// piece written while share i is read has an index below i + lanes (one per
// share done, plus one per cut, and the lanes so far made fewer than `lanes`
// cuts), so it never lands on share i or a later one.
//
// kWrite false: only the lanes' tasks' npu, lane and bytes (PartitionCredit):
// the walk is the same, so are the bytes; `pieces` is not touched (`used`
// still counts the ranges a lane would have, so a lane has a task exactly
// when it would).
// `mine[i]` is share i (an array of them, or WholeTransfers).
template <bool kWrite, typename Shares>
void BalanceLanes(const Plan& plan, int npu, int lanes, int64_t align, int64_t min_lane_bytes, const Shares& mine,
                  size_t count, Piece* pieces, LaneTask* tasks, size_t* used_out, size_t* made_out) {
  size_t used = 0, made = 0;
  int64_t total = 0;
  for (size_t i = 0; i < count; ++i)
    total += (mine[i].col_end - mine[i].col_begin) * BytesPerColumn(plan, plan.transfers[mine[i].transfer]);
  const int64_t used_lanes =
      std::max<int64_t>(1, std::min<int64_t>(lanes, total / std::max<int64_t>(1, min_lane_bytes)));
  // Walk the pieces, cutting whenever the running byte count passes the
  // next lane's quota; the cut is snapped to an aligned column.
  size_t pi = 0;
  int64_t col = mine[0].col_begin;
  int64_t done = 0;
  for (int64_t l = 0; l < used_lanes && pi < count; ++l) {
    // An equal share of what is left: a lane that ended at a piece's end
    // (below) spreads its shortfall over all the lanes after it.
    const int64_t quota_end = l + 1 == used_lanes ? total : done + (total - done) / (used_lanes - l);
    LaneTask task{npu, static_cast<int32_t>(l), static_cast<uint32_t>(used), 0, 0};
    while (pi < count && done < quota_end) {
      const Piece p = mine[pi];  // a copy: writing the piece may reuse a share's place
      const int64_t bpc = BytesPerColumn(plan, plan.transfers[p.transfer]);
      // The rest of the piece fits the quota: no divide (most pieces of a
      // plan of many small transfers).
      int64_t end = (p.col_end - col) * bpc <= quota_end - done
                        ? p.col_end
                        : std::min(p.col_end, col + (quota_end - done + bpc - 1) / bpc);
      // A short tail of a piece that is not the NPU's last goes with this
      // lane rather than making the next one straddle two pieces.
      if (end < p.col_end && l + 1 != used_lanes && pi + 1 < count && 2 * (p.col_end - end) <= kMessageBytes)
        end = p.col_end;
      if (end < p.col_end && l + 1 != used_lanes) {
        // To the nearest aligned column: rounding down every cut carried
        // each lane's shortfall on to the last lane (47 lanes of one
        // column and one of 17 for a 4 KB all_reduce over 48 lanes).
        int64_t snapped = std::min(p.col_end, p.col_begin + AlignNearest(end - p.col_begin, align));
        end = snapped > col ? snapped : std::min(p.col_end, col + align);
      }
      if (l + 1 == used_lanes) end = p.col_end;
      // A range that continues the lane's previous one is the same piece
      // (one contiguous copy: one DataCopy or descriptor on the NPU).
      if (!kWrite) {
        ++used;
      } else if (used > task.piece_begin && pieces[used - 1].transfer == p.transfer && pieces[used - 1].col_end == col) {
        pieces[used - 1].col_end = end;
      } else {
        pieces[used++] = {p.transfer, npu, col, end};
      }
      task.bytes += plan.PieceBytes(plan.transfers[p.transfer], end - col);
      done += (end - col) * bpc;
      col = end;
      if (col >= p.col_end) {
        ++pi;
        if (pi < count) col = mine[pi].col_begin;
        // The lane's piece ended just short of its quota: starting the
        // next piece, only to cut it, would cost the lane that piece's
        // messages for less than one message's worth of its bytes; the
        // next lane takes the piece (a whole small piece still goes here).
        if (pi < count && l + 1 != used_lanes) {
          const int64_t next_bpc = BytesPerColumn(plan, plan.transfers[mine[pi].transfer]);
          const int64_t room_left = quota_end - done;
          if (2 * room_left < next_bpc * kMessageBytes && room_left < (mine[pi].col_end - mine[pi].col_begin) * next_bpc)
            break;
        }
      }
    }
    task.piece_end = static_cast<uint32_t>(used);
    if (task.piece_end > task.piece_begin) tasks[made++] = task;
  }
  *used_out = used;
  *made_out = made;
}

}  // namespace

PlanPartition::PlanPartition(Plan* plan, int lanes, Planner planner, int64_t align, int64_t min_lane_bytes,
                             int64_t host_chunk_bytes)
    : plan_(plan), lanes_(std::max(1, lanes)), planner_(planner), min_lane_bytes_(min_lane_bytes),
      host_chunk_bytes_(host_chunk_bytes) {
  Plan& p = *plan;
  const int n = p.num_ranks;
  // Element alignment is the hard constraint; cache lines are the soft one.
  const int64_t esize = static_cast<int64_t>(DTypeSize(p.dtype));
  align_ = std::max<int64_t>(align / esize * esize, esize);

  // 1. Each transfer's columns are shared evenly by its destination ranks
  // (ForEachShare), run twice: to count each NPU's pieces, then to place
  // them in one array by NPU (a vector per NPU grown piece by piece cost MoE
  // dispatch's ten thousand transfers a third of Partition).
  auto shares_of = [&](auto&& emit) { ForEachShare(p, align_, emit); };
  npu_start_.assign(n + 1, 0);
  shares_of([&](uint32_t ti, int32_t npu, int64_t c0, int64_t c1) {
    npu_start_[npu + 1]++;
    bytes_ += p.PieceBytes(p.transfers[ti], c1 - c0);
  });
  for (int npu = 0; npu < n; ++npu) npu_start_[npu + 1] += npu_start_[npu];
  // Room in the plan for each NPU's pieces: its shares, plus one per lane (a
  // lane cuts at most one piece in two), and for its lanes' tasks; Finish
  // closes the gaps. The shares wait at the end of their NPU's room, and the
  // split writes the pieces from its start: a second array of shares, and
  // its page faults, cost MoE dispatch's partition as much as the split.
  // Only NPUs with shares get room: a plan of one rank's work (a share of MoE
  // combine's, built by each of 384 ranks) would otherwise size and clear
  // 384 x lanes tasks.
  // The steps after this one visit only those NPUs (busy_): at 384 ranks a
  // share's three partitions per op each walked every NPU four times more.
  busy_before_.assign(n + 1, 0);
  busy_.clear();
  for (int npu = 0; npu < n; ++npu) {
    const bool busy = npu_start_[npu + 1] > npu_start_[npu];
    busy_before_[npu + 1] = busy_before_[npu] + (busy ? 1 : 0);
    if (busy) busy_.push_back(npu);
  }
  p.pieces.resize(npu_start_[n] + busy_before_[n] * lanes_);
  p.tasks.resize(busy_before_[n] * lanes_);
  {
    std::vector<size_t> next(n);
    for (const int32_t npu : busy_) next[npu] = RoomStart(npu) + lanes_;
    shares_of([&](uint32_t ti, int32_t npu, int64_t c0, int64_t c1) { p.pieces[next[npu]++] = {ti, npu, c0, c1}; });
  }
  piece_count_.assign(n, 0);
  task_count_.assign(n, 0);
}

size_t PlanPartition::RoomStart(int npu) const { return npu_start_[npu] + busy_before_[npu] * lanes_; }
size_t PlanPartition::TaskRoom(int npu) const { return busy_before_[npu] * lanes_; }

void PlanPartition::Npu(int npu) {
  Plan& plan = *plan_;
  const size_t count = npu_start_[npu + 1] - npu_start_[npu];
  if (count == 0) return;
  const int lanes = lanes_;
  Piece* const pieces = plan.pieces.data() + RoomStart(npu);
  const Piece* const shares = pieces + lanes;
  LaneTask* const tasks = plan.tasks.data() + TaskRoom(npu);
  // Piece indices in tasks are local to the NPU until Finish places them.
  size_t used = 0, made = 0;
  if (planner_ == Planner::kNaive) {
    // Out of order, so from a copy of the shares.
    const std::vector<Piece> mine(shares, shares + count);
    NaiveLanes<true>(plan, npu, lanes, mine.data(), count, pieces, tasks, &used, &made);
  } else {
    Balance(npu, shares, count, pieces, tasks, &used, &made);
  }
  piece_count_[npu] = used;
  task_count_[npu] = made;
}

void PlanPartition::Balance(int npu, const Piece* mine, size_t count, Piece* pieces, LaneTask* tasks,
                            size_t* used_out, size_t* made_out) const {
  BalanceLanes<true>(*plan_, npu, lanes_, align_, min_lane_bytes_, mine, count, pieces, tasks, used_out, made_out);
}

void PlanPartition::Finish() {
  Plan& plan = *plan_;
  // 2'. Every NPU's pieces and tasks, in NPU order, without the gaps.
  plan.lanes_per_npu = lanes_;
  size_t pieces = 0, tasks = 0;
  for (const int32_t npu : busy_) {  // NPU order; the others have nothing
    const size_t room = RoomStart(npu);
    if (pieces != room && piece_count_[npu] > 0)
      std::memmove(plan.pieces.data() + pieces, plan.pieces.data() + room, piece_count_[npu] * sizeof(Piece));
    const LaneTask* task = plan.tasks.data() + TaskRoom(npu);
    for (size_t i = 0; i < task_count_[npu]; ++i) {
      LaneTask t = task[i];
      t.piece_begin += static_cast<uint32_t>(pieces);
      t.piece_end += static_cast<uint32_t>(pieces);
      plan.tasks[tasks++] = t;
    }
    pieces += piece_count_[npu];
  }
  plan.pieces.resize(pieces);
  plan.tasks.resize(tasks);

  // 3. Host chunks.
  const int64_t host_chunk_bytes = host_chunk_bytes_;
  plan.chunk_starts.clear();
  int64_t acc = host_chunk_bytes;
  for (uint32_t t = 0; t < plan.tasks.size(); ++t) {
    if (acc >= host_chunk_bytes) {
      plan.chunk_starts.push_back(t);
      acc = 0;
    }
    acc += plan.tasks[t].bytes;
  }
  plan.chunk_starts.push_back(static_cast<uint32_t>(plan.tasks.size()));
  plan.chunk_bytes.assign(plan.chunk_starts.size() - 1, ChunkBytes{});
  for (size_t c = 0; c + 1 < plan.chunk_starts.size(); ++c) {
    ChunkBytes& bytes = plan.chunk_bytes[c];
    for (uint32_t i = plan.chunk_starts[c]; i < plan.chunk_starts[c + 1]; ++i) {
      for (uint32_t pi = plan.tasks[i].piece_begin; pi < plan.tasks[i].piece_end; ++pi) {
        const Piece& piece = plan.pieces[pi];
        AddBytesByKind(plan, plan.transfers[piece.transfer], piece.col_end - piece.col_begin, &bytes);
      }
    }
  }

  // 4. Moves, when the plan is only 1 -> 1 copies, or a small fan-out copy.
  plan.moves.clear();
  plan.move_starts.clear();
  const bool one_source = !plan.is_reduction() && !plan.transfers.empty() &&
                          std::all_of(plan.transfers.begin(), plan.transfers.end(),
                                      [](const Transfer& t) { return t.src_count == 1 && t.dst_count >= 1; });
  if (!one_source) return;
  const bool one_to_one = std::all_of(plan.transfers.begin(), plan.transfers.end(),
                                      [](const Transfer& t) { return t.dst_count == 1; });
  if (!one_to_one) {
    int64_t sources = 0;
    for (const Transfer& t : plan.transfers) sources += plan.Columns(t);
    if (sources <= kPullSourceBytes) PullMoves(plan);
    return;
  }
  for (size_t c = 0; c + 1 < plan.chunk_starts.size(); ++c) {
    plan.move_starts.push_back(static_cast<uint32_t>(plan.moves.size()));
    uint32_t last_transfer = UINT32_MAX;
    for (uint32_t i = plan.chunk_starts[c]; i < plan.chunk_starts[c + 1]; ++i) {
      const LaneTask& task = plan.tasks[i];
      for (uint32_t pi = task.piece_begin; pi < task.piece_end; ++pi) {
        const Piece& piece = plan.pieces[pi];
        if (piece.col_end <= piece.col_begin) continue;
        const bool open_in_chunk = plan.moves.size() > plan.move_starts.back();
        // A lane's range that continues the previous one is one move (as
        // ExchangePhase's runs are: a move per source stream, not per lane).
        if (piece.transfer == last_transfer && plan.moves.back().count == 1) {  // set only after a move of this chunk
          Move& open = plan.moves.back();
          if (open.col + open.len == piece.col_begin) {
            open.len += piece.col_end - piece.col_begin;
            continue;
          }
        }
        const Transfer& t = plan.transfers[piece.transfer];
        const BlockRef& src = plan.refs[t.src_begin];
        const BlockRef& dst = plan.refs[t.dst_begin];
        Move next{src.rank, src.block, dst.rank, dst.block, piece.col_begin, piece.col_end - piece.col_begin};
        last_transfer = piece.transfer;
        if (open_in_chunk && ExtendRun(plan.moves.back(), next)) continue;
        plan.moves.push_back(next);
      }
    }
  }
  plan.move_starts.push_back(static_cast<uint32_t>(plan.moves.size()));
}

void Partition(Plan& plan, int lanes, Planner planner, int64_t align, int64_t min_lane_bytes,
               int64_t host_chunk_bytes) {
  PlanPartition steps(&plan, lanes, planner, align, min_lane_bytes, host_chunk_bytes);
  for (const int32_t npu : steps.Busy()) steps.Npu(npu);
  steps.Finish();
}

void PartitionCredit(const Plan& plan, int lanes, Planner planner, LaneCredit* credit, int64_t align,
                     int64_t min_lane_bytes) {
  lanes = std::max(1, lanes);
  const int64_t esize = static_cast<int64_t>(DTypeSize(plan.dtype));
  const int64_t align_bytes = std::max<int64_t>(align / esize * esize, esize);  // as PlanPartition's
  credit->tasks.clear();
  credit->bytes = ChunkBytes{};
  credit->lanes_per_npu = lanes;
  credit->on_sdma = plan.on_sdma;
  // Each NPU's shares split over its lanes as Partition splits them.
  std::vector<LaneTask>& tasks = credit->tasks;
  auto split = [&](int npu, const auto& mine, size_t count) {
    const size_t first = tasks.size();
    tasks.resize(first + static_cast<size_t>(lanes));
    size_t used = 0, made = 0;
    if (planner == Planner::kNaive) {
      NaiveLanes<false>(plan, npu, lanes, mine, count, nullptr, tasks.data() + first, &used, &made);
    } else {
      BalanceLanes<false>(plan, npu, lanes, align_bytes, min_lane_bytes, mine, count, nullptr, tasks.data() + first,
                          &used, &made);
    }
    for (size_t i = first; i < first + made; ++i) tasks[i].piece_begin = tasks[i].piece_end = 0;
    tasks.resize(first + made);
  };
  // Counted by NPU; when every transfer is one whole share on one NPU (a
  // MoE share's plans), the transfers are the shares, as they are.
  const int n = plan.num_ranks;
  thread_local std::vector<size_t> start;
  start.assign(static_cast<size_t>(n) + 2, 0);
  int32_t only_npu = -1;
  bool whole = true;
  size_t emitted = 0;
  ForEachShare(plan, align_bytes, [&](uint32_t ti, int32_t npu, int64_t c0, int64_t c1) {
    start[npu + 2]++;
    whole = whole && ti == emitted && c0 == 0 && c1 == plan.Columns(plan.transfers[ti]) &&
            (only_npu < 0 || npu == only_npu);
    only_npu = npu;
    ++emitted;
  });
  if (whole && emitted == plan.transfers.size()) {
    if (emitted > 0) split(only_npu, WholeTransfers{&plan, only_npu}, emitted);
  } else {
    // Placed by NPU (a counting sort) in the thread's scratch: npu's are
    // [start[npu], start[npu + 1]).
    thread_local std::vector<Piece> shares;
    for (int i = 2; i <= n + 1; ++i) start[i] += start[i - 1];
    shares.resize(start[n + 1]);
    ForEachShare(plan, align_bytes, [&](uint32_t ti, int32_t npu, int64_t c0, int64_t c1) {
      shares[start[npu + 1]++] = {ti, npu, c0, c1};
    });
    for (int npu = 0; npu < n; ++npu)
      if (start[npu + 1] > start[npu]) split(npu, shares.data() + start[npu], start[npu + 1] - start[npu]);
  }
  // The bytes by kind, as Finish counts them over the pieces: the pieces
  // cover each transfer's columns once, and every count is linear in them.
  for (const Transfer& t : plan.transfers) {
    const int64_t cols = plan.Columns(t);
    if (t.dst_count > 0 && cols > 0) AddBytesByKind(plan, t, cols, &credit->bytes);
  }
}

double LaneImbalance(const Plan& plan) {
  if (plan.tasks.empty()) return 1.0;
  // Lanes of one NPU work in parallel: the NPU finishes with its busiest
  // lane. Compare that with a perfect split of the NPU's bytes over all lanes.
  std::vector<int64_t> busiest(plan.num_ranks, 0), total(plan.num_ranks, 0);
  for (const LaneTask& t : plan.tasks) {
    busiest[t.npu] = std::max(busiest[t.npu], t.bytes);
    total[t.npu] += t.bytes;
  }
  double worst = 1.0;
  for (int i = 0; i < plan.num_ranks; ++i) {
    if (total[i] == 0) continue;
    double mean = static_cast<double>(total[i]) / plan.lanes_per_npu;
    worst = std::max(worst, busiest[i] / mean);
  }
  return worst;
}

}  // namespace strata
