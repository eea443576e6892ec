"""Shared pieces of the side-by-side benchmarks (benchmarks/peer_*.py): the same GPT, data and
step for every system, step-time helpers, machine notes, the JSON line and optional PNG plot.

Nothing here imports `elastic`: the peers (Ray Train, a plain DDP loop) run without the framework.
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from itertools import pairwise
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _p in (os.path.join(ROOT, "examples"), os.path.join(ROOT, "benchmarks"), ROOT):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import gpt  # noqa: E402
from chaos.services import wait_until  # noqa: E402


def ship_by_value(*modules) -> None:
    """Workers of a local Ray cannot import benchmarks/ or examples/ by name: pickle by value."""
    from ray import cloudpickle
    for module in (gpt, sys.modules[__name__], *modules):
        if module.__name__ != "__main__":
            cloudpickle.register_pickle_by_value(module)


def _mix(*parts: Any) -> int:
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:8], "little") & ((1 << 63) - 1)


class Batches:
    """The same per-rank batches as the framework's loader: a seeded order per epoch, rank r reads
    global positions [seen + r*B, seen + (r+1)*B). Per-step seeding like the framework's loader."""

    def __init__(self, model_size: str, batch_size: int, seed: int = 0, n_samples: int = 100_000):
        cfg = gpt.GPTConfig.named(model_size)
        self.data = gpt.SyntheticTokens(n_samples, cfg.seq_len, cfg.vocab, seed=seed)
        self.batch_size, self.seed = batch_size, seed
        self._order: tuple[int, torch.Tensor] | None = None

    def _index(self, position: int) -> int:
        epoch, pos = divmod(position, len(self.data))
        if self._order is None or self._order[0] != epoch:
            g = torch.Generator().manual_seed(_mix(self.seed, "epoch", epoch))
            self._order = (epoch, torch.randperm(len(self.data), generator=g))
        return int(self._order[1][pos])

    def batch(self, step: int, rank: int, world_size: int) -> torch.Tensor:
        torch.manual_seed(_mix(self.seed, "step", step, rank))
        start = step * world_size * self.batch_size + rank * self.batch_size
        return torch.stack([self.data[self._index(p)] for p in range(start, start + self.batch_size)])


def build_model(model_size: str, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return gpt.GPT(gpt.GPTConfig.named(model_size))


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: torch.Tensor) -> torch.Tensor:
    """Exactly gpt.train_loop's step body."""
    logits = model(batch[:, :-1])
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss


def steady_rate(times: list[float], skip: int) -> float:
    """Steps per second over completion times `times` (one per step), after `skip` warm-up steps."""
    t = times[skip:]
    if len(t) < 2:
        raise ValueError(f"need at least {skip + 2} step times, got {len(times)}")
    return (len(t) - 1) / (t[-1] - t[0])


def median_interval(times: list[float]) -> float | None:
    gaps = [b - a for a, b in pairwise(times)]
    return round(statistics.median(gaps), 4) if gaps else None


def machine() -> dict:
    load = os.getloadavg() if hasattr(os, "getloadavg") else (None,)
    return {"machine": f"{platform.machine()} {os.cpu_count()} cores", "loadavg_1m_at_start": round(load[0], 2),
            "torch": torch.__version__, "note": "shared machine: compare the systems side by side in one run"}


def read_json(path: str) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def read_jsonl(path: str) -> list[dict]:
    try:
        with open(path) as f:
            return [json.loads(line) for line in f if line.strip().endswith("}")]
    except FileNotFoundError:
        return []


def wait_for(condition: Callable[[], Any], timeout_s: float, poll_s: float = 0.02) -> Any:
    """Poll `condition` (chaos.services.wait_until) until it returns something truthy, and return
    that; None when `timeout_s` passes first."""
    seen: list[Any] = [None]

    def holds() -> bool:
        seen[0] = condition()
        return bool(seen[0])
    try:
        wait_until(holds, timeout_s, "a benchmark condition", interval_s=poll_s)
    except TimeoutError:
        return None
    return seen[0]


class CpuSampler:
    """CPU seconds (user + system, from /proc) of this Ray instance's processes over time, by
    category, so that a system's cost per step can be read for any window of the run. On a shared
    machine CPU time per step moves much less with other users' load than steps per second."""

    def __init__(self, categorise: Callable[[], dict[int, str]], interval_s: float = 0.2):
        import threading
        self._categorise, self._interval = categorise, interval_s
        self._last: dict[int, tuple[str, float]] = {}
        self.samples: list[tuple[float, dict[str, float]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                for pid, category in self._categorise().items():
                    cpu = cpu_seconds(pid)
                    if cpu is not None:
                        self._last[pid] = (category, cpu)
            except Exception:   # noqa: BLE001 - a process vanished mid-scan: the next sample has it
                pass
            totals: dict[str, float] = {}
            for category, cpu in self._last.values():
                totals[category] = totals.get(category, 0.0) + cpu
            self.samples.append((time.time(), totals))
            self._stop.wait(self._interval)

    def __enter__(self) -> CpuSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _at(self, t: float) -> dict[str, float]:
        before = [s for s in self.samples if s[0] <= t]
        return (before[-1] if before else self.samples[0])[1]

    def per_step(self, t_start: float, t_end: float, steps: int) -> dict[str, float]:
        """CPU seconds per step by category between two step-completion times."""
        a, b = self._at(t_start), self._at(t_end)
        out = {k: round((b.get(k, 0.0) - a.get(k, 0.0)) / steps, 4) for k in sorted(set(a) | set(b))}
        out["total"] = round(sum(out.values()), 4)
        return out


def descendants(root: int | None = None) -> dict[int, str]:
    """pid -> command line (first 80 chars) of every descendant of `root` (default: this process),
    from /proc (psutil is only importable here once Ray has been imported)."""
    root = os.getpid() if root is None else root
    parent: dict[int, int] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    parent[int(name)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    found, frontier = {}, [root]
    while frontier:
        kids = [p for p, pp in parent.items() if pp in frontier and p not in found]
        for pid in kids:
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    found[pid] = f.read().replace(b"\0", b" ").decode(errors="replace").strip()[:80]
            except OSError:
                found[pid] = ""
        frontier = kids
    return found


def ray_processes() -> dict[int, str]:
    """This driver's Ray instance: pid -> process title (ray::..., raylet, gcs_server, ...)."""
    return descendants()


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of `pid` so far."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


def emit(result: dict, plot_path: str | None, plot: Callable[[Any, dict], None] | None,
         out_path: str | None = None) -> None:
    """Print the one JSON line (and write it to `out_path`: Ray prints its own worker-death notices
    to the driver's stdout); with `plot_path`, draw `plot(fig, result)` into a PNG."""
    if plot_path and plot is not None:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig = plt.figure(figsize=(9, 5))
        try:
            plot(fig, result)
            fig.tight_layout()
            os.makedirs(os.path.dirname(os.path.abspath(plot_path)), exist_ok=True)
            fig.savefig(plot_path, dpi=110)
        finally:
            plt.close(fig)
        result = {**result, "plot": plot_path}
    line = json.dumps(result)
    if out_path:
        os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
        with open(out_path, "w") as f:
            f.write(line + "\n")
    print(line, flush=True)
