// nanobind glue of the supernode model (xla_ffi/model/): time a collective's,
// a ragged exchange's or an MoE op's program on a machine, and read the host
// trace records.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <stdexcept>
#include <string>
#include <vector>

#include "../algorithms/moe.h"
#include "../algorithms/moe_backward_plan.h"
#include "../algorithms/moe_combine_plan.h"
#include "../algorithms/moe_plan.h"
#include "../algorithms/op_registry.h"
#include "../algorithms/ragged_all_to_all.h"
#include "../model/model.h"
#include "../model/trace_log.h"
#include "../runtime/observer.h"

namespace nb = nanobind;
using namespace strata;
using namespace strata::model;

namespace {

using I32Matrix = nb::ndarray<const int32_t, nb::ndim<2>, nb::c_contig, nb::device::cpu>;

template <typename T>
nb::ndarray<nb::numpy, T> ToNumpy(std::vector<T> v, std::vector<size_t> shape) {
  auto* heap = new std::vector<T>(std::move(v));
  nb::capsule owner(heap, [](void* p) noexcept { delete static_cast<std::vector<T>*>(p); });
  return nb::ndarray<nb::numpy, T>(heap->data(), shape.size(), shape.data(), owner);
}

Machine ToMachine(const nb::dict& d) {
  Machine m;
  auto get = [&](const char* key, double* field) {
    if (d.contains(key)) *field = nb::cast<double>(d[key]);
  };
  if (d.contains("npus_per_node")) m.npus_per_node = nb::cast<int>(d["npus_per_node"]);
  if (d.contains("ranks_per_npu")) m.ranks_per_npu = nb::cast<int>(d["ranks_per_npu"]);
  get("die_latency_us", &m.die_latency_us);
  get("intra_latency_us", &m.intra_latency_us);
  get("inter_latency_us", &m.inter_latency_us);
  get("die_gbps", &m.die_gbps);
  get("intra_gbps", &m.intra_gbps);
  get("inter_gbps", &m.inter_gbps);
  get("egress_gbps", &m.egress_gbps);
  get("ingress_gbps", &m.ingress_gbps);
  get("hbm_gbps", &m.hbm_gbps);
  get("core_copy_gbps", &m.core_copy_gbps);
  get("core_reduce_gbps", &m.core_reduce_gbps);
  get("sdma_gbps", &m.sdma_gbps);
  get("sdma_descriptor_us", &m.sdma_descriptor_us);
  get("core_message_us", &m.core_message_us);
  get("sdma_message_us", &m.sdma_message_us);
  if (m.npus_per_node < 1 || m.ranks_per_npu < 1) throw std::invalid_argument("machine: counts must be positive");
  return m;
}

void CheckPlacement(const std::vector<int32_t>& rank_npu, int ranks) {
  if (rank_npu.empty()) return;
  if (static_cast<int>(rank_npu.size()) != ranks)
    throw std::invalid_argument("rank_npu must place every rank (one NPU index per rank)");
  for (int32_t v : rank_npu)
    if (v < 0) throw std::invalid_argument("rank_npu holds a negative NPU index");
}

nb::dict ToDict(const Result& r, const Program& prog) {
  nb::dict d;
  d["time_us"] = r.time_us;
  d["sync_us"] = r.sync_us;
  d["exchange_us"] = r.exchange_us;
  d["stage_us"] = r.stage_us;
  d["latency_us"] = r.latency_us;
  d["descriptor_us"] = r.descriptor_us;
  d["message_us"] = r.busiest_message_us;
  d["on_sdma"] = r.on_sdma;
  d["busiest_lane_us"] = r.busiest_lane_us;
  d["busiest_hbm_us"] = r.busiest_hbm_us;
  d["busiest_egress_us"] = r.busiest_egress_us;
  d["busiest_ingress_us"] = r.busiest_ingress_us;
  d["busiest_path_us"] = r.busiest_path_us;
  d["min_remote_latency_us"] = r.min_remote_latency_us;
  d["cores"] = prog.cores;
  d["engines"] = prog.engines;
  d["lane_busy_us"] = ToNumpy(r.lane_busy_us, {static_cast<size_t>(prog.num_ranks),
                                               static_cast<size_t>(prog.cores + prog.engines)});
  d["egress_bytes"] = ToNumpy(r.egress_bytes, {r.egress_bytes.size()});
  d["ingress_bytes"] = ToNumpy(r.ingress_bytes, {r.ingress_bytes.size()});
  d["lane_bytes"] = ToNumpy(r.lane_bytes, {static_cast<size_t>(prog.num_ranks),
                                           static_cast<size_t>(prog.cores + prog.engines)});
  d["staged_bytes"] = ToNumpy(r.staged_bytes, {r.staged_bytes.size()});
  std::vector<double> slices;
  slices.reserve(r.slices.size() * 7);
  for (const Slice& s : r.slices) {
    slices.insert(slices.end(), {static_cast<double>(s.rank), static_cast<double>(s.kind),
                                 static_cast<double>(s.lane), static_cast<double>(s.phase),
                                 s.start_us, s.end_us, static_cast<double>(s.bytes)});
  }
  d["slices"] = ToNumpy(std::move(slices), {r.slices.size(), 7});
  std::vector<int32_t> kinds;
  for (const ModelPhase& ph : prog.phases) kinds.push_back(ph.kind);
  d["phase_kinds"] = kinds;
  return d;
}

nb::dict ModelCollective(int kind, int dtype, int reduce_op, int root, std::vector<int32_t> perm,
                         int group_size, int64_t block_bytes, int64_t rows, int mode, int cores,
                         int engines, int planner, int64_t comm_buffer_bytes, nb::dict machine,
                         std::vector<int32_t> rank_npu, bool keep_slices) {
  if (group_size < 1 || cores < 1 || engines < 1 || rows < 1 || block_bytes < 0)
    throw std::invalid_argument("group_size, cores, engines and rows must be positive");
  const CollectiveDef* def = FindCollective(kind);
  if (!def) throw std::invalid_argument("model_collective: no collective has code " + std::to_string(kind));
  if (def->PlannedAtRendezvous())
    throw std::invalid_argument(std::string("model_collective: ") + def->name +
                                "'s plan is built from its ranks' sizes: use model_ragged");
  OpParams p = MakeOpParams(*def, dtype, reduce_op, root, std::move(perm), group_size, block_bytes,
                            rows, mode, cores, engines, planner, comm_buffer_bytes);
  const Machine m = ToMachine(machine);
  CheckPlacement(rank_npu, group_size);
  Program prog;
  Result r;
  {
    nb::gil_scoped_release release;
    prog = CollectiveProgram(p, m);
    if (!rank_npu.empty()) prog.rank_npu = std::move(rank_npu);
    r = Simulate(prog, m, keep_slices);
  }
  return ToDict(r, prog);
}

using I64Matrix = nb::ndarray<const int64_t, nb::ndim<2>, nb::c_contig, nb::device::cpu>;

// A ragged exchange from every rank's input_offsets, send_sizes and
// output_offsets ([group_size, group_size * slices_per_peer] each): the plan
// BuildRaggedPlan builds from them (receivers' recv_sizes are the senders'
// sizes), timed as the runtime's PlanJob would run it.
nb::dict ModelRagged(int dtype, int group_size, int64_t operand_rows, int64_t output_rows, int64_t row_bytes,
                     I64Matrix input_offsets, I64Matrix send_sizes, I64Matrix output_offsets, int mode,
                     int cores, int engines, int planner, int64_t comm_buffer_bytes, nb::dict machine,
                     std::vector<int32_t> rank_npu, bool keep_slices) {
  if (group_size < 1 || cores < 1 || engines < 1 || operand_rows < 0 || output_rows < 0 || row_bytes < 0)
    throw std::invalid_argument("model_ragged: group_size, cores and engines must be positive, rows and "
                                "row_bytes >= 0");
  const size_t n = static_cast<size_t>(group_size), entries = send_sizes.shape(1);
  for (const I64Matrix* v : {&input_offsets, &send_sizes, &output_offsets})
    if (v->shape(0) != n || v->shape(1) != entries || entries == 0 || entries % n != 0)
      throw std::invalid_argument("model_ragged: offsets and sizes must be [group_size, group_size * "
                                  "slices_per_peer]");
  RaggedParams p;
  p.group_size = group_size;
  p.slices_per_peer = static_cast<int32_t>(entries / n);
  p.operand_rows = operand_rows;
  p.output_rows = output_rows;
  p.row_bytes = row_bytes;
  p.dtype = static_cast<DType>(dtype);
  for (IndexType& t : p.index_types) t = IndexType::S64;
  p.mode = static_cast<Mode>(mode);
  p.cores = cores;
  p.engines = engines;
  p.planner = static_cast<Planner>(planner);
  p.comm_buffer_bytes = comm_buffer_bytes;
  const int k = p.slices_per_peer;
  std::vector<int64_t> recv(n * entries);
  for (size_t src = 0; src < n; ++src)
    for (size_t i = 0; i < entries; ++i) recv[(i / k) * entries + src * k + i % k] = send_sizes.data()[src * entries + i];
  std::vector<RaggedVectors> ranks(n);
  for (size_t r = 0; r < n; ++r)
    ranks[r] = {input_offsets.data() + r * entries, send_sizes.data() + r * entries,
                output_offsets.data() + r * entries, recv.data() + r * entries};
  const Machine m = ToMachine(machine);
  CheckPlacement(rank_npu, group_size);
  Plan plan;
  Status st = BuildRaggedPlan(p, ranks, &plan);
  if (!st.ok) throw std::invalid_argument(st.message);
  Program prog;
  Result r;
  {
    nb::gil_scoped_release release;
    prog = PlanProgram(std::move(plan), RaggedRunParams(p), m);
    if (!rank_npu.empty()) prog.rank_npu = std::move(rank_npu);
    r = Simulate(prog, m, keep_slices);
  }
  return ToDict(r, prog);
}

std::vector<std::vector<int32_t>> Rows(const I32Matrix& a) {
  std::vector<std::vector<int32_t>> out(a.shape(0));
  for (size_t r = 0; r < a.shape(0); ++r) out[r].assign(a.data() + r * a.shape(1), a.data() + (r + 1) * a.shape(1));
  return out;
}

nb::dict ModelMoe(int op, int ranks, int experts, int64_t tokens, int64_t topk, int64_t capacity,
                  int64_t row_bytes, int64_t weight_bytes, int cores, int engines, bool buffer_centric,
                  int64_t comm_buffer_bytes, I32Matrix pair_slot, nb::dict machine,
                  std::vector<int32_t> rank_npu, bool keep_slices, int dtype, int planner) {
  if (planner < 0 || planner >= kPlannerCount) throw std::invalid_argument("unknown planner code");
  if (ranks < 1 || experts < 1 || tokens < 0 || topk < 1 || capacity < 1 || cores < 1 || engines < 1)
    throw std::invalid_argument("MoE shape: counts must be positive");
  if (experts % ranks != 0) throw std::invalid_argument("num_experts must be a multiple of the ranks");
  if (static_cast<int>(pair_slot.shape(0)) != ranks || static_cast<int64_t>(pair_slot.shape(1)) != tokens * topk)
    throw std::invalid_argument("pair_slot must be [ranks, tokens * top_k]");
  if (op < 0 || op > 2) throw std::invalid_argument("MoE op: 0 dispatch, 1 combine, 2 combine backward");
  // The weights' width follows from the rows' dtype (the plans' own rule).
  if (weight_bytes != static_cast<int64_t>(DTypeSize(MoeWeightDType(static_cast<DType>(dtype)))))
    throw std::invalid_argument("MoE weight_bytes does not match the rows' dtype");
  const Machine m = ToMachine(machine);
  CheckPlacement(rank_npu, ranks);
  auto slots = Rows(pair_slot);
  Program prog;
  Result r;
  {
    nb::gil_scoped_release release;
    // Every op from the plans the runtime executes, built from the same
    // slots (algorithms/moe_plan.h, moe_combine_plan.h, moe_backward_plan.h)
    // and timed as it runs them.
    MoeOpShape shape;
    shape.group_size = ranks;
    shape.num_experts = experts;
    shape.capacity = capacity;
    shape.tokens = tokens;
    shape.topk = topk;
    shape.dtype = static_cast<DType>(dtype);
    shape.hidden = row_bytes / static_cast<int64_t>(DTypeSize(shape.dtype));
    shape.cores = cores;
    shape.engines = engines;
    shape.mode = buffer_centric ? Mode::kBufferCentric : Mode::kStrata;
    shape.planner = static_cast<Planner>(planner);
    shape.comm_buffer_bytes = comm_buffer_bytes;
    std::vector<const int32_t*> rank_slots(ranks);
    for (int rank = 0; rank < ranks; ++rank) rank_slots[rank] = slots[rank].data();
    if (op == 0) {
      Plan plan;
      const Status st = BuildMoeDispatchPlan(shape, rank_slots, &plan);
      if (!st.ok) throw std::invalid_argument(st.message);  // the GIL is retaken on the way out
      prog = PlanProgram(std::move(plan), MoeDispatchRunParams(shape), m);
    } else if (op == 1) {
      MoeCombinePlans plans;
      const Status st = BuildMoeCombinePlans(shape, rank_slots, {}, buffer_centric, &plans);
      if (!st.ok) throw std::invalid_argument(st.message);
      prog = MoeCombineProgram(std::move(plans.partials), std::move(plans.sums), shape, m);
    } else {
      // The dispatch's other field, slot_source, from its pair_slot.
      std::vector<std::vector<int32_t>> sources;
      Status st = MoeSlotSources(shape, rank_slots, &sources);
      if (!st.ok) throw std::invalid_argument(st.message);
      std::vector<const int32_t*> rank_sources(ranks);
      for (int rank = 0; rank < ranks; ++rank) rank_sources[rank] = sources[rank].data();
      MoeBackwardPlans plans;
      st = BuildMoeBackwardPlans(shape, rank_slots, rank_sources, {}, &plans);
      if (!st.ok) throw std::invalid_argument(st.message);
      PartitionMoeBackwardPlans(shape, &plans, m.sdma_descriptor_us, m.sdma_gbps);
      prog = MoeCombineBackwardProgram(std::move(plans.carry), std::move(plans.scale), std::move(plans.dots), shape, m);
    }
    if (!rank_npu.empty()) prog.rank_npu = std::move(rank_npu);
    r = Simulate(prog, m, keep_slices);
  }
  return ToDict(r, prog);
}

nb::ndarray<nb::numpy, int32_t> PairSlots(int ranks, int experts, int64_t capacity, I32Matrix topk_idx) {
  MoeShape s;
  s.ranks = ranks;
  s.experts = experts;
  s.capacity = capacity;
  if (static_cast<int>(topk_idx.shape(0)) != ranks) throw std::invalid_argument("topk_idx must have one row per rank");
  auto slots = MoePairSlots(s, Rows(topk_idx));
  std::vector<int32_t> flat;
  flat.reserve(topk_idx.shape(0) * topk_idx.shape(1));
  for (auto& row : slots) flat.insert(flat.end(), row.begin(), row.end());
  return ToNumpy(std::move(flat), {topk_idx.shape(0), topk_idx.shape(1)});
}

// An explicit program, for tests with closed-form answers: phases of
// (kind, lanes, reduce, sync_before, repeat, pieces), a piece being
// (rank, lane, [(rank, write, bytes), ...]).
nb::dict ModelPieces(int num_ranks, int cores, int engines, nb::list phases, bool sync_end,
                     nb::dict machine, std::vector<int32_t> rank_npu, bool keep_slices) {
  Program prog;
  prog.num_ranks = num_ranks;
  prog.cores = cores;
  prog.engines = engines;
  prog.sync_end = sync_end;
  CheckPlacement(rank_npu, num_ranks);
  prog.rank_npu = std::move(rank_npu);
  for (nb::handle h : phases) {
    nb::tuple t = nb::cast<nb::tuple>(h);
    ModelPhase ph;
    ph.kind = static_cast<PhaseKind>(nb::cast<int>(t[0]));
    ph.lanes = static_cast<LaneKind>(nb::cast<int>(t[1]));
    ph.reduce = nb::cast<bool>(t[2]);
    ph.sync_before = nb::cast<bool>(t[3]);
    ph.repeat = nb::cast<int64_t>(t[4]);
    const int lanes = ph.lanes == kCore ? cores : engines;
    for (nb::handle ph_piece : nb::cast<nb::list>(t[5])) {
      nb::tuple pt = nb::cast<nb::tuple>(ph_piece);
      ModelPiece piece;
      piece.rank = nb::cast<int>(pt[0]);
      piece.lane = nb::cast<int>(pt[1]);
      if (piece.rank < 0 || piece.rank >= num_ranks || piece.lane < 0 || piece.lane >= lanes)
        throw std::invalid_argument("piece outside the ranks or lanes");
      piece.io_begin = static_cast<uint32_t>(ph.io.size());
      for (nb::handle io : nb::cast<nb::list>(pt[2])) {
        nb::tuple it = nb::cast<nb::tuple>(io);
        IO x{nb::cast<int>(it[0]), nb::cast<int>(it[1]), nb::cast<int64_t>(it[2])};
        if (x.rank < 0 || x.rank >= num_ranks) throw std::invalid_argument("io outside the ranks");
        ph.io.push_back(x);
      }
      piece.io_end = static_cast<uint32_t>(ph.io.size());
      ph.pieces.push_back(piece);
    }
    prog.phases.push_back(std::move(ph));
  }
  const Machine m = ToMachine(machine);
  Result r = Simulate(prog, m, keep_slices);
  return ToDict(r, prog);
}

nb::list TakeRecords() {
  int64_t dropped = 0;
  std::vector<TraceRecord> recs = TakeTraceRecords(&dropped);
  nb::list out;
  for (TraceRecord& r : recs) {
    nb::dict d;
    d["kind"] = static_cast<int>(r.kind);
    d["run_id"] = r.run_id;
    d["site_id"] = r.site_id;
    d["group_id"] = r.group_id;
    d["rank"] = r.rank;
    d["device"] = r.device;
    d["arrive_us"] = r.arrive_us;
    d["end_us"] = r.end_us;
    d["ok"] = r.ok;
    if (r.kind == ObservedOp::kCollective || r.kind == ObservedOp::kRaggedAllToAll) {
      const OpParams& p = r.op;
      d["op_kind"] = p.builder->code;
      d["dtype"] = static_cast<int>(p.dtype);
      d["reduce_op"] = static_cast<int>(p.op);
      d["root"] = p.root;
      d["perm"] = p.perm;
      d["group_size"] = p.group_size;
      d["block_bytes"] = p.block_bytes;
      d["rows"] = p.rows;
      d["in_blocks"] = p.in_blocks;
      d["out_blocks"] = p.out_blocks;
      d["mode"] = static_cast<int>(p.mode);
      d["cores"] = p.cores;
      d["engines"] = p.engines;
      d["planner"] = static_cast<int>(p.planner);
      d["comm_buffer_bytes"] = p.comm_buffer_bytes;
      if (r.kind == ObservedOp::kRaggedAllToAll) {
        RaggedRankSizes& sizes = r.ragged;
        const size_t entries = sizes.send_sizes.size();
        d["slices_per_peer"] = sizes.slices_per_peer;
        d["input_offsets"] = ToNumpy(std::move(sizes.input_offsets), {entries});
        d["send_sizes"] = ToNumpy(std::move(sizes.send_sizes), {entries});
        d["output_offsets"] = ToNumpy(std::move(sizes.output_offsets), {entries});
      }
    } else {
      const MoeOpShape& p = r.moe;
      d["group_size"] = p.group_size;
      d["num_experts"] = p.num_experts;
      d["capacity"] = p.capacity;
      d["tokens"] = p.tokens;
      d["topk"] = p.topk;
      d["hidden"] = p.hidden;
      d["dtype"] = static_cast<int>(p.dtype);
      d["row_bytes"] = p.row_bytes();
      d["weight_bytes"] = static_cast<int64_t>(DTypeSize(MoeWeightDType(p.dtype)));
      d["cores"] = p.cores;
      d["engines"] = p.engines;
      d["mode"] = static_cast<int>(p.mode);
      d["planner"] = static_cast<int>(p.planner);
      d["comm_buffer_bytes"] = p.comm_buffer_bytes;
      d["routing"] = ToNumpy(std::move(r.routing), {static_cast<size_t>(p.tokens * p.topk)});
    }
    out.append(d);
  }
  return out;
}

}  // namespace

void BindModel(nb::module_& m) {
  m.def("model_collective", &ModelCollective);
  m.def("model_ragged", &ModelRagged);
  m.def("model_moe", &ModelMoe);
  m.def("model_pieces", &ModelPieces);
  m.def("moe_pair_slots", &PairSlots);
  m.def("trace_enable", [](bool on) { SetObserver(on ? TraceLog() : nullptr); });
  m.def("trace_now_us", &TraceNowUs);
  m.def("trace_take", &TakeRecords);
}
