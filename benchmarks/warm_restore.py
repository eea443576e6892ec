"""Warm restore (issue 15 part 4): one source broadcasting the whole state (the warm rung before,
`broadcast.broadcast_state` from rank 0 to every rank) against every survivor sending a slice in
place (`warm_slices.send_slices`, the warm rung now), on 4 local gloo processes (no Ray), with
the `base` GPT's state (model and AdamW after one step).

Every rank holds the same state (same seed, same batch, as DDP's replicas do) in its old
objects; each rep builds new objects (other initial weights) on every rank and restores them, the
two ways alternated rep by rep (so a change in the machine's load hits both alike), each step
as `Restorer._warm` takes it: the state dict (a source's held state; a receiver's template), the
transfer, the load. Every rank's restored state is checked bitwise against the held one. Per rank:
- `time_s`: its restore, from a barrier to the new objects loaded; `restore_s` is the slowest
  rank's (the generation's next step waits for it);
- memory, from the kernel's resident-set high-water mark (VmHWM, reset by writing 5 to
  /proc/self/clear_refs at the start of each phase; glibc is told to map every buffer over
  128 KiB on its own, MALLOC_MMAP_THRESHOLD_, so a freed buffer leaves the resident set):
  `transfer_extra_mb`, the growth during the transfer over the resident size at its start (the
  issue's "extra memory": the buffers that moving the state takes); `load_extra_mb`, the same for
  the load; `restore_extra_mb`, the whole restore's peak over what the rank holds after it;
- `counted_extra_mb`: the bytes of the buffers the transfer allocates, by the code (before: the
  flat buffer on the source, the flat buffer and the per-tensor clones on a receiver; now:
  `Transfer.extra_bytes`).

Scenarios at 4 ranks: `replace_one` (ranks 0-2 survived, rank 3 is new: 3 sources, 1 receiver)
and `replace_two` (ranks 0 and 2 survived: 2 sources, 2 receivers).

    python benchmarks/warm_restore.py --reps 6
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))
sys.path.insert(0, ROOT)

WORLD = 4
SCENARIOS = {"replace_one": (0, 1, 2), "replace_two": (0, 2)}
WAYS = ("one_source_broadcast", "slices")
MB = 1 << 20


def _status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {key} in /proc/self/status")


def _rank(rank: int, port: int, reps: int, model_size: str, out: str) -> None:
    import torch
    import torch.distributed as dist

    import gpt
    from elastic._worker.broadcast import _numel, _slots, _split_tree, broadcast_state
    from elastic._worker.precision import Precision
    from elastic._worker.train_state import Progress, TrainState
    from elastic._worker.warm_slices import send_slices

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    cpu = torch.device("cpu")
    cfg = gpt.GPTConfig.named(model_size)

    def objects(seed: int) -> TrainState:
        torch.manual_seed(seed)
        model = gpt.GPT(cfg)
        return TrainState({"model": model, "optimizer": torch.optim.AdamW(model.parameters(), lr=3e-4)},
                          progress=Progress(), precision=Precision("fp32", "ddp", cpu, None))

    old = objects(0)
    model, optimizer = old.objects["model"], old.objects["optimizer"]
    batch = torch.randint(0, cfg.vocab, (8, cfg.seq_len + 1), generator=torch.Generator().manual_seed(1))
    logits = model(batch[:, :-1])
    torch.nn.functional.cross_entropy(logits.reshape(-1, cfg.vocab), batch[:, 1:].reshape(-1)).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    old.progress.step = 1
    held_tensors: list[torch.Tensor] = []
    _split_tree(old.state_dict(), held_tensors)
    state_bytes = sum(t.numel() * t.element_size() for t in held_tensors)
    del held_tensors, logits

    marks: list[tuple[str, int, int]] = []     # (phase, resident bytes at its start, high-water mark at its end)

    def phase(name: str) -> None:
        """Close the running phase (its high-water mark) and start `name` (a fresh mark)."""
        if marks:
            marks[-1] = (marks[-1][0], marks[-1][1], _status("VmHWM"))
        if name:
            Path("/proc/self/clear_refs").write_text("5")
            marks.append((name, _status("VmRSS"), 0))

    def one_source(new: TrainState, sources: tuple[int, ...]) -> int:
        """The warm rung before: rank 0's whole state to every rank, survivors included."""
        phase("state_dict")
        payload = old.state_dict() if rank == 0 else None
        phase("transfer")
        payload = broadcast_state(payload, 0, cpu)
        phase("load")
        new.load_state_dict(payload, source="rank 0")
        phase("")
        slots = _slots(_split_tree(payload, []))
        total = sum(s.dtype.itemsize * _numel(s.shape) for s in slots)
        return total if rank == 0 else 2 * total       # the flat buffer; on a receiver its clones too

    def slices(new: TrainState, sources: tuple[int, ...]) -> int:
        """The warm rung now, step by step as Restorer._warm takes it."""
        phase("state_dict")
        if rank in sources:
            held, template = old.state_dict(), None
        else:
            held, template = None, new.state_dict()
        phase("transfer")
        transfer = send_slices(held, sources, cpu, into=template)
        phase("load")
        new.load_state_dict(transfer.state, source="the sources")
        phase("")
        return transfer.extra_bytes

    rows = []
    reference = _digest(old.state_dict())
    for rep in range(reps):
        for scenario, sources in SCENARIOS.items():
            order = WAYS if rep % 2 == 0 else tuple(reversed(WAYS))
            for way in order:
                survivor = rank in sources
                new = objects(100 + rep)
                gc.collect()
                dist.barrier()
                marks.clear()
                started = time.perf_counter()
                counted = (one_source if way == "one_source_broadcast" else slices)(new, sources)
                elapsed = time.perf_counter() - started
                gc.collect()
                after = _status("VmRSS")
                growth = {name: max(0, hwm - start) for name, start, hwm in marks}
                peak = max(hwm for _, _, hwm in marks)
                if _digest(new.state_dict()) != reference:
                    raise SystemExit(f"rank {rank}: {way} in {scenario} restored another state")
                rows.append({"rep": rep, "scenario": scenario, "way": way, "survivor": survivor,
                             "time_s": elapsed, "peak_extra": max(0, peak - max(after, marks[0][1])),
                             "transfer_extra": growth["transfer"], "load_extra": growth["load"],
                             "counted": counted})
                del new
                dist.barrier()
    Path(out, f"rank{rank}.json").write_text(json.dumps({"state_bytes": state_bytes, "rows": rows}))
    dist.destroy_process_group()



def _digest(state) -> str:
    import hashlib

    import torch

    from elastic._worker.warm_slices import _leaves
    h = hashlib.sha256()
    for path, t in _leaves(state):
        h.update(repr(path).encode())
        h.update(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=6)
    p.add_argument("--model-size", default="base")
    args = p.parse_args()

    import torch.multiprocessing as mp

    from chaos.services import free_port
    # Read at each process's start: buffers over 128 KiB are mapped on their own and returned on free.
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(128 * 1024)
    with tempfile.TemporaryDirectory(prefix="warm-") as out:
        mp.start_processes(_rank, args=(free_port(), args.reps, args.model_size, out), nprocs=WORLD,
                           start_method="spawn")
        results = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(WORLD)]
    state_bytes = results[0]["state_bytes"]
    summary: dict = {}
    for scenario, sources in SCENARIOS.items():
        slice_bytes = -(-state_bytes // len(sources))
        entry: dict = {"sources": list(sources), "slice_mb": round(slice_bytes / MB, 2)}
        for way in WAYS:
            per_rank = [[row for row in results[r]["rows"] if row["scenario"] == scenario and row["way"] == way]
                        for r in range(WORLD)]
            restore = [max(per_rank[r][i]["time_s"] for r in range(WORLD)) for i in range(args.reps)]
            entry[way] = {
                "restore_s_median": round(statistics.median(restore), 4),
                "restore_s_per_rep": [round(x, 4) for x in restore],
                "time_s_median_per_rank": [round(statistics.median(row["time_s"] for row in rows), 4)
                                           for rows in per_rank],
                "transfer_extra_mb_max_per_rank": [round(max(row["transfer_extra"] for row in rows) / MB, 2)
                                                   for rows in per_rank],
                "restore_extra_mb_max_per_rank": [round(max(row["peak_extra"] for row in rows) / MB, 2)
                                                  for rows in per_rank],
                "load_extra_mb_max_per_rank": [round(max(row["load_extra"] for row in rows) / MB, 2)
                                               for rows in per_rank],
                "counted_extra_mb_per_rank": [round(rows[0]["counted"] / MB, 2) for rows in per_rank]}
        ratio = [b / a for a, b in zip(entry["one_source_broadcast"]["restore_s_per_rep"],
                                       entry["slices"]["restore_s_per_rep"], strict=True)]
        entry["time_ratio_slices_to_one_source_median"] = round(statistics.median(ratio), 3)
        summary[scenario] = entry
    print(json.dumps({"benchmark": "warm_restore", "world": WORLD, "model_size": args.model_size, "reps": args.reps,
                      "state_mb": round(state_bytes / MB, 2), "backend": "gloo",
                      "machine": f"{platform.machine()} {os.cpu_count()} cores", "scenarios": summary}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
