#include "model.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <queue>
#include <stdexcept>
#include <utility>

#include "../runtime/moe_shape.h"

namespace strata::model {

namespace {

constexpr double kBytesPerUsPerGbps = 1e3;  // 1 GB/s = 1e9 B/s = 1e3 B/us

// The plan a piece's transfer belongs to.
const Plan& PlanOf(const ModelPhase& phase, const ModelPiece& piece) {
  return piece.plan ? *piece.plan : *phase.plan;
}

int32_t NpuOf(const Program& prog, int rank) {
  return prog.rank_npu.empty() ? rank : prog.rank_npu[rank];
}

// A group sync, as the plan needs it: the (owner, executor) pairs of ranks
// where the executor's pieces touch the owner's memory. Before a phase every
// owner tells each of its executors that its buffers are ready; after one,
// every executor tells each owner it touched that it is done (its reads of
// the inputs and writes into the outputs are over). Each signal is a small
// UB write: one message on a lane of the phase's kind, then one path latency.
// A rank spreads its k signals over its L lanes, so it is done signalling at
// ceil(k / L) * o + the longest latency of its signals, and the sync ends
// when the last rank's signals have landed. This is a flat barrier over the
// pairs the plan really has (N - 1 peers per rank for all_reduce or
// all_to_all, one for a ring ppermute): it is what the exchange needs (each
// piece waits only for the ranks it touches), and with L lanes signalling in
// parallel it costs ceil((N - 1) / L) messages where a dissemination barrier
// costs ceil(log2 N) rounds of a message and a latency each (at N = 384 on
// 48 lanes: 8 messages + one latency, against 9 latencies).
using Pairs = std::vector<std::pair<int32_t, int32_t>>;  // (owner, executor), distinct

Pairs PhasePairs(const ModelPhase& phase, int n) {
  std::vector<uint8_t> seen(static_cast<size_t>(n) * n, 0);
  Pairs out;
  auto touch = [&](int owner, int executor) {
    if (owner == executor) return;
    uint8_t& s = seen[static_cast<size_t>(owner) * n + executor];
    if (!s) {
      s = 1;
      out.push_back({owner, executor});
    }
  };
  for (const ModelPiece& p : phase.pieces) {
    if (p.transfer >= 0) {
      const Plan& plan = PlanOf(phase, p);
      const Transfer& tr = plan.transfers[p.transfer];
      if (p.bytes <= 0) continue;
      for (uint32_t k = 0; k < tr.src_count; ++k) touch(plan.refs[tr.src_begin + k].rank, p.rank);
      for (uint32_t k = 0; k < tr.dst_count; ++k) touch(plan.refs[tr.dst_begin + k].rank, p.rank);
    } else {
      for (uint32_t k = p.io_begin; k < p.io_end; ++k)
        if (phase.io[k].bytes > 0) touch(phase.io[k].rank, p.rank);
    }
  }
  return out;
}

// from_owner: start signals (owner -> executor); else completion signals.
double SignalUs(const Pairs& pairs, bool from_owner, int n, int lanes, double message_us,
                const std::vector<double>& path_lat) {
  std::vector<int64_t> count(n, 0);
  std::vector<double> lat(n, 0.0);
  for (const auto& [owner, executor] : pairs) {
    const int from = from_owner ? owner : executor, to = from_owner ? executor : owner;
    count[from]++;
    lat[from] = std::max(lat[from], path_lat[static_cast<size_t>(from) * n + to]);
  }
  double worst = 0;
  const int64_t l = std::max(1, lanes);
  for (int r = 0; r < n; ++r)
    if (count[r] > 0) worst = std::max(worst, static_cast<double>((count[r] + l - 1) / l) * message_us + lat[r]);
  return worst;
}

// Resources, each a FIFO queue: when it is next free and how long it served.
struct Queue {
  double free_us = 0, busy_us = 0;
};

}  // namespace

void PathOf(const Machine& m, const Program& prog, int a, int b, double* lat_us, double* gbps) {
  const int32_t pa = NpuOf(prog, a), pb = NpuOf(prog, b);
  const int ranks_per_node = m.npus_per_node * m.ranks_per_npu;
  if (pa / ranks_per_node != pb / ranks_per_node) {
    *lat_us = m.inter_latency_us;
    *gbps = m.inter_gbps;
  } else if (pa / m.ranks_per_npu != pb / m.ranks_per_npu) {
    *lat_us = m.intra_latency_us;
    *gbps = m.intra_gbps;
  } else {
    *lat_us = m.die_latency_us;
    *gbps = m.die_gbps;
  }
}

Result Simulate(const Program& prog, const Machine& m, bool keep_slices, size_t max_slices) {
  const int n = prog.num_ranks;
  const int lanes = prog.cores + prog.engines;
  Result res;
  res.lane_busy_us.assign(static_cast<size_t>(n) * lanes, 0.0);
  res.egress_bytes.assign(n, 0);
  res.lane_bytes.assign(static_cast<size_t>(n) * lanes, 0);
  res.staged_bytes.assign(n, 0);
  res.ingress_bytes.assign(n, 0);
  if (n <= 0) return res;

  // Resource ids: [0, n) HBM, [n, 2n) egress, [2n, 3n) ingress, then the
  // n*n ordered paths. Their bandwidths in bytes per us.
  const size_t kHbm = 0, kEgress = n, kIngress = 2 * static_cast<size_t>(n), kPath = 3 * static_cast<size_t>(n);
  std::vector<Queue> queues(kPath + static_cast<size_t>(n) * n);
  std::vector<double> path_lat(static_cast<size_t>(n) * n), path_bw(static_cast<size_t>(n) * n);
  double min_lat = 1e300;
  for (int a = 0; a < n; ++a)
    for (int b = 0; b < n; ++b) {
      if (a == b) continue;
      double lat, gbps;
      PathOf(m, prog, a, b, &lat, &gbps);
      path_lat[static_cast<size_t>(a) * n + b] = lat;
      path_bw[static_cast<size_t>(a) * n + b] = gbps * kBytesPerUsPerGbps;
    }
  auto bandwidth = [&](size_t id) -> double {
    if (id < kEgress) return m.hbm_gbps * kBytesPerUsPerGbps;
    if (id < kIngress) return m.egress_gbps * kBytesPerUsPerGbps;
    if (id < kPath) return m.ingress_gbps * kBytesPerUsPerGbps;
    return path_bw[id - kPath];
  };
  std::vector<Queue> lane_q(static_cast<size_t>(n) * lanes);
  std::vector<double> lane_latency(lane_q.size(), 0.0);

  // Per piece: units (bytes) on each touched resource.
  std::vector<double> units(queues.size(), 0.0);
  std::vector<size_t> touched;
  touched.reserve(1024);

  // The signals of each phase's sync (see SignalUs).
  std::vector<Pairs> pairs(prog.phases.size());
  for (size_t ph = 0; ph < prog.phases.size(); ++ph) pairs[ph] = PhasePairs(prog.phases[ph], n);
  auto lanes_of = [&](const ModelPhase& ph) { return ph.lanes == kCore ? prog.cores : prog.engines; };
  auto message_of = [&](const ModelPhase& ph) {
    return ph.lanes == kCore ? m.core_message_us : m.sdma_message_us;
  };
  // The completion signals of the last phase before `ph` that touched peers.
  auto completion = [&](size_t ph) {
    for (size_t q = ph; q-- > 0;)
      if (!pairs[q].empty())
        return SignalUs(pairs[q], false, n, lanes_of(prog.phases[q]), message_of(prog.phases[q]), path_lat);
    return 0.0;
  };
  std::vector<double> lane_message_us(static_cast<size_t>(n) * lanes, 0.0);
  double t = 0;
  // The op's SDMA descriptor chains are submitted once, every engine in
  // parallel, before anything moves.
  for (const ModelPhase& phase : prog.phases)
    if (phase.lanes == kSdma && !phase.pieces.empty()) {
      t = res.descriptor_us = m.sdma_descriptor_us;
      res.on_sdma = true;
      break;
    }
  bool any_remote = false;
  for (size_t ph = 0; ph < prog.phases.size(); ++ph) {
    const ModelPhase& phase = prog.phases[ph];
    if (phase.pieces.empty()) continue;
    // Start signals when the phase itself touches peers; otherwise (the
    // stage-out after an exchange) the completion signals of that exchange.
    const double sync = !phase.sync_before ? 0.0
                        : !pairs[ph].empty() ? SignalUs(pairs[ph], true, n, lanes_of(phase), message_of(phase), path_lat)
                                             : completion(ph);
    if (phase.sync_before) {
      t += sync;
      res.sync_us += sync;
    }
    const double phase_start = t;
    std::vector<double> busy_before, lane_busy_before;
    std::vector<int64_t> egress_before, ingress_before;
    if (phase.repeat > 1) {
      for (const Queue& q : queues) busy_before.push_back(q.busy_us);
      for (const Queue& q : lane_q) lane_busy_before.push_back(q.busy_us);
      egress_before = res.egress_bytes;
      ingress_before = res.ingress_bytes;
    }
    const int lane_offset = phase.lanes == kCore ? 0 : prog.cores;
    const double message_us = message_of(phase);
    const double lane_rate = 2 * kBytesPerUsPerGbps *
        (phase.lanes == kSdma ? m.sdma_gbps : phase.reduce ? m.core_reduce_gbps : m.core_copy_gbps);
    // Each lane's pieces, in the order given.
    std::vector<std::vector<uint32_t>> by_lane(lane_q.size());
    for (uint32_t i = 0; i < phase.pieces.size(); ++i) {
      const ModelPiece& p = phase.pieces[i];
      by_lane[static_cast<size_t>(p.rank) * lanes + lane_offset + p.lane].push_back(i);
    }
    // Bytes each piece moves, and its legs (resources it walks).
    std::vector<int64_t> piece_moved(phase.pieces.size(), 0), piece_msgs(phase.pieces.size(), 0);
    std::vector<int64_t> lane_moved(lane_q.size(), 0);
    double legs_total = 0;
    for (uint32_t i = 0; i < phase.pieces.size(); ++i) {
      const ModelPiece& p = phase.pieces[i];
      int64_t moved = 0, legs = 0, msgs = 0;
      if (p.transfer >= 0) {
        // One DataCopy / descriptor per leg: the piece's columns are one
        // contiguous run of each source and destination block (rows ride
        // on one strided copy).
        const Plan& plan = PlanOf(phase, p);
        const Transfer& tr = plan.transfers[p.transfer];
        legs = tr.src_count + tr.dst_count;
        moved = plan.PieceBytes(tr, p.bytes);  // a dot plan writes one value per row
        msgs = p.bytes > 0 ? legs : 0;
      } else {
        for (uint32_t k = p.io_begin; k < p.io_end; ++k) {
          moved += std::max<int64_t>(0, phase.io[k].bytes);
          if (phase.io[k].bytes > 0) msgs += phase.io[k].msgs;
        }
        legs = p.io_end - p.io_begin;
      }
      piece_moved[i] = moved;
      piece_msgs[i] = msgs;
      lane_moved[static_cast<size_t>(p.rank) * lanes + lane_offset + p.lane] += moved;
      legs_total += static_cast<double>(legs);
      if (phase.kind != kExchange)
        for (uint32_t k = p.io_begin; k < p.io_end; ++k)
          if (phase.io[k].write) res.staged_bytes[phase.io[k].rank] += phase.io[k].bytes * phase.repeat;
    }
    if (phase.kind == kExchange)
      for (size_t l = 0; l < lane_moved.size(); ++l) res.lane_bytes[l] += lane_moved[l] * phase.repeat;
    // Queues serve segments, not whole pieces, so lanes that share a
    // resource interleave on it (a piece that became ready late does not wait
    // behind every early piece's whole reservation): about kSegmentsPerLane
    // segments for the busiest lane, fewer when the walk would get too long.
    constexpr double kSegmentsPerLane = 32, kWalkBudget = 1.5e7;
    const int64_t busiest = *std::max_element(lane_moved.begin(), lane_moved.end());
    double seg_bytes = std::max(4096.0, busiest / kSegmentsPerLane);
    double walk = 0;
    for (uint32_t i = 0; i < phase.pieces.size(); ++i) walk += std::ceil(piece_moved[i] / seg_bytes);
    walk *= legs_total / std::max<double>(1, phase.pieces.size());
    if (walk > kWalkBudget) seg_bytes *= walk / kWalkBudget;

    using Ready = std::pair<double, uint32_t>;  // (ready time, lane id)
    std::priority_queue<Ready, std::vector<Ready>, std::greater<Ready>> heap;
    std::vector<uint32_t> next(lane_q.size(), 0);
    std::vector<int64_t> seg(lane_q.size(), 0), segs(lane_q.size(), 0);
    std::vector<double> piece_start(lane_q.size(), 0);
    for (uint32_t l = 0; l < by_lane.size(); ++l)
      if (!by_lane[l].empty()) heap.push({phase_start, l});
    double phase_end = phase_start;
    while (!heap.empty()) {
      const auto [ready, lane_id] = heap.top();
      heap.pop();
      const uint32_t pi = by_lane[lane_id][next[lane_id]];
      if (seg[lane_id] == 0) {
        segs[lane_id] = std::max<int64_t>(1, static_cast<int64_t>(std::ceil(piece_moved[pi] / seg_bytes)));
        piece_start[lane_id] = ready;
      }

      const double frac = 1.0 / static_cast<double>(segs[lane_id]);
      const bool last_seg = ++seg[lane_id] == segs[lane_id];
      const ModelPiece& piece = phase.pieces[pi];
      const int e = piece.rank;
      double lat = 0;
      double moved = 0;  // bytes read + written by this segment
      auto add = [&](size_t id, double bytes) {
        if (units[id] == 0) touched.push_back(id);
        units[id] += bytes;
      };
      auto visit = [&](int rank, bool write, int64_t whole) {
        if (whole <= 0) return;
        const double bytes = whole * frac;
        moved += bytes;
        add(kHbm + rank, bytes);
        if (rank == e) return;
        const int src = write ? e : rank, dst = write ? rank : e;
        add(kEgress + src, bytes);
        add(kIngress + dst, bytes);
        const size_t path = static_cast<size_t>(src) * n + dst;
        add(kPath + path, bytes);
        lat = std::max(lat, path_lat[path]);
        if (last_seg) {
          res.egress_bytes[src] += whole;
          res.ingress_bytes[dst] += whole;
        }
      };
      if (piece.transfer >= 0) {
        const Plan& plan = PlanOf(phase, piece);
        const Transfer& tr = plan.transfers[piece.transfer];
        for (uint32_t k = 0; k < tr.src_count; ++k) visit(plan.refs[tr.src_begin + k].rank, false, piece.bytes);
        for (uint32_t k = 0; k < tr.dst_count; ++k) visit(plan.refs[tr.dst_begin + k].rank, true, plan.OutBytes(piece.bytes));
      } else {
        for (uint32_t k = piece.io_begin; k < piece.io_end; ++k) visit(phase.io[k].rank, phase.io[k].write != 0, phase.io[k].bytes);
      }
      if (lat > 0) {
        any_remote = true;
        min_lat = std::min(min_lat, lat);
      }
      const double t0 = ready;
      const double issue = static_cast<double>(piece_msgs[pi]) * frac * message_us;
      lane_message_us[lane_id] += issue * static_cast<double>(phase.repeat);
      double end = t0 + moved / lane_rate + issue;
      for (size_t id : touched) {
        const double serve = units[id] / bandwidth(id);
        Queue& q = queues[id];
        const double s = std::max(t0, q.free_us);
        q.free_us = s + serve;
        q.busy_us += serve;
        end = std::max(end, q.free_us);
        units[id] = 0;
      }
      touched.clear();
      lane_q[lane_id].busy_us += end - ready;
      if (last_seg) {
        // The piece's data lands one path latency after its last segment.
        const double landed = end + lat;
        lane_latency[lane_id] = std::max(lane_latency[lane_id], lat);
        if (keep_slices && res.slices.size() < max_slices)
          res.slices.push_back({e, phase.lanes, piece.lane, static_cast<int32_t>(ph), piece_start[lane_id],
                                end, static_cast<int64_t>(piece_moved[pi])});
        phase_end = std::max(phase_end, landed);
        seg[lane_id] = 0;
        next[lane_id]++;
      }
      if (next[lane_id] < by_lane[lane_id].size()) heap.push({end, lane_id});
    }
    const double duration = phase_end - phase_start;
    (phase.kind == kExchange ? res.exchange_us : res.stage_us) += duration * phase.repeat;
    t = phase_end;
    if (phase.repeat > 1) {
      // The other instances: same duration, same work on every resource.
      const double extra = static_cast<double>(phase.repeat - 1);
      t += extra * (duration + (phase.sync_before ? sync : 0.0));
      if (phase.sync_before) res.sync_us += extra * sync;
      for (size_t i = 0; i < queues.size(); ++i) {
        queues[i].busy_us += extra * (queues[i].busy_us - busy_before[i]);
        queues[i].free_us = 0;
      }
      for (size_t l = 0; l < lane_q.size(); ++l) {
        lane_q[l].busy_us += extra * (lane_q[l].busy_us - lane_busy_before[l]);
      }
      for (int r = 0; r < n; ++r) {
        res.egress_bytes[r] += static_cast<int64_t>(extra) * (res.egress_bytes[r] - egress_before[r]);
        res.ingress_bytes[r] += static_cast<int64_t>(extra) * (res.ingress_bytes[r] - ingress_before[r]);
      }
    }
  }
  if (prog.sync_end && t > 0) {
    const double sync = completion(prog.phases.size());
    t += sync;
    res.sync_us += sync;
  }
  res.time_us = t;
  res.min_remote_latency_us = any_remote ? min_lat : 0.0;
  for (size_t l = 0; l < lane_q.size(); ++l) {
    res.lane_busy_us[l] = lane_q[l].busy_us;
    res.busiest_lane_us = std::max(res.busiest_lane_us, lane_q[l].busy_us);
    res.latency_us = std::max(res.latency_us, lane_latency[l]);
    res.busiest_message_us = std::max(res.busiest_message_us, lane_message_us[l]);
  }
  for (size_t id = 0; id < queues.size(); ++id) {
    double& slot = id < kEgress ? res.busiest_hbm_us : id < kIngress ? res.busiest_egress_us
                   : id < kPath ? res.busiest_ingress_us : res.busiest_path_us;
    slot = std::max(slot, queues[id].busy_us);
  }
  return res;
}

namespace {

// A local copy of `bytes` on `rank`, split evenly over its lanes in 64-byte
// aligned parts (every lane works when there is work, as the planner's
// lanes do: a copy that got one more lane past each 16 KiB made the modeled
// time fall as the message grew). `zero_bytes` more are only written (zero
// fills), split the same way.
void AddLocalCopies(ModelPhase& phase, int rank, int64_t bytes, int lanes, int64_t zero_bytes = 0) {
  if (bytes + zero_bytes <= 0) return;
  const int64_t used = std::max<int64_t>(1, std::min<int64_t>(lanes, (bytes + zero_bytes + 63) / 64));
  // Lane l's share of `total`, in 64-byte units.
  auto share = [used](int64_t total, int64_t l) {
    const int64_t units = (total + 63) / 64;
    return std::min(total, units * (l + 1) / used * 64) - std::min(total, units * l / used * 64);
  };
  for (int64_t l = 0; l < used; ++l) {
    const int64_t part = share(bytes, l), zeros = share(zero_bytes, l);
    if (part <= 0 && zeros <= 0) continue;
    ModelPiece p;
    p.rank = rank;
    p.lane = static_cast<int32_t>(l);
    p.io_begin = static_cast<uint32_t>(phase.io.size());
    if (part > 0) phase.io.push_back({rank, 0, part});
    if (part + zeros > 0) phase.io.push_back({rank, 1, part + zeros});
    p.io_end = static_cast<uint32_t>(phase.io.size());
    phase.pieces.push_back(p);
  }
}

}  // namespace

namespace {

// The exchange phase of a partitioned plan: its pieces on the lanes the
// partition gave them, after a sync.
ModelPhase ExchangeOf(const Plan& plan, int64_t rows, LaneKind kind) {
  ModelPhase ph;
  ph.kind = kExchange;
  ph.lanes = kind;
  ph.reduce = plan.is_reduction();
  ph.sync_before = true;
  ph.plan = &plan;
  for (const LaneTask& task : plan.tasks)
    for (uint32_t i = task.piece_begin; i < task.piece_end; ++i) {
      const Piece& piece = plan.pieces[i];
      ModelPiece mp;
      mp.rank = task.npu;
      mp.lane = task.lane;
      mp.transfer = static_cast<int32_t>(piece.transfer);
      mp.bytes = (piece.col_end - piece.col_begin) * rows;
      ph.pieces.push_back(mp);
    }
  return ph;
}

// A plan op's program as the runtime runs it (collective.cc): strata mode is
// one exchange of `round_plan(block_bytes)` over the user buffers;
// buffer_centric runs rounds of the comm buffer's window (full windows, then
// the rest; BufferCentricJob), each staging in, exchanging
// `round_plan(width)` and staging out every block, or only `runs`' when given
// (PlanJob's plans). p.movement_lanes holds the op's lanes.
Program PlanRounds(const OpParams& p, const std::function<Plan(int64_t width)>& round_plan,
                   const StagedRuns* runs) {
  Program prog;
  prog.num_ranks = p.group_size;
  prog.cores = p.cores;
  prog.engines = p.engines;
  prog.plans.reserve(2);  // phases point into it: never grows past this
  const LaneKind kind = p.movement_lanes == 1 ? kSdma : kCore;

  // The exchange of one plan (the whole message, or one round's window).
  auto exchange = [&](int64_t width, int64_t repeat) {
    prog.plans.push_back(round_plan(width));
    ModelPhase ph = ExchangeOf(prog.plans.back(), p.rows, kind);
    ph.repeat = repeat;
    return ph;
  };

  if (p.mode == Mode::kStrata) {
    prog.phases.push_back(exchange(p.block_bytes, 1));
    prog.sync_end = true;
    return prog;
  }
  const int64_t window = CommWindowBytes(p);
  if (window <= 0)
    throw std::invalid_argument("comm_buffer_bytes=" + std::to_string(p.comm_buffer_bytes) +
                                " cannot hold one column of the op's blocks");
  prog.sync_end = false;
  // The blocks each rank stages in and out.
  // With `runs`, staging out also covers the rank's own local copies (read
  // + write, as a staged block) and zero fills (write only).
  std::vector<int64_t> in_blocks(p.group_size, p.in_blocks), out_blocks(p.group_size, p.out_blocks);
  std::vector<int64_t> zero_blocks(p.group_size, 0);
  if (runs) {
    for (int r = 0; r < p.group_size; ++r) {
      in_blocks[r] = out_blocks[r] = 0;
      for (const BlockRun& run : runs->in[r]) in_blocks[r] += run.end - run.begin;
      out_blocks[r] = runs->crossed[r] + runs->copied[r];
      zero_blocks[r] = runs->zeroed[r];
    }
  }
  const int64_t block = p.block_bytes;
  const int64_t full = block / window, rest = block % window;
  for (const auto& [w, count] : {std::pair<int64_t, int64_t>{window, full}, {rest, 1}}) {
    if (w <= 0 || count <= 0) continue;
    const int lanes = kind == kCore ? p.cores : p.engines;
    ModelPhase in;
    in.kind = kStageIn;
    in.lanes = kind;
    in.repeat = count;
    for (int r = 0; r < p.group_size; ++r) AddLocalCopies(in, r, p.rows * in_blocks[r] * w, lanes);
    prog.phases.push_back(std::move(in));
    prog.phases.push_back(exchange(w, count));
    ModelPhase out;
    out.kind = kStageOut;
    out.lanes = kind;
    out.sync_before = true;  // every peer's writes into this rank's buffer are in
    out.repeat = count;
    for (int r = 0; r < p.group_size; ++r)
      AddLocalCopies(out, r, p.rows * out_blocks[r] * w, lanes, p.rows * zero_blocks[r] * w);
    prog.phases.push_back(std::move(out));
  }
  return prog;
}

}  // namespace

Program CollectiveProgram(const OpParams& op_params, const Machine& m) {
  // The runtime's rule picks the lanes, with this machine's figures; every
  // round of buffer_centric inherits the op's choice (as the runtime's do).
  OpParams p = op_params;
  p.movement_lanes = MovesOnSdma(p, m.sdma_descriptor_us, m.sdma_gbps) ? 1 : 0;
  return PlanRounds(p, [&p](int64_t width) {
    OpParams round = p;
    round.block_bytes = width;
    return BuildPartitionedPlan(round);
  }, nullptr);
}

Program PlanProgram(Plan plan, const OpParams& op_params, const Machine& m) {
  // As PlanJob: the lanes by the busiest rank's bytes (this machine's
  // figures), each round the plan partitioned at its window's width, and
  // buffer_centric staging only the blocks the plan touches.
  OpParams p = op_params;
  plan.on_sdma = PlanMovesOnSdma(plan, p.rows, p.engines, m.sdma_descriptor_us, m.sdma_gbps);
  p.movement_lanes = plan.on_sdma ? 1 : 0;
  StagedRuns runs;
  if (p.mode == Mode::kBufferCentric) PlanStagedRuns(&plan, &runs);
  return PlanRounds(p, [&plan, &p](int64_t width) {
    Plan round = plan;
    round.block_bytes = width;
    Partition(round, round.on_sdma ? p.engines : p.cores, p.planner);
    return round;
  }, p.mode == Mode::kBufferCentric ? &runs : nullptr);
}

namespace {
// An MoE op's program over p's group (buffer_centric ends with its copy-out,
// so without a final sync), room reserved for `plans` plans (phases point
// into them: never grows past this).
Program MoeProgram(const MoeOpShape& p, size_t plans) {
  Program prog;
  prog.num_ranks = p.group_size;
  prog.cores = p.cores;
  prog.engines = p.engines;
  prog.sync_end = p.mode != Mode::kBufferCentric;
  prog.plans.reserve(plans);
  return prog;
}
// buffer_centric's copy-out: each rank copies `bytes` of results out of its
// comm buffer once every peer is done with it.
ModelPhase StageOut(const MoeOpShape& p, int64_t bytes) {
  ModelPhase out;
  out.kind = kStageOut;
  out.lanes = kCore;
  out.sync_before = true;
  for (int r = 0; r < p.group_size; ++r) AddLocalCopies(out, r, bytes, p.cores);
  return out;
}
}  // namespace

Program MoeCombineProgram(Plan partials, Plan sums, const MoeOpShape& p, const Machine& m) {
  const bool staged = p.mode == Mode::kBufferCentric;
  if (staged) {
    const int64_t rb = p.row_bytes();
    if (p.local_experts() * p.capacity * rb > p.comm_buffer_bytes || p.tokens * rb > p.comm_buffer_bytes)
      throw std::invalid_argument("buffer_centric mode needs more communication buffer than comm_buffer_bytes");
  }
  Program prog = MoeProgram(p, 2);
  prog.plans.push_back(std::move(partials));
  prog.plans.push_back(std::move(sums));
  for (Plan& plan : prog.plans) Partition(plan, p.cores, p.planner);
  // Reductions: on the cores (the runtime's rule, PlanMovesOnSdma).
  ModelPhase partial_phase = ExchangeOf(prog.plans[0], 1, kCore);
  if (staged) partial_phase.kind = kStageIn;
  if (!partial_phase.pieces.empty()) prog.phases.push_back(std::move(partial_phase));
  prog.phases.push_back(ExchangeOf(prog.plans[1], 1, kCore));
  if (staged) prog.phases.push_back(StageOut(p, p.tokens * p.row_bytes()));
  return prog;
}

std::vector<std::vector<int32_t>> MoePairSlots(const MoeShape& s,
                                               const std::vector<std::vector<int32_t>>& topk_idx) {
  std::vector<int64_t> next(s.experts, 0);
  std::vector<std::vector<int32_t>> slots(s.ranks);
  for (int r = 0; r < s.ranks; ++r) {
    const auto& idx = topk_idx[r];
    slots[r].assign(idx.size(), -1);
    for (size_t i = 0; i < idx.size(); ++i) {
      const int32_t e = idx[i];
      if (e < 0 || e >= s.experts) throw std::invalid_argument("expert id outside [0, num_experts)");
      const int64_t row = next[e]++;
      if (row < s.capacity) slots[r][i] = static_cast<int32_t>(e * s.capacity + row);
    }
  }
  return slots;
}

Program MoeCombineBackwardProgram(Plan carry, Plan scale, Plan dots, const MoeOpShape& p, const Machine& m) {
  const bool staged = p.mode == Mode::kBufferCentric;
  const int64_t rb = p.row_bytes(), slots = p.local_experts() * p.capacity;
  const int64_t weight_bytes = dots.OutBlockBytes();
  // What each rank stages in (ct_y, its expert rows: owners read a token's
  // row from its rank's comm buffer) and out (d_expert_y, d_weights), as
  // algorithms/moe.cc.
  const int64_t in_bytes = p.tokens * rb + slots * rb, out_bytes = slots * rb + p.tokens * p.topk * weight_bytes;
  if (staged && (in_bytes > p.comm_buffer_bytes || out_bytes > p.comm_buffer_bytes))
    throw std::invalid_argument("buffer_centric mode needs more communication buffer than comm_buffer_bytes");
  Program prog = MoeProgram(p, 3);
  prog.plans.push_back(std::move(carry));
  prog.plans.push_back(std::move(scale));
  prog.plans.push_back(std::move(dots));
  if (staged) {
    ModelPhase in;
    in.kind = kStageIn;
    in.lanes = kCore;
    for (int r = 0; r < p.group_size; ++r) AddLocalCopies(in, r, in_bytes, p.cores);
    prog.phases.push_back(std::move(in));
  }
  // The owners pull their carried rows, then scale them and take the dots
  // side by side (one phase: each lane its scale pieces, then its dots) from
  // their own memory (no sync between: each owner waits only for its own
  // pulls); the values land on the tokens' ranks.
  prog.phases.push_back(ExchangeOf(prog.plans[0], 1, prog.plans[0].on_sdma ? kSdma : kCore));
  ModelPhase work = ExchangeOf(prog.plans[1], 1, kCore);
  ModelPhase dot_pieces = ExchangeOf(prog.plans[2], 1, kCore);
  for (ModelPiece& piece : dot_pieces.pieces) {
    piece.plan = &prog.plans[2];
    work.pieces.push_back(piece);
  }
  work.sync_before = false;
  prog.phases.push_back(std::move(work));
  if (staged) prog.phases.push_back(StageOut(p, out_bytes));
  return prog;
}

}  // namespace strata::model
