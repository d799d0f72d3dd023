#include "dtypes.h"

#include "copy.h"

#include <algorithm>

namespace strata {
namespace {

// Half-precision conversions (round to nearest even), written out because the
// host compiler gives no portable _Float16 / bfloat16 type.
inline float Bf16ToFloat(uint16_t h) {
  uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}
inline uint16_t FloatToBf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);  // NaN
  uint32_t rounding = 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>((bits + rounding) >> 16);
}
inline float F16ToFloat(uint16_t h) {
  uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, mant = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal: normalise
      int e = -1;
      do { ++e; mant <<= 1; } while ((mant & 0x400u) == 0);
      bits = sign | static_cast<uint32_t>(127 - 15 - e) << 23 | (mant & 0x3ffu) << 13;
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else {
    bits = sign | (exp + 112) << 23 | (mant << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}
inline uint16_t FloatToF16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  uint32_t sign = (bits >> 16) & 0x8000u;
  uint32_t abs = bits & 0x7fffffffu;
  if (abs > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u);  // NaN
  if (abs >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // overflow -> inf
  if (abs < 0x38800000u) {  // result is subnormal or zero
    if (abs < 0x33000000u) return static_cast<uint16_t>(sign);
    uint32_t mant = (abs & 0x7fffffu) | 0x800000u;
    int shift = 126 - static_cast<int>(abs >> 23);  // 14..24
    uint32_t half = mant >> shift;
    uint32_t rem = mant & ((1u << shift) - 1), mid = 1u << (shift - 1);
    if (rem > mid || (rem == mid && (half & 1u))) ++half;
    return static_cast<uint16_t>(sign | half);
  }
  uint32_t rounded = abs + 0xfffu + ((abs >> 13) & 1u);
  return static_cast<uint16_t>(sign | ((rounded - 0x38000000u) >> 13));
}

// Floats: NaN must win max/min like XLA does, not vanish in std::max.
template <typename F>
inline F FloatMaxMin(ReduceOp op, F a, F b) {
  if (a != a) return a;
  if (b != b) return b;
  return op == ReduceOp::kMax ? std::max(a, b) : std::min(a, b);
}

// Signed integer sums/products wrap like XLA's: do them in the unsigned type.
template <typename S, typename U>
inline S WrapCombine(ReduceOp op, S a, S b) {
  if (op == ReduceOp::kSum) return static_cast<S>(static_cast<U>(a) + static_cast<U>(b));
  if (op == ReduceOp::kProd) return static_cast<S>(static_cast<U>(a) * static_cast<U>(b));
  return op == ReduceOp::kMax ? std::max(a, b) : std::min(a, b);
}

template <typename T, typename Fold>
void ReduceLoop(T* const* outs, int num_outs, const void* const* srcs, int n, size_t count, bool streaming, Fold fold) {
  // Strips of 32 KiB: long enough per source for the hardware prefetcher,
  // small enough that the accumulator stays in L2 while the sources stream
  // by, up to four per pass; then the strip is written to every destination.
  // The fold order is source 0, 1, 2, ... for every element.
  constexpr size_t kBlock = (32 << 10) / sizeof(T);
  alignas(64) T acc[kBlock];
  for (size_t base = 0; base < count; base += kBlock) {
    const size_t len = std::min(kBlock, count - base);
    std::memcpy(acc, static_cast<const T*>(srcs[0]) + base, len * sizeof(T));
    // Fold up to four sources per accumulator pass.
    for (int k = 1; k < n;) {
      const int take = std::min(4, n - k);
      const T* __restrict a = static_cast<const T*>(srcs[k]) + base;
      const T* __restrict b = static_cast<const T*>(srcs[k + (take > 1)]) + base;
      const T* __restrict c = static_cast<const T*>(srcs[k + 2 * (take > 2)]) + base;
      const T* __restrict d = static_cast<const T*>(srcs[k + 3 * (take > 3)]) + base;
      switch (take) {
        case 4: for (size_t i = 0; i < len; ++i) acc[i] = fold(fold(fold(fold(acc[i], a[i]), b[i]), c[i]), d[i]); break;
        case 3: for (size_t i = 0; i < len; ++i) acc[i] = fold(fold(fold(acc[i], a[i]), b[i]), c[i]); break;
        case 2: for (size_t i = 0; i < len; ++i) acc[i] = fold(fold(acc[i], a[i]), b[i]); break;
        default: for (size_t i = 0; i < len; ++i) acc[i] = fold(acc[i], a[i]); break;
      }
      k += take;
    }
    for (int d = 0; d < num_outs; ++d) CopyBytes(outs[d] + base, acc, len * sizeof(T), streaming);
  }
}

template <uint16_t (*ToBits)(float), float (*FromBits)(uint16_t)>
void ReduceHalf(ReduceOp op, void* const* outs, int num_outs, const void* const* srcs, int n, size_t count, bool streaming) {
  constexpr size_t kBlock = 1024;
  float acc[kBlock];
  uint16_t rounded[kBlock];
  for (size_t base = 0; base < count; base += kBlock) {
    size_t len = std::min(kBlock, count - base);
    const uint16_t* s0 = static_cast<const uint16_t*>(srcs[0]) + base;
    for (size_t i = 0; i < len; ++i) acc[i] = FromBits(s0[i]);
    for (int k = 1; k < n; ++k) {
      const uint16_t* s = static_cast<const uint16_t*>(srcs[k]) + base;
      switch (op) {
        case ReduceOp::kSum: for (size_t i = 0; i < len; ++i) acc[i] += FromBits(s[i]); break;
        case ReduceOp::kProd: for (size_t i = 0; i < len; ++i) acc[i] *= FromBits(s[i]); break;
        default: for (size_t i = 0; i < len; ++i) acc[i] = FloatMaxMin(op, acc[i], FromBits(s[i])); break;
      }
    }
    for (size_t i = 0; i < len; ++i) rounded[i] = ToBits(acc[i]);
    for (int d = 0; d < num_outs; ++d)
      CopyBytes(static_cast<uint16_t*>(outs[d]) + base, rounded, len * sizeof(uint16_t), streaming);
  }
}

template <typename F>
void ReduceFloat(ReduceOp op, void* const* outs, int num_outs, const void* const* srcs, int n, size_t count, bool streaming) {
  F* const* o = reinterpret_cast<F* const*>(outs);
  switch (op) {
    case ReduceOp::kSum: return ReduceLoop<F>(o, num_outs, srcs, n, count, streaming, [](F a, F b) { return a + b; });
    case ReduceOp::kProd: return ReduceLoop<F>(o, num_outs, srcs, n, count, streaming, [](F a, F b) { return a * b; });
    case ReduceOp::kMax: return ReduceLoop<F>(o, num_outs, srcs, n, count, streaming, [](F a, F b) { return FloatMaxMin(ReduceOp::kMax, a, b); });
    default: return ReduceLoop<F>(o, num_outs, srcs, n, count, streaming, [](F a, F b) { return FloatMaxMin(ReduceOp::kMin, a, b); });
  }
}

template <typename S, typename U>
void ReduceInt(ReduceOp op, void* const* outs, int num_outs, const void* const* srcs, int n, size_t count, bool streaming) {
  S* const* o = reinterpret_cast<S* const*>(outs);
  switch (op) {
    case ReduceOp::kSum: return ReduceLoop<S>(o, num_outs, srcs, n, count, streaming, [](S a, S b) { return WrapCombine<S, U>(ReduceOp::kSum, a, b); });
    case ReduceOp::kProd: return ReduceLoop<S>(o, num_outs, srcs, n, count, streaming, [](S a, S b) { return WrapCombine<S, U>(ReduceOp::kProd, a, b); });
    case ReduceOp::kMax: return ReduceLoop<S>(o, num_outs, srcs, n, count, streaming, [](S a, S b) { return std::max(a, b); });
    default: return ReduceLoop<S>(o, num_outs, srcs, n, count, streaming, [](S a, S b) { return std::min(a, b); });
  }
}

// Complex sums are sums of the interleaved (re, im) floats; products fold
// pairs in rank order like every other kernel.
template <typename F>
void ReduceComplex(ReduceOp op, void* const* outs, int num_outs, const void* const* srcs, int n, size_t count, bool streaming) {
  struct C { F re, im; };
  if (op == ReduceOp::kSum) return ReduceFloat<F>(op, outs, num_outs, srcs, n, 2 * count, streaming);
  C* const* o = reinterpret_cast<C* const*>(outs);
  ReduceLoop<C>(o, num_outs, srcs, n, count, streaming,
                [](C a, C b) { return C{a.re * b.re - a.im * b.im, a.re * b.im + a.im * b.re}; });
}

}  // namespace

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
  switch (dtype) {
    case DType::F32: return ReduceFloat<float>(op, outs, num_outs, srcs, num_srcs, count, streaming);
    case DType::F64: return ReduceFloat<double>(op, outs, num_outs, srcs, num_srcs, count, streaming);
    case DType::F16: return ReduceHalf<FloatToF16, F16ToFloat>(op, outs, num_outs, srcs, num_srcs, count, streaming);
    case DType::BF16: return ReduceHalf<FloatToBf16, Bf16ToFloat>(op, outs, num_outs, srcs, num_srcs, count, streaming);
    case DType::S8: return ReduceInt<int8_t, uint8_t>(op, outs, num_outs, srcs, num_srcs, count, streaming);
    case DType::S32: return ReduceInt<int32_t, uint32_t>(op, outs, num_outs, srcs, num_srcs, count, streaming);
    case DType::S64: return ReduceInt<int64_t, uint64_t>(op, outs, num_outs, srcs, num_srcs, count, streaming);
    case DType::U8: return ReduceInt<uint8_t, uint8_t>(op, outs, num_outs, srcs, num_srcs, count, streaming);
    case DType::U32: return ReduceInt<uint32_t, uint32_t>(op, outs, num_outs, srcs, num_srcs, count, streaming);
    case DType::PRED: return ReduceInt<uint8_t, uint8_t>(op, outs, num_outs, srcs, num_srcs, count, streaming);
    case DType::C64: return ReduceComplex<float>(op, outs, num_outs, srcs, num_srcs, count, streaming);
    case DType::C128: return ReduceComplex<double>(op, outs, num_outs, srcs, num_srcs, count, streaming);
  }
}

}  // namespace strata
