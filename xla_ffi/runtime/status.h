// Every runtime call returns a Status (as NCCL returns ncclResult_t): errors
// travel back to the FFI handler, which turns them into a Python exception.
#pragma once
#include <string>
#include <utility>

namespace strata {

struct Status {
  bool ok = true;
  std::string message;

  static Status Ok() { return {}; }
  static Status Error(std::string msg) { return {false, std::move(msg)}; }
};

#define STRATA_RETURN_IF_ERROR(expr)          \
  do {                                        \
    ::strata::Status _st = (expr);            \
    if (!_st.ok) return _st;                  \
  } while (0)

}  // namespace strata
