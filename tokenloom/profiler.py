"""Where an engine step's time goes: named sections accumulated across steps.

Off by default (a disabled section costs one attribute lookup). `tokenloom bench throughput
--profile` turns it on and prints `report()`.
"""
from __future__ import annotations

import time
from collections import defaultdict


class _Section:
    __slots__ = ("profiler", "name", "start")

    def __init__(self, profiler: "StepProfiler", name: str):
        self.profiler, self.name = profiler, name

    def __enter__(self):
        self.start = time.perf_counter()

    def __exit__(self, *exc):
        self.profiler.totals[self.name] += time.perf_counter() - self.start


class _Null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


_NULL = _Null()

# Report rows: (section, parent). Children's time is part of their parent's.
_LAYOUT = [("schedule", None), ("prepare_inputs", None), ("forward", None), ("attention", "forward"),
           ("matmul", "forward"), ("lora", "forward"), ("sampling", None), ("update", None), ("detokenize", None)]


class StepProfiler:
    def __init__(self):
        self.enabled = False
        self.totals: dict[str, float] = defaultdict(float)
        self.steps = 0

    def section(self, name: str):
        return _Section(self, name) if self.enabled else _NULL

    def reset(self) -> None:
        self.totals.clear()
        self.steps = 0

    def report(self) -> list[dict]:
        total = sum(self.totals[name] for name, parent in _LAYOUT if parent is None) or 1e-12
        rows = []
        for name, parent in _LAYOUT:
            rows.append({"phase": name if parent is None else f"  {name}", "seconds": self.totals[name],
                         "share": self.totals[name] / total})
            if name == "lora":
                other = self.totals["forward"] - self.totals["attention"] - self.totals["matmul"] - self.totals["lora"]
                rows.append({"phase": "  other", "seconds": other, "share": other / total})
        return rows

    def format(self) -> str:
        lines = [f"{'phase':<18}{'seconds':>10}{'share':>9}"]
        lines += [f"{r['phase']:<18}{r['seconds']:>10.3f}{100 * r['share']:>8.1f}%" for r in self.report()]
        return "\n".join(lines)


PROFILER = StepProfiler()
