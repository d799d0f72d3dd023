// nanobind module `stratacl_jax._core`: FFI handler capsules for
// jax.ffi.register_ffi_target, the runtime's statistics and registry, and a
// threads-as-ranks harness that drives the runtime without XLA (for tests
// of mismatches and timeouts that a single SPMD program cannot produce).
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <cstring>
#include <thread>
#include <vector>

#include "../algorithms/op_registry.h"
#include "../runtime/collective.h"
#include "../runtime/copy.h"
#include "../runtime/reduce_isa.h"
#include "../runtime/registry.h"
#include "../runtime/rendezvous.h"
#include "../runtime/stats.h"
#include "ffi_common.h"
#include "handlers.h"
#include "moe_handlers.h"
#include "ragged_handlers.h"
#include "reference_handlers.h"
#include "xproc_handlers.h"

namespace nb = nanobind;
using namespace strata;

namespace {

template <typename T>
nb::capsule EncapsulateFfiHandler(T* fn) {
  return nb::capsule(reinterpret_cast<void*>(fn));
}

// Each target: its execute handler and the shared instantiate stage (one
// SiteInstance per custom-call instruction, which ranks meet by).
nb::dict Registrations() {
  auto target = [](auto* execute) {
    nb::dict stages;
    stages["instantiate"] = EncapsulateFfiHandler(StrataSiteInstantiate);
    stages["execute"] = EncapsulateFfiHandler(execute);
    return stages;
  };
  nb::dict d;
  for (const CollectiveDef& def : Collectives()) {
    XLA_FFI_Handler* execute = def.kind == OpKind::kRaggedAllToAll ? StrataRaggedAllToAll
                               : def.kind == OpKind::kMoeDispatch  ? StrataMoeDispatch
                                                                   : CollectiveHandler(def.kind);
    d[("strata_" + std::string(def.name)).c_str()] = target(execute);
  }
  d["strata_moe_combine"] = target(StrataMoeCombine);
  d["strata_moe_combine_backward"] = target(StrataMoeCombineBackward);
  // Floors for the latency benchmark, not ops.
  d["strata_ref_copy"] = EncapsulateFfiHandler(StrataRefCopy);
  d["strata_ref_barrier"] = EncapsulateFfiHandler(StrataRefBarrier);
  d["strata_ref_meet"] = EncapsulateFfiHandler(StrataRefMeet);
  // Brackets around the cross-process step of an op (the in-flight table).
  d["strata_xproc_mark"] = EncapsulateFfiHandler(StrataXprocMark);
  d["strata_xproc_check"] = EncapsulateFfiHandler(StrataXprocCheck);
  d["strata_xproc_hash"] = EncapsulateFfiHandler(StrataXprocHash);
  return d;
}

// For jax.ffi.register_ffi_type: the SiteInstance state type.
nb::dict SiteInstanceType() {
  nb::dict d;
  d["type_id"] = nb::capsule(reinterpret_cast<void*>(&ffi_common::SiteInstance::id));
  d["type_info"] = nb::capsule(const_cast<void*>(static_cast<const void*>(ffi_common::SiteInstanceTypeInfo())));
  return d;
}

nb::dict GetStats() {
  Stats& s = GlobalStats();
  nb::dict d;
  d["ops"] = s.ops.load();
  d["bytes_direct"] = s.bytes_direct.load();
  d["bytes_staged"] = s.bytes_staged.load();
  d["bytes_exchanged"] = s.bytes_exchanged.load();
  d["bytes_local"] = s.bytes_local.load();
  d["registrations"] = s.registrations.load();
  d["bytes_registered"] = s.bytes_registered.load();
  d["registry_lookups"] = s.registry_lookups.load();
  d["registry_hits"] = s.registry_hits.load();
  d["registry_misses"] = s.registry_misses.load();
  d["operand_registry_misses"] = s.operand_registry_misses.load();
  d["waits_handed_off"] = s.waits_handed_off.load();
  d["reduce_isa"] = ReduceIsa();
  d["resumers_blocked"] = s.resumers_blocked.load();
  std::lock_guard<std::mutex> lock(s.mu);
  d["core_bytes"] = s.core_bytes;
  d["sdma_bytes"] = s.sdma_bytes;
  d["staged_bytes"] = s.staged_bytes;
  return d;
}


using Bytes = nb::ndarray<uint8_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;

// The registry entry of an op code from Python, or a ValueError naming it.
// Only a fixed-plan op when `fixed`: the caller builds its plan from sizes alone.
const CollectiveDef& Checked(const CollectiveDef* def, const std::string& what, const char* caller, bool fixed) {
  if (!def) throw nb::value_error((std::string(caller) + ": no collective " + what).c_str());
  if (fixed && def->PlannedAtRendezvous()) {
    const char* from = def->kind == OpKind::kMoeDispatch ? "the pair slots its ranks' routing gets"
                                                         : "the sizes its ranks publish";
    throw nb::value_error((std::string(caller) + ": " + def->name + "'s plan is built from " + from +
                           " at run time, not from a block size").c_str());
  }
  return *def;
}

const CollectiveDef& CollectiveOf(int code, const char* caller, bool fixed = true) {
  return Checked(FindCollective(code), "has code " + std::to_string(code), caller, fixed);
}

const CollectiveDef& CollectiveNamed(const std::string& name, const char* caller, bool fixed = true) {
  return Checked(FindCollective(name.c_str()), "is named " + name, caller, fixed);
}

// The codes Python passes, from the C++ tables they index: name -> code, for
// an enum whose codes run 0..count-1.
template <typename Enum>
nb::dict NameCodes(int32_t count, const char* (*name)(Enum)) {
  nb::dict d;
  for (int32_t c = 0; c < count; ++c) d[name(static_cast<Enum>(c))] = c;
  return d;
}

nb::dict DTypeSizes() {
  nb::dict d;
  for (int32_t t = 0; t < kDTypeCount; ++t)
    d[DTypeName(static_cast<DType>(t))] = DTypeSize(static_cast<DType>(t));
  return d;
}

// The ops' names in code order (an op's code is its index).
nb::tuple OpNames() {
  nb::list names;
  for (const CollectiveDef& def : Collectives()) names.append(def.name);
  return nb::tuple(names);
}

// Runs one op with every rank a thread (gloo-style). `block_bytes_per_rank`
// lets a test make ranks disagree; ranks in `absent` never call. Returns one
// error string per rank ("" for success).
std::vector<std::string> RunRanks(int kind, int dtype, int reduce_op, int root,
                                  std::vector<int32_t> perm, std::vector<int64_t> block_bytes_per_rank,
                                  int64_t rows, int mode, int cores, int engines, int planner,
                                  int64_t comm_buffer_bytes, double timeout_s, int64_t site_id,
                                  int64_t run_id, std::vector<Bytes> inputs, std::vector<Bytes> outputs,
                                  std::vector<int> absent) {
  const CollectiveDef& def = CollectiveOf(kind, "run_ranks");
  const int n = static_cast<int>(inputs.size());
  std::vector<std::string> errors(n);
  std::vector<std::thread> threads;
  {
    nb::gil_scoped_release release;
    for (int r = 0; r < n; ++r) {
      if (std::find(absent.begin(), absent.end(), r) != absent.end()) continue;
      threads.emplace_back([&, r] {
        OpParams p = MakeOpParams(def, dtype, reduce_op, root, perm, n, block_bytes_per_rank[r], rows,
                                  mode, cores, engines, planner, comm_buffer_bytes);
        RankCall c;
        c.run_id = run_id;
        c.site_id = site_id;
        c.rank = r;
        c.device = r;
        c.in = inputs[r].data();
        c.out = outputs[r].data();
        c.timeout_s = timeout_s;
        Status st = RunCollective(p, c);
        if (!st.ok) errors[r] = st.message;
      });
    }
    for (auto& t : threads) t.join();
  }
  return errors;
}

nb::dict PlanInfo(int kind, int dtype, int reduce_op, int group_size, int64_t block_bytes,
                  int lanes, int planner) {
  OpParams p = MakeOpParams(CollectiveOf(kind, "plan_info"), dtype, reduce_op, 0, {}, group_size,
                            block_bytes, 1, 0, lanes, lanes, planner, 0);
  Plan plan = BuildPartitionedPlan(p);
  std::vector<std::vector<int64_t>> lane_bytes(group_size, std::vector<int64_t>(lanes, 0));
  for (const LaneTask& t : plan.tasks) lane_bytes[t.npu][t.lane] += t.bytes;
  nb::dict d;
  d["imbalance"] = LaneImbalance(plan);
  d["on_sdma"] = plan.on_sdma;
  d["lane_bytes"] = lane_bytes;
  d["transfers"] = plan.transfers.size();
  d["tasks"] = plan.tasks.size();
  // The host's resolved copies of a copy-only plan, and how many moves hold them.
  int64_t copies = 0;
  for (const Move& m : plan.moves) copies += m.count;
  d["moves"] = plan.moves.size();
  d["copies"] = copies;
  return d;
}

// One reduction kernel variant run directly on host bytes (tests compare the
// variants bit for bit without switching the process-wide choice):
// outs[d] = reduce(srcs) for every d, counts from the byte sizes.
void ReduceWith(const std::string& isa, const std::string& dtype_name, const std::string& op_name,
                std::vector<Bytes> srcs, std::vector<Bytes> outs, bool streaming) {
  ReduceFn fn = ReduceKernel(isa);
  if (fn == nullptr) {
    const std::string why = SetReduceIsa(isa);  // only for its message; fails without changing anything
    throw nb::value_error(("reduce_with: " + (why.empty() ? "unusable ISA " + isa : why)).c_str());
  }
  int dtype = -1, op = -1;
  for (int t = 0; t < kDTypeCount; ++t)
    if (dtype_name == DTypeName(static_cast<DType>(t))) dtype = t;
  for (int o = 0; o < static_cast<int>(ReduceOp::kNone); ++o)
    if (op_name == ReduceOpName(static_cast<ReduceOp>(o))) op = o;
  if (dtype < 0 || op < 0) throw nb::value_error("reduce_with: unknown dtype or op");
  if (srcs.empty() || outs.empty()) throw nb::value_error("reduce_with: needs sources and outputs");
  const size_t bytes = srcs[0].size(), esize = DTypeSize(static_cast<DType>(dtype));
  if (bytes % esize != 0) throw nb::value_error("reduce_with: size is not a whole number of elements");
  for (const Bytes& b : srcs)
    if (b.size() != bytes) throw nb::value_error("reduce_with: sources differ in size");
  for (const Bytes& b : outs)
    if (b.size() != bytes) throw nb::value_error("reduce_with: outputs differ in size from the sources");
  std::vector<const void*> sp;
  std::vector<void*> op_;
  for (const Bytes& b : srcs) sp.push_back(b.data());
  for (Bytes& b : outs) op_.push_back(b.data());
  nb::gil_scoped_release release;
  fn(static_cast<DType>(dtype), static_cast<ReduceOp>(op), op_.data(), static_cast<int>(op_.size()), sp.data(),
     static_cast<int>(sp.size()), bytes / esize, streaming);
  if (streaming) StoreFence();
}

}  // namespace

void BindMemory(nb::module_& m);  // memory_bindings.cc
void BindModel(nb::module_& m);   // model_bindings.cc

NB_MODULE(_core, m) {
  BindMemory(m);
  BindModel(m);
  BindXproc(m);
  m.def("registrations", &Registrations);
  m.def("site_instance_type", &SiteInstanceType);
  m.def("stats", &GetStats);
  m.def("reset_stats", [] { GlobalStats().Reset(); });
  m.def("register_region", [](int device, uintptr_t addr, int64_t len) {
    GlobalRegistry().Register(device, addr, len);
  });
  m.def("deregister_region", [](int device, uintptr_t addr) {
    GlobalRegistry().Deregister(device, addr);
  });
  m.def("region_registered", [](int device, uintptr_t addr, int64_t len) {
    return GlobalRegistry().Lookup(device, addr, len);
  });
  m.def("region_count", [](int device) { return GlobalRegistry().RegionCount(device); });
  m.def("live_slot_count", &LiveSlotCount);
  m.def("abort_pending", &AbortPending, nb::arg("why"), nb::arg("refuse_new") = false,
        nb::call_guard<nb::gil_scoped_release>());
  m.def("install_interrupt_handler", &InstallInterruptHandler);
  m.def("set_streaming_threshold_bytes", &SetStreamingThresholdBytes);
  // Reduction kernels per instruction set (reduce_isa.h).
  m.def("reduce_isa", [] { return std::string(ReduceIsa()); });
  m.def("reduce_isas_available", &ReduceIsasAvailable);
  m.def("reduce_isas_known", &ReduceIsasKnown);
  m.def("reduce_isa_note", [] { return ReduceIsaNote(); });
  // Returns the previous choice; an unknown or unusable name is a ValueError
  // and changes nothing.
  m.def("set_reduce_isa", [](const std::string& isa) {
    std::string prev = ReduceIsa();
    std::string why = SetReduceIsa(isa);
    if (!why.empty()) throw nb::value_error(("set_reduce_isa: " + why).c_str());
    return prev;
  });
  m.def("reduce_with", &ReduceWith, nb::arg("isa"), nb::arg("dtype"), nb::arg("op"), nb::arg("srcs"),
        nb::arg("outs"), nb::arg("streaming") = false);
  // The op registry and code tables (algorithms/op_registry.h, runtime/dtypes.h):
  // Python reads names and codes from here rather than keeping copies.
  m.def("op_names", &OpNames);
  m.def("op_block_counts", [](const std::string& name, int group_size) {
    const CollectiveDef& def = CollectiveNamed(name, "op_block_counts");
    return std::make_pair(def.InBlocks(group_size), def.OutBlocks(group_size));
  });
  m.def("bus_factor", [](const std::string& name, int group_size) {
    if (group_size < 1) throw nb::value_error("bus_factor: group_size must be positive");
    return CollectiveNamed(name, "bus_factor", /*fixed=*/false).bus_factor(group_size);
  });
  // True for an op whose plan is built at the rendezvous (its sizes are data).
  m.def("op_planned_at_rendezvous", [](const std::string& name) {
    return CollectiveNamed(name, "op_planned_at_rendezvous", /*fixed=*/false).PlannedAtRendezvous();
  });
  m.def("dtype_codes", [] { return NameCodes(kDTypeCount, DTypeName); });
  m.def("dtype_sizes", &DTypeSizes);
  // "none" (kNone) marks pure data movement.
  m.def("reduce_ops", [] { return NameCodes(kReduceOpCount, ReduceOpName); });
  m.def("mode_codes", [] { return NameCodes(kModeCount, ModeName); });
  m.def("planner_codes", [] { return NameCodes(kPlannerCount, PlannerName); });
  m.def("run_ranks", &RunRanks);
  m.def("plan_info", &PlanInfo);
}
