#include "observer.h"

#include <atomic>

namespace strata {

namespace {
std::atomic<OpObserver*> g_observer{nullptr};
}  // namespace

OpObserver* ActiveObserver() { return g_observer.load(std::memory_order_acquire); }
void SetObserver(OpObserver* observer) { g_observer.store(observer, std::memory_order_release); }

}  // namespace strata
