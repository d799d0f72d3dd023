"""The watchdog of cross-process steps: XLA's cross-process collectives block
with no timeout when a peer process is gone, so a monitor thread ends the
process with a message naming the op, its ranks and the missing process when
a step (between its in-flight marks) waits past the op's timeout
(strata.config(timeout_s=)) or a peer stops its heartbeat (a counter each
process bumps in JAX's distributed key-value store; on one host a dead peer's
pid is also checked)."""
from __future__ import annotations

import atexit
import os
import socket
import sys
import threading
import time

import jax

from .. import _core
from .axis_split import process_count

_monitor_lock = threading.Lock()
_monitor_started = False
_seen: dict = {}  # process -> (last counter value, monotonic time it changed)
_kv_ok = [time.monotonic()]
HEARTBEAT_S = 0.25


def peer_timeout_s() -> float:
    """How long a peer's heartbeat may stand still while we wait for it in a
    cross-process step: STRATA_PEER_TIMEOUT_S (default 10 s), and at most half
    of jax.distributed's heartbeat_timeout_seconds, so strata names the op and
    the stalled process before JAX's coordination service aborts this one
    (with a 10 s heartbeat both fired at 10 s and JAX's SIGABRT won)."""
    try:
        limit = float(os.environ.get("STRATA_PEER_TIMEOUT_S", "10"))
    except ValueError:
        limit = 10.0
    if _jax_heartbeat_s[0]:
        limit = min(limit, 0.5 * _jax_heartbeat_s[0])
    return max(limit, 2 * HEARTBEAT_S)


# heartbeat_timeout_seconds given to jax.distributed.initialize (None: unknown).
_jax_heartbeat_s: list = [None]


def _capture_heartbeat_setting() -> None:
    """Records heartbeat_timeout_seconds when jax.distributed.initialize runs
    (JAX keeps it only inside its C++ client)."""
    try:
        import functools
        import inspect

        from jax._src import distributed
    except Exception:  # noqa: BLE001
        return
    original = distributed.State.initialize
    if getattr(original, "_strata_wrapped", False):
        return
    signature = inspect.signature(original)

    @functools.wraps(original)
    def initialize(self, *args, **kwargs):
        try:
            bound = signature.bind(self, *args, **kwargs)
            bound.apply_defaults()
            value = bound.arguments.get("heartbeat_timeout_seconds")
            _jax_heartbeat_s[0] = float(value) if value else None
        except Exception:  # noqa: BLE001
            pass
        return original(self, *args, **kwargs)

    initialize._strata_wrapped = True
    distributed.State.initialize = initialize


_capture_heartbeat_setting()


def _client():
    from jax._src import distributed

    return distributed.global_state.client


def ensure_monitor():
    global _monitor_started
    if _monitor_started or process_count() <= 1 or _client() is None:
        return
    with _monitor_lock:
        if _monitor_started:
            return
        _monitor_started = True
        threads = [threading.Thread(target=_heartbeat_loop, name="strata-heartbeat", daemon=True),
                   threading.Thread(target=_monitor_loop, name="strata-monitor", daemon=True)]
        for t in threads:
            t.start()

        def stop():
            # Before the interpreter ends its daemon threads: one inside a
            # key-value call would be unwound through C++ and abort the exit.
            _stop.set()
            for t in threads:
                t.join(timeout=2.0)

        atexit.register(stop)
        _install_excepthook()


_stop = threading.Event()


def _heartbeat_loop():
    first = _client()
    me = jax.process_index()
    host = socket.gethostname()
    beat = 0
    while not _stop.is_set():
        beat += 1
        client = _client()
        if client is None or client is not first:  # jax.distributed.shutdown()
            return
        try:
            client.key_value_set(f"strata/hb/{me}", f"{beat} {host} {os.getpid()}", allow_overwrite=True)
            now = time.monotonic()
            for key, value in client.key_value_dir_get("strata/hb/"):
                p = int(key.rsplit("/", 1)[1])
                count, phost, pid = value.split()
                last = _seen.get(p)
                if last is None or last[0] != count:
                    _seen[p] = (count, now, phost, int(pid))
            _kv_ok[0] = now
        except Exception:  # the coordinator is gone: the monitor reports it
            pass
        _stop.wait(HEARTBEAT_S)


def _pid_gone(pid: int) -> bool:
    """A local process that has exited (a zombie its parent has not reaped counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return False


def _dead_peers(procs, now, limit):
    host = socket.gethostname()
    dead = []
    for p in procs:
        if p == jax.process_index():
            continue
        seen = _seen.get(p)
        if seen is None:
            continue
        _, since, phost, pid = seen
        if phost == host and _pid_gone(pid):
            dead.append((p, f"its process {pid} is gone"))
            continue
        if now - since > limit:
            dead.append((p, f"no heartbeat for {now - since:.1f} s"))
    return dead


def _procs_in(what):
    import re

    return sorted({int(p) for p in re.findall(r"process (\d+):", what)}) or list(range(process_count()))


def _monitor_loop():
    while not _stop.wait(HEARTBEAT_S):
        try:
            inflight = _core_inflight()
        except Exception:
            continue
        if not inflight:
            continue
        now = time.monotonic()
        limit = peer_timeout_s()
        for site, device, age, what, timeout in inflight:
            dead = _dead_peers(_procs_in(what), now, limit)
            why = None
            if dead:
                why = "; ".join(f"process {p} ({reason})" for p, reason in dead) + " stopped responding"
            elif now - _kv_ok[0] > limit and age > limit:
                why = f"the coordination service (process 0) has been unreachable for {now - _kv_ok[0]:.1f} s"
            elif age > max(timeout, limit):
                why = (f"the peers did not complete it within {max(timeout, limit):.1f} s (strata.config "
                       f"timeout_s={timeout}); a peer process may be stuck or running another program")
            if why is not None:
                _fail(f"{what}: waited {age:.1f} s on process {jax.process_index()}, device {device}: {why}. "
                      f"XLA's cross-process collectives cannot be cancelled, so this process ends now "
                      f"instead of hanging.")


def diagnose() -> str | None:
    """What strata knows when a program failed inside a cross-process step:
    the op, its ranks per process and which peer process is gone; None when
    no step is in flight."""
    try:
        inflight = _core_inflight()
    except Exception:
        return None
    if not inflight:
        return None
    now = time.monotonic()
    lines = []
    for what in sorted({row[3] for row in inflight}):
        dead = _dead_peers(_procs_in(what), now, peer_timeout_s())
        why = ("; ".join(f"process {p} ({reason})" for p, reason in dead) + " stopped responding") if dead else \
            "no peer process is known to be gone"
        lines.append(f"{what} did not complete: {why}")
        if dead:
            _diagnosed_dead[0] = True
    return "\n".join(lines)


_diagnosed_dead = [False]


def _install_excepthook():
    """An uncaught error raised while a cross-process step was in flight (XLA
    reports gloo's "Connection closed by peer", which names no op) gets a note
    naming the strata op, its ranks and the missing process; when a peer is
    known to be gone the process then ends at once (JAX's shutdown barrier
    would only wait for the dead peer and abort)."""
    previous = sys.excepthook

    def hook(kind, value, tb):
        message = diagnose()
        if message and isinstance(value, BaseException):
            value.add_note(f"stratacl_jax: {message}")
        previous(kind, value, tb)
        if message and _diagnosed_dead[0]:
            sys.stderr.write(f"stratacl_jax: error: {message}\n")
            sys.stderr.flush()
            os._exit(75)

    sys.excepthook = hook


def _core_inflight():
    return _core.xproc_inflight()


def _fail(message):
    sys.stderr.write(f"stratacl_jax: error: {message}\n")
    sys.stderr.flush()
    os._exit(75)
