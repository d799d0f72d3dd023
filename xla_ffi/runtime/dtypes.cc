#include "dtypes.h"

#include <atomic>
#include <cstdlib>
#include <string>

#include "reduce_isa.h"

namespace strata {
namespace {

struct IsaEntry {
  const char* name;
  ReduceFn fn;  // nullptr: not built by this compiler / for this target
  AxpyRowFn axpy;
  AxpyAddRoundedRowFn axpy_add_rounded;
  NarrowRowFn narrow;
  ScaleRowFn scale;
  StartSumRowFn start_sum;
  DotRowFn dot;
  bool (*supported)();
};

#if defined(__x86_64__) || defined(__i386__)
bool CpuHasAvx2() { __builtin_cpu_init(); return __builtin_cpu_supports("avx2"); }
bool CpuHasAvx512() {
  // The variant is built with AVX-512 F, BW, VL and DQ; libgcc reports a
  // feature only when the OS also saves its registers (XCR0).
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
}
#else
bool CpuHasAvx2() { return false; }
bool CpuHasAvx512() { return false; }
#endif
bool Always() { return true; }

// Narrowest first.
const IsaEntry kIsas[] = {
    {"baseline", &isa_baseline::ReduceInto, &isa_baseline::AxpyRow, &isa_baseline::AxpyAddRoundedRow, &isa_baseline::NarrowRow, &isa_baseline::ScaleRow, &isa_baseline::StartSumRow, &isa_baseline::DotRow, &Always},
#ifdef STRATA_REDUCE_HAVE_AVX2
    {"avx2", &isa_avx2::ReduceInto, &isa_avx2::AxpyRow, &isa_avx2::AxpyAddRoundedRow, &isa_avx2::NarrowRow, &isa_avx2::ScaleRow, &isa_avx2::StartSumRow, &isa_avx2::DotRow, &CpuHasAvx2},
#else
    {"avx2", nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, &CpuHasAvx2},
#endif
#ifdef STRATA_REDUCE_HAVE_AVX512
    {"avx512", &isa_avx512::ReduceInto, &isa_avx512::AxpyRow, &isa_avx512::AxpyAddRoundedRow, &isa_avx512::NarrowRow, &isa_avx512::ScaleRow, &isa_avx512::StartSumRow, &isa_avx512::DotRow, &CpuHasAvx512},
#else
    {"avx512", nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, &CpuHasAvx512},
#endif
};
constexpr int kNumIsas = sizeof(kIsas) / sizeof(kIsas[0]);

bool Usable(const IsaEntry& e) { return e.fn != nullptr && e.supported(); }

const IsaEntry* FindIsa(const std::string& name) {
  for (const IsaEntry& e : kIsas)
    if (name == e.name) return &e;
  return nullptr;
}

const IsaEntry* WidestUsable() {
  for (int i = kNumIsas - 1; i > 0; --i)
    if (Usable(kIsas[i])) return &kIsas[i];
  return &kIsas[0];
}

// Constant-initialised to the baseline, so a kernel called before the
// load-time choice below (no such caller exists) is still correct.
std::atomic<const IsaEntry*> g_isa{&kIsas[0]};
const IsaEntry* g_auto = &kIsas[0];
std::string g_note;

std::string WhyNot(const std::string& name) {
  const IsaEntry* e = FindIsa(name);
  if (e == nullptr) return "unknown reduction ISA '" + name + "' (known: baseline, avx2, avx512, auto)";
  if (e->fn == nullptr) return "the " + name + " reduction kernels were not built (compiler or target lacks it)";
  if (!e->supported()) return "this CPU does not support " + name;
  return "";
}

// At load time: the widest variant the CPU runs, unless STRATA_REDUCE_ISA
// names another usable one.
struct ChooseAtLoad {
  ChooseAtLoad() {
    g_auto = WidestUsable();
    const IsaEntry* pick = g_auto;
    if (const char* env = std::getenv("STRATA_REDUCE_ISA"); env != nullptr && *env != '\0') {
      const std::string want(env);
      if (want != "auto") {
        const std::string why = WhyNot(want);
        if (why.empty())
          pick = FindIsa(want);
        else
          g_note = "STRATA_REDUCE_ISA=" + want + " ignored: " + why + "; using " + g_auto->name;
      }
    }
    g_isa.store(pick, std::memory_order_relaxed);
  }
};
const ChooseAtLoad choose_at_load;

}  // namespace

const char* ReduceIsa() { return g_isa.load(std::memory_order_relaxed)->name; }

std::vector<std::string> ReduceIsasAvailable() {
  std::vector<std::string> out;
  for (const IsaEntry& e : kIsas)
    if (Usable(e)) out.push_back(e.name);
  return out;
}

std::vector<std::string> ReduceIsasKnown() {
  std::vector<std::string> out;
  for (const IsaEntry& e : kIsas) out.push_back(e.name);
  return out;
}

ReduceFn ReduceKernel(const std::string& isa) {
  const IsaEntry* e = FindIsa(isa);
  return e != nullptr && Usable(*e) ? e->fn : nullptr;
}

AxpyRowFn AxpyRowKernel(const std::string& isa) {
  const IsaEntry* e = FindIsa(isa);
  return e != nullptr && Usable(*e) ? e->axpy : nullptr;
}

void AxpyRow(DType row_dtype, void* acc, const void* row, double w, int64_t n) {
  g_isa.load(std::memory_order_relaxed)->axpy(row_dtype, acc, row, w, n);
}

void AxpyAddRoundedRow(DType row_dtype, void* acc, const void* part, const void* row, double w, int64_t n) {
  g_isa.load(std::memory_order_relaxed)->axpy_add_rounded(row_dtype, acc, part, row, w, n);
}

void NarrowRow(DType row_dtype, void* out, const void* acc, int64_t n) {
  g_isa.load(std::memory_order_relaxed)->narrow(row_dtype, out, acc, n);
}

void ScaleRow(DType row_dtype, void* out, const void* row, double w, int64_t n) {
  g_isa.load(std::memory_order_relaxed)->scale(row_dtype, out, row, w, n);
}

void StartSumRow(DType row_dtype, void* acc, const void* row, double w, int64_t n) {
  g_isa.load(std::memory_order_relaxed)->start_sum(row_dtype, acc, row, w, n);
}

double DotRow(DType row_dtype, const void* a, const void* b, int64_t n) {
  return g_isa.load(std::memory_order_relaxed)->dot(row_dtype, a, b, n);
}

std::string SetReduceIsa(const std::string& isa) {
  if (isa == "auto") {
    g_isa.store(g_auto, std::memory_order_relaxed);
    return "";
  }
  std::string why = WhyNot(isa);
  if (why.empty()) g_isa.store(FindIsa(isa), std::memory_order_relaxed);
  return why;
}

const std::string& ReduceIsaNote() { return g_note; }

bool IsComplex(DType t) { return t == DType::C64 || t == DType::C128; }

size_t DTypeSize(DType t) {
  switch (t) {
    case DType::C128: return 16;
    case DType::F64: case DType::S64: case DType::C64: return 8;
    case DType::F32: case DType::S32: case DType::U32: return 4;
    case DType::F16: case DType::BF16: return 2;
    default: return 1;
  }
}

const char* DTypeName(DType t) {
  static const char* names[] = {"float32", "float64", "float16", "bfloat16", "int8",
                                "int32", "int64", "uint8", "uint32", "bool",
                                "complex64", "complex128"};
  return names[static_cast<int>(t)];
}

const char* ReduceOpName(ReduceOp op) {
  static const char* names[] = {"sum", "max", "min", "prod", "none"};
  return names[static_cast<int>(op)];
}

void ReduceInto(DType dtype, ReduceOp op, void* const* outs, int num_outs,
                const void* const* srcs, int num_srcs, size_t count, bool streaming) {
  g_isa.load(std::memory_order_relaxed)->fn(dtype, op, outs, num_outs, srcs, num_srcs, count, streaming);
}

}  // namespace strata
