#include "rendezvous.h"

#include <algorithm>
#include <cstdlib>
#include <map>
#include <thread>
#include <sstream>
#include <tuple>

namespace strata {

using Clock = std::chrono::steady_clock;

namespace {

using SlotKey = std::tuple<int64_t, int64_t, int32_t, int64_t>;
using SiteKey = std::tuple<int64_t, int64_t, int32_t>;

struct SiteState {
  std::vector<int64_t> next_iteration;
  Clock::time_point touched;
};

std::mutex g_mu;
std::map<SlotKey, std::shared_ptr<Slot>> g_slots;
std::map<SiteKey, SiteState> g_sites;
std::map<const Slot*, SlotKey> g_slot_keys;

// Drops bookkeeping of runs nobody touched for a while, and tombstones of
// aborted slots that every thread has left. Caller holds g_mu.
void PruneLocked(Clock::time_point now) {
  if (g_sites.size() > 4096) {
    for (auto it = g_sites.begin(); it != g_sites.end();)
      it = now - it->second.touched > std::chrono::seconds(120) ? g_sites.erase(it) : std::next(it);
  }
  if (g_slots.size() > 1024) {
    for (auto it = g_slots.begin(); it != g_slots.end();) {
      Slot& s = *it->second;
      std::lock_guard<std::mutex> lock(s.mu);
      bool stale = s.aborted && s.inside == 0 && now - s.aborted_at > std::chrono::seconds(60);
      if (stale) g_slot_keys.erase(&s);
      it = stale ? g_slots.erase(it) : std::next(it);
    }
  }
}

std::string RankList(const std::vector<char>& present, bool want) {
  std::ostringstream os;
  os << '[';
  bool first = true;
  for (size_t i = 0; i < present.size(); ++i) {
    if ((present[i] != 0) != want) continue;
    os << (first ? "" : ", ") << i;
    first = false;
  }
  os << ']';
  return os.str();
}

// Caller holds s.mu.
void AbortLocked(Slot& s, const std::string& why) {
  if (!s.aborted) {
    s.aborted = true;
    s.error = why;
    s.aborted_at = Clock::now();
  }
  s.cv.notify_all();
}

}  // namespace

Rendezvous::Rendezvous(const Participant& who) : who_(who) {
  std::lock_guard<std::mutex> lock(g_mu);
  Clock::time_point now = Clock::now();
  SiteState& site = g_sites[SiteKey{who.run_id, who.site_id, who.group_id}];
  if (site.next_iteration.size() < static_cast<size_t>(who.group_size))
    site.next_iteration.resize(who.group_size, 0);
  site.touched = now;
  int64_t iteration = site.next_iteration[who.rank]++;
  SlotKey key{who.run_id, who.site_id, who.group_id, iteration};
  auto& slot = g_slots[key];
  if (!slot) {
    PruneLocked(now);
    slot = std::make_shared<Slot>(who.group_size);
    g_slot_keys[slot.get()] = key;
  }
  slot_ = slot;
  std::lock_guard<std::mutex> slock(slot_->mu);
  slot_->inside++;
}

Rendezvous::~Rendezvous() {
  bool erase = false;
  {
    std::lock_guard<std::mutex> lock(slot_->mu);
    slot_->inside--;
    slot_->left++;
    erase = !slot_->aborted && slot_->left == slot_->n;
  }
  if (!erase) return;
  std::lock_guard<std::mutex> lock(g_mu);
  auto it = g_slot_keys.find(slot_.get());
  if (it != g_slot_keys.end()) {
    g_slots.erase(it->second);
    g_slot_keys.erase(it);
  }
}

// Each wait gets the full timeout: a long exchange is not a missing peer.
Clock::time_point Rendezvous::Deadline() const {
  return Clock::now() + std::chrono::microseconds(static_cast<int64_t>(who_.timeout_s * 1e6));
}

std::string Rendezvous::Prefix() const {
  std::ostringstream os;
  os << who_.opname << " (call site " << who_.site_id << ", group " << who_.group_id << ", rank "
     << who_.rank << " of " << who_.group_size << ", device " << who_.device << "): ";
  return os.str();
}

Status Rendezvous::Fail(const Status& st) {
  std::lock_guard<std::mutex> lock(slot_->mu);
  AbortLocked(*slot_, st.message);
  return Status::Error(slot_->error);
}

Status Rendezvous::Arrive(std::vector<void*> ptrs, std::string signature,
                          const std::function<Status(Slot&)>& on_all_arrived) {
  Slot& s = *slot_;
  std::unique_lock<std::mutex> lock(s.mu);
  if (s.aborted) return Status::Error(s.error);
  if (s.n != who_.group_size) {
    AbortLocked(s, Prefix() + "ranks disagree on the group size (" + std::to_string(s.n) +
                       " vs " + std::to_string(who_.group_size) + ")");
    return Status::Error(s.error);
  }
  if (s.present[who_.rank]) {
    AbortLocked(s, Prefix() + "two calls claim the same rank");
    return Status::Error(s.error);
  }
  s.present[who_.rank] = 1;
  s.ptrs[who_.rank] = std::move(ptrs);
  s.devices[who_.rank] = who_.device;
  s.signatures[who_.rank] = std::move(signature);
  if (++s.arrived == s.n) {
    std::ostringstream bad;
    for (int r = 1; r < s.n; ++r)
      if (s.signatures[r] != s.signatures[0]) bad << "\n  rank " << r << ": " << s.signatures[r];
    if (!bad.str().empty()) {
      std::ostringstream os;
      os << who_.opname << " (call site " << who_.site_id << ", group " << who_.group_id
         << "): ranks disagree on the op.\n  rank 0: " << s.signatures[0] << bad.str();
      AbortLocked(s, os.str());
      return Status::Error(s.error);
    }
    if (on_all_arrived) {
      Status st = on_all_arrived(s);
      if (!st.ok) {
        AbortLocked(s, Prefix() + st.message);
        return Status::Error(s.error);
      }
    }
    s.cv.notify_all();
    return Status::Ok();
  }
  bool ok = s.cv.wait_until(lock, Deadline(), [&] { return s.arrived == s.n || s.aborted; });
  if (s.aborted) return Status::Error(s.error);
  if (!ok) {
    std::ostringstream os;
    os << Prefix() << "timed out after " << who_.timeout_s << " s waiting for ranks "
       << RankList(s.present, false) << " (arrived: " << RankList(s.present, true)
       << "). A peer never reached this collective: ranks took different control flow, "
       << "or a peer failed. Raise strata.config(timeout_s=...) if peers are only slow.";
    AbortLocked(s, os.str());
    return Status::Error(s.error);
  }
  return Status::Ok();
}

Status Rendezvous::Barrier(const char* phase) {
  Slot& s = *slot_;
  std::unique_lock<std::mutex> lock(s.mu);
  if (s.aborted) return Status::Error(s.error);
  int64_t gen = s.phase_gen;
  if (++s.phase_count == s.n) {
    s.phase_count = 0;
    s.phase_gen++;
    s.next_task.store(0);
    s.workers.store(0);
    s.cv.notify_all();
    return Status::Ok();
  }
  bool ok = s.cv.wait_until(lock, Deadline(), [&] { return s.phase_gen != gen || s.aborted; });
  if (s.aborted) return Status::Error(s.error);
  if (!ok) {
    AbortLocked(s, Prefix() + "timed out after " + std::to_string(who_.timeout_s) +
                       " s in phase '" + phase + "'");
    return Status::Error(s.error);
  }
  return Status::Ok();
}

int HostWorkers() {
  static const int workers = [] {
    const char* env = std::getenv("STRATA_HOST_WORKERS");
    int n = env ? std::atoi(env) : 0;
    if (n <= 0) n = static_cast<int>(std::thread::hardware_concurrency());
    return std::max(1, n);
  }();
  return workers;
}

int64_t LiveSlotCount() {
  std::lock_guard<std::mutex> lock(g_mu);
  int64_t live = 0;
  for (auto& kv : g_slots) {
    std::lock_guard<std::mutex> slock(kv.second->mu);
    if (!kv.second->aborted) live++;
  }
  return live;
}

}  // namespace strata
