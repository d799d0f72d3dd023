"""Which TSan reports are about the project's code.

XLA, jaxlib, numpy and Python are not built with -fsanitize=thread, so TSan
sees none of their synchronisation: every buffer XLA hands a handler (written
by an XLA or numpy thread, released to us through XLA's own futures) looks
raced, and their mutex/condvar use through libstdc++ looks broken. A
suppressions file cannot tell those apart from ours (the stacks mix both), so
this keeps a report only when the project is on both sides of it:

- a data race counts when both accesses have a frame in xla_ffi/ (two of our
  threads: workers, handlers, watchdog, completions, on our own state or on
  buffers we hand each other through our own locks);
- any other report (lock order, mutex misuse, signal safety, ...) counts when
  one of its access or acquisition stacks has a frame in xla_ffi/.

Thread-creation and heap-allocation stacks are ignored (every thread that runs
a handler was created by XLA). Usage: tsan_filter.py LOG... ; prints the
project's reports and exits 1 if there is any.
"""
from __future__ import annotations

import re
import sys

OURS = "/xla_ffi/"


def stacks(report: str) -> list[str]:
    """The access/acquisition stacks of a report, without thread-creation and
    allocation stacks."""
    out, current, keep = [], [], False
    for line in report.splitlines():
        if re.match(r"\s+#\d+ ", line):
            if keep:
                current.append(line)
            continue
        if current:
            out.append("\n".join(current))
            current = []
        keep = not ("created by" in line or "Location is" in line)
    if current:
        out.append("\n".join(current))
    return out


def is_ours(report: str) -> bool:
    parts = stacks(report)
    if "WARNING: ThreadSanitizer: data race" in report:
        return len(parts) >= 2 and all(OURS in p for p in parts[:2])
    return any(OURS in p for p in parts)


def main(paths: list[str]) -> int:
    found = 0
    for path in paths:
        text = open(path, errors="replace").read()
        for report in re.split(r"^={10,}$", text, flags=re.M):
            if "WARNING: ThreadSanitizer" in report and is_ours(report):
                found += 1
                print(f"== {path}\n{report.strip()}\n")
    print(f"tsan_filter: {found} report(s) in the project's code", file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
