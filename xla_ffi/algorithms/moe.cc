#include "moe.h"

#include <sys/mman.h>

#include <algorithm>
#include <cassert>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <sstream>
#include <utility>
#include <vector>

#include "../runtime/observer.h"
#include "../runtime/registry.h"
#include "../runtime/rendezvous.h"
#include "../runtime/stats.h"
#include "moe_backward_plan.h"
#include "moe_combine_plan.h"
#include "moe_plan.h"

namespace strata {

std::string MoeParams::Describe(const char* opname) const {
  std::ostringstream os;
  os << opname << " group_size=" << group_size << " num_experts=" << num_experts
     << " capacity=" << capacity << " tokens=" << tokens << " topk=" << topk
     << " hidden=" << hidden << " dtype=" << DTypeName(dtype) << " cores=" << cores
     << " engines=" << engines << " mode=" << (mode == Mode::kStrata ? "strata" : "buffer_centric")
     << " planner=" << PlannerName(planner) << " comm_buffer_bytes=" << comm_buffer_bytes;
  return os.str();
}

Signature MoeParams::Sign(const char* opname) const {
  SignatureHasher h;
  h.Add(opname, std::strlen(opname));
  h.Add(group_size).Add(num_experts).Add(capacity).Add(tokens).Add(topk).Add(hidden).Add(dtype);
  h.Add(cores).Add(engines).Add(mode).Add(comm_buffer_bytes).Add(planner);
  Signature sig;
  sig.hash = h.hash();
  // `this` outlives JoinAsync (the caller's parameters), which is all keep needs.
  sig.keep = [this, opname] {
    return std::function<std::string()>([p = *this, opname] { return p.Describe(opname); });
  };
  return sig;
}

int64_t ExpertIds::At(int64_t i) const {
  switch (dtype) {
    case DType::S64: return static_cast<const int64_t*>(data)[i];
    case DType::U32: return static_cast<const uint32_t*>(data)[i];
    case DType::U8: return static_cast<const uint8_t*>(data)[i];
    default: return static_cast<const int32_t*>(data)[i];
  }
}

DType MoeWeightDType(DType rows) { return rows == DType::F64 ? DType::F64 : DType::F32; }

bool MoeSupportsCombine(DType rows) {
  return rows == DType::F32 || rows == DType::F64 || rows == DType::F16 || rows == DType::BF16;
}

namespace {

constexpr const char* kDispatchName = "strata.moe.dispatch";
constexpr const char* kCombineName = "strata.moe.combine";
constexpr const char* kCombineBwdName = "strata.moe.combine (backward)";

Status CheckCall(const char* opname, const MoeParams& p, const MoeCall& c) {
  // The common case first, without a string stream (one was an allocation
  // per rank per op).
  const bool rank_ok = c.rank >= 0 && c.rank < p.group_size;
  const bool experts_ok = p.num_experts >= p.group_size && p.num_experts % p.group_size == 0;
  if (rank_ok && experts_ok && p.capacity >= 1 &&
      static_cast<int64_t>(p.num_experts) * p.capacity <= INT32_MAX &&
      p.group_size * p.tokens * p.topk <= INT32_MAX)
    return Status::Ok();
  std::ostringstream os;
  os << opname << ": ";
  if (!rank_ok)
    os << "rank " << c.rank << " is out of range for a group of " << p.group_size;
  else if (!experts_ok)
    os << "num_experts=" << p.num_experts << " must be a positive multiple of the group size "
       << p.group_size;
  else if (p.capacity < 1)
    os << "capacity must be positive, got " << p.capacity;
  else if (static_cast<int64_t>(p.num_experts) * p.capacity > INT32_MAX)
    os << "num_experts * capacity = " << p.num_experts * p.capacity << " exceeds int32 slots";
  else if (p.group_size * p.tokens * p.topk > INT32_MAX)
    os << "group_size * tokens * topk exceeds int32 pair indices";
  else
    return Status::Ok();
  return Status::Error(os.str());
}

// ---------------------------------------------------------------------------
// Where peers find a rank's rows. Direct (strata) mode: the user buffers
// themselves. Buffer-centric mode: communication buffers, registered once
// and reused; inputs are copied in before peers may read them, results are
// written there and copied out.
// ---------------------------------------------------------------------------
class StagingPool {
 public:
  struct Buffer {
    char* data = nullptr;
    int64_t bytes = 0;
    int device = -1;
  };

  // A call holds its buffer until its group's op is over, so ops that XLA
  // runs concurrently never share one.
  Buffer* Take(int device, int64_t bytes) {
    std::lock_guard<std::mutex> lock(mu_);
    for (size_t i = 0; i < free_.size(); ++i) {
      if (free_[i]->device != device) continue;
      Buffer* b = free_[i];
      free_.erase(free_.begin() + i);
      if (b->bytes < bytes) Grow(b, bytes);
      return b->data ? b : nullptr;
    }
    auto* b = new Buffer();
    b->device = device;
    Grow(b, bytes);
    return b->data ? b : nullptr;
  }
  void Give(Buffer* b) {
    std::lock_guard<std::mutex> lock(mu_);
    free_.push_back(b);
  }

 private:
  static void Grow(Buffer* b, int64_t bytes) {
    if (b->data) {
      GlobalRegistry().Deregister(b->device, reinterpret_cast<uintptr_t>(b->data));
      std::free(b->data);
    }
    const size_t rounded = (static_cast<size_t>(bytes) + (2u << 20) - 1) / (2u << 20) * (2u << 20);
    b->data = static_cast<char*>(std::aligned_alloc(2u << 20, rounded));
    b->bytes = b->data ? static_cast<int64_t>(rounded) : 0;
    if (!b->data) return;
#ifdef MADV_HUGEPAGE
    madvise(b->data, rounded, MADV_HUGEPAGE);
#endif
    GlobalRegistry().Register(b->device, reinterpret_cast<uintptr_t>(b->data), b->bytes);
  }

  std::mutex mu_;
  std::vector<Buffer*> free_;
};

StagingPool& Staging() {
  static StagingPool* pool = new StagingPool();  // never destroyed: handlers may run at exit
  return *pool;
}

class RowBuffers {
 public:
  struct In {
    const void* user;
    int64_t bytes;
  };
  struct Out {
    void* user;
    int64_t bytes;
  };

  // Held inline (at most the combine backward's 2 in, 2 out): two vectors
  // were two allocations per rank per op.
  static constexpr size_t kMaxIns = 2, kMaxOuts = 2;
  template <typename T, size_t kMax>
  struct Few {
    Few(std::initializer_list<T> items) : count(items.size()) {
      assert(count <= kMax && "RowBuffers: raise kMaxIns / kMaxOuts");
      std::copy_n(items.begin(), count, at);
    }
    const T* begin() const { return at; }
    const T* end() const { return at + count; }
    const T& operator[](size_t i) const { return at[i]; }
    size_t size() const { return count; }
    T at[kMax] = {};
    size_t count;
  };

  // `by_plan`: the op runs as a transfer plan (runtime/collective.h PlanJob),
  // whose executor stages buffer_centric's rows itself: these buffers then
  // only name the user's, registered as in strata mode.
  RowBuffers(const char* opname, const MoeParams& p, int device, std::initializer_list<In> ins,
             std::initializer_list<Out> outs, bool by_plan = false)
      : opname_(opname), staged_(p.mode == Mode::kBufferCentric && !by_plan),
        direct_(p.mode == Mode::kStrata), limit_(p.comm_buffer_bytes), device_(device), ins_(ins),
        outs_(outs) {
    for (const In& in : ins_) in_bytes_ += Align(in.bytes);
    for (const Out& out : outs_) out_bytes_ += Align(out.bytes);
    if (direct_) {
      // Registration-on-allocation makes these hits; an XLA temporary is
      // registered on first use and cached, and that miss is counted.
      for (const In& in : ins_)
        if (in.bytes > 0) GlobalRegistry().LookupOrRegister(device, reinterpret_cast<uintptr_t>(in.user), in.bytes, true);
      for (const Out& out : outs_) {
        if (out.bytes <= 0) continue;
        GlobalRegistry().LookupOrRegister(device, reinterpret_cast<uintptr_t>(out.user), out.bytes, false);
        // XLA hands us a fresh output every call: back it with large pages
        // before anyone writes it, as fabric registration would.
        Registry::PreferLargePages(out.user, out.bytes);
      }
    }
  }
  ~RowBuffers() {
    if (in_) Staging().Give(in_);
    if (out_) Staging().Give(out_);
  }
  RowBuffers(const RowBuffers&) = delete;
  RowBuffers& operator=(const RowBuffers&) = delete;

  // Takes the communication buffers (buffer-centric mode). Every rank has the
  // same sizes, so every rank fails alike, before joining the group.
  Status Acquire() {
    if (!staged_) return Status::Ok();
    if (in_bytes_ > limit_ || out_bytes_ > limit_) {
      std::ostringstream os;
      os << opname_ << ": buffer_centric mode needs " << std::max(in_bytes_, out_bytes_)
         << " bytes of communication buffer per rank but comm_buffer_bytes=" << limit_
         << "; raise strata.config(comm_buffer_bytes=...)";
      return Status::Error(os.str());
    }
    in_ = Staging().Take(device_, std::max<int64_t>(in_bytes_, 1));
    out_ = Staging().Take(device_, std::max<int64_t>(out_bytes_, 1));
    if (!in_ || !out_) return Status::Error(std::string(opname_) + ": cannot allocate communication buffers");
    return Status::Ok();
  }

  // What peers address: the user buffer, or its place in the comm buffer.
  void* in(size_t i) const {
    return staged_ ? in_->data + InOffset(i) : const_cast<void*>(ins_[i].user);
  }
  void* out(size_t i) const { return staged_ ? out_->data + OutOffset(i) : outs_[i].user; }
  bool direct() const { return direct_; }
  // The caller's own buffers (the same as in()/out() in direct mode).
  const void* user_in(size_t i) const { return ins_[i].user; }
  void* user_out(size_t i) const { return outs_[i].user; }
  // This rank's share of the op's traffic (sizes the small-op path).
  int64_t bytes() const { return in_bytes_ + out_bytes_; }

  // Copies this rank's inputs into its comm buffer (before peers may read).
  void StageIn() const {
    if (!staged_) return;
    int64_t bytes = 0;
    for (size_t i = 0; i < ins_.size(); ++i) {
      std::memcpy(in(i), ins_[i].user, ins_[i].bytes);
      bytes += ins_[i].bytes;
    }
    GlobalStats().bytes_staged += bytes;
  }
  // Copies results out of the comm buffer (after every peer is done).
  void StageOut() const {
    if (!staged_) return;
    int64_t bytes = 0;
    for (size_t i = 0; i < outs_.size(); ++i) {
      std::memcpy(outs_[i].user, out(i), outs_[i].bytes);
      bytes += outs_[i].bytes;
    }
    GlobalStats().bytes_staged += bytes;
  }

 private:
  static int64_t Align(int64_t b) { return (b + 63) / 64 * 64; }
  int64_t InOffset(size_t i) const {
    int64_t off = 0;
    for (size_t j = 0; j < i; ++j) off += Align(ins_[j].bytes);
    return off;
  }
  int64_t OutOffset(size_t i) const {
    int64_t off = 0;
    for (size_t j = 0; j < i; ++j) off += Align(outs_[j].bytes);
    return off;
  }

  const char* opname_;
  bool staged_;  // through this op's own comm buffers
  bool direct_;  // strata mode: peers address the user buffers
  int64_t limit_;
  int device_;
  Few<In, kMaxIns> ins_;
  Few<Out, kMaxOuts> outs_;
  int64_t in_bytes_ = 0, out_bytes_ = 0;
  StagingPool::Buffer* in_ = nullptr;
  StagingPool::Buffer* out_ = nullptr;
};


// One rank's part of an op in flight. It lives until the group's job is over
// (peers read its comm buffers until then); then the rank's completion runs.
struct RankState {
  RankState(const char* opname, const MoeParams& p, int device,
            std::initializer_list<RowBuffers::In> ins, std::initializer_list<RowBuffers::Out> outs,
            bool by_plan = false)
      : rows(opname, p, device, ins, outs, by_plan) {}
  virtual ~RankState() = default;

  RowBuffers rows;
  // An error the group agreed on, set on every rank by the starter: each rank
  // reports it as is, not behind the last arriver's prefix.
  std::string error;
  // What this rank found wrong in its own operands before joining (a bad
  // expert id, a layout value out of range), if anything.
  std::string bad;
  // The rank's own completion, run once the state is gone (see Launch).
  MoeDone done;
};

// The prefix every MoE error carries: which op, where, which rank.
std::string Where(const char* opname, const MoeParams& p, const MoeCall& c) {
  std::ostringstream os;
  os << opname << " (call site " << c.site_id << ", group " << c.group_id << ", rank " << c.rank
     << " of " << p.group_size << ", device " << c.device << "): ";
  return os.str();
}

// First value of `values[0, count)` outside [-1, limit), as an error naming
// the op, the rank and the handle field; empty when all are in range. -1
// marks an empty entry. The rank's description is formatted only for an
// error (on every call it cost each rank a string stream per op).
std::string CheckLayout(const char* opname, const MoeParams& p, const MoeCall& c, const char* field,
                        const int32_t* values, int64_t count, int64_t limit) {
  for (int64_t i = 0; i < count; ++i) {
    if (values[i] >= -1 && values[i] < limit) continue;
    std::ostringstream os;
    os << Where(opname, p, c) << "DispatchHandle." << field << "[" << i << "] = " << values[i]
       << " is outside [-1, " << limit << "): the handle does not come from this group's "
       << "strata.moe.dispatch, or was modified";
    return os.str();
  }
  return "";
}

// When some rank found its operands bad, every rank gets the first such
// error and nothing runs (no peer buffer has been touched). True if so.
template <typename R>
bool AgreeOnBad(const std::vector<R*>& ranks) {
  for (R* r : ranks) {
    if (r->bad.empty()) continue;
    const std::string why = r->bad;
    for (R* other : ranks) other->error = why;
    return true;
  }
  return false;
}

// Makes `phases` the group's job, or runs them here and now (inside the
// starter, the group complete) when the op is small and direct. The
// buffer_centric baseline always goes through the workers, as collectives do.
void Schedule(std::vector<Phase> phases, const RankState& any, int n, std::shared_ptr<Job>* job) {
  *job = std::make_shared<Job>();
  (*job)->phases = std::move(phases);
  if (any.rows.direct() && RunsInline(Mode::kStrata, any.rows.bytes(), n, kMoeInlineGroupBytes))
    RunPhasesHere(job->get());
}

// One task per rank: copies inputs into, or results out of, its comm buffer.
template <typename R>
Phase StagePhase(std::vector<R*> ranks, bool in) {
  Phase phase;
  phase.count = ranks.size();
  phase.run = [ranks = std::move(ranks), in](uint64_t r) {
    if (in) ranks[r]->rows.StageIn();
    else ranks[r]->rows.StageOut();
  };
  return phase;
}

// The group's published pointers as one flat table, for a phase to keep:
// its copy of s.ptrs (a vector per rank) cost an allocation per rank per op.
class PtrTable {
 public:
  explicit PtrTable(const Slot& s) : width_(s.ptrs.empty() ? 0 : s.ptrs[0].size()), flat_(s.n * width_) {
    for (int r = 0; r < s.n; ++r)
      std::copy_n(s.ptrs[r].begin(), std::min(width_, s.ptrs[r].size()), flat_.begin() + r * width_);
  }
  void* const* operator[](int64_t rank) const { return flat_.data() + rank * width_; }

 private:
  size_t width_;
  std::vector<void*> flat_;
};

// The rank states the group published (each rank's last pointer).
template <typename R>
std::vector<R*> Ranks(const Slot& s) {
  std::vector<R*> ranks(s.n);
  for (int r = 0; r < s.n; ++r) ranks[r] = static_cast<R*>(s.ptrs[r].back());
  return ranks;
}

// Joins the group without blocking the caller. `state` is published after
// `ptrs` and kept until the group's job is over, then dropped (its comm
// buffers go back to the pool) before `done` hears the outcome.
void Launch(const char* opname, const MoeParams& p, const MoeCall& c,
            std::unique_ptr<RankState> state, PtrList ptrs, const Starter& start,
            MoeDone done) {
  ptrs.push_back(state.get());
  state->done = std::move(done);
  // The completion owns the state through a plain pointer (it runs exactly
  // once): a lambda holding a shared_ptr and the done function did not fit
  // std::function's inline buffer, an allocation per rank per op.
  Completion finish = [raw = state.release()](const Status& st) {
    std::unique_ptr<RankState> owned(raw);
    const Status out = st.ok && !owned->error.empty() ? Status::Error(owned->error) : st;
    MoeDone done = std::move(owned->done);
    owned.reset();
    done(out);
  };
  JoinAsync(c.As(opname, p.group_size), ptrs, p.Sign(opname), std::move(finish),
            start);
}

// Dispatch's plan builder, combine's and its backward's plans, and
// combine's shares, are rebuilt every op; when an op is over they come back
// here and the next op reuses their arrays (fresh ones cost a page fault
// per 4 KiB written: most of the serial layout step). At most `kept` are
// kept and, with `bytes`, at most `budget` bytes of them (shares: one per
// rank per op, at any group size), so memory stays flat.
template <typename T>
std::shared_ptr<T> AcquirePooled(size_t kept = 2, int64_t (*bytes)(const T&) = nullptr, int64_t budget = 0) {
  static std::mutex& mu = *new std::mutex;  // never destroyed: workers may run at exit
  static auto& pool = *new std::vector<std::unique_ptr<T>>;
  static int64_t kept_bytes = 0;
  std::unique_ptr<T> item;
  {
    std::lock_guard<std::mutex> lock(mu);
    if (!pool.empty()) {
      item = std::move(pool.back());
      pool.pop_back();
      if (bytes) kept_bytes -= bytes(*item);
    }
  }
  if (!item) item = std::make_unique<T>();
  return std::shared_ptr<T>(item.release(), [kept, bytes, budget](T* done) {
    std::unique_ptr<T> owned(done);
    const int64_t size = bytes ? bytes(*owned) : 0;
    std::lock_guard<std::mutex> lock(mu);
    if (pool.size() >= kept || (bytes && kept_bytes + size > budget)) return;
    kept_bytes += size;
    pool.push_back(std::move(owned));
  });
}

struct DispatchRank : RankState {
  using RankState::RankState;
  // Until the placement phase, pair_slot[i] holds pair i's (checked) expert as
  // its entry in `entries`: the rank's own output, so no buffer of its own.
  int32_t *pair_slot = nullptr, *slot_source = nullptr, *recv_counts = nullptr, *dropped = nullptr;
  // The experts this rank routes to, sparse: a dense count of every expert
  // on every rank made the group's layout N x E per op (384 ranks x 768
  // experts for a few pairs each), a serial pass of the last rank in.
  // One vector each (at 384 ranks a few allocations per rank and op were a
  // fifth of the MoE pair's CPU time in malloc and free).
  struct Entry {
    int32_t expert;
    int64_t count = 0;
    int64_t next = 0;  // the next row of the expert this rank fills (set by the layout)
    // Set by the placement phase: the expert's owning rank and its first
    // row among the owner's slots (one division per expert, not per pair).
    int32_t owner = 0;
    int64_t first_row = 0;
  };
  std::vector<Entry> entries;  // in order of first use
};

// What the last rank to arrive at a dispatch works out for the group.
struct DispatchLayout {
  std::vector<int64_t> total;  // [E]: pairs routed to each expert
  std::string error;           // the first rank's bad expert id, if any
};

}  // namespace

void MoeDispatchAsync(const MoeParams& p, const MoeCall& c, const void* x, ExpertIds topk_idx,
                      void* recv_x, int32_t* pair_slot, int32_t* slot_source, int32_t* recv_counts,
                      int32_t* dropped, MoeDone done) {
  Status st = CheckCall(kDispatchName, p, c);
  if (!st.ok) return done(st);
  if (OpObserver* observer = ActiveObserver())
    done = observer->OnMoe(ObservedOp::kMoeDispatch, p, c, pair_slot, p.tokens * p.topk, true, std::move(done));
  const int32_t num_e = p.num_experts;
  const int64_t el = p.local_experts(), cap = p.capacity, pairs = p.tokens * p.topk;
  const int64_t rb = p.row_bytes();

  // The rows move as a transfer plan (algorithms/moe_plan.h), whose executor
  // stages buffer_centric's rows in rounds of the comm buffer.
  auto me = std::make_unique<DispatchRank>(kDispatchName, p, c.device,
                                           std::initializer_list<RowBuffers::In>{{x, p.tokens * rb}},
                                           std::initializer_list<RowBuffers::Out>{{recv_x, el * cap * rb}},
                                           /*by_plan=*/true);
  me->pair_slot = pair_slot;
  me->slot_source = slot_source;
  me->recv_counts = recv_counts;
  me->dropped = dropped;
  // This rank's pairs per expert, and the first bad id (reported by everyone,
  // before anyone touches a peer's buffer). Only this rank's buffers are
  // read, so it happens before joining. Each checked id is kept as its entry
  // in the rank's expert list, in pair_slot: XLA may not reuse topk_idx before
  // we complete, but the entry keeps the placement phase free of width switches.
  // entry_of[e]: e's entry in me->entries, or -1; kept by the thread and
  // reset after use, so building the sparse list costs O(pairs), not O(E).
  thread_local std::vector<int32_t> entry_of;
  if (entry_of.size() < static_cast<size_t>(num_e)) entry_of.resize(num_e, -1);
  me->entries.reserve(std::min<int64_t>(pairs, num_e));
  for (int64_t i = 0; i < pairs; ++i) {
    const int64_t e = topk_idx.At(i);
    if (e < 0 || e >= num_e) {
      std::ostringstream os;
      os << Where(kDispatchName, p, c) << "token " << i / p.topk << ", k=" << i % p.topk
         << " is routed to expert id " << e << ", outside [0, " << num_e << ")";
      me->bad = os.str();
      break;
    }
    int32_t& entry = entry_of[e];
    if (entry < 0) {
      entry = static_cast<int32_t>(me->entries.size());
      me->entries.push_back({static_cast<int32_t>(e)});
    }
    me->pair_slot[i] = entry;
    me->entries[entry].count++;
  }
  for (const DispatchRank::Entry& entry : me->entries) entry_of[entry.expert] = -1;
  if (!me->bad.empty()) me->entries.clear();  // nothing of this rank is placed: the group fails
  st = me->rows.Acquire();
  if (!st.ok) return done(st);
  GlobalStats().ops++;

  PtrList ptrs = {me->rows.in(0), me->rows.out(0)};  // PlanJob's in and out
  // The starter runs inside some rank's JoinAsync, while that rank's `p` is
  // alive; capturing it by reference keeps the lambda in std::function's
  // inline buffer (a copy of MoeParams was an allocation per rank per op).
  Launch(kDispatchName, p, c, std::move(me), std::move(ptrs),
         [&p](Slot& s, std::shared_ptr<Job>* job) -> Status {
    const int n = p.group_size;
    const int32_t num_e = p.num_experts;
    const int64_t el = p.local_experts(), cap = p.capacity, pairs = p.tokens * p.topk;
    std::vector<DispatchRank*> ranks = Ranks<DispatchRank>(s);
    auto layout = std::make_shared<DispatchLayout>();
    layout->total.assign(num_e, 0);
    // Each rank's pairs of expert e go after those of lower ranks.
    for (int r = 0; r < n; ++r) {
      DispatchRank& rank = *ranks[r];
      if (layout->error.empty() && !rank.bad.empty()) layout->error = rank.bad;
      for (DispatchRank::Entry& entry : rank.entries) {
        entry.next = layout->total[entry.expert];
        layout->total[entry.expert] += entry.count;
      }
    }
    if (!layout->error.empty()) {
      // Every rank reports the same error and nobody has touched a peer.
      for (DispatchRank* r : ranks) r->error = layout->error;
      return Status::Ok();
    }

    // Phase 1, a task per rank: place its pairs in (token, k) order after
    // all pairs of lower ranks, tell the owning ranks where each of their
    // rows comes from, and enter its slots in the plan.
    auto builder = AcquirePooled<MoeDispatchPlanBuilder>(
        2, [](const MoeDispatchPlanBuilder& b) { return b.CapacityBytes(); }, int64_t{64} << 20);
    builder->Reset(p);
    Phase place;
    place.count = n;
    place.run = [ranks, layout, builder, el, cap, pairs](uint64_t rank) {
      DispatchRank& me = *ranks[rank];
      for (DispatchRank::Entry& entry : me.entries) {
        entry.owner = static_cast<int32_t>(entry.expert / el);
        entry.first_row = (entry.expert % el) * cap;
      }
      int32_t drops = 0;
      const int64_t first_pair = static_cast<int64_t>(rank) * pairs;
      for (int64_t i = 0; i < pairs; ++i) {
        DispatchRank::Entry& entry = me.entries[me.pair_slot[i]];
        const int64_t row = entry.next++;
        if (row >= cap) {
          me.pair_slot[i] = -1;
          drops++;
          continue;
        }
        me.pair_slot[i] = static_cast<int32_t>(entry.expert * cap + row);
        ranks[entry.owner]->slot_source[entry.first_row + row] = static_cast<int32_t>(first_pair + i);
      }
      *me.dropped = drops;
      for (int64_t l = 0; l < el; ++l) {
        const int64_t filled = std::min(layout->total[rank * el + l], cap);
        me.recv_counts[l] = static_cast<int32_t>(filled);
        std::fill(me.slot_source + l * cap + filled, me.slot_source + (l + 1) * cap, -1);
      }
      builder->Sources(static_cast<int>(rank), me.pair_slot);
    };
    std::vector<Phase> phases;
    phases.push_back(std::move(place));
    if (ranks[0]->rows.direct()) {
      // Strata mode: each owner's plan runs as it is built (phase 2, a task
      // per owner: its transfers write only its rows), whole transfers in
      // the plan's order, and is credited as the NPU's lanes would run it,
      // on the lanes the busiest rank's bytes chose once every rank's pairs
      // were placed. The joined plan's partition was three serial steps
      // between phases and a piece walk per row; a phase of its own for the
      // credit cost ~8 % of the op.
      auto on_sdma = std::make_shared<bool>(false);
      phases.back().then = [shape = static_cast<const MoeOpShape&>(p), builder, on_sdma](Job*) {
        const OpParams run = MoeDispatchRunParams(shape);
        *on_sdma = MovesOnSdma(run.rows * builder->BusiestRankBytes(), run.engines);
      };
      PlanGroup group;
      for (int r = 0; r < n; ++r) {
        group.plans.push_back({std::shared_ptr<const Plan>(builder, &builder->OwnerPlan(r)), nullptr, nullptr});
        group.buffers.in.push_back(s.ptrs[r][0]);
        group.buffers.out.push_back(s.ptrs[r][1]);
      }
      Phase owners = OrderedPlanPhase(
          {std::move(group)}, n,
          [shape = static_cast<const MoeOpShape&>(p), builder, on_sdma, devices = s.devices](
              uint64_t o, const TransferRunner& runner) {
            const int32_t owner = static_cast<int32_t>(o);
            if (!builder->Owner(owner)) return;  // bad slots: CheckSlots says so next
            const Plan& plan = builder->OwnerPlan(owner);
            runner.RunAll(0, o);
            thread_local LaneCredit lanes;  // the thread's, reused
            PartitionCredit(plan, *on_sdma ? shape.engines : shape.cores, shape.planner, &lanes);
            lanes.on_sdma = *on_sdma;
            CreditLanes(lanes, devices, /*direct=*/true);
          });
      owners.then = [ranks, builder](Job*) {
        std::vector<const int32_t*> slots(ranks.size());
        for (size_t r = 0; r < ranks.size(); ++r) slots[r] = ranks[r]->pair_slot;
        const Status st = builder->CheckSlots(slots);  // its errors name the op
        if (!st.ok)
          for (DispatchRank* r : ranks) r->error = st.message;
      };
      phases.push_back(std::move(owners));
      Schedule(std::move(phases), *ranks[0], n, job);
      return Status::Ok();
    }
    // buffer_centric: the plan of the slots just placed (each owner's
    // transfers built in parallel, phase 2), joined and run as any plan is
    // (staged in rounds of the comm buffer, the NPUs' lanes, stats: each
    // (token, rank) pair crosses once, the fan-out to the rank's other rows
    // is local).
    Phase owners;
    owners.count = n;
    owners.run = [builder](uint64_t owner) { builder->Owner(static_cast<int32_t>(owner)); };
    owners.then = [shape = static_cast<const MoeOpShape&>(p), ranks, builder, slot = &s](Job* rows_job) {
      std::vector<const int32_t*> slots(ranks.size());
      for (size_t r = 0; r < ranks.size(); ++r) slots[r] = ranks[r]->pair_slot;
      Plan plan;
      Status st = builder->Finish(slots, &plan);  // its errors name the op
      std::shared_ptr<Job> rows;
      if (st.ok) {
        OpParams run = MoeDispatchRunParams(shape);
        run.movement_lanes = MovesOnSdma(run.rows * builder->BusiestRankBytes(), run.engines) ? 1 : 0;
        st = PlanJob(*slot, std::move(plan), run, &rows);
        if (!st.ok) st = Status::Error(std::string(kDispatchName) + ": " + st.message);
      }
      if (!st.ok) {
        for (DispatchRank* r : ranks) r->error = st.message;
        return;
      }
      *rows_job = std::move(*rows);
    };
    phases.push_back(std::move(owners));
    Schedule(std::move(phases), *ranks[0], n, job);
    return Status::Ok();
  }, std::move(done));
}

namespace {
// A rank's share of an op's plans (combine's: its tokens' sums and the
// partials they make; the backward's: its rows as an owner), pooled by bytes.
template <typename Share>
std::shared_ptr<Share> AcquireShare() {
  return AcquirePooled<Share>(
      SIZE_MAX, [](const Share& share) { return share.CapacityBytes(); }, int64_t{64} << 20);
}

// A rank that built its share of the op's plans from its own fields before
// it joined (algorithms/moe_combine_plan.h, moe_backward_plan.h).
template <typename Share>
struct ShareRank : RankState {
  using RankState::RankState;
  std::shared_ptr<Share> share;
};
using CombineRank = ShareRank<MoeCombineShare>;
using BackwardRank = ShareRank<MoeBackwardShare>;

using Shares = std::vector<std::shared_ptr<const MoeCombineShare>>;
std::vector<const MoeCombineShare*> Views(const Shares& shares) {
  std::vector<const MoeCombineShare*> views;
  views.reserve(shares.size());
  for (const auto& share : shares) views.push_back(share.get());
  return views;
}
}  // namespace

void MoeCombineAsync(const MoeParams& p, const MoeCall& c, const void* expert_y,
                     const void* weights, const int32_t* pair_slot, void* y, MoeDone done) {
  Status st = CheckCall(kCombineName, p, c);
  if (!st.ok) return done(st);
  if (OpObserver* observer = ActiveObserver())
    done = observer->OnMoe(ObservedOp::kMoeCombine, p, c, pair_slot, p.tokens * p.topk, false, std::move(done));
  if (!MoeSupportsCombine(p.dtype))
    return done(Status::Error(std::string(kCombineName) + ": rows must be a float type, got " +
                              DTypeName(p.dtype)));
  const int64_t el = p.local_experts(), cap = p.capacity, k_top = p.topk;
  const int64_t rb = p.row_bytes(), slots_per_rank = el * cap, all_slots = p.group_size * slots_per_rank;
  auto me = std::make_unique<CombineRank>(kCombineName, p, c.device,
                                          std::initializer_list<RowBuffers::In>{{expert_y, slots_per_rank * rb}},
                                          std::initializer_list<RowBuffers::Out>{{y, p.tokens * rb}});
  me->bad = CheckLayout(kCombineName, p, c, "pair_slot", pair_slot, p.tokens * k_top, all_slots);
  st = me->rows.Acquire();
  if (!st.ok) return done(st);
  GlobalStats().ops++;
  // y[t] = from zero, over the ranks r holding t's pairs, ascending, in the
  // accumulation type: w * expert row if r holds one of t's pairs (the row
  // crosses as it is), else r's partial, the sum of w * row over t's pairs
  // on r in k order, rounded to the rows' dtype (the one row that crosses
  // back); y is that rounded to the rows' dtype. Same order in both modes
  // and in moe.py's references. As two plans (algorithms/moe_combine_plan.h)
  // of which this rank's share (its tokens' sums, the partials they make)
  // depends on its own slots and weights alone: it is built here, before the
  // rank joins, while its peers are still on their way (built at the
  // rendezvous, the plans were an eighth of a combine's time there).
  const bool direct = me->rows.direct();
  if (me->bad.empty()) {
    me->share = AcquireShare<MoeCombineShare>();
    const Status built = BuildMoeCombineShare(p, /*stage_all=*/!direct, c.rank, pair_slot, weights, me->share.get());
    if (!built.ok) me->bad = Where(kCombineName, p, c) + built.message;
    else if (direct) PartitionCredit(me->share->sums, p.cores, p.planner, &me->share->sums_credit);  // this rank's NPU's lanes
  }

  enum { kEy = 0, kY };  // the slots and weights are in the share
  PtrList ptrs = {me->rows.in(0), me->rows.out(0)};
  Launch(kCombineName, p, c, std::move(me), std::move(ptrs),  // &p: see dispatch
         [&p](Slot& s, std::shared_ptr<Job>* job) -> Status {
    const int n = p.group_size;
    std::vector<CombineRank*> ranks = Ranks<CombineRank>(s);
    if (AgreeOnBad(ranks)) return Status::Ok();
    const bool direct = ranks[0]->rows.direct();
    const MoeOpShape& shape = p;
    Shares shares;
    for (CombineRank* r : ranks) shares.push_back(r->share);
    auto plans = AcquirePooled<MoeCombinePlans>();
    // The joined plans' sizes (the join itself cannot fail after this).
    if (const Status fits = JoinMoeCombineShares(shape, Views(shares), plans.get(), false, false); !fits.ok) {
      for (CombineRank* r : ranks) r->error = fits.message;
      return Status::Ok();
    }
    std::vector<Phase> phases;
    if (direct) {
      // One pass on the tokens' ranks, share by share, whole transfers in
      // order: each partial is summed from its owner's rows as it is read
      // (its owner's plan, fused). Each share's sums are credited as its
      // handler split them; the owners' lanes from the joined partials,
      // partitioned as the model has them, by one task beside the sums.
      PlanBuffers buffers;
      for (int r = 0; r < n; ++r) {
        buffers.in.push_back(s.ptrs[r][kEy]);
        buffers.out.push_back(s.ptrs[r][kY]);
      }
      Phase credit;
      credit.count = 1;
      credit.run = [shape = shape, shares, plans, devices = s.devices](uint64_t) {
        for (const auto& share : shares) CreditLanes(share->sums_credit, devices, /*direct=*/true);
        JoinMoeCombineShares(shape, Views(shares), plans.get(), /*join_partials=*/true, /*join_sums=*/false);
        PartitionCredit(plans->partials, shape.cores, shape.planner, &plans->partials_credit);
        CreditLanes(plans->partials_credit, devices, /*direct=*/true);
      };
      phases.push_back(Concat(std::move(credit), MoeCombineSharesPhase(shape, shares, buffers)));
      Schedule(std::move(phases), *ranks[0], n, job);
      return Status::Ok();
    }
    // buffer_centric: the shares joined into the group's plans and
    // partitioned (a task each); then the owners stage in only what crosses
    // (one row per (token, rank): a lone expert row as it is, or the rounded
    // partial) into their comm buffers; then every token's rank sums what it
    // reads there into its own comm buffer, copied out at the end.
    Phase join;
    join.count = 2;
    join.run = [shape = shape, shares, plans](uint64_t i) {
      JoinMoeCombineShares(shape, Views(shares), plans.get(), i == 0, i == 1);
      Partition(i == 0 ? plans->partials : plans->sums, shape.cores, shape.planner);
    };
    join.then = [plans, ranks, ptrs = PtrTable(s), devices = s.devices](Job* more) {
      const int n = static_cast<int>(ranks.size());
      std::shared_ptr<const Plan> partials(plans, &plans->partials), sums(plans, &plans->sums);
      PlanBuffers stage, sum;
      for (int r = 0; r < n; ++r) {
        stage.in.push_back(ranks[r]->rows.user_in(0));
        stage.out.push_back(ptrs[r][kEy]);
        sum.in.push_back(ranks[r]->rows.user_in(0));
        sum.scratch.push_back(ptrs[r][kEy]);
        sum.out.push_back(ptrs[r][kY]);
      }
      more->phases.push_back(PlanPhase(partials, stage, devices, false, /*staging=*/true));
      more->phases.push_back(PlanPhase(sums, sum, devices, false));
      more->phases.push_back(StagePhase(ranks, /*in=*/false));
    };
    phases.push_back(std::move(join));
    Schedule(std::move(phases), *ranks[0], n, job);
    return Status::Ok();
  }, std::move(done));
}

namespace {
// MoeLayoutDisagreement over the fields as published by the backward op.
std::string CrossCheckLayout(const Slot& s, const MoeOpShape& p) {
  enum { kPairSlot = 3, kSlotSource = 4 };  // MoeCombineBackwardAsync's
  std::vector<const int32_t*> pair_slot(s.n), slot_source(s.n);
  for (int r = 0; r < s.n; ++r) {
    pair_slot[r] = static_cast<const int32_t*>(s.ptrs[r][kPairSlot]);
    slot_source[r] = static_cast<const int32_t*>(s.ptrs[r][kSlotSource]);
  }
  const std::string why = MoeLayoutDisagreement(p, pair_slot, slot_source);
  if (why.empty()) return why;
  std::ostringstream os;
  os << kCombineBwdName << " (call site " << s.site_id << ", group " << s.group_id << "): " << why;
  return os.str();
}
}  // namespace

void MoeCombineBackwardAsync(const MoeParams& p, const MoeCall& c, const void* ct_y,
                             const void* expert_y, const void* weights, const int32_t* pair_slot,
                             const int32_t* slot_source, void* d_expert_y, void* d_weights,
                             MoeDone done) {
  Status st = CheckCall(kCombineBwdName, p, c);
  if (!st.ok) return done(st);
  if (OpObserver* observer = ActiveObserver())
    done = observer->OnMoe(ObservedOp::kMoeCombineBackward, p, c, pair_slot, p.tokens * p.topk, false, std::move(done));
  if (!MoeSupportsCombine(p.dtype))
    return done(Status::Error(std::string(kCombineBwdName) + ": rows must be a float type, got " +
                              DTypeName(p.dtype)));
  const int n = p.group_size;
  const int64_t el = p.local_experts(), cap = p.capacity;
  const int64_t rb = p.row_bytes(), slots_per_rank = el * cap, all_slots = n * slots_per_rank;
  const int64_t pairs = p.tokens * p.topk;
  const int64_t wsize = static_cast<int64_t>(DTypeSize(MoeWeightDType(p.dtype)));
  // buffer_centric: ct_y and the expert rows are staged in (owners read a
  // token's ct_y row from its rank's comm buffer), both results out.
  auto me = std::make_unique<BackwardRank>(
      kCombineBwdName, p, c.device,
      std::initializer_list<RowBuffers::In>{{ct_y, p.tokens * rb}, {expert_y, slots_per_rank * rb}},
      std::initializer_list<RowBuffers::Out>{{d_expert_y, slots_per_rank * rb}, {d_weights, pairs * wsize}});
  me->bad = CheckLayout(kCombineBwdName, p, c, "pair_slot", pair_slot, pairs, all_slots);
  if (me->bad.empty())
    me->bad = CheckLayout(kCombineBwdName, p, c, "slot_source", slot_source, slots_per_rank,
                          n * pairs);
  st = me->rows.Acquire();
  if (!st.ok) return done(st);
  GlobalStats().ops++;
  // This rank's share of the plans as an owner (algorithms/moe_backward_plan.h:
  // its carried rows, their scale and dots, its zeros) depends on its own
  // dispatch fields alone: built here, before the rank joins, while its
  // peers are on their way (built at the rendezvous, by owner, laid out,
  // joined and partitioned, the plans were ~2 ms of a ~12 ms backward). It
  // runs on this rank's NPU alone, so its lanes' credit is made here too, as
  // the joined plans' partition on this NPU would give it.
  if (me->bad.empty()) {
    me->share = AcquireShare<MoeBackwardShare>();
    const Status built = BuildMoeBackwardShare(p, c.rank, pair_slot, slot_source, me->share.get());
    if (!built.ok) {
      me->bad = Where(kCombineBwdName, p, c) + built.message;
    } else {
      MoeBackwardShare& share = *me->share;
      PartitionCredit(share.scale, p.cores, p.planner, &share.scale_credit);
      PartitionCredit(share.dots, p.cores, p.planner, &share.dots_credit, /*align=*/share.dots.block_bytes);
    }
  }

  enum { kCt = 0, kEy, kW, kPairSlot, kSlotSource, kDEy, kDW };
  PtrList ptrs = {me->rows.in(0), me->rows.in(1), const_cast<void*>(weights),
                  const_cast<int32_t*>(pair_slot), const_cast<int32_t*>(slot_source),
                  me->rows.out(0), me->rows.out(1)};
  Launch(kCombineBwdName, p, c, std::move(me), std::move(ptrs),  // &p: see dispatch
         [&p](Slot& s, std::shared_ptr<Job>* job) -> Status {
    const int n = p.group_size;
    std::vector<BackwardRank*> ranks = Ranks<BackwardRank>(s);
    if (AgreeOnBad(ranks)) return Status::Ok();
    // In range is not enough: the two fields must describe one layout.
    if (std::string bad = CrossCheckLayout(s, p); !bad.empty()) {
      for (BackwardRank* r : ranks) r->error = bad;
      return Status::Ok();
    }
    const bool direct = ranks[0]->rows.direct();
    const MoeOpShape& shape = p;
    std::vector<std::shared_ptr<MoeBackwardShare>> shares;
    std::vector<const MoeBackwardShare*> views;
    std::vector<const void*> weights(n);
    for (int r = 0; r < n; ++r) {
      shares.push_back(ranks[r]->share);
      views.push_back(ranks[r]->share.get());
      weights[r] = s.ptrs[r][kW];
    }
    // Both modes run the owners' shares as they are (buffer_centric from the
    // comm buffers: ptrs name them, ct_y staged in first, the results staged
    // out last). Joining them into the group's three plans and partitioning
    // those, as the model times them, gave the same lanes and bytes for ~3 ms
    // more CPU a call at the A/B's shape (perf; test_plans checks the two
    // agree): buffer_centric's backward ran 1.12x dcc4dd8's, now 0.95x.
    const bool carry_on_sdma = MoeBackwardCarryOnSdma(shape, views);
    // Each owner's share fills in its weights and is credited as its NPU
    // runs it (the carry split on the lanes chosen for all; the scale and
    // dots as its handler split them).
    Phase prepare;
    prepare.count = n;
    prepare.run = [shape = shape, shares, weights, carry_on_sdma, devices = s.devices, direct](uint64_t o) {
      MoeBackwardShare& share = *shares[o];
      FillMoeBackwardWeights(shape, weights, &share);
      share.carry.on_sdma = carry_on_sdma;
      PartitionCredit(share.carry, carry_on_sdma ? shape.engines : shape.cores, shape.planner, &share.carry_credit);
      for (const LaneCredit* credit : {&share.carry_credit, &share.scale_credit, &share.dots_credit})
        CreditLanes(*credit, devices, direct);
    };
    PlanBuffers to_scale, to_dot;
    std::vector<const int32_t*> pair_slots(n);
    for (int r = 0; r < n; ++r) {
      to_scale.out.push_back(s.ptrs[r][kDEy]);
      to_dot.in.push_back(s.ptrs[r][kEy]);
      to_dot.out.push_back(s.ptrs[r][kDW]);
      to_scale.producer_in.push_back(s.ptrs[r][kCt]);
      pair_slots[r] = static_cast<const int32_t*>(s.ptrs[r][kPairSlot]);
    }
    to_dot.producer_in = to_scale.producer_in;
    std::vector<Phase> phases;
    // Staging in and the weights are independent: one phase.
    phases.push_back(direct ? std::move(prepare) : Together(StagePhase(ranks, /*in=*/true), std::move(prepare)));
    phases.push_back(MoeBackwardSharesPhase(shape, {shares.begin(), shares.end()}, std::move(pair_slots), to_scale, to_dot));
    if (!direct) phases.push_back(StagePhase(ranks, /*in=*/false));
    Schedule(std::move(phases), *ranks[0], n, job);
    return Status::Ok();
  }, std::move(done));
}

}  // namespace strata
