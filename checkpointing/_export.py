"""Export a committed checkpoint's model weights as one plain `torch.save` file.

Internal; the public names are `checkpointing.export_model_state` and `checkpointing.export`.
A checkpoint holds DCP shards of several entries (modules, optimizers, other Stateful objects,
the framework's `extra`); only the module entries are exported, and only their byte ranges are
read. Which entries are modules comes from `extra.state_kinds` (a JSON string: name -> "module" |
"optimizer" | "stateful"); a checkpoint without it has the older layout "model" / "optim" /
"extra", where "model" is the one module.

Everything read is checked against the COMMITTED manifest first (size and sha256 of `.metadata`
and of every shard file holding a wanted item): with no step given, a checkpoint that does not
match falls back to the previous committed one, as training does; an explicit step that does not
match is refused. Tensors come out as plain, contiguous CPU tensors (DTensor shards of FSDP2 are
reassembled by DCP), so the file loads with `torch.load(f, weights_only=True)` and no copy of this
package. torch is imported on first use, not with the package (see `checkpointing.manager`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import pickle
import re
import time
import uuid
from collections.abc import Callable
from typing import Any

from checkpointing import manifest as mf
from checkpointing.errors import CheckpointError, CorruptCheckpointError, StorageError
from checkpointing.storage import Storage

log = logging.getLogger("checkpointing")

KINDS_KEY = ("extra", "state_kinds")
LEGACY_MODULE = "model"
_METADATA = ".metadata"

Progress = Callable[[str], None]


@dataclasses.dataclass(frozen=True)
class ExportResult:
    """What `export` wrote: the checkpoint it came from and what the file holds."""

    out: str
    step: int
    generation: int
    world_size: int
    source: str  # URL of the checkpoint's step directory
    modules: list  # names of the exported module entries, in checkpoint order
    tensors: int
    bytes: int  # tensor bytes in the file (the file adds a small header)
    nested: bool  # True: {name: state_dict}; False: the one module's state dict itself
    skipped: list = dataclasses.field(default_factory=list)  # [{"step", "reason"}] fallen back from


@dataclasses.dataclass
class _Selected:
    info: mf.CommitInfo
    metadata: Any  # torch.distributed.checkpoint.metadata.Metadata
    modules: list[str]
    skipped: list[dict]


def _size(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


class _Reporter:
    """Progress lines go to `progress` when given, else to the `checkpointing` logger."""

    def __init__(self, progress: Progress | None) -> None:
        self._progress = progress

    def info(self, msg: str) -> None:
        if self._progress is not None:
            self._progress(msg)
        else:
            log.info("%s", msg)

    def warning(self, msg: str) -> None:
        if self._progress is not None:
            self._progress(f"warning: {msg}")
        else:
            log.warning("%s", msg)


# ---- reading ---------------------------------------------------------------------------------
def _data_path(storage: Storage, info: mf.CommitInfo) -> str:
    return f"{mf.step_path(storage, info.step)}/{info.data_dir}".rstrip("/")


def _manifest_name(info: mf.CommitInfo, relative_path: str) -> str:
    return f"{info.data_dir}/{relative_path}" if info.data_dir else relative_path


def _check(storage: Storage, info: mf.CommitInfo, names: set[str], rep: _Reporter) -> list[dict]:
    """verify_files on `names` (manifest keys); a name the manifest lacks is a mismatch too."""
    if names:
        size = sum(info.files[n]["size"] for n in names if n in info.files)
        rep.info(f"step {info.step}: verifying {len(names)} file(s), {_size(size)}, against the manifest")
    unknown = sorted(n for n in names if n not in info.files)
    bad = [{"file": n, "reason": "not in the manifest"} for n in unknown]
    return bad + mf.verify_files(storage, info.step, {n: info.files[n] for n in names if n in info.files})


def _read_metadata(storage: Storage, info: mf.CommitInfo) -> tuple[Any, list[dict]]:
    """DCP's `.metadata`, unpickled only once its bytes match the manifest."""
    name = _manifest_name(info, _METADATA)
    want = info.files.get(name)
    if want is None:
        return None, [{"file": name, "reason": "not in the manifest"}]
    try:
        raw = storage.read_bytes(f"{_data_path(storage, info)}/{_METADATA}")
    except FileNotFoundError:
        return None, [{"file": name, "reason": "missing"}]
    digest = hashlib.sha256(raw).hexdigest()
    if len(raw) != want["size"] or digest != want["sha256"]:
        return None, [{"file": name, "reason": f"size {len(raw)} / sha256 {digest[:12]}.. != manifest "
                                               f"{want['size']} / {want['sha256'][:12]}.."}]
    import torch.distributed.checkpoint  # noqa: F401 - the classes the pickle refers to
    try:
        return pickle.loads(raw), []
    except Exception as e:  # a manifest-matching file that does not unpickle
        raise CheckpointError(f"cannot read {storage.display(info.path)}/{name}: {type(e).__name__}: {e} (written by "
                              f"an incompatible torch version?)", url=storage.url) from e


def _top(metadata: Any, key: str) -> str:
    """The top-level entry (a name given to ctx.restore, or "extra") a flattened key is under."""
    return metadata.planner_data.get(key, (key,))[0]


def _keys_of(metadata: Any, names: set[str]) -> list[str]:
    """Flattened DCP keys under the top-level entries `names`, in checkpoint order."""
    return [k for k in metadata.state_dict_metadata if _top(metadata, k) in names]


def _files_of(info: mf.CommitInfo, metadata: Any, keys: list[str]) -> set[str]:
    wanted = set(keys)
    return {_manifest_name(info, si.relative_path)
            for idx, si in metadata.storage_data.items() if idx.fqn in wanted}


def _tensor_bytes(metadata: Any, keys: list[str]) -> tuple[int, int]:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    count = size = 0
    for k in keys:
        md = metadata.state_dict_metadata[k]
        if isinstance(md, TensorStorageMetadata):
            count += 1
            numel = 1
            for d in md.size:
                numel *= d
            size += numel * md.properties.dtype.itemsize
    return count, size


def _dcp_load(storage: Storage, info: mf.CommitInfo, state: dict) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from checkpointing._dcp_io import StorageReader
    try:
        # no_dist: one process reads the whole entry, whatever process group may exist here.
        dcp.load(state, storage_reader=StorageReader(storage, _data_path(storage, info),
                                                     allowed=mf.data_files(info)), no_dist=True)
    except (Exception, CheckpointException) as e:
        excs = [f[0] if isinstance(f, tuple) else f for f in getattr(e, "failures", {0: e}).values()]
        cls = StorageError if any(isinstance(x, (StorageError, OSError)) for x in excs) else CheckpointError
        raise cls(f"reading step {info.step} from {storage.display(info.path)} failed: "
                  f"{'; '.join(f'{type(x).__name__}: {x}' for x in excs)}", url=storage.url) from e


def _placeholders(metadata: Any, keys: list[str]) -> dict:
    """A nested state dict DCP can load `keys` into: empty CPU tensors of the saved full shape."""
    import torch
    from torch.distributed.checkpoint._traverse import set_element
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    state: dict = {}
    for k in keys:
        md = metadata.state_dict_metadata[k]
        value = torch.empty(md.size, dtype=md.properties.dtype) if isinstance(md, TensorStorageMetadata) else md
        set_element(state, metadata.planner_data.get(k, (k,)), value)
    return state


def _module_names(storage: Storage, info: mf.CommitInfo, metadata: Any, checked: set[str],
                  rep: _Reporter) -> tuple[list[str] | None, list[dict]]:
    """The module entries of the checkpoint: from `extra.state_kinds` in the manifest's JSON
    meta (the runtime's layout), else in the DCP state (earlier runtimes), else the oldest layout."""
    flat_kinds = ".".join(KINDS_KEY)
    top = list(dict.fromkeys(_top(metadata, k) for k in metadata.state_dict_metadata))
    in_meta = ((info.meta or {}).get(KINDS_KEY[0]) or {}).get(KINDS_KEY[1])
    if in_meta is not None:
        return _modules_of_kinds(storage, info, in_meta, top, rep), []
    if flat_kinds not in metadata.state_dict_metadata:
        if LEGACY_MODULE in top:
            return [LEGACY_MODULE], []
        raise CheckpointError(
            f"step {info.step} at {storage.display(info.path)} has no '{flat_kinds}' entry and no '{LEGACY_MODULE}' "
            f"entry (top-level entries: {top}): cannot tell which entries are modules", url=storage.url)
    files = _files_of(info, metadata, [flat_kinds]) - checked
    bad = _check(storage, info, files, rep)
    if bad:
        return None, bad
    checked.update(files)  # the caller's set: these need no second pass
    state = _placeholders(metadata, [flat_kinds])
    _dcp_load(storage, info, state)
    return _modules_of_kinds(storage, info, state[KINDS_KEY[0]][KINDS_KEY[1]], top, rep), []


def _modules_of_kinds(storage: Storage, info: mf.CommitInfo, raw: Any, top: list[str], rep: _Reporter) -> list[str]:
    """The module names of a `state_kinds` JSON string."""
    flat_kinds = ".".join(KINDS_KEY)
    try:
        kinds = json.loads(raw)
        if not isinstance(kinds, dict):
            raise ValueError(f"expected a JSON object, got {type(kinds).__name__}")
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"step {info.step} at {storage.display(info.path)}: unreadable {flat_kinds} {raw!r}: {e}",
                              url=storage.url) from e
    modules = [name for name, kind in kinds.items() if kind == "module"]
    if not modules:
        raise CheckpointError(f"step {info.step} at {storage.display(info.path)} holds no module "
                              f"(state kinds: {kinds})", url=storage.url)
    missing = [m for m in modules if m not in top]
    if missing:
        rep.warning(f"step {info.step}: module entries {missing} hold no saved items; exported empty")
    return modules


def _verify_for_export(storage: Storage, info: mf.CommitInfo,
                       rep: _Reporter) -> tuple[_Selected | None, list[dict]]:
    """The metadata and module names of `info` once every file to read matches the manifest."""
    metadata, bad = _read_metadata(storage, info)
    if bad:
        return None, bad
    checked: set[str] = {_manifest_name(info, _METADATA)}
    modules, bad = _module_names(storage, info, metadata, checked, rep)
    if bad:
        return None, bad
    assert modules is not None
    keys = _keys_of(metadata, set(modules))
    files = _files_of(info, metadata, keys) - checked
    bad = _check(storage, info, files, rep)
    if bad:
        return None, bad
    return _Selected(info=info, metadata=metadata, modules=modules, skipped=[]), []


def _reason(bad: list[dict]) -> str:
    reason = "; ".join(f"{b['file']}: {b['reason']}" for b in bad[:5])
    return reason + (f"; and {len(bad) - 5} more files" if len(bad) > 5 else "")


def _select(storage: Storage, step: int | None, rep: _Reporter) -> _Selected:
    committed = mf.list_committed(storage, log=log)
    if not committed:
        raise CheckpointError(f"no committed checkpoint under {storage.display_url}: nothing to export "
                              f"(list them with `elastic ckpt list {storage.display_url}`)", url=storage.url)
    if step is not None:
        chosen = [c for c in committed if c.step == step]
        if not chosen:
            raise CheckpointError(
                f"no committed checkpoint at step {step} under {storage.display_url}; committed steps: "
                f"{', '.join(str(c.step) for c in committed)}", url=storage.url)
        sel, bad = _verify_for_export(storage, chosen[0], rep)
        if sel is None:
            raise CorruptCheckpointError(
                f"step {step} at {storage.display(chosen[0].path)} does not match its manifest ({_reason(bad)}); "
                f"refusing to export it (without --step the newest checkpoint that verifies is "
                f"exported)", url=storage.url)
        return sel
    skipped: list[dict] = []
    for info in reversed(committed):
        sel, bad = _verify_for_export(storage, info, rep)
        if sel is not None:
            sel.skipped = skipped
            return sel
        reason = _reason(bad)
        rep.warning(f"checkpoint step {info.step} at {storage.display(info.path)} does not match its manifest "
                    f"({reason}); falling back to the previous committed checkpoint")
        skipped.append({"step": info.step, "reason": reason})
    detail = "; ".join(f"step {s['step']}: {s['reason']}" for s in skipped[:3])
    if len(skipped) > 3:
        detail += f"; and {len(skipped) - 3} older steps"
    raise CorruptCheckpointError(
        f"no committed checkpoint under {storage.display_url} matches its manifest ({detail}); inspect "
        f"with `elastic ckpt verify {storage.display_url}`", url=storage.url)


def _read_modules(storage: Storage, sel: _Selected, rep: _Reporter) -> tuple[dict, int, int]:
    keys = _keys_of(sel.metadata, set(sel.modules))
    count, size = _tensor_bytes(sel.metadata, keys)
    info = sel.info
    rep.info(f"step {info.step}: reading {', '.join(sel.modules)} ({count} tensors, {_size(size)}) "
             f"from {storage.display(info.path)}")
    t0 = time.monotonic()
    state = _placeholders(sel.metadata, keys)
    if keys:
        _dcp_load(storage, info, state)
    rep.info(f"step {info.step}: read {_size(size)} in {time.monotonic() - t0:.1f}s")
    return {name: dict(state.get(name, {})) for name in sel.modules}, count, size


def _shape(modules: dict) -> dict:
    """One module: its state dict itself (loads with model.load_state_dict); else {name: sd}."""
    if len(modules) == 1:
        return next(iter(modules.values()))
    return modules


# ---- public ----------------------------------------------------------------------------------
_STEP_URL = re.compile(r"^(?P<run>.+?)/checkpoints/step_(?P<step>\d{8})/?$")


def run_and_step(url: str, step: int | None) -> tuple[str, int | None]:
    """A checkpoint's own URL (`Result.checkpoint`: <run>/checkpoints/step_<step:08d>) stands
    for its run and step; a run's URL is taken as it is."""
    match = _STEP_URL.match(str(url))
    if match is None:
        return url, step
    named = int(match["step"])
    if step is not None and step != named:
        raise CheckpointError(f"{url} is the checkpoint of step {named}, but step={step} was asked for",
                              url=match["run"])
    return match["run"], named


def export_model_state(url: str, step: int | None = None, *, storage_options: dict | None = None,
                       progress: Progress | None = None) -> dict:
    """The model weights of a committed checkpoint under `url`, as plain CPU tensors.

    `url` is the run's storage URL, or a checkpoint's own (`Result.checkpoint`), which names
    the step. `step=None`: the newest committed checkpoint whose files match the manifest (a newer one that
    does not is skipped with a warning). One module entry: its state dict (FQN -> tensor, as
    `model.state_dict()` without DDP's `module.` prefix); several: {name: state_dict}.
    Optimizers and other Stateful entries are not loaded. `progress` receives one line per phase
    (default: the `checkpointing` logger).

    Raises CheckpointError (no committed checkpoint, unknown step), CorruptCheckpointError
    (`step` does not match its manifest, or none does), StorageError.
    """
    rep = _Reporter(progress)
    url, step = run_and_step(url, step)
    storage = Storage(url, storage_options)
    sel = _select(storage, step, rep)
    modules, _, _ = _read_modules(storage, sel, rep)
    return _shape(modules)


def export(url: str, out: str | os.PathLike, *, step: int | None = None,
           storage_options: dict | None = None, progress: Progress | None = None) -> ExportResult:
    """Write the model weights of a committed checkpoint to the local file `out` (see
    `export_model_state` for which step and what the file holds).

    `out` is written atomically (temporary file, fsync, rename) and checked to load with
    `torch.load(out, weights_only=True)`; parent directories are created.
    """
    import torch
    rep = _Reporter(progress)
    url, step = run_and_step(url, step)
    storage = Storage(url, storage_options)
    sel = _select(storage, step, rep)
    modules, count, size = _read_modules(storage, sel, rep)
    payload = _shape(modules)
    out = os.fspath(out)
    parent = os.path.dirname(os.path.abspath(out))
    tmp = os.path.join(parent, f".{os.path.basename(out)}.{uuid.uuid4().hex}.tmp")
    try:
        os.makedirs(parent, exist_ok=True)
        with open(tmp, "wb") as f:
            torch.save(payload, f)
            f.flush()
            os.fsync(f.fileno())
        try:
            # The promise of the file: plain torch reads it. mmap reads the header, not the data.
            torch.load(tmp, weights_only=True, mmap=True)
        except Exception as e:  # torch raises UnpicklingError or RuntimeError
            raise CheckpointError(
                f"the module state of step {sel.info.step} holds values plain "
                f"torch.load(weights_only=True) refuses ({type(e).__name__}: {str(e).splitlines()[0]}); "
                f"use export_model_state() and save what you need", url=storage.url) from e
        os.replace(tmp, out)
    except OSError as e:
        raise StorageError(f"cannot write {out}: {type(e).__name__}: {e}", url=storage.url) from e
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    rep.info(f"wrote {out} ({_size(os.path.getsize(out))})")
    info = sel.info
    return ExportResult(out=out, step=info.step, generation=info.generation, world_size=info.world_size,
                        source=info.path, modules=list(modules), tensors=count, bytes=size,
                        nested=len(modules) != 1, skipped=sel.skipped)
