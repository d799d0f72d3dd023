"""The C++ layers' includes point down only (docs/architecture.md): runtime/ names no
other layer; algorithms/ and model/ build on runtime/ and not on each other; bindings/
may use them all. An include that runs up would make the runtime depend on what it runs."""
import re
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "xla_ffi"
MAY_INCLUDE = {
    "runtime": set(),
    "algorithms": {"runtime"},
    "model": {"runtime"},
    "bindings": {"runtime", "algorithms", "model"},
}
INCLUDE = re.compile(r'^\s*#\s*include\s+"\.\./([a-z_]+)/([^"]+)"', re.MULTILINE)


def test_includes_point_down():
    assert set(p.name for p in SRC.iterdir() if p.is_dir()) == set(MAY_INCLUDE)
    wrong = []
    for layer, allowed in MAY_INCLUDE.items():
        for path in sorted((SRC / layer).iterdir()):
            for target_layer, target in INCLUDE.findall(path.read_text()):
                edge = (f"{layer}/{path.name}", f"{target_layer}/{target}")
                if target_layer not in allowed:
                    wrong.append(" -> ".join(edge))
    assert not wrong, "includes that run up a layer:\n" + "\n".join(wrong)
