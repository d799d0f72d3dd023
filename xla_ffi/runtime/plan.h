// A collective as data: which blocks of which ranks' inputs are combined into
// which blocks of which ranks' outputs, and how that work is split over each
// NPU's vector cores or DMA engines ("lanes").
//
// Layout every op is normalised to (the Python layer moves axes so it holds):
//   input  of each rank: [rows, in_blocks,  block_bytes]
//   output of each rank: [rows, out_blocks, block_bytes]
// `rows` is 1 except under vmap, where batch dims lead. A transfer moves the
// same column range of every row, so one plan serves any batch size.
// A transfer may span several consecutive blocks (ragged_all_to_all's run of
// rows): within a row they are contiguous, so its columns are the one byte
// range [0, span x block_bytes) from each ref's block on.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "dtypes.h"

namespace strata {

struct BlockRef {
  int32_t rank;
  int32_t block;
};

// Blocks [begin, end) of one rank's buffer.
struct BlockRun {
  int64_t begin, end;
};

// Reduce (or copy, with one source) `srcs` into every one of `dsts`.
// No sources means the destinations are zero-filled (ppermute's silent ranks,
// MoE dispatch's empty expert rows). A rank's destinations are listed
// together: the first carries the data to that rank, the others are copies
// made there (MoE dispatch's fan-out of a token to more of a rank's experts).
struct Transfer {
  uint32_t src_begin, src_count;  // into Plan::refs
  uint32_t dst_begin, dst_count;
  uint32_t span = 1;  // consecutive blocks each ref covers
  // Destinations on the same rank as the one listed before them (Plan::Add
  // counts them): what the stats call local, not exchanged.
  uint32_t local_copies = 0;
};

// Bytes per row one host chunk's pieces carry to destination ranks
// (`carried`: Stats' bytes_exchanged) and copy within a rank (`local`:
// bytes_local); zero fills are neither. A weighted plan's sources are what
// crosses (each is read by the destination's rank: carried), or, in a
// local_sums plan, what is summed where it lives (local). `written`: bytes
// stored to destinations, zero fills included (a staging plan's bytes_staged).
struct ChunkBytes {
  int64_t carried = 0, local = 0, written = 0;
};

enum class Planner : int32_t { kBalanced = 0, kNaive = 1 };
inline constexpr int32_t kPlannerCount = 2;
const char* PlannerName(Planner planner);  // "balanced", "naive": strata.config's names

// One lane's share of one transfer: columns [col_begin, col_end) of all rows
// (of the transfer's span x block_bytes columns).
struct Piece {
  uint32_t transfer;
  int32_t executor;  // the NPU doing it
  int64_t col_begin, col_end;
};

// A unit of host work: lane `lane` of NPU `npu` runs pieces [begin, end).
struct LaneTask {
  int32_t npu, lane;
  uint32_t piece_begin, piece_end;
  int64_t bytes;  // read + written, per row
};

// One run of a one-source, one-destination copy, resolved from its piece,
// transfer and block refs: columns [col, col + len) of block src_block of
// src_rank's input go to block dst_block of dst_rank's output, every row.
// A move stands for `count` such copies of the same columns, the k-th's ranks
// and blocks advanced k steps: a destination's pull of one block from each
// of N sources (all_to_all: source rank +1, destination block +1) is one move
// instead of N. At 384 ranks of 4-byte blocks the N-fold list was 4.7 MB per
// op streamed through the cache, evicting the very source lines it reads.
struct Move {
  int32_t src_rank, src_block, dst_rank, dst_block;
  int64_t col, len;
  int32_t count = 1;
  int32_t src_rank_step = 0, src_block_step = 0, dst_rank_step = 0, dst_block_step = 0;
};

struct Plan {
  int32_t num_ranks = 0;
  int64_t in_blocks = 0, out_blocks = 0, block_bytes = 0;
  DType dtype = DType::F32;
  ReduceOp op = ReduceOp::kNone;  // kNone: pure data movement
  // Lanes the plan runs on: SDMA engines (pure movement large enough to
  // amortise the descriptor cost, collective.h MovesOnSdma) or vector cores.
  bool on_sdma = false;
  std::vector<BlockRef> refs;
  std::vector<Transfer> transfers;
  // A weighted sum (MoE combine, op kSum): each destination is 0 + the sum
  // of weights[k] x source k over the transfer's sources in their listed
  // order, in the accumulation type (float32; float64 for F64), rounded once
  // to dtype. `weights` runs beside `refs` (destinations' entries unused).
  bool weighted = false;
  std::vector<double> weights;
  // A source ref's block in_blocks + j names block j of its rank's scratch:
  // what an earlier plan wrote there (MoE combine's partial sums). Scratch
  // has `scratch_blocks` blocks of block_bytes per rank.
  int64_t scratch_blocks = 0;
  // The sources are summed on the rank that holds them (MoE combine's
  // partials on the experts' ranks): their bytes are local, not exchanged,
  // and a lone source of weight 1 is copied as it is (a row staged for its
  // reader to weight).
  bool local_sums = false;
  // A dot plan (MoE combine's backward, d_weights): each transfer with
  // sources is two of them, a and b, and its destination gets their dot
  // product sum_i a[i] x b[i] over the transfer's columns, in the
  // accumulation type (float32; float64 for F64), stored as that type: an
  // output block is one such value (out_block_bytes). The NPU holding b does
  // the work and writes the value to the destination's rank. A transfer
  // without sources zeroes span values. Partition it with align =
  // block_bytes, so no lane splits a product.
  bool dot = false;
  // Bytes of one output block when narrower than block_bytes (a dot plan's
  // value); 0: block_bytes.
  int64_t out_block_bytes = 0;

  // Filled by Partition():
  int32_t lanes_per_npu = 0;
  std::vector<Piece> pieces;
  std::vector<LaneTask> tasks;
  // Host work units: runs of consecutive lane tasks [chunk_starts[i],
  // chunk_starts[i+1]). Lanes are the emulated hardware's split; a host
  // thread takes a few at once so tiny lanes do not cost a dispatch each.
  std::vector<uint32_t> chunk_starts;
  std::vector<ChunkBytes> chunk_bytes;  // per chunk
  // When every transfer is a plain 1 -> 1 copy (all_to_all, ppermute): the
  // host's moves, chunk i's being [move_starts[i], move_starts[i+1]), in the
  // order and with the merged runs the pieces would give. A small fan-out
  // copy (kPullSourceBytes) gets them too, destination by destination. The
  // host runs these instead of walking pieces, transfers and refs: a 1 KB all_to_all
  // over 384 ranks is 147k copies of 4 bytes, where that walk (five dependent
  // loads a copy) cost more than the copies; as strided moves it is 768.
  std::vector<Move> moves;
  std::vector<uint32_t> move_starts;

  bool is_reduction() const { return op != ReduceOp::kNone; }
  // A plan as default-constructed, its lists emptied but keeping their
  // storage: a plan rebuilt every op (MoE combine's) reuses it instead of
  // paying a page fault per 4 KiB of fresh arrays.
  void Clear();
  // As Clear, but `transfers`, `refs` and `weights` keep their elements, for
  // a builder that resizes them and then writes every element: a pooled
  // plan's lists emptied and grown back were value-initialized on every
  // build (a tenth of a MoE share's build, perf).
  void ClearKeepingElements();
  int64_t Columns(const Transfer& t) const { return t.span * block_bytes; }
  // Bytes a destination holds for `cols` of a transfer's columns (a dot
  // plan's: one value per block_bytes of them).
  int64_t OutBytes(int64_t cols) const {
    return out_block_bytes > 0 && block_bytes > 0 ? cols / block_bytes * out_block_bytes : cols;
  }
  int64_t OutBlockBytes() const { return out_block_bytes > 0 ? out_block_bytes : block_bytes; }
  // Bytes read + written for `cols` columns of transfer t (a lane's credit,
  // the model's too).
  int64_t PieceBytes(const Transfer& t, int64_t cols) const {
    return cols * t.src_count + OutBytes(cols) * t.dst_count;
  }
  // The NPU that runs a share of t whose destination is `dst_rank`: that
  // rank, or for a dot plan's product the rank holding its b.
  int32_t Executor(const Transfer& t, int32_t dst_rank) const {
    return dot && t.src_count > 0 ? refs[t.src_begin + t.src_count - 1].rank : dst_rank;
  }
  void Add(const std::vector<BlockRef>& srcs, const std::vector<BlockRef>& dsts, uint32_t span = 1);
  // The same from arrays (plans of many small transfers: MoE dispatch's rows).
  void Add(const BlockRef* srcs, uint32_t src_count, const BlockRef* dsts, uint32_t dst_count,
           uint32_t span = 1);
  // A weighted plan's transfer: source k weighs w[k].
  void AddWeighted(const BlockRef* srcs, const double* w, uint32_t src_count, const BlockRef* dsts,
                   uint32_t dst_count, uint32_t span = 1);
};

// Splits every transfer's columns over its destination ranks (each computes a
// share and writes it to all destinations), then splits each NPU's pieces
// over `lanes` lanes, and groups lanes into host chunks of about
// `host_chunk_bytes` (1 MiB: long enough per source stream that the host's
// prefetchers keep up; a 256 KiB chunk cost reduce_scatter 4 MB ~5 %). kBalanced gives every lane an equal share of bytes,
// cut at `align`-byte column boundaries; kNaive gives each piece whole to
// lane (index mod lanes), which is what a per-peer loop does. Lanes carry at
// least `min_lane_bytes` (default: any work at all, one aligned column). It
// was 16 KiB: a message just past a multiple of it got one more lane and ran
// up to 30 % faster on the modeled NPU than a slightly smaller one (lanes
// issue in parallel, so one more is never slower there); the host is
// unaffected (it runs neighbouring lanes' ranges as one run, in host chunks).
constexpr int64_t kHostChunkBytes = 1 << 20;
// What one message (a DataCopy or descriptor) costs a lane, in bytes it could
// have moved meanwhile: Ascend C's guidance puts near-peak DataCopy bandwidth
// at 16 KB; at 90 % there the fixed cost is 16 KiB / 9 of streaming (the
// supernode model's core_message_us is the same figure in time). The
// balanced planner keeps a lane inside one piece when crossing into the next
// would buy it less than that: a lane that straddles two pieces issues both
// pieces' messages (an all_gather of 8.6 KB over 8 ranks ran 19 % slower on
// the modeled NPU than one of 8.7 KB whose cuts fell on the pieces' ends).
constexpr int64_t kMessageBytes = 16384 / 9;
// A fan-out copy (all_gather, broadcast) whose sources total at most this is
// run by the host destination by destination (Plan::moves): the sources stay
// in cache while each output is written in one sequential run. Above it a
// pull would read every source from memory once per destination.
constexpr int64_t kPullSourceBytes = 1 << 20;
void Partition(Plan& plan, int lanes, Planner planner, int64_t align = 64,
               int64_t min_lane_bytes = 1, int64_t host_chunk_bytes = kHostChunkBytes);

// Partition in steps, for a plan built at run time (PlanJob's): the
// constructor shares every transfer among its destination NPUs (serial, one
// pass over the transfers); Npu(npu) splits one NPU's shares over its lanes
// and may run for different NPUs at once (MoE dispatch's ten thousand rows
// made that split most of a serial step between its phases); Finish, after
// every NPU's, places their pieces and tasks in NPU order and makes the host
// chunks and moves. The plan is Partition's, piece for piece. The plan must
// outlive the steps and not change in between.
class PlanPartition {
 public:
  PlanPartition(Plan* plan, int lanes, Planner planner, int64_t align = 64, int64_t min_lane_bytes = 1,
                int64_t host_chunk_bytes = kHostChunkBytes);
  void Npu(int npu);
  // The NPUs with shares, ascending (Npu of any other does nothing).
  const std::vector<int32_t>& Busy() const { return busy_; }
  void Finish();
  // Bytes read + written per row by all the plan's lanes (its tasks' sum).
  int64_t bytes() const { return bytes_; }

 private:
  size_t RoomStart(int npu) const;  // where an NPU's pieces are split
  size_t TaskRoom(int npu) const;   // and its lanes' tasks
  void Balance(int npu, const Piece* mine, size_t count, Piece* pieces, LaneTask* tasks, size_t* used,
               size_t* made) const;
  Plan* plan_;
  int lanes_;
  Planner planner_;
  int64_t align_ = 1, min_lane_bytes_, host_chunk_bytes_, bytes_ = 0;
  std::vector<size_t> npu_start_;  // each NPU's shares: [npu_start_[npu], npu_start_[npu + 1])
  std::vector<size_t> busy_before_;  // NPUs with shares before each NPU
  std::vector<int32_t> busy_;        // the NPUs with shares, ascending
  std::vector<size_t> piece_count_, task_count_;  // per NPU, as split
};

// What a partitioned plan credits its lanes, without the pieces: for a plan
// the host runs in its own order (not by lanes) whose lanes only need their
// bytes (stats, the model's cross-check). Partition's tasks, lane for lane
// and byte for byte (npu, lane, bytes; piece ranges unset), and the bytes
// by kind its chunks would hold, summed. Partitioning a plan only to credit
// it was most of MoE's per-op build on the host.
struct LaneCredit {
  std::vector<LaneTask> tasks;
  ChunkBytes bytes;
  int32_t lanes_per_npu = 0;
  bool on_sdma = false;
};
void PartitionCredit(const Plan& plan, int lanes, Planner planner, LaneCredit* credit, int64_t align = 64,
                     int64_t min_lane_bytes = 1);

// max/mean of the bytes per used lane over all NPUs' lanes (1.0 is perfect).
double LaneImbalance(const Plan& plan);

}  // namespace strata
