// Python access to the registration-on-allocation arenas: a block comes back
// as a numpy array that owns it, so the block returns to its arena exactly
// when the last reference (in the end, JAX's buffer) goes away.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <new>

#include "../runtime/arena.h"

namespace nb = nanobind;

void BindMemory(nb::module_& m) {
  // None when the arena cannot map the memory (Python names the op, the
  // size and the device; nothing was kept).
  m.def("arena_buffer", [](int device, size_t nbytes) -> nb::object {
    void* p = strata::ArenaFor(device).Allocate(nbytes);
    if (!p) return nb::none();
    nb::capsule owner(p, [](void* q) noexcept { strata::ArenaFree(q); });
    size_t shape[1] = {nbytes};
    return nb::cast(nb::ndarray<nb::numpy, uint8_t, nb::ndim<1>>(p, 1, shape, owner));
  });
  m.def("arena_info", [](int device) {
    strata::ArenaInfo i = strata::ArenaFor(device).Info();
    nb::dict d;
    d["chunks"] = i.chunks;
    d["bytes_reserved"] = i.bytes_reserved;
    d["chunks_released"] = i.chunks_released;
    d["bytes_in_use"] = i.bytes_in_use;
    d["live_blocks"] = i.live_blocks;
    d["allocations"] = i.allocations;
    return d;
  });
}
