#include "rendezvous.h"

#include <semaphore.h>
#include <signal.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <climits>
#include <deque>
#include <cstdlib>
#include <map>
#include <condition_variable>
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

// Never destroyed: detached runtime threads (workers, the watchdog,
// completion threads) may still touch these while the process exits.
SpinLock& g_mu = *new SpinLock;  // see spin_lock.h
std::map<SlotKey, std::shared_ptr<Slot>>& g_slots = *new std::map<SlotKey, std::shared_ptr<Slot>>;
std::map<SiteKey, SiteState>& g_sites = *new std::map<SiteKey, SiteState>;
std::map<const Slot*, SlotKey>& g_slot_keys = *new std::map<const Slot*, SlotKey>;

// Drops bookkeeping of runs nobody touched for a while, and tombstones of
// slots aborted over a minute ago (until then a late rank of a failed group
// finds the error there). Caller holds g_mu.
void PruneLocked(Clock::time_point now) {
  // At most once a second: a sweep is linear in what is kept.
  static Clock::time_point last_sweep;
  if (now - last_sweep < std::chrono::seconds(1)) return;
  last_sweep = now;
  if (g_sites.size() > 4096) {
    for (auto it = g_sites.begin(); it != g_sites.end();)
      it = now - it->second.touched > std::chrono::seconds(120) ? g_sites.erase(it) : std::next(it);
  }
  if (g_slots.size() > 1024) {
    for (auto it = g_slots.begin(); it != g_slots.end();) {
      // Declared before the lock, so the slot outlives it: erasing the map's
      // reference may free the slot, and unlocking a freed mutex writes into
      // freed heap memory (glibc then aborts somewhere else, much later).
      const std::shared_ptr<Slot> keep = it->second;
      Slot& s = *keep;
      std::lock_guard<SpinLock> lock(s.mu);
      bool stale = s.aborted && now - s.aborted_at > std::chrono::seconds(60);
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
}

// Slots waiting for ranks, checked by the watchdog.
std::vector<std::shared_ptr<Slot>>& g_pending = *new std::vector<std::shared_ptr<Slot>>;  // guarded by g_mu
std::condition_variable_any& g_watchdog_cv = *new std::condition_variable_any;
// When the watchdog wakes next (guarded by g_mu): a new slot wakes it only
// if its deadline comes sooner, which with one timeout for all is almost
// never, so an op does not pay a wake-up of the watchdog thread.
Clock::time_point g_watchdog_wake = Clock::time_point::min();
std::once_flag g_watchdog_once;

// Where the ranks missing from `s` are instead: the other slots of the same
// run and group (pending, or aborted not long ago) that they joined. A rank
// that skipped an op and called another is in one of those; naming it tells
// both sides which op the other side is at. Caller holds g_mu and s.mu; only
// the watchdog takes a second slot's lock while holding one, so this nesting
// cannot deadlock.
std::string ElsewhereLocked(Slot& s) {
  std::ostringstream os;
  auto lo = g_slots.lower_bound(SlotKey{s.run_id, INT64_MIN, INT32_MIN, INT64_MIN});
  for (auto it = lo; it != g_slots.end() && std::get<0>(it->first) == s.run_id; ++it) {
    Slot& o = *it->second;
    if (&o == &s || std::get<2>(it->first) != s.group_id || o.n != s.n) continue;
    std::lock_guard<SpinLock> lock(o.mu);
    std::vector<char> there(s.n, 0);
    bool any = false;
    for (int r = 0; r < s.n; ++r) {
      there[r] = !s.present[r] && o.present[r];
      any = any || there[r];
    }
    if (!any) continue;
    os << "\n  ranks " << RankList(there, true) << " are at " << o.opname << " (call site "
       << o.site_id;
    if (o.site_id == s.site_id) os << ", another instruction of it: e.g. the other branch of a lax.cond, or another call of a jitted helper";
    os << ", iteration " << std::get<3>(it->first) << ") instead";
    os << " (arrived there: " << RankList(o.present, true) << ")";
  }
  return os.str();
}

std::string MissingRanksError(Slot& s) {
  std::ostringstream os;
  os << s.opname << " (call site " << s.site_id << ", group " << s.group_id << "): timed out after "
     << s.timeout_s << " s waiting for ranks " << RankList(s.present, false)
     << " (arrived: " << RankList(s.present, true)
     << "). A peer never reached this collective: ranks took different control flow, "
     << "or a peer failed. Every rank of a group must issue the same collectives (the same "
     << "instructions of the program). Raise strata.config(timeout_s=...) if peers are only slow.";
  os << ElsewhereLocked(s);
  // What strata cannot undo (README, "Guaranteed, and not"): a rank held in
  // XLA's own rendezvous stays there, and XLA aborts the process later.
  os << "\n  If this program also runs XLA's own collectives (jax.lax.psum and the like, or ones autodiff "
     << "inserts), ranks that took the other path wait in XLA's rendezvous, which cannot be cancelled: XLA will "
     << "abort this process after its own timeout (~40-60 s). Save what you need and restart the process.";
  return os.str();
}

// Aborts `s` with `why` and hands back the completions to call (outside
// any lock). Caller holds s.mu.
std::vector<Completion> AbortAsyncLocked(Slot& s, const std::string& why) {
  AbortLocked(s, why);
  std::vector<Completion> out;
  for (auto& c : s.completions)
    if (c) out.push_back(std::move(c));
  s.completions.assign(s.n, nullptr);
  return out;
}

// Completions are cheap by contract: one that resumes an XLA program must
// move to a thread of its own first (see Complete in executor.h).
void Finish(std::vector<Completion> completions, const Status& st) {
  CompletionBatch batch;
  for (auto& c : completions) c(st);
}

void WatchdogLoop() {
  std::unique_lock<SpinLock> lock(g_mu);
  for (;;) {
    Clock::time_point now = Clock::now(), next = now + std::chrono::seconds(1);
    std::vector<std::pair<std::vector<Completion>, std::string>> expired;
    for (auto it = g_pending.begin(); it != g_pending.end();) {
      // g_pending often holds a finished slot's last reference: keep it past
      // the unlock (see PruneLocked).
      const std::shared_ptr<Slot> keep = *it;
      Slot& s = *keep;
      std::lock_guard<SpinLock> slock(s.mu);
      if (s.arrived == s.n || s.aborted) {
        it = g_pending.erase(it);
        continue;
      }
      if (s.deadline <= now) {
        std::string why = MissingRanksError(s);
        expired.emplace_back(AbortAsyncLocked(s, why), why);
        it = g_pending.erase(it);
        continue;
      }
      next = std::min(next, s.deadline);
      ++it;
    }
    if (!expired.empty()) {
      lock.unlock();
      for (auto& [completions, why] : expired) Finish(std::move(completions), Status::Error(why));
      lock.lock();
      continue;
    }
    g_watchdog_wake = next;
    g_watchdog_cv.wait_until(lock, next);
  }
}

void EraseSlot(const Slot* slot) {
  std::lock_guard<SpinLock> lock(g_mu);
  // Off the watchdog's list now: it wakes rarely (see g_watchdog_wake), and a
  // finished slot left there would keep its buffers' bookkeeping alive until
  // then. The caller still holds the slot, so this never frees it under g_mu.
  for (size_t i = g_pending.size(); i-- > 0;) {
    if (g_pending[i].get() != slot) continue;
    g_pending[i] = std::move(g_pending.back());
    g_pending.pop_back();
    break;
  }
  auto it = g_slot_keys.find(slot);
  if (it == g_slot_keys.end()) return;
  const auto [run, site, group, iteration] = it->second;
  g_slots.erase(it->second);
  g_slot_keys.erase(it);
  // Once every rank has run the site exactly this often and nothing of it is
  // in flight, its counters can go: a later call starts again at iteration 0,
  // whose slot is long gone. Keeps long runs from piling up bookkeeping.
  auto s = g_sites.find(SiteKey{run, site, group});
  if (s == g_sites.end()) return;
  for (int64_t next : s->second.next_iteration)
    if (next != iteration + 1) return;
  g_sites.erase(s);
}

// Runs whose ops were aborted by AbortPending, with why: a rank of such a
// run that reaches another op fails there at once. Guarded by g_mu; bounded.
std::map<int64_t, std::string>& g_aborted_runs = *new std::map<int64_t, std::string>;
std::deque<int64_t>& g_aborted_order = *new std::deque<int64_t>;
std::atomic<bool> g_refuse_new{false};
std::string& g_refuse_why = *new std::string;  // set once, before g_refuse_new

}  // namespace

int64_t AbortPending(const std::string& why, bool refuse_new) {
  std::vector<std::pair<std::vector<Completion>, std::string>> aborted;
  {
    std::lock_guard<SpinLock> lock(g_mu);
    if (refuse_new && !g_refuse_new.load()) {
      g_refuse_why = why;
      g_refuse_new.store(true);
    }
    for (auto it = g_pending.begin(); it != g_pending.end();) {
      const std::shared_ptr<Slot> keep = *it;  // past the unlock (see PruneLocked)
      Slot& s = *keep;
      std::lock_guard<SpinLock> slock(s.mu);
      it = g_pending.erase(it);
      if (s.arrived == s.n || s.aborted) continue;
      std::ostringstream os;
      os << s.opname << " (call site " << s.site_id << ", group " << s.group_id << "): aborted while "
         << "waiting for ranks " << RankList(s.present, false) << ": " << why;
      if (g_aborted_runs.emplace(s.run_id, why).second) g_aborted_order.push_back(s.run_id);
      aborted.emplace_back(AbortAsyncLocked(s, os.str()), os.str());
    }
    while (g_aborted_order.size() > 256) {
      g_aborted_runs.erase(g_aborted_order.front());
      g_aborted_order.pop_front();
    }
  }
  for (auto& [completions, message] : aborted) Finish(std::move(completions), Status::Error(message));
  return static_cast<int64_t>(aborted.size());
}

namespace {
sem_t g_interrupt_sem;
struct sigaction g_prev_sigint;

void OnInterrupt(int sig, siginfo_t* info, void* context) {
  const int saved_errno = errno;
  sem_post(&g_interrupt_sem);  // async-signal-safe; the thread below does the work
  errno = saved_errno;
  if (g_prev_sigint.sa_flags & SA_SIGINFO) {
    if (g_prev_sigint.sa_sigaction) g_prev_sigint.sa_sigaction(sig, info, context);
  } else if (g_prev_sigint.sa_handler == SIG_DFL) {
    signal(sig, SIG_DFL);
    raise(sig);
  } else if (g_prev_sigint.sa_handler != SIG_IGN) {
    g_prev_sigint.sa_handler(sig);
  }
}

void InterruptLoop() {
  for (;;) {
    if (sem_wait(&g_interrupt_sem) != 0) continue;  // EINTR
    AbortPending("interrupted (SIGINT)", /*refuse_new=*/false);
  }
}
}  // namespace

void InstallInterruptHandler() {
  static std::once_flag once;
  std::call_once(once, [] {
    struct sigaction now;
    if (sigaction(SIGINT, nullptr, &now) != 0 || (!(now.sa_flags & SA_SIGINFO) && now.sa_handler == SIG_IGN))
      return;  // SIGINT ignored: nothing would interrupt the program either
    sem_init(&g_interrupt_sem, 0, 0);
    std::thread([] {
      NameThisThread("strata-sigint");
      InterruptLoop();
    }).detach();
    g_prev_sigint = now;
    struct sigaction ours = {};
    ours.sa_sigaction = OnInterrupt;
    ours.sa_flags = SA_SIGINFO | (now.sa_flags & SA_RESTART);
    ours.sa_mask = now.sa_mask;
    sigaction(SIGINT, &ours, nullptr);
  });
}

void JoinAsync(const Participant& who, const PtrList& ptrs, const Signature& signature,
               Completion done, const Starter& start) {
  std::call_once(g_watchdog_once, [] {
    std::thread([] {
      NameThisThread("strata-watchdog");
      WatchdogLoop();
    }).detach();
  });
  std::shared_ptr<Slot> slot;
  {
    std::unique_lock<SpinLock> lock(g_mu);
    std::string refused;
    if (g_refuse_new.load()) {
      refused = g_refuse_why;
    } else if (auto run = g_aborted_runs.find(who.run_id); run != g_aborted_runs.end()) {
      refused = "this run's other ops were aborted: " + run->second;
    }
    if (!refused.empty()) {
      lock.unlock();
      std::ostringstream os;
      os << who.opname << " (call site " << who.site_id << ", group " << who.group_id << ", rank "
         << who.rank << " of " << who.group_size << "): not started: " << refused;
      done(Status::Error(os.str()));
      return;
    }
    Clock::time_point now = Clock::now();
    SiteState& site = g_sites[SiteKey{who.run_id, who.MeetingSite(), who.group_id}];
    if (site.next_iteration.size() < static_cast<size_t>(who.group_size))
      site.next_iteration.resize(who.group_size, 0);
    site.touched = now;
    int64_t iteration = site.next_iteration[who.rank]++;
    SlotKey key{who.run_id, who.MeetingSite(), who.group_id, iteration};
    auto& entry = g_slots[key];
    if (!entry) {
      PruneLocked(now);
      entry = std::make_shared<Slot>(who.group_size);
      entry->completions.resize(who.group_size);
      entry->deadline = now + std::chrono::microseconds(static_cast<int64_t>(who.timeout_s * 1e6));
      entry->timeout_s = who.timeout_s;
      entry->opname = who.opname;
      entry->run_id = who.run_id;
      entry->site_id = who.site_id;
      entry->instance_id = who.MeetingSite();
      entry->group_id = who.group_id;
      g_slot_keys[entry.get()] = key;
      g_pending.push_back(entry);
      if (entry->deadline < g_watchdog_wake) {
        g_watchdog_wake = entry->deadline;
        g_watchdog_cv.notify_all();
      }
    }
    slot = entry;
  }
  Slot& s = *slot;
  std::unique_lock<SpinLock> lock(s.mu);
  auto prefix = [&] {
    std::ostringstream os;
    os << who.opname << " (call site " << who.site_id << ", group " << who.group_id << ", rank "
       << who.rank << " of " << who.group_size << ", device " << who.device << "): ";
    return os.str();
  };
  if (s.aborted) {
    std::string why = s.error;
    lock.unlock();
    done(Status::Error(why));
    return;
  }
  if (s.n != who.group_size || s.present[who.rank]) {
    std::string why = prefix() + (s.n != who.group_size ? "ranks disagree on the group size"
                                                        : "two calls claim the same rank");
    auto completions = AbortAsyncLocked(s, why);
    lock.unlock();
    completions.push_back(std::move(done));
    Finish(std::move(completions), Status::Error(why));
    return;
  }
  s.present[who.rank] = 1;
  s.ptrs[who.rank] = ptrs;
  s.devices[who.rank] = who.device;
  if (s.first_in < 0) {
    s.first_in = who.rank;
    s.first_hash = signature.hash;
  }
  const bool agrees = signature.hash == s.first_hash;
  const bool keep = who.rank == s.first_in || !agrees;
  if (keep && signature.keep) s.descriptions[who.rank] = signature.keep();
  s.disagree = s.disagree || !agrees;
  s.completions[who.rank] = std::move(done);
  if (++s.arrived < s.n) return;

  // Last one in: the group is complete.
  Status st;
  if (s.disagree) {
    // Described: the first rank in and every rank that differs from it; the
    // ranks not listed agree with the first.
    std::ostringstream os;
    os << who.opname << " (call site " << who.site_id << ", group " << who.group_id
       << "): ranks disagree on the op (ranks not listed agree with rank " << s.first_in << ").";
    for (int r = 0; r < s.n; ++r)
      if (s.descriptions[r]) os << "\n  rank " << r << ": " << s.descriptions[r]();
    st = Status::Error(os.str());
  }
  std::shared_ptr<Job> job;
  if (st.ok) {
    st = start(s, &job);
    if (!st.ok) st = Status::Error(prefix() + st.message);
  }
  if (!st.ok) {
    auto completions = AbortAsyncLocked(s, st.message);
    lock.unlock();
    Finish(std::move(completions), st);
    return;
  }
  // Left empty: every later join of this slot is refused before it could
  // index it (AbortAsyncLocked copes), and refilling it was an allocation.
  std::vector<Completion> completions = std::move(s.completions);
  s.completions.clear();
  lock.unlock();
  if (!job) job = std::make_shared<Job>();
  job->on_done = [slot, completions = std::move(completions), cleanup = std::move(job->on_done)]() mutable {
    if (cleanup) cleanup();
    EraseSlot(slot.get());
    Finish(std::move(completions), Status::Ok());
  };
  // The last rank in is an XLA thread with nothing else to do for this op:
  // it works on the job rather than waking another worker for its share.
  Submit(std::move(job), /*help=*/true);
}

Signature Signature::Of(std::string text) {
  Signature sig;
  sig.hash = SignatureHasher().Add(text.data(), text.size()).hash();
  sig.keep = [text = std::move(text)] { return std::function<std::string()>([text] { return text; }); };
  return sig;
}

int64_t LiveSlotCount() {
  std::lock_guard<SpinLock> lock(g_mu);
  int64_t live = 0;
  for (auto& kv : g_slots) {
    std::lock_guard<SpinLock> slock(kv.second->mu);
    if (!kv.second->aborted) live++;
  }
  return live;
}

}  // namespace strata
