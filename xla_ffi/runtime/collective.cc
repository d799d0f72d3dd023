#include "collective.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>
#include <thread>
#include <tuple>

#include "copy.h"
#include "observer.h"
#include "reduce_isa.h"
#include "registry.h"
#include "rendezvous.h"
#include "stats.h"

namespace strata {

const char* ModeName(Mode mode) {
  return mode == Mode::kBufferCentric ? "buffer_centric" : "strata";
}

std::string OpParams::Describe() const {
  std::ostringstream os;
  os << name() << " dtype=" << DTypeName(dtype) << " op=" << ReduceOpName(op) << " root=" << root
     << " group_size=" << group_size << " rows=" << rows << " in_blocks=" << in_blocks
     << " out_blocks=" << out_blocks << " block_bytes=" << block_bytes
     << " mode=" << ModeName(mode) << " cores=" << cores
     << " engines=" << engines << " planner=" << PlannerName(planner)
     << " comm_buffer_bytes=" << comm_buffer_bytes << " perm=[";
  for (int32_t v : perm) os << v << ',';
  os << ']';
  return os.str();
}

Signature OpParams::Sign() const {
  SignatureHasher h;
  h.Add(builder->code).Add(dtype).Add(op).Add(root).Add(group_size).Add(in_blocks).Add(out_blocks);
  h.Add(block_bytes).Add(rows).Add(mode).Add(cores).Add(engines).Add(planner).Add(comm_buffer_bytes);
  h.Add(perm.size());
  if (!perm.empty()) h.Add(perm.data(), perm.size() * sizeof(int32_t));
  Signature sig;
  sig.hash = h.hash();
  // `this` outlives JoinAsync (the caller's parameters), which is all keep needs.
  sig.keep = [this] { return std::function<std::string()>([p = *this] { return p.Describe(); }); };
  return sig;
}

void OpParams::PlanKey(std::string* out) const {
  // Raw bytes, not text: the key is built on every op (a 384-rank ppermute's
  // pairs formatted as text cost tens of microseconds).
  std::string& key = *out;
  key.clear();
  auto put = [&key](const auto& v) { key.append(reinterpret_cast<const char*>(&v), sizeof(v)); };
  put(builder->code), put(dtype), put(op), put(root), put(group_size), put(in_blocks), put(out_blocks);
  put(block_bytes), put(cores), put(engines), put(planner), put(movement_lanes);
  key.append(reinterpret_cast<const char*>(perm.data()), perm.size() * sizeof(int32_t));
}

Plan BuildPartitionedPlan(const OpParams& p) {
  Plan plan;
  plan.num_ranks = p.group_size;
  plan.in_blocks = p.in_blocks;
  plan.out_blocks = p.out_blocks;
  plan.block_bytes = p.block_bytes;
  plan.dtype = p.dtype;
  plan.op = p.op;
  p.builder->add_transfers(p, plan);
  // Reductions run on vector cores; pure data movement on DMA engines when
  // their descriptor cost is amortised, else on the cores (MovesOnSdma).
  plan.on_sdma = MovesOnSdma(p);
  Partition(plan, plan.on_sdma ? p.engines : p.cores, p.planner);
  return plan;
}

bool MovesOnSdma(int64_t bytes_per_rank, int engines, double descriptor_us, double sdma_gbps) {
  // Engines stream read + written bytes at 2 x sdma_gbps each (1 GB/s = 1e3 B/us).
  const double streaming_us = static_cast<double>(bytes_per_rank) /
                              (std::max(1, engines) * 2.0 * sdma_gbps * 1e3);
  return streaming_us >= descriptor_us;
}

bool MovesOnSdma(const OpParams& p, double descriptor_us, double sdma_gbps) {
  if (p.op != ReduceOp::kNone) return false;
  if (p.movement_lanes >= 0) return p.movement_lanes == 1;
  return MovesOnSdma(p.rows * (p.in_blocks + p.out_blocks) * p.block_bytes, p.engines, descriptor_us,
                     sdma_gbps);
}

int64_t CommWindowBytes(const OpParams& p) {
  const int64_t max_blocks = std::max(p.in_blocks, p.out_blocks);
  const int64_t esize = static_cast<int64_t>(DTypeSize(p.dtype));
  int64_t window = p.comm_buffer_bytes / std::max<int64_t>(1, p.rows * max_blocks);
  return window >= 64 ? window / 64 * 64 : window / esize * esize;
}

namespace {

// ---------------------------------------------------------------------------
// Communicator: one per group of devices. Owns the plan cache and, for the
// buffer-centric baseline, each rank's pre-registered comm buffers.
// ---------------------------------------------------------------------------
struct CommBuffers {
  int64_t bytes = 0;
  std::vector<char*> in, out;  // per rank
};

struct Communicator {
  std::vector<int32_t> devices;
  std::mutex mu;
  std::map<std::string, std::shared_ptr<const Plan>> plans;
  // Buffer sets not in use. Ops the program runs concurrently on one
  // communicator each take their own set, as HCCL's streams would.
  std::vector<std::unique_ptr<CommBuffers>> idle_buffers;

  std::shared_ptr<const Plan> GetPlan(const OpParams& p) {
    // Built in a buffer each thread keeps: a fresh string per op was an allocation.
    thread_local std::string key;
    p.PlanKey(&key);
    std::lock_guard<std::mutex> lock(mu);
    auto it = plans.find(key);
    if (it != plans.end()) return it->second;
    auto plan = std::make_shared<const Plan>(BuildPartitionedPlan(p));
    if (plans.size() > 256) plans.clear();  // bound memory for programs with many shapes
    plans[key] = plan;
    return plan;
  }

  // HCCL-style: an in and an out buffer per rank, allocated and registered
  // once, then reused.
  std::unique_ptr<CommBuffers> AcquireBuffers(int64_t bytes) {
    {
      std::lock_guard<std::mutex> lock(mu);
      for (auto it = idle_buffers.begin(); it != idle_buffers.end(); ++it) {
        if ((*it)->bytes != bytes) continue;
        std::unique_ptr<CommBuffers> set = std::move(*it);
        idle_buffers.erase(it);
        return set;
      }
    }
    auto set = std::make_unique<CommBuffers>();
    set->bytes = bytes;
    // Large pages, as a fabric registers its buffers: on 4 KiB pages the
    // exchange's reads of rows scattered over every rank's buffer missed the
    // TLB (MoE dispatch's buffer_centric ran 1.5x slower than on the 2 MiB
    // pages the staging pool before it used).
    constexpr size_t kHuge = 2u << 20;
    const size_t rounded = (static_cast<size_t>(bytes) + kHuge - 1) / kHuge * kHuge;
    for (int32_t device : devices) {
      char* in = static_cast<char*>(std::aligned_alloc(kHuge, rounded));
      char* out = static_cast<char*>(std::aligned_alloc(kHuge, rounded));
      if (in) Registry::PreferLargePages(in, static_cast<int64_t>(rounded));
      if (out) Registry::PreferLargePages(out, static_cast<int64_t>(rounded));
      if (!in || !out) {
        // A partial set must never be reused: later ops would index the
        // missing ranks' buffers. Give back what this attempt took.
        std::free(in);
        std::free(out);
        FreeBuffers(*set);
        return nullptr;
      }
      set->in.push_back(in);
      set->out.push_back(out);
      GlobalRegistry().Register(device, reinterpret_cast<uintptr_t>(in), bytes);
      GlobalRegistry().Register(device, reinterpret_cast<uintptr_t>(out), bytes);
    }
    return set;
  }

  void FreeBuffers(CommBuffers& set) {
    for (size_t r = 0; r < set.in.size(); ++r) {
      GlobalRegistry().Deregister(devices[r], reinterpret_cast<uintptr_t>(set.in[r]));
      GlobalRegistry().Deregister(devices[r], reinterpret_cast<uintptr_t>(set.out[r]));
      std::free(set.in[r]);
      std::free(set.out[r]);
    }
    set.in.clear();
    set.out.clear();
  }

  void ReleaseBuffers(std::unique_ptr<CommBuffers> set) {
    std::lock_guard<std::mutex> lock(mu);
    idle_buffers.push_back(std::move(set));
  }
};

// Never destroyed: detached runtime threads (workers, the watchdog,
// completion threads) may still touch these while the process exits.
std::mutex& g_comms_mu = *new std::mutex;
std::map<std::vector<int32_t>, std::unique_ptr<Communicator>>& g_comms = *new std::map<std::vector<int32_t>, std::unique_ptr<Communicator>>;

Communicator* GetCommunicator(const std::vector<int32_t>& devices) {
  std::lock_guard<std::mutex> lock(g_comms_mu);
  auto& c = g_comms[devices];
  if (!c) {
    c = std::make_unique<Communicator>();
    c->devices = devices;
  }
  return c.get();
}


// Where each rank's blocks live during one phase: the user buffers (strata
// mode) or comm buffers holding a round's window of columns (buffer_centric,
// whose every round has a plan of its own width: a view always holds all of
// its plan's columns).
struct View {
  std::vector<const char*> in;
  std::vector<char*> out;
  int64_t rows = 1;
  int64_t in_row_stride = 0, out_row_stride = 0, block_stride = 0;
  bool streaming = false;  // outputs too large to stay cached: non-temporal stores
  // A weighted plan's scratch (Plan::scratch_blocks), row stride in_row_stride.
  std::vector<const char*> scratch;
  // When set, a scratch block is computed from the transfer of `producer`
  // that writes it (block j of rank r: transfer producer_first[r] + j), as
  // it is read, instead of being read (PlanPhase's fused producer), from
  // the producer's inputs `producer_in` (row stride in_row_stride).
  const Plan* producer = nullptr;
  const uint32_t* producer_first = nullptr;
  std::vector<const char*> producer_in;
};

// A copy of a few bytes: an all_to_all of 1 KB per rank over 384 ranks is
// 147k transfers of one float, where a call to memcpy costs more than the move.
inline void CopySmall(char* d, const char* s, int64_t n) {
  switch (n) {
    case 2: std::memcpy(d, s, 2); return;
    case 4: std::memcpy(d, s, 4); return;
    case 8: std::memcpy(d, s, 8); return;
    case 16: std::memcpy(d, s, 16); return;
    default: std::memcpy(d, s, static_cast<size_t>(n));
  }
}

// One source's `len` bytes to one destination, in every row of the view.
inline void CopyRows(char* dst, const char* src, int64_t len, const View& v) {
  if (len <= 64) {
    for (int64_t row = 0; row < v.rows; ++row)
      CopySmall(dst + row * v.out_row_stride, src + row * v.in_row_stride, len);
  } else {
    for (int64_t row = 0; row < v.rows; ++row)
      CopyBytes(dst + row * v.out_row_stride, src + row * v.in_row_stride, len, v.streaming);
  }
}

// Stores a weighted sum (the accumulation type) as `n` values of `dtype`:
// the ISA's kernel, except for float16, whose NaN payloads only the
// compiler's conversion keeps.
void StoreSum(DType dtype, void* out, const void* acc, int64_t n) {
  if (dtype == DType::F16) {
    const float* a = static_cast<const float*>(acc);
    _Float16* o = static_cast<_Float16*>(out);
    for (int64_t i = 0; i < n; ++i) o[i] = static_cast<_Float16>(a[i]);
  } else {
    NarrowRow(dtype, out, acc, n);
  }
}

// The thread's accumulators: `count` of n elements of the accumulation type
// each (float64 is the widest), reused call after call.
double* SumScratch(int64_t n, int count) {
  thread_local std::vector<double> scratch;
  const size_t need = static_cast<size_t>(n) * static_cast<size_t>(count);
  if (scratch.size() < need) scratch.resize(need);
  return scratch.data();
}

// Where columns [c0, ...) of source ref `b` of `plan` are in row `row`: its
// input, its scratch, or, when a fused producer writes that scratch block
// by a copy, the copy's source. nullptr: a weighted producer computes it
// (AddProduced).
inline const char* SourceAt(const Plan& plan, const BlockRef& b, int64_t row, int64_t c0, const View& v) {
  const int64_t at = row * v.in_row_stride + c0;
  if (b.block < plan.in_blocks) return v.in[b.rank] + at + b.block * v.block_stride;
  const int64_t j = b.block - plan.in_blocks;
  if (!v.producer) return v.scratch[b.rank] + at + j * v.block_stride;
  if (v.producer->weighted) return nullptr;
  const Transfer& pt = v.producer->transfers[v.producer_first[b.rank] + j];
  const BlockRef& s = v.producer->refs[pt.src_begin];
  return v.producer_in[s.rank] + at + s.block * v.block_stride;
}

// acc += weight x (the sum producer transfer `pt` writes, rounded to dtype),
// columns [c0, c0 + n elements) of row `row`: the producer's work fused into
// its reader's. With weight 1 the last source's product, the rounding and
// the add are one kernel (AxpyAddRoundedRow), as the NPU's owner rounds a
// partial it sends and the reader adds it. `fresh`: acc holds nothing yet
// (the sum's first term), so it is stored, not added (StartSumRow: the same
// bits as adding it to zeros, without a pass to zero acc first).
void AddProduced(const Plan& producer, const Transfer& pt, int64_t row, int64_t c0, int64_t n, double weight,
                 const View& v, void* acc, bool fresh, void* part, void* rounded) {
  const DType dtype = producer.dtype;
  const size_t acc_size = dtype == DType::F64 ? 8 : 4;
  auto source = [&](uint32_t k) {
    const BlockRef& b = producer.refs[pt.src_begin + k];
    return v.producer_in[b.rank] + row * v.in_row_stride + b.block * v.block_stride + c0;
  };
  auto zero = [n, acc_size](void* to) { std::memset(to, 0, static_cast<size_t>(n) * acc_size); };
  if (pt.src_count == 0) {  // a sum of nothing adds zeros
    if (fresh) zero(acc);
    return;
  }
  if (producer.local_sums && pt.src_count == 1 && producer.weights[pt.src_begin] == 1.0) {
    // A copy, weighted where it is read.
    (fresh ? StartSumRow : AxpyRow)(dtype, acc, source(0), weight, n);
    return;
  }
  const uint32_t last = pt.src_count - 1;
  if (last > 0) {
    StartSumRow(dtype, part, source(0), producer.weights[pt.src_begin], n);
  } else {
    zero(part);
  }
  for (uint32_t k = 1; k < last; ++k) AxpyRow(dtype, part, source(k), producer.weights[pt.src_begin + k], n);
  if (weight == 1.0) {
    if (fresh) zero(acc);
    AxpyAddRoundedRow(dtype, acc, part, source(last), producer.weights[pt.src_begin + last], n);
    return;
  }
  AxpyRow(dtype, part, source(last), producer.weights[pt.src_begin + last], n);
  StoreSum(dtype, rounded, part, n);
  (fresh ? StartSumRow : AxpyRow)(dtype, acc, rounded, weight, n);
}

// How much of each source row PrefetchSources asks for: the head, enough
// for the hardware's streamer to take the row over from there. Whole rows
// (a MoE combine transfer's 8 x 4 KiB at once) filled the core's miss
// queue and stalled it on the prefetches themselves: combine ran 10-20 %
// slower than with none on an AVX-512 Xeon; 128 B, 256 B and none measured
// the same there.
constexpr int64_t kPrefetchHeadBytes = 256;

// Asks the cache for the head of columns [c0, c1) of a weighted transfer's
// sources (row 0; a fused producer's own sources for a scratch block): they
// sit at random rows of their ranks, and the sum otherwise starts each row
// with a miss (RunPieces asks a transfer ahead).
void PrefetchSources(const Plan& plan, uint32_t transfer, int64_t c0, int64_t c1, const View& v) {
  const Transfer& t = plan.transfers[transfer];
  c1 = std::min(c1, c0 + kPrefetchHeadBytes);
  auto fetch = [c0, c1](const char* base) {
    // The empty asm is a side effect: GCC deletes a loop of prefetches alone.
    for (int64_t line = c0; line < c1; line += 64) {
      __builtin_prefetch(base + line, 0, 3);
      asm volatile("");
    }
  };
  for (uint32_t k = 0; k < t.src_count; ++k) {
    const BlockRef& b = plan.refs[t.src_begin + k];
    if (const char* at = SourceAt(plan, b, 0, 0, v)) {
      fetch(at);
      continue;
    }
    const Plan& p = *v.producer;
    const Transfer& pt = p.transfers[v.producer_first[b.rank] + (b.block - plan.in_blocks)];
    for (uint32_t j = 0; j < pt.src_count; ++j) {
      const BlockRef& s = p.refs[pt.src_begin + j];
      fetch(v.producer_in[s.rank] + s.block * v.block_stride);
    }
  }
}

// Columns [c0, c1) of one transfer of a weighted plan, every row.
void RunWeighted(const Plan& plan, const Transfer& t, int64_t c0, int64_t c1, const View& v) {
  const DType dtype = plan.dtype;
  const int64_t n = (c1 - c0) / static_cast<int64_t>(DTypeSize(dtype));
  for (int64_t row = 0; row < v.rows; ++row) {
    auto dst = [&](uint32_t k) {
      const BlockRef& b = plan.refs[t.dst_begin + k];
      return v.out[b.rank] + row * v.out_row_stride + b.block * v.block_stride + c0;
    };
    if (t.src_count == 0) {
      for (uint32_t k = 0; k < t.dst_count; ++k) std::memset(dst(k), 0, c1 - c0);
      continue;
    }
    const char* only = t.src_count == 1 ? SourceAt(plan, plan.refs[t.src_begin], row, c0, v) : nullptr;
    if (only && plan.local_sums && plan.weights[t.src_begin] == 1.0) {
      for (uint32_t k = 0; k < t.dst_count; ++k) std::memcpy(dst(k), only, c1 - c0);
      continue;
    }
    if (only && dtype != DType::F16) {
      // One weighted row (MoE combine's backward, d_expert_y): the product
      // stored in one pass, as the sum from zero below would store it.
      ScaleRow(dtype, dst(0), only, plan.weights[t.src_begin], n);
      for (uint32_t k = 1; k < t.dst_count; ++k) std::memcpy(dst(k), dst(0), c1 - c0);
      continue;
    }
    // The sum accumulates in the first destination itself when the rows are
    // of the accumulation type (float32, float64: storing it would be a
    // copy, a pass over the row for nothing), else in the thread's scratch.
    // In place assumes no destination is a source, as no plan's is (outputs
    // and comm buffers are never an op's inputs).
    double* const scratch = SumScratch(n, 3);
    const bool in_place = dtype == DType::F32 || dtype == DType::F64;
    void* const acc = in_place ? static_cast<void*>(dst(0)) : scratch;
    for (uint32_t k = 0; k < t.src_count; ++k) {
      const BlockRef& b = plan.refs[t.src_begin + k];
      const double w = plan.weights[t.src_begin + k];
      if (const char* at = SourceAt(plan, b, row, c0, v)) {
        (k == 0 ? StartSumRow : AxpyRow)(dtype, acc, at, w, n);  // the first stored: no zeroing pass
      } else {
        const Transfer& pt = v.producer->transfers[v.producer_first[b.rank] + (b.block - plan.in_blocks)];
        AddProduced(*v.producer, pt, row, c0, n, w, v, acc, k == 0, scratch + n, scratch + 2 * n);
      }
    }
    if (in_place) {
      for (uint32_t k = 1; k < t.dst_count; ++k) std::memcpy(dst(k), acc, c1 - c0);
    } else {
      for (uint32_t k = 0; k < t.dst_count; ++k) StoreSum(dtype, dst(k), acc, n);
    }
  }
}

// Columns [c0, c1) of one transfer of a dot plan, every row: whole products
// (Partition keeps them on one lane), or a run of zeroed values.
void RunDot(const Plan& plan, const Transfer& t, int64_t c0, int64_t c1, const View& v) {
  const int64_t value = plan.OutBlockBytes(), first = c0 / plan.block_bytes;
  for (int64_t row = 0; row < v.rows; ++row) {
    auto dst = [&](uint32_t k) {
      const BlockRef& b = plan.refs[t.dst_begin + k];
      return v.out[b.rank] + row * v.out_row_stride + (b.block + first) * value;
    };
    if (t.src_count == 0) {
      for (uint32_t k = 0; k < t.dst_count; ++k) std::memset(dst(k), 0, plan.OutBytes(c1 - c0));
      continue;
    }
    const char* a = SourceAt(plan, plan.refs[t.src_begin], row, c0, v);
    const char* b = SourceAt(plan, plan.refs[t.src_begin + 1], row, c0, v);
    const int64_t n = (c1 - c0) / static_cast<int64_t>(DTypeSize(plan.dtype));
    const double f64 = DotRow(plan.dtype, a, b, n);
    const float f32 = static_cast<float>(f64);  // exact: a float32 sum
    for (uint32_t k = 0; k < t.dst_count; ++k) std::memcpy(dst(k), value == 8 ? static_cast<const void*>(&f64) : &f32, value);
  }
}

void RunGeneral(const Plan& plan, uint32_t transfer, int64_t c0, int64_t c1, const View& v);
// A fan-out copy goes to every destination this many bytes at a time (the
// source's strip stays in cache between them).
constexpr int64_t kCopyStripBytes = 64 << 10;

// Moves columns [c0, c1) of one transfer, every row.
void RunColumns(const Plan& plan, uint32_t transfer, int64_t c0, int64_t c1, const View& v) {
  if (plan.dot) return RunDot(plan, plan.transfers[transfer], c0, c1, v);
  if (plan.weighted) return RunWeighted(plan, plan.transfers[transfer], c0, c1, v);
  const Transfer& one = plan.transfers[transfer];
  const int64_t len = c1 - c0;
  if (!plan.is_reduction() && one.src_count <= 1 && (one.dst_count == 1 || len <= kCopyStripBytes)) {
    // A copy or zeros to one destination (all_to_all, ppermute, gathers), or
    // a few blocks to each of several (MoE dispatch's rows and empty rows,
    // ten thousand an op, whose source stays in cache from one destination
    // to the next): no pointer tables, and small moves inline.
    const BlockRef* const dst = &plan.refs[one.dst_begin];
    const BlockRef* const from = one.src_count == 0 ? nullptr : &plan.refs[one.src_begin];
    const char* const src = from ? v.in[from->rank] + from->block * v.block_stride + c0 : nullptr;
    for (uint32_t k = 0; k < one.dst_count; ++k) {
      char* const to = v.out[dst[k].rank] + dst[k].block * v.block_stride + c0;
      if (src) {
        CopyRows(to, src, len, v);
      } else {
        for (int64_t row = 0; row < v.rows; ++row) std::memset(to + row * v.out_row_stride, 0, len);
      }
    }
    return;
  }
  RunGeneral(plan, transfer, c0, c1, v);
}

// RunColumns' general case: any sources to any destinations, through
// pointer tables. Apart, so the row kernels' paths (a transfer each, tens of
// thousands per MoE op) do not set up its 8 KiB frame every call: inlined
// into RunColumns it was a sixth of the backward's run beside its kernels.
__attribute__((noinline)) void RunGeneral(const Plan& plan, uint32_t transfer, int64_t c0, int64_t c1,
                                          const View& v) {
  const void* srcs[512];
  void* dsts[512];
  std::vector<const void*> srcs_heap;
  std::vector<void*> dsts_heap;
  const Transfer& t = plan.transfers[transfer];
  const int64_t len = c1 - c0, local = c0;
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
                 len / DTypeSize(plan.dtype), v.streaming);
    } else {
      // Copy in strips so a multi-destination source stays in cache.
      for (int64_t off = 0; off < len; off += kCopyStripBytes) {
        int64_t n = std::min(kCopyStripBytes, len - off);
        for (uint32_t k = 0; k < t.dst_count; ++k)
          CopyBytes(static_cast<char*>(dp[k]) + off, static_cast<const char*>(sp[0]) + off, n, v.streaming);
      }
    }
  }
}

// The `count` copies of a strided move; kLen > 0: each is kLen bytes, one row.
template <int64_t kLen>
inline void RunStrided(const Move& m, const View& v) {
  int32_t sr = m.src_rank, sb = m.src_block, dr = m.dst_rank, db = m.dst_block;
  for (int32_t k = 0; k < m.count; ++k) {
    char* dst = v.out[dr] + db * v.block_stride + m.col;
    const char* src = v.in[sr] + sb * v.block_stride + m.col;
    if constexpr (kLen > 0) std::memcpy(dst, src, kLen);
    else CopyRows(dst, src, m.len, v);
    sr += m.src_rank_step, sb += m.src_block_step;
    dr += m.dst_rank_step, db += m.dst_block_step;
  }
}

// Each lane task of host chunk `chunk` its bytes (per row, x rows), as the
// partition gave them: what a chunk run as moves, or not run at all (a
// producer fused into its reader), credits its lanes.
void CreditTasks(const Plan& plan, uint64_t chunk, const std::vector<int32_t>& devices, int64_t rows,
                 std::vector<Stats::LaneBytes>* lane_bytes) {
  for (uint32_t i = plan.chunk_starts[chunk]; i < plan.chunk_starts[chunk + 1]; ++i) {
    const LaneTask& task = plan.tasks[i];
    if (task.bytes > 0) lane_bytes->push_back({devices[task.npu], task.lane, task.bytes * rows});
  }
}

// Host chunk `chunk` of a copy-only plan over the whole message: its resolved
// moves (Plan::moves); credits each lane its bytes.
void RunMoves(const Plan& plan, uint64_t chunk, const View& v, const std::vector<int32_t>& devices,
                 std::vector<Stats::LaneBytes>* lane_bytes) {
  for (uint32_t i = plan.move_starts[chunk]; i < plan.move_starts[chunk + 1]; ++i) {
    const Move& m = plan.moves[i];
    if (v.rows == 1 && m.len == 4) {
      RunStrided<4>(m, v);  // a 384-rank all_to_all of floats: keep the loop tight
    } else if (v.rows == 1 && m.len == 8) {
      RunStrided<8>(m, v);
    } else {
      RunStrided<0>(m, v);
    }
  }
  CreditTasks(plan, chunk, devices, v.rows, lane_bytes);
}

// Host chunk `chunk` of any plan: the chunk's pieces
// as long column runs. Consecutive lanes of an NPU cut one transfer into
// neighbouring ranges, and running each range on its own restarts every
// source stream (rs 4 MB per rank over 48 lanes: 15 % slower than over 2).
void RunPieces(const Plan& plan, uint64_t chunk, const View& v, const std::vector<int32_t>& devices,
               std::vector<Stats::LaneBytes>* lane_bytes) {
  uint32_t run_transfer = 0;
  int64_t run_c0 = 0, run_c1 = 0;  // the open run; empty when run_c1 == run_c0
  for (uint32_t i = plan.chunk_starts[chunk]; i < plan.chunk_starts[chunk + 1]; ++i) {
    const LaneTask& task = plan.tasks[i];
    int64_t touched = 0;
    for (uint32_t pi = task.piece_begin; pi < task.piece_end; ++pi) {
      const Piece& piece = plan.pieces[pi];
      const Transfer& t = plan.transfers[piece.transfer];
      const int64_t c0 = piece.col_begin, c1 = piece.col_end;
      if (c1 <= c0) continue;
      touched += plan.PieceBytes(t, c1 - c0) * v.rows;
      if (piece.transfer == run_transfer && c0 == run_c1 && run_c1 > run_c0) {
        run_c1 = c1;  // the next lane's range continues the run
        continue;
      }
      // The transfer after the one this piece opens, two ahead of the one
      // run next: one ahead came too late (MoE combine's plan ran 14 %
      // slower than without; two ahead, as fast as its fused engine was).
      if ((plan.weighted || plan.dot) && piece.transfer + 1 < plan.transfers.size())
        PrefetchSources(plan, piece.transfer + 1, 0, plan.Columns(plan.transfers[piece.transfer + 1]), v);
      if (run_c1 > run_c0) RunColumns(plan, run_transfer, run_c0, run_c1, v);
      run_transfer = piece.transfer;
      run_c0 = c0;
      run_c1 = c1;
    }
    if (touched > 0) lane_bytes->push_back({devices[task.npu], task.lane, touched});
  }
  if (run_c1 > run_c0) RunColumns(plan, run_transfer, run_c0, run_c1, v);
}

// The exchange as a phase: one task per host chunk of lane tasks. Each lane
// is credited with what it moves (the emulated core's or engine's work), the
// stats with the bytes the chunk carries between ranks and copies within one
// (Plan::chunk_bytes); the host runs a copy-only plan's resolved moves when
// it has them, else the chunk's pieces.
// `devices` is the communicator's list: communicators live as long as the process.
Phase ExchangePhase(std::shared_ptr<const Plan> plan, View v, const std::vector<int32_t>* devices,
                    bool direct) {
  Phase phase;
  phase.count = plan->chunk_starts.size() - 1;
  phase.run = [plan, v = std::move(v), devices, direct](uint64_t chunk) {
    // Reused by the thread: a fresh vector grew (allocated) several times per chunk.
    thread_local std::vector<Stats::LaneBytes> lane_bytes;
    lane_bytes.clear();
    if (!plan->moves.empty()) RunMoves(*plan, chunk, v, *devices, &lane_bytes);
    else RunPieces(*plan, chunk, v, *devices, &lane_bytes);
    if (v.streaming) StoreFence();
    Stats& stats = GlobalStats();
    stats.AddLaneBytes(plan->on_sdma, plan->lanes_per_npu, lane_bytes);
    const ChunkBytes& bytes = plan->chunk_bytes[chunk];
    stats.AddExchanged(bytes.carried * v.rows, direct);
    stats.AddLocal(bytes.local * v.rows);
  };
  return phase;
}

// A plan's partition by NPU (PlanPartition::Npu) as `tasks` tasks of a
// phase, task i taking NPUs [i n / tasks, (i + 1) n / tasks): a few per
// worker, so a group of hundreds of small NPUs' splits is not as many
// claims of the executor's lock.
uint64_t PartitionTasks(int npus) { return static_cast<uint64_t>(std::min(npus, 4 * HostWorkers())); }
void RunPartitionTask(PlanPartition& steps, int npus, uint64_t tasks, uint64_t i) {
  const int first = static_cast<int>(i * npus / tasks), end = static_cast<int>((i + 1) * npus / tasks);
  for (int npu = first; npu < end; ++npu) steps.Npu(npu);
}

// The ranks' own buffers, as one view for the whole message.
View DirectView(const Slot& s, const OpParams& p) {
  View v;
  v.in.reserve(s.n);
  v.out.reserve(s.n);
  for (int r = 0; r < s.n; ++r) {
    v.in.push_back(static_cast<const char*>(s.ptrs[r][0]));
    v.out.push_back(static_cast<char*>(s.ptrs[r][1]));
  }
  v.rows = p.rows;
  v.in_row_stride = p.in_blocks * p.block_bytes;
  v.out_row_stride = p.out_blocks * p.block_bytes;
  v.block_stride = p.block_bytes;
  v.streaming = StreamsOutputs(p.rows * p.out_blocks * p.block_bytes, s.n);
  return v;
}

// Columns [lo, lo + w) of blocks [b0, b1) of every row, between a user
// buffer (blocks of m bytes) and a comm buffer (blocks of w bytes): one
// contiguous range per row when the window is the whole block.
void StageBlocks(const char* from, char* to, bool into_comm, int64_t rows, int64_t blocks, int64_t b0,
                 int64_t b1, int64_t m, int64_t lo, int64_t w) {
  for (int64_t row = 0; row < rows; ++row) {
    const int64_t first = row * blocks + b0;
    if (w == m) {
      std::memcpy(to + first * m, from + first * m, (b1 - b0) * m);
      continue;
    }
    for (int64_t b = first; b < first + (b1 - b0); ++b) {
      if (into_comm) std::memcpy(to + b * w, from + b * m + lo, w);
      else std::memcpy(to + b * m + lo, from + b * w, w);
    }
  }
}

// One round's plan, at the round's column width; called once per round, in
// order, `last` on the final one (which may take what it was built from).
using RoundPlan = std::function<std::shared_ptr<const Plan>(int64_t width, bool last)>;

// The vendor-library baseline: each rank's data is copied into its comm
// buffer, the exchange runs between comm buffers, and results are copied out,
// in rounds of columns when the message is larger than the buffer. Each
// round exchanges its window as a whole op of that width (its own plan,
// `round_plan(width, last)`), so every rank and lane shares every round's work, as
// a vendor library's rounds do. Every block is staged, or `runs`' when given.
// Every copy is one task of a phase; phases run in order. With a `pending`
// round (PlanJob's plans, built at the rendezvous), the op runs in one round
// whose remaining set-up runs in parallel, as more work of the staging in.
struct PendingRound {
  // Partitions the round's plan, by NPU, as more tasks of the staging in.
  std::shared_ptr<PlanPartition> partition;
  // Each rank's staging in first reads its `runs` off these (RankStagedRuns);
  // freed once the staging in is over.
  std::shared_ptr<StagedMarks> marks;
};
Status BufferCentricJob(const Slot& s, const CommBuffers& comm, Communicator* communicator,
                        const OpParams& p, const RoundPlan& round_plan,
                        std::shared_ptr<StagedRuns> runs, PendingRound pending, Job* job) {
  const int64_t m = p.block_bytes;
  const int64_t max_blocks = std::max(p.in_blocks, p.out_blocks);
  const int64_t window = CommWindowBytes(p);
  if (window <= 0)
    return Status::Error("comm_buffer_bytes=" + std::to_string(p.comm_buffer_bytes) +
                         " cannot hold one column of " + std::to_string(p.rows * max_blocks) +
                         " blocks; raise strata.config(comm_buffer_bytes=...)");
  std::vector<const char*> user_in;
  std::vector<char*> user_out;
  View v;
  v.rows = p.rows;
  for (int r = 0; r < s.n; ++r) {
    user_in.push_back(static_cast<const char*>(s.ptrs[r][0]));
    user_out.push_back(static_cast<char*>(s.ptrs[r][1]));
    v.in.push_back(comm.in[r]);
    v.out.push_back(comm.out[r]);
  }
  const int64_t rows = p.rows, in_blocks = p.in_blocks, out_blocks = p.out_blocks;
  const std::vector<int32_t>* devices = &communicator->devices;  // lives as long as the process
  if (pending.partition && window < m)
    return Status::Error("a plan partitioned while staging in must run in one round");
  for (int64_t lo = 0; lo < m; lo += window) {
    const int64_t w = std::min(window, m - lo);
    std::shared_ptr<const Plan> plan = round_plan(w, /*last=*/lo + w >= m);
    v.block_stride = w;  // the round's plan addresses the window's own columns
    v.in_row_stride = in_blocks * w;
    v.out_row_stride = out_blocks * w;
    // Stage in: rank r's columns [lo, lo+w) of every block (or run) and row.
    Phase stage_in;
    const int n = s.n;
    const uint64_t split = pending.partition ? PartitionTasks(n) : 0;
    stage_in.count = n + split;
    stage_in.run = [=](uint64_t r) {
      if (r >= static_cast<uint64_t>(n)) return RunPartitionTask(*pending.partition, n, split, r - n);
      if (pending.marks) RankStagedRuns(*pending.marks, static_cast<int>(r), runs.get());
      char* comm_in = const_cast<char*>(v.in[r]);
      int64_t blocks = in_blocks;
      if (!runs) {
        StageBlocks(user_in[r], comm_in, true, rows, in_blocks, 0, in_blocks, m, lo, w);
      } else {
        blocks = 0;
        for (const BlockRun& run : runs->in[r]) {
          StageBlocks(user_in[r], comm_in, true, rows, in_blocks, run.begin, run.end, m, lo, w);
          blocks += run.end - run.begin;
        }
      }
      GlobalStats().AddStaged((*devices)[r], rows * blocks * w);
    };
    Phase stage_out;
    stage_out.count = s.n;
    stage_out.run = [=](uint64_t r) {
      int64_t blocks = out_blocks;
      if (!runs) {
        StageBlocks(v.out[r], user_out[r], false, rows, out_blocks, 0, out_blocks, m, lo, w);
      } else {
        // One ordered pass over the rank's output (StagedRuns::copy_out).
        const char* comm_out = v.out[r];
        char* out = user_out[r];
        for (int64_t row = 0; row < rows; ++row) {
          const int64_t first = row * out_blocks;
          for (const StagedRuns::CopyOut& c : runs->copy_out[r]) {
            char* dst = out + (first + c.dst_block) * m + lo;
            if (c.src_block < 0) {
              if (w == m) std::memset(dst, 0, c.span * m);
              else for (int64_t b = 0; b < c.span; ++b) std::memset(dst + b * m, 0, w);
              continue;
            }
            const char* src = comm_out + (first + c.src_block) * w;
            if (w == m) std::memcpy(dst, src, c.span * m);
            else for (int64_t b = 0; b < c.span; ++b) std::memcpy(dst + b * m, src + b * w, w);
          }
        }
        blocks = runs->crossed[r];
        const int64_t copied = runs->copied[r];
        GlobalStats().AddLocal(rows * copied * w);
      }
      GlobalStats().AddStaged((*devices)[r], rows * blocks * w);
    };
    if (pending.partition) {
      // The exchange joins once the last NPU's split is in (Splice puts it
      // before the staging out).
      stage_in.then = [pending, plan, v, devices](Job* more) {
        pending.partition->Finish();
        if (pending.marks) *pending.marks = StagedMarks{};  // every rank has its runs
        more->phases.push_back(ExchangePhase(plan, v, devices, /*direct=*/false));
      };
      job->phases.push_back(std::move(stage_in));
    } else {
      job->phases.push_back(std::move(stage_in));
      job->phases.push_back(ExchangePhase(plan, v, &communicator->devices, /*direct=*/false));
    }
    job->phases.push_back(std::move(stage_out));
  }
  return Status::Ok();
}

// buffer_centric's job on a set of the communicator's comm buffers, which go
// back to it when the job is done (or failed to be made).
Status StagedJob(const Slot& s, Communicator* comm, const OpParams& p,
                 const RoundPlan& round_plan, std::shared_ptr<StagedRuns> runs,
                 PendingRound pending, Job* job) {
  std::shared_ptr<CommBuffers> buffers = comm->AcquireBuffers(p.comm_buffer_bytes);
  if (!buffers)
    return Status::Error("cannot allocate communication buffers of comm_buffer_bytes=" +
                         std::to_string(p.comm_buffer_bytes) + " per rank; lower " +
                         "strata.config(comm_buffer_bytes=...)");
  auto release = [comm, buffers] { comm->ReleaseBuffers(std::make_unique<CommBuffers>(std::move(*buffers))); };
  Status st = BufferCentricJob(s, *buffers, comm, p, round_plan, std::move(runs), std::move(pending), job);
  if (!st.ok) release();
  else job->on_done = release;
  return st;
}

// `buffers` as a view for `plan`'s layout, the producer's inputs included
// (`buffers.producer_in`, or else `buffers.in`) when `with_producer`.
View PlanView(const Plan& plan, const PlanBuffers& buffers, bool with_producer) {
  View v;
  for (const void* in : buffers.in) v.in.push_back(static_cast<const char*>(in));
  for (const void* scratch : buffers.scratch) v.scratch.push_back(static_cast<const char*>(scratch));
  for (void* out : buffers.out) v.out.push_back(static_cast<char*>(out));
  v.in_row_stride = plan.in_blocks * plan.block_bytes;
  v.out_row_stride = plan.out_blocks * plan.OutBlockBytes();
  v.block_stride = plan.block_bytes;
  if (with_producer)
    for (const void* in : buffers.producer_in.empty() ? buffers.in : buffers.producer_in)
      v.producer_in.push_back(static_cast<const char*>(in));
  return v;
}

// Runs host chunk `chunk` of a partitioned plan over `v`, crediting its lanes
// and bytes (`staging`: what it writes is bytes_staged, its lanes uncredited).
void RunPlanChunk(const Plan& plan, uint64_t chunk, const View& v, const std::vector<int32_t>& devices, bool direct,
                  bool staging) {
  thread_local std::vector<Stats::LaneBytes> lane_bytes;  // reused by the thread
  lane_bytes.clear();
  RunPieces(plan, chunk, v, devices, &lane_bytes);
  Stats& stats = GlobalStats();
  const ChunkBytes& bytes = plan.chunk_bytes[chunk];
  if (staging) {
    stats.bytes_staged += bytes.written;
  } else {
    stats.AddLaneBytes(plan.on_sdma, plan.lanes_per_npu, lane_bytes);
  }
  stats.AddExchanged(bytes.carried, direct);
  stats.AddLocal(bytes.local);
}

// Credits host chunk `chunk` of a plan whose work ran elsewhere (a producer
// fused into its reader) as running it would have.
void CreditPlanChunk(const Plan& plan, uint64_t chunk, const std::vector<int32_t>& devices, bool direct) {
  thread_local std::vector<Stats::LaneBytes> lane_bytes;
  lane_bytes.clear();
  CreditTasks(plan, chunk, devices, 1, &lane_bytes);
  Stats& stats = GlobalStats();
  stats.AddLaneBytes(plan.on_sdma, plan.lanes_per_npu, lane_bytes);
  stats.AddExchanged(plan.chunk_bytes[chunk].carried, direct);
  stats.AddLocal(plan.chunk_bytes[chunk].local);
}
}  // namespace

Phase PlanPhase(std::shared_ptr<const Plan> plan, const PlanBuffers& buffers, std::vector<int32_t> devices,
                bool direct, bool staging, std::shared_ptr<const Plan> producer,
                std::vector<uint32_t> producer_first, bool credit_producer) {
  View v = PlanView(*plan, buffers, producer != nullptr);
  auto first = std::make_shared<const std::vector<uint32_t>>(std::move(producer_first));
  if (producer) {
    v.producer = producer.get();
    v.producer_first = first->data();
  }
  const uint64_t own = plan->chunk_starts.size() - 1;
  Phase phase;
  phase.count = own + (producer && credit_producer ? producer->chunk_starts.size() - 1 : 0);
  phase.run = [plan, producer, first, v = std::move(v), devices = std::move(devices), direct, staging,
               own](uint64_t chunk) {
    // The fused producer's chunks: their work ran inside the reader's; their
    // lanes and bytes are credited as their own phase's would be.
    if (chunk >= own) return CreditPlanChunk(*producer, chunk - own, devices, direct);
    RunPlanChunk(*plan, chunk, v, devices, direct, staging);
  };
  return phase;
}

namespace {
// Transfers [begin, end) of a copy plan (no weights, dots or reductions)
// over one row, cached stores: each source's bytes to each destination, or
// zeros. RunColumns' own checks and calls per transfer were a fifth of a
// MoE dispatch owner's run, whose transfers are a row or a few each.
void CopyRange(const Plan& plan, uint32_t begin, uint32_t end, const View& v) {
  const Transfer* const transfers = plan.transfers.data();
  const BlockRef* const refs = plan.refs.data();
  const int64_t stride = v.block_stride;
  for (uint32_t i = begin; i < end; ++i) {
    const Transfer& t = transfers[i];
    const size_t len = static_cast<size_t>(plan.Columns(t));
    const BlockRef* dst = refs + t.dst_begin;
    if (t.src_count == 0) {
      for (uint32_t k = 0; k < t.dst_count; ++k) std::memset(v.out[dst[k].rank] + dst[k].block * stride, 0, len);
      continue;
    }
    if (t.src_count > 1 || (t.dst_count > 1 && static_cast<int64_t>(len) > kCopyStripBytes)) {
      RunColumns(plan, i, 0, static_cast<int64_t>(len), v);  // strips for a large fan-out
      continue;
    }
    const char* const src = v.in[refs[t.src_begin].rank] + refs[t.src_begin].block * stride;
    for (uint32_t k = 0; k < t.dst_count; ++k) std::memcpy(v.out[dst[k].rank] + dst[k].block * stride, src, len);
  }
}
}  // namespace

Phase OrderedPlanPhase(std::vector<PlanGroup> groups, uint64_t tasks,
                       std::function<void(uint64_t task, const TransferRunner& runner)> order) {
  struct Group {
    std::vector<FusedPlan> plans;
    View v;
  };
  auto shared = std::make_shared<std::vector<Group>>();
  for (PlanGroup& g : groups) {
    View v = g.plans.empty() ? View() : PlanView(*g.plans[0].plan, g.buffers, /*with_producer=*/true);
    shared->push_back({std::move(g.plans), std::move(v)});
  }
  // Each thread runs from its own copies of the views, the producer set per
  // plan: a view per plan was the ranks' pointers once per rank (n^2 of them
  // at 384 ranks). The copies are made once per thread per phase.
  static std::atomic<uint64_t> next_id{0};
  const uint64_t id = ++next_id;
  struct Runner final : TransferRunner {
    const std::vector<Group>* groups;
    std::vector<View>* views;
    void Run(size_t g, size_t p, uint32_t transfer) const override {
      const Plan& plan = *(*groups)[g].plans[p].plan;
      RunColumns(plan, transfer, 0, plan.Columns(plan.transfers[transfer]), ViewFor(g, p));
    }
    void RunRange(size_t g, size_t p, uint32_t begin, uint32_t end) const override {
      const Plan& plan = *(*groups)[g].plans[p].plan;
      const View& v = ViewFor(g, p);
      // A weighted or dot plan's sources are rows at random places: the next
      // transfer's are asked for before this one runs (as RunPieces does).
      const bool gather = plan.weighted || plan.dot;
      end = std::min(end, static_cast<uint32_t>(plan.transfers.size()));
      if (!gather && !plan.is_reduction() && v.rows == 1 && !v.streaming) return CopyRange(plan, begin, end, v);
      for (uint32_t t = begin; t < end; ++t) {
        if (gather && t + 1 < end) PrefetchSources(plan, t + 1, 0, plan.Columns(plan.transfers[t + 1]), v);
        RunColumns(plan, t, 0, plan.Columns(plan.transfers[t]), v);
      }
    }
    void RunAll(size_t g, size_t p) const override {
      RunRange(g, p, 0, static_cast<uint32_t>((*groups)[g].plans[p].plan->transfers.size()));
    }
    // Group g's view with plan p's producer.
    const View& ViewFor(size_t g, size_t p) const {
      const FusedPlan& f = (*groups)[g].plans[p];
      View& v = (*views)[g];
      v.producer = f.producer.get();
      v.producer_first = f.first ? f.first->data() : nullptr;
      return v;
    }
  };
  Phase phase;
  phase.count = tasks;
  phase.run = [shared, id, order = std::move(order)](uint64_t task) {
    thread_local std::vector<View> mine;
    thread_local uint64_t mine_id = 0;
    if (mine_id != id) {
      mine.clear();
      for (const Group& g : *shared) mine.push_back(g.v);
      mine_id = id;
    }
    Runner runner;
    runner.groups = shared.get();
    runner.views = &mine;
    order(task, runner);
  };
  return phase;
}

void CreditLanes(const LaneCredit& credit, const std::vector<int32_t>& devices, bool direct) {
  thread_local std::vector<Stats::LaneBytes> lane_bytes;
  lane_bytes.clear();
  for (const LaneTask& task : credit.tasks)
    if (task.bytes > 0) lane_bytes.push_back({devices[task.npu], task.lane, task.bytes});
  Stats& stats = GlobalStats();
  stats.AddLaneBytes(credit.on_sdma, credit.lanes_per_npu, lane_bytes);
  stats.AddExchanged(credit.bytes.carried, direct);
  stats.AddLocal(credit.bytes.local);
}

bool RunsInline(const OpParams& p) {
  return RunsInline(p.mode, p.rows * (p.in_blocks + p.out_blocks) * p.block_bytes, p.group_size,
                    kHostChunkBytes);
}

void RunCollectiveAsync(const OpParams& p, const RankCall& c, std::function<void(const Status&)> done) {
  const Participant who = c.As(p.name(), p.group_size);
  if (!p.builder || !p.builder->add_transfers)
    return done(Status::Error(std::string(who.opname) + ": the op has no plan builder (OpParams made "
                              "without algorithms/op_registry.h's MakeOpParams)"));
  if (c.rank < 0 || c.rank >= p.group_size)
    return done(Status::Error(std::string(who.opname) + ": rank " + std::to_string(c.rank) +
                              " is out of range for a group of " + std::to_string(p.group_size)));
  if (OpObserver* observer = ActiveObserver()) done = observer->OnCollective(p, c, std::move(done));
  const int64_t in_bytes = p.rows * p.in_blocks * p.block_bytes;
  const int64_t out_bytes = p.rows * p.out_blocks * p.block_bytes;
  if (p.mode == Mode::kStrata) {
    // Registration-on-allocation makes these hits; an XLA temporary is
    // registered on first use and cached, and that miss is counted.
    if (in_bytes > 0) GlobalRegistry().LookupOrRegister(c.device, reinterpret_cast<uintptr_t>(c.in), in_bytes, /*operand=*/true);
    if (out_bytes > 0) GlobalRegistry().LookupOrRegister(c.device, reinterpret_cast<uintptr_t>(c.out), out_bytes, /*operand=*/false);
    // XLA hands us a fresh output buffer every call; before anyone writes it,
    // back it with large pages as fabric registration would.
    Registry::PreferLargePages(c.out, out_bytes);
  }
  GlobalStats().ops++;
  JoinAsync(who, {const_cast<void*>(c.in), c.out}, p.Sign(), std::move(done),
            [&p](Slot& s, std::shared_ptr<Job>* job) -> Status {
              if (p.block_bytes == 0) return Status::Ok();
              Communicator* comm = GetCommunicator(s.devices);
              *job = std::make_shared<Job>();
              if (p.mode == Mode::kBufferCentric) {
                auto round_plan = [comm, &p](int64_t width, bool /*last*/) {
                  OpParams round = p;
                  round.block_bytes = width;
                  round.movement_lanes = MovesOnSdma(p) ? 1 : 0;  // the op's choice, every round
                  return comm->GetPlan(round);
                };
                return StagedJob(s, comm, p, round_plan, nullptr, {}, job->get());
              }
              Phase exchange = ExchangePhase(comm->GetPlan(p), DirectView(s, p), &comm->devices, /*direct=*/true);
              if (RunsInline(p)) {
                for (uint64_t i = 0; i < exchange.count; ++i) exchange.run(i);
              } else {
                (*job)->phases.push_back(std::move(exchange));
              }
              return Status::Ok();
            });
}

void AddRankBytes(const Plan& plan, std::vector<int64_t>* rank_bytes) {
  for (const Transfer& t : plan.transfers) {
    for (uint32_t k = 0; k < t.src_count; ++k) (*rank_bytes)[plan.refs[t.src_begin + k].rank] += plan.Columns(t);
    for (uint32_t k = 0; k < t.dst_count; ++k) (*rank_bytes)[plan.refs[t.dst_begin + k].rank] += plan.Columns(t);
  }
}

bool PlanMovesOnSdma(const Plan& plan, int64_t rows, int engines, double descriptor_us, double sdma_gbps) {
  if (plan.is_reduction()) return false;
  // The busiest rank's bytes read + written decide, as a collective's buffers do.
  std::vector<int64_t> rank_bytes(plan.num_ranks, 0);
  AddRankBytes(plan, &rank_bytes);
  const int64_t busiest = rank_bytes.empty() ? 0 : *std::max_element(rank_bytes.begin(), rank_bytes.end());
  return MovesOnSdma(rows * busiest, engines, descriptor_us, sdma_gbps);
}

namespace {

// Blocks [0, blocks) marked in `marked` as merged runs, ascending.
void MarkedRuns(const std::vector<uint8_t>& marked, std::vector<BlockRun>* runs) {
  const int64_t blocks = static_cast<int64_t>(marked.size());
  for (int64_t b = 0; b < blocks;) {
    if (!marked[b]) {
      ++b;
      continue;
    }
    const int64_t begin = b;
    while (b < blocks && marked[b]) ++b;
    runs->push_back({begin, b});
  }
}

}  // namespace

StagedMarks MarkStagedRuns(Plan* plan_ptr, StagedRuns* runs) {
  // In place: copying MoE's ten thousand transfers into a new plan cost as
  // much as marking them. Each transfer keeps its first destination on each
  // rank (they are listed together; its refs are compacted within its own
  // range), zero fills leave the transfer list.
  Plan& plan = *plan_ptr;
  const int n = plan.num_ranks;
  runs->in.assign(n, {});
  runs->crossed.assign(n, 0);
  runs->copied.assign(n, 0);
  runs->zeroed.assign(n, 0);
  runs->copy_out.assign(n, {});
  // Per rank: blocks read by the exchange (marked), and where each output
  // block comes from (its own block in the comm buffer when the exchange
  // writes it, the block that crossed for a local copy, kZero, or kUntouched),
  // read off as runs by RankStagedRuns (sorting MoE's ten thousand rows' runs
  // cost more than building its plan).
  StagedMarks marks;
  marks.read.assign(n, std::vector<uint8_t>(plan.in_blocks, 0));
  marks.source.assign(n, std::vector<int64_t>(plan.out_blocks, StagedMarks::kUntouched));
  std::vector<std::vector<uint8_t>>& read = marks.read;
  std::vector<std::vector<int64_t>>& source = marks.source;
  size_t kept = 0;
  for (size_t i = 0; i < plan.transfers.size(); ++i) {
    Transfer t = plan.transfers[i];
    BlockRef* dsts = plan.refs.data() + t.dst_begin;
    if (t.src_count == 0) {
      for (uint32_t k = 0; k < t.dst_count; ++k)
        std::fill_n(source[dsts[k].rank].begin() + dsts[k].block, t.span, StagedMarks::kZero);
      continue;
    }
    uint32_t carried = 0;
    for (uint32_t k = 0; k < t.dst_count; ++k) {
      const BlockRef dst = dsts[k];
      int64_t* from = source[dst.rank].data() + dst.block;
      if (carried > 0 && dst.rank == dsts[carried - 1].rank) {
        const int64_t src = dsts[carried - 1].block;
        for (uint32_t s = 0; s < t.span; ++s) from[s] = src + s;
        continue;
      }
      dsts[carried++] = dst;
      for (uint32_t s = 0; s < t.span; ++s) from[s] = dst.block + s;
    }
    const BlockRef* srcs = plan.refs.data() + t.src_begin;
    for (uint32_t k = 0; k < t.src_count; ++k)
      std::fill_n(read[srcs[k].rank].begin() + srcs[k].block, t.span, uint8_t{1});
    t.dst_count = carried;
    t.local_copies = 0;
    plan.transfers[kept++] = t;
  }
  plan.transfers.resize(kept);
  return marks;
}

void RankStagedRuns(const StagedMarks& marks, int r, StagedRuns* runs) {
  MarkedRuns(marks.read[r], &runs->in[r]);
  const std::vector<int64_t>& from = marks.source[r];
  const int64_t out_blocks = static_cast<int64_t>(from.size());
  std::vector<StagedRuns::CopyOut>& out = runs->copy_out[r];
  int64_t crossed = 0, copied = 0, zeroed = 0;
  for (int64_t b = 0; b < out_blocks;) {
    const int64_t first = from[b];
    if (first == StagedMarks::kUntouched) {
      ++b;
      continue;
    }
    // One run while the source stays contiguous (or stays a zero fill).
    const int64_t begin = b;
    if (first == StagedMarks::kZero) {
      while (b < out_blocks && from[b] == StagedMarks::kZero) ++b;
      zeroed += b - begin;
      out.push_back({begin, -1, b - begin});
      continue;
    }
    while (b < out_blocks && from[b] == first + (b - begin)) ++b;
    // Blocks that come from themselves crossed; the others are local copies.
    (first == begin ? crossed : copied) += b - begin;
    out.push_back({begin, first, b - begin});
  }
  runs->crossed[r] = crossed;
  runs->copied[r] = copied;
  runs->zeroed[r] = zeroed;
}

void PlanStagedRuns(Plan* plan, StagedRuns* runs) {
  const StagedMarks marks = MarkStagedRuns(plan, runs);
  for (int r = 0; r < plan->num_ranks; ++r) RankStagedRuns(marks, r, runs);
}

Status PlanJob(const Slot& s, Plan plan, OpParams p, std::shared_ptr<Job>* job) {
  *job = std::make_shared<Job>();
  if (plan.num_ranks != s.n)
    return Status::Error("a plan for " + std::to_string(plan.num_ranks) + " ranks given to a group of " +
                         std::to_string(s.n));
  if (p.block_bytes == 0) return Status::Ok();
  // The caller may have made PlanMovesOnSdma's choice already (MoE dispatch
  // sums the busiest rank's bytes in its parallel build: one walk fewer here).
  plan.on_sdma = p.movement_lanes >= 0 ? p.movement_lanes == 1 : PlanMovesOnSdma(plan, p.rows, p.engines);
  p.movement_lanes = plan.on_sdma ? 1 : 0;
  Communicator* comm = GetCommunicator(s.devices);
  const int lanes = plan.on_sdma ? p.engines : p.cores;
  if (p.mode == Mode::kBufferCentric) {
    auto runs = std::make_shared<StagedRuns>();
    auto marks = std::make_shared<StagedMarks>(MarkStagedRuns(&plan, runs.get()));
    auto base = std::make_shared<Plan>(std::move(plan));
    if (CommWindowBytes(p) >= p.block_bytes) {
      // One round (the usual case): its plan is split by NPU, and each rank's
      // staged runs read off, while the ranks stage in, not on the thread
      // that built it.
      PendingRound pending{std::make_shared<PlanPartition>(base.get(), lanes, p.planner), std::move(marks)};
      auto whole = [base](int64_t, bool) -> std::shared_ptr<const Plan> { return base; };
      return StagedJob(s, comm, p, whole, std::move(runs), std::move(pending), job->get());
    }
    for (int r = 0; r < base->num_ranks; ++r) RankStagedRuns(*marks, r, runs.get());
    // The last round takes the plan itself (no copy of it).
    auto round_plan = [base, lanes, &p](int64_t width, bool last) {
      Plan round = last ? std::move(*base) : *base;
      round.block_bytes = width;
      Partition(round, lanes, p.planner);
      return std::make_shared<const Plan>(std::move(round));
    };
    return StagedJob(s, comm, p, round_plan, std::move(runs), {}, job->get());
  }
  auto shared = std::make_shared<Plan>(std::move(plan));
  auto steps = std::make_shared<PlanPartition>(shared.get(), lanes, p.planner);
  View view = DirectView(s, p);
  const std::vector<int32_t>* devices = &comm->devices;
  if (RunsInline(p.mode, steps->bytes() * p.rows, 1, kHostChunkBytes)) {
    for (int npu = 0; npu < s.n; ++npu) steps->Npu(npu);
    steps->Finish();
    Phase exchange = ExchangePhase(shared, std::move(view), devices, /*direct=*/true);
    for (uint64_t i = 0; i < exchange.count; ++i) exchange.run(i);
    return Status::Ok();
  }
  // The split by NPU runs on the workers; the exchange follows it.
  Phase split;
  split.count = PartitionTasks(s.n);
  split.run = [steps, n = s.n, tasks = split.count](uint64_t i) { RunPartitionTask(*steps, n, tasks, i); };
  split.then = [steps, shared, view = std::move(view), devices](Job* more) {
    steps->Finish();
    more->phases.push_back(ExchangePhase(shared, view, devices, /*direct=*/true));
  };
  (*job)->phases.push_back(std::move(split));
  return Status::Ok();
}

Status RunCollective(const OpParams& p, const RankCall& c) {
  std::promise<Status> finished;
  std::future<Status> result = finished.get_future();
  RunCollectiveAsync(p, c, [&finished](const Status& st) { finished.set_value(st); });
  return result.get();
}

}  // namespace strata
