#include "collective.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>
#include <tuple>

#include "../algorithms/algorithms.h"
#include "registry.h"
#include "stats.h"

namespace strata {

using Clock = std::chrono::steady_clock;

const char* OpName(OpKind kind) {
  static const char* names[] = {"strata.all_reduce", "strata.all_gather", "strata.reduce_scatter",
                                "strata.all_to_all", "strata.broadcast", "strata.ppermute"};
  return names[static_cast<int>(kind)];
}

std::string OpParams::Describe() const {
  std::ostringstream os;
  os << "dtype=" << DTypeName(dtype) << " op=" << ReduceOpName(op) << " root=" << root
     << " group_size=" << group_size << " rows=" << rows << " in_blocks=" << in_blocks
     << " out_blocks=" << out_blocks << " block_bytes=" << block_bytes
     << " mode=" << (mode == Mode::kStrata ? "strata" : "buffer_centric");
  return os.str();
}

bool OpParams::SameOp(const OpParams& o) const {
  return kind == o.kind && dtype == o.dtype && op == o.op && root == o.root && perm == o.perm &&
         group_size == o.group_size && in_blocks == o.in_blocks && out_blocks == o.out_blocks &&
         block_bytes == o.block_bytes && rows == o.rows && mode == o.mode && cores == o.cores &&
         engines == o.engines && planner == o.planner && comm_buffer_bytes == o.comm_buffer_bytes;
}

std::string OpParams::PlanKey() const {
  std::ostringstream os;
  os << static_cast<int>(kind) << '/' << static_cast<int>(dtype) << '/' << static_cast<int>(op)
     << '/' << root << '/' << group_size << '/' << in_blocks << '/' << out_blocks << '/'
     << block_bytes << '/' << cores << '/' << engines << '/' << static_cast<int>(planner);
  for (int32_t v : perm) os << ',' << v;
  return os.str();
}

void BlockCounts(OpKind kind, int n, int64_t* in_blocks, int64_t* out_blocks) {
  *in_blocks = (kind == OpKind::kReduceScatter || kind == OpKind::kAllToAll) ? n : 1;
  *out_blocks = (kind == OpKind::kAllGather || kind == OpKind::kAllToAll) ? n : 1;
}

Plan BuildPartitionedPlan(const OpParams& p) {
  Plan plan;
  plan.num_ranks = p.group_size;
  plan.in_blocks = p.in_blocks;
  plan.out_blocks = p.out_blocks;
  plan.block_bytes = p.block_bytes;
  plan.dtype = p.dtype;
  plan.op = p.op;
  switch (p.kind) {
    case OpKind::kAllReduce: BuildAllReducePlan(p, plan); break;
    case OpKind::kAllGather: BuildAllGatherPlan(p, plan); break;
    case OpKind::kReduceScatter: BuildReduceScatterPlan(p, plan); break;
    case OpKind::kAllToAll: BuildAllToAllPlan(p, plan); break;
    case OpKind::kBroadcast: BuildBroadcastPlan(p, plan); break;
    case OpKind::kPermute: BuildPermutePlan(p, plan); break;
  }
  // Reductions run on vector cores; pure data movement on DMA engines.
  Partition(plan, plan.is_reduction() ? p.cores : p.engines, p.planner);
  return plan;
}

namespace {

// ---------------------------------------------------------------------------
// Communicator: one per group of devices. Owns the plan cache and, for the
// buffer-centric baseline, each rank's pre-registered comm buffers.
// ---------------------------------------------------------------------------
struct CommBuffers {
  int64_t bytes = 0;
  char* in = nullptr;
  char* out = nullptr;
};

struct Communicator {
  std::vector<int32_t> devices;
  std::mutex mu;
  std::map<std::string, std::shared_ptr<const Plan>> plans;
  std::vector<CommBuffers> buffers;

  std::shared_ptr<const Plan> GetPlan(const OpParams& p) {
    std::string key = p.PlanKey();
    std::lock_guard<std::mutex> lock(mu);
    auto it = plans.find(key);
    if (it != plans.end()) return it->second;
    auto plan = std::make_shared<const Plan>(BuildPartitionedPlan(p));
    if (plans.size() > 256) plans.clear();  // bound memory for programs with many shapes
    plans[key] = plan;
    return plan;
  }

  // HCCL-style: two buffers per rank, allocated and registered once.
  Status EnsureBuffers(int64_t bytes) {
    std::lock_guard<std::mutex> lock(mu);
    if (buffers.empty()) buffers.resize(devices.size());
    for (size_t r = 0; r < devices.size(); ++r) {
      CommBuffers& b = buffers[r];
      if (b.bytes == bytes) continue;
      std::free(b.in);
      std::free(b.out);
      size_t rounded = (static_cast<size_t>(bytes) + 4095) / 4096 * 4096;
      b.in = static_cast<char*>(std::aligned_alloc(4096, rounded));
      b.out = static_cast<char*>(std::aligned_alloc(4096, rounded));
      if (!b.in || !b.out) return Status::Error("cannot allocate communication buffers");
      b.bytes = bytes;
      GlobalRegistry().Register(devices[r], reinterpret_cast<uintptr_t>(b.in), bytes);
      GlobalRegistry().Register(devices[r], reinterpret_cast<uintptr_t>(b.out), bytes);
    }
    return Status::Ok();
  }
};

std::mutex g_comms_mu;
std::map<std::vector<int32_t>, std::unique_ptr<Communicator>> g_comms;

Communicator* GetCommunicator(const std::vector<int32_t>& devices) {
  std::lock_guard<std::mutex> lock(g_comms_mu);
  auto& c = g_comms[devices];
  if (!c) {
    c = std::make_unique<Communicator>();
    c->devices = devices;
  }
  return c.get();
}

// ---------------------------------------------------------------------------
// Rendezvous. A slot is one execution of one call site by one group:
// key (run, site, group, iteration). The iteration counts how often each rank
// has run the site in this run, so loop trips (scan/while) get their own
// slots, and a fresh run id after a failure starts clean.
// ---------------------------------------------------------------------------
using SlotKey = std::tuple<int64_t, int64_t, int32_t, int64_t>;

struct Slot {
  explicit Slot(int n)
      : n(n), present(n, 0), ins(n, nullptr), outs(n, nullptr), devices(n, -1), params(n) {}

  const int n;
  std::mutex mu;
  std::condition_variable cv;
  int arrived = 0;
  int inside = 0;  // threads currently holding a reference
  int left = 0;
  std::vector<char> present;
  std::vector<const void*> ins;
  std::vector<void*> outs;
  std::vector<int32_t> devices;
  std::vector<OpParams> params;
  bool aborted = false;
  std::string error;
  Clock::time_point aborted_at;

  // Set by the last arriver.
  Communicator* comm = nullptr;
  std::shared_ptr<const Plan> plan;

  // Phase barrier and the shared task cursor of the current phase.
  int phase_count = 0;
  int64_t phase_gen = 0;
  std::atomic<uint32_t> next_task{0};
};

struct SiteKey {
  int64_t run, site;
  int32_t group;
  bool operator<(const SiteKey& o) const {
    return std::tie(run, site, group) < std::tie(o.run, o.site, o.group);
  }
};
struct SiteState {
  std::vector<int64_t> next_iteration;
  Clock::time_point touched;
};

std::mutex g_slots_mu;
std::map<SlotKey, std::shared_ptr<Slot>> g_slots;
std::map<SiteKey, SiteState> g_sites;

// Drops bookkeeping of runs nobody has touched for a while, and tombstones
// of aborted slots that every thread has left.
void PruneLocked(Clock::time_point now) {
  if (g_sites.size() > 4096) {
    for (auto it = g_sites.begin(); it != g_sites.end();)
      it = now - it->second.touched > std::chrono::seconds(120) ? g_sites.erase(it) : std::next(it);
  }
  if (g_slots.size() > 1024) {
    for (auto it = g_slots.begin(); it != g_slots.end();) {
      Slot& s = *it->second;
      std::lock_guard<std::mutex> lock(s.mu);
      bool stale = s.aborted && s.inside == 0 && now - s.aborted_at > std::chrono::seconds(60);
      it = stale ? g_slots.erase(it) : std::next(it);
    }
  }
}

std::shared_ptr<Slot> JoinSlot(const OpParams& p, const RankCall& c) {
  std::lock_guard<std::mutex> lock(g_slots_mu);
  Clock::time_point now = Clock::now();
  SiteState& site = g_sites[{c.run_id, c.site_id, c.group_id}];
  if (site.next_iteration.empty()) site.next_iteration.assign(p.group_size, 0);
  site.touched = now;
  int64_t iteration = site.next_iteration[c.rank]++;
  auto& slot = g_slots[SlotKey{c.run_id, c.site_id, c.group_id, iteration}];
  if (!slot) {
    PruneLocked(now);
    slot = std::make_shared<Slot>(p.group_size);
  }
  {
    std::lock_guard<std::mutex> slock(slot->mu);
    slot->inside++;
  }
  return slot;
}

void LeaveSlot(const std::shared_ptr<Slot>& slot, const RankCall& c, int64_t iteration_unused) {
  (void)iteration_unused;
  bool erase = false;
  {
    std::lock_guard<std::mutex> lock(slot->mu);
    slot->inside--;
    slot->left++;
    erase = !slot->aborted && slot->left == slot->n;
  }
  if (!erase) return;
  std::lock_guard<std::mutex> lock(g_slots_mu);
  for (auto it = g_slots.begin(); it != g_slots.end(); ++it) {
    if (it->second == slot) {
      g_slots.erase(it);
      break;
    }
  }
  (void)c;
}

std::string RankList(const std::vector<char>& present, bool want) {
  std::ostringstream os;
  os << '[';
  bool first = true;
  for (size_t i = 0; i < present.size(); ++i) {
    if ((present[i] != 0) != want) continue;
    os << (first ? "" : ", ") << i;
    first = false;
  }
  os << ']';
  return os.str();
}

std::string Prefix(const OpParams& p, const RankCall& c) {
  std::ostringstream os;
  os << OpName(p.kind) << " (call site " << c.site_id << ", group " << c.group_id << ", rank "
     << c.rank << " of " << p.group_size << ", device " << c.device << "): ";
  return os.str();
}

// Marks the slot failed and wakes everybody waiting on it. Caller holds mu.
void AbortLocked(Slot& s, std::string why) {
  if (!s.aborted) {
    s.aborted = true;
    s.error = std::move(why);
    s.aborted_at = Clock::now();
  }
  s.cv.notify_all();
}

// Waits until all ranks of the group have arrived, or the timeout passes.
Status Arrive(Slot& s, const OpParams& p, const RankCall& c, Clock::time_point deadline) {
  std::unique_lock<std::mutex> lock(s.mu);
  if (s.aborted) return Status::Error(s.error);
  if (s.present[c.rank]) {
    AbortLocked(s, Prefix(p, c) + "two calls claim the same rank; is the rank operand wrong?");
    return Status::Error(s.error);
  }
  s.present[c.rank] = 1;
  s.ins[c.rank] = c.in;
  s.outs[c.rank] = c.out;
  s.devices[c.rank] = c.device;
  s.params[c.rank] = p;
  if (++s.arrived == s.n) {
    // Last one in: check every rank asked for the same op, then set up.
    std::ostringstream bad;
    for (int r = 0; r < s.n; ++r) {
      if (!s.params[r].SameOp(s.params[0]))
        bad << "\n  rank " << r << ": " << s.params[r].Describe();
    }
    if (!bad.str().empty()) {
      AbortLocked(s, std::string(OpName(p.kind)) + " (call site " + std::to_string(c.site_id) +
                         ", group " + std::to_string(c.group_id) +
                         "): ranks disagree on the op.\n  rank 0: " + s.params[0].Describe() +
                         bad.str());
      return Status::Error(s.error);
    }
    s.comm = GetCommunicator(s.devices);
    s.plan = s.comm->GetPlan(p);
    s.cv.notify_all();
    return Status::Ok();
  }
  bool ok = s.cv.wait_until(lock, deadline, [&] { return s.arrived == s.n || s.aborted; });
  if (s.aborted) return Status::Error(s.error);
  if (!ok) {
    std::ostringstream os;
    os << Prefix(p, c) << "timed out after " << c.timeout_s << " s waiting for ranks "
       << RankList(s.present, false) << " (arrived: " << RankList(s.present, true)
       << "). A peer never reached this collective: ranks took different control flow, "
       << "or a peer failed. Raise strata.config(timeout_s=...) if peers are just slow.";
    AbortLocked(s, os.str());
    return Status::Error(s.error);
  }
  return Status::Ok();
}

// Group barrier between phases. The last thread in runs `on_last` first
// (resetting the shared task cursor for the next phase).
Status Barrier(Slot& s, const OpParams& p, const RankCall& c, Clock::time_point deadline,
               const char* phase) {
  std::unique_lock<std::mutex> lock(s.mu);
  if (s.aborted) return Status::Error(s.error);
  int64_t gen = s.phase_gen;
  if (++s.phase_count == s.n) {
    s.phase_count = 0;
    s.phase_gen++;
    s.next_task.store(0);
    s.cv.notify_all();
    return Status::Ok();
  }
  bool ok = s.cv.wait_until(lock, deadline, [&] { return s.phase_gen != gen || s.aborted; });
  if (s.aborted) return Status::Error(s.error);
  if (!ok) {
    AbortLocked(s, Prefix(p, c) + "timed out in phase '" + phase + "'");
    return Status::Error(s.error);
  }
  return Status::Ok();
}

// Where each rank's blocks live during one phase: the user buffers (strata
// mode) or a window of columns staged in comm buffers (buffer_centric).
struct View {
  std::vector<const char*> in;
  std::vector<char*> out;
  int64_t rows = 1;
  int64_t in_row_stride = 0, out_row_stride = 0, block_stride = 0;
  int64_t col_lo = 0, col_hi = 0;  // window of the message's columns present
};

struct Moved {
  int64_t written = 0;  // bytes stored into destinations
  int64_t touched = 0;  // bytes read + written: the lane's work
};

// Runs one lane task: its pieces, clipped to the view's column window.
Moved RunTask(const Plan& plan, const LaneTask& task, const View& v) {
  const void* srcs[512];
  void* dsts[512];
  std::vector<const void*> srcs_heap;
  std::vector<void*> dsts_heap;
  Moved moved;
  for (uint32_t pi = task.piece_begin; pi < task.piece_end; ++pi) {
    const Piece& piece = plan.pieces[pi];
    const Transfer& t = plan.transfers[piece.transfer];
    int64_t c0 = std::max(piece.col_begin, v.col_lo), c1 = std::min(piece.col_end, v.col_hi);
    if (c1 <= c0) continue;
    const int64_t len = c1 - c0, local = c0 - v.col_lo;
    const void** sp = srcs;
    void** dp = dsts;
    if (t.src_count > 512 || t.dst_count > 512) {
      srcs_heap.resize(t.src_count);
      dsts_heap.resize(t.dst_count);
      sp = srcs_heap.data();
      dp = dsts_heap.data();
    }
    for (int64_t row = 0; row < v.rows; ++row) {
      for (uint32_t k = 0; k < t.src_count; ++k) {
        const BlockRef& b = plan.refs[t.src_begin + k];
        sp[k] = v.in[b.rank] + row * v.in_row_stride + b.block * v.block_stride + local;
      }
      for (uint32_t k = 0; k < t.dst_count; ++k) {
        const BlockRef& b = plan.refs[t.dst_begin + k];
        dp[k] = v.out[b.rank] + row * v.out_row_stride + b.block * v.block_stride + local;
      }
      if (t.src_count == 0) {
        for (uint32_t k = 0; k < t.dst_count; ++k) std::memset(dp[k], 0, len);
      } else if (plan.is_reduction()) {
        ReduceInto(plan.dtype, plan.op, dp, t.dst_count, sp, t.src_count,
                   len / DTypeSize(plan.dtype));
      } else {
        // Copy in 64 KiB strips so a multi-destination source stays in cache.
        constexpr int64_t kStrip = 64 << 10;
        for (int64_t off = 0; off < len; off += kStrip) {
          int64_t n = std::min(kStrip, len - off);
          for (uint32_t k = 0; k < t.dst_count; ++k)
            std::memcpy(static_cast<char*>(dp[k]) + off, static_cast<const char*>(sp[0]) + off, n);
        }
      }
      moved.written += len * t.dst_count;
      moved.touched += len * (t.src_count + t.dst_count);
    }
  }
  return moved;
}

// Every thread of the group pulls lane tasks until none are left, so the
// work is spread over however many host threads are running.
void RunTasks(Slot& s, const View& v, bool direct) {
  const Plan& plan = *s.plan;
  const uint32_t total = static_cast<uint32_t>(plan.tasks.size());
  Stats& stats = GlobalStats();
  int64_t written_total = 0;
  for (uint32_t i = s.next_task.fetch_add(1); i < total; i = s.next_task.fetch_add(1)) {
    const LaneTask& task = plan.tasks[i];
    Moved moved = RunTask(plan, task, v);
    if (moved.touched == 0) continue;
    stats.AddLaneBytes(!plan.is_reduction(), s.devices[task.npu], task.lane, plan.lanes_per_npu, moved.touched);
    written_total += moved.written;
  }
  stats.bytes_exchanged += written_total;
  if (direct) stats.bytes_direct += written_total;
}

Status RunStrataMode(Slot& s, const OpParams& p, const RankCall& c, Clock::time_point deadline) {
  View v;
  v.in.resize(s.n);
  for (int r = 0; r < s.n; ++r) v.in[r] = static_cast<const char*>(s.ins[r]);
  v.out.resize(s.n);
  for (int r = 0; r < s.n; ++r) v.out[r] = static_cast<char*>(s.outs[r]);
  v.rows = p.rows;
  v.in_row_stride = p.in_blocks * p.block_bytes;
  v.out_row_stride = p.out_blocks * p.block_bytes;
  v.block_stride = p.block_bytes;
  v.col_lo = 0;
  v.col_hi = p.block_bytes;
  RunTasks(s, v, /*direct=*/true);
  // Nobody may return (and let XLA reuse its input) while a peer still reads it.
  return Barrier(s, p, c, deadline, "exchange");
}

// The vendor-library baseline: user data is copied into the rank's comm
// buffer, the exchange runs between comm buffers, and results are copied out,
// in rounds of columns when the message is larger than the buffer.
Status RunBufferCentricMode(Slot& s, const OpParams& p, const RankCall& c,
                            Clock::time_point deadline) {
  const int64_t m = p.block_bytes;
  const int64_t max_blocks = std::max(p.in_blocks, p.out_blocks);
  const int64_t esize = static_cast<int64_t>(DTypeSize(p.dtype));
  int64_t window = p.comm_buffer_bytes / (p.rows * max_blocks);
  window = window >= 64 ? window / 64 * 64 : window / esize * esize;
  if (window <= 0)
    return Status::Error(Prefix(p, c) + "comm_buffer_bytes=" + std::to_string(p.comm_buffer_bytes) +
                         " cannot hold one column of " + std::to_string(p.rows * max_blocks) +
                         " blocks; raise strata.config(comm_buffer_bytes=...)");
  STRATA_RETURN_IF_ERROR(s.comm->EnsureBuffers(p.comm_buffer_bytes));

  View v;
  v.rows = p.rows;
  for (int r = 0; r < s.n; ++r) {
    v.in.push_back(s.comm->buffers[r].in);
    v.out.push_back(s.comm->buffers[r].out);
  }
  const char* user_in = static_cast<const char*>(c.in);
  char* user_out = static_cast<char*>(c.out);
  char* my_in = s.comm->buffers[c.rank].in;
  char* my_out = s.comm->buffers[c.rank].out;
  Stats& stats = GlobalStats();
  for (int64_t lo = 0; lo < m; lo += window) {
    const int64_t w = std::min(window, m - lo);
    v.col_lo = lo;
    v.col_hi = lo + w;
    v.block_stride = w;
    v.in_row_stride = p.in_blocks * w;
    v.out_row_stride = p.out_blocks * w;
    // Stage in: this rank's columns [lo, lo+w) of every block and row.
    for (int64_t row = 0; row < p.rows; ++row)
      for (int64_t b = 0; b < p.in_blocks; ++b)
        std::memcpy(my_in + (row * p.in_blocks + b) * w,
                    user_in + (row * p.in_blocks + b) * m + lo, w);
    stats.bytes_staged += p.rows * p.in_blocks * w;
    STRATA_RETURN_IF_ERROR(Barrier(s, p, c, deadline, "stage-in"));
    RunTasks(s, v, /*direct=*/false);
    STRATA_RETURN_IF_ERROR(Barrier(s, p, c, deadline, "exchange"));
    // Stage out. The next round's stage-in barrier keeps peers from writing
    // this comm buffer again before the copy is done.
    for (int64_t row = 0; row < p.rows; ++row)
      for (int64_t b = 0; b < p.out_blocks; ++b)
        std::memcpy(user_out + (row * p.out_blocks + b) * m + lo,
                    my_out + (row * p.out_blocks + b) * w, w);
    stats.bytes_staged += p.rows * p.out_blocks * w;
  }
  return Status::Ok();
}

}  // namespace

int64_t LiveSlotCount() {
  std::lock_guard<std::mutex> lock(g_slots_mu);
  int64_t live = 0;
  for (auto& kv : g_slots) {
    std::lock_guard<std::mutex> slock(kv.second->mu);
    if (!kv.second->aborted) live++;
  }
  return live;
}

Status RunCollective(const OpParams& p, const RankCall& c) {
  if (c.rank < 0 || c.rank >= p.group_size)
    return Status::Error(Prefix(p, c) + "rank out of range");
  const int64_t in_bytes = p.rows * p.in_blocks * p.block_bytes;
  const int64_t out_bytes = p.rows * p.out_blocks * p.block_bytes;
  if (p.mode == Mode::kStrata) {
    // Registration-on-allocation makes these hits; an XLA temporary is
    // registered on first use and cached, and that miss is counted.
    if (in_bytes > 0) GlobalRegistry().LookupOrRegister(c.device, reinterpret_cast<uintptr_t>(c.in), in_bytes);
    if (out_bytes > 0) GlobalRegistry().LookupOrRegister(c.device, reinterpret_cast<uintptr_t>(c.out), out_bytes);
  }
  GlobalStats().ops++;
  const Clock::time_point deadline =
      Clock::now() + std::chrono::microseconds(static_cast<int64_t>(c.timeout_s * 1e6));
  std::shared_ptr<Slot> slot = JoinSlot(p, c);
  Status st = Arrive(*slot, p, c, deadline);
  if (st.ok && p.block_bytes > 0) {
    st = p.mode == Mode::kStrata ? RunStrataMode(*slot, p, c, deadline)
                                 : RunBufferCentricMode(*slot, p, c, deadline);
  }
  if (!st.ok) {
    std::lock_guard<std::mutex> lock(slot->mu);
    AbortLocked(*slot, st.message);
  }
  LeaveSlot(slot, c, 0);
  return st;
}

}  // namespace strata
