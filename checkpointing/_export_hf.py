"""Export a committed checkpoint's model as a Hugging Face model directory.

Internal; the public name is `checkpointing.export_hf`. What `from_pretrained(out)` reads:
`model.safetensors` (one module's weights, as `export_model_state` reads them: checked against
the manifest, FSDP2's shards reassembled, plain CPU tensors) and the model's `config.json`. The
checkpoint holds no model configuration, so it comes from the caller (a file, or a directory
with `config.json`, such as one `config.save_pretrained` wrote), or from the run's storage at
`HF_CONFIG` (examples/hf_llama.py writes it there before training). Needs the `safetensors`
package (`pip install elastic-train[hf]`).
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile

from checkpointing._export import (
    ExportResult,
    Progress,
    _read_modules,
    _Reporter,
    _select,
    _size,
    run_and_step,
)
from checkpointing.errors import CheckpointError, StorageError
from checkpointing.storage import Storage

HF_CONFIG = "hf/config.json"          # under the run's storage: the model's configuration, if the job wrote it
WEIGHTS = "model.safetensors"


def _config_bytes(storage: Storage, config: str | os.PathLike | None) -> bytes:
    if config is not None:
        path = os.fspath(config)
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        try:
            with open(path, "rb") as f:
                raw = f.read()
        except OSError as e:
            raise CheckpointError(f"cannot read the model's configuration {path}: {e}", url=storage.url) from e
    else:
        try:
            raw = storage.read_bytes(storage.path(HF_CONFIG))
        except FileNotFoundError:
            raise CheckpointError(
                f"no model configuration: a Hugging Face directory needs config.json; pass it (a config.json, "
                f"or the directory config.save_pretrained wrote), or have the job write it to "
                f"{storage.display(storage.path(HF_CONFIG))}", url=storage.url) from None
    try:
        if not isinstance(json.loads(raw), dict):
            raise ValueError("not a JSON object")
    except ValueError as e:
        raise CheckpointError(f"the model's configuration is not a JSON object ({e})", url=storage.url) from None
    return raw


def export_hf(url: str, out: str | os.PathLike, *, config: str | os.PathLike | None = None,
              module: str | None = None, step: int | None = None, storage_options: dict | None = None,
              progress: Progress | None = None) -> ExportResult:
    """Write the directory `out` that `transformers`' `from_pretrained(out)` reads: the weights of
    module entry `module` (default: the checkpoint's only one) of a committed checkpoint as
    `model.safetensors`, and `config.json` (see the module docstring for where it comes from).

    The files are written to a temporary directory beside `out` and renamed into it, so `out`
    never holds half a model. Raises CheckpointError (no such checkpoint or module, no
    configuration), CorruptCheckpointError, StorageError.
    """
    try:
        from safetensors.torch import save_file
    except ImportError as e:
        raise CheckpointError("exporting in Hugging Face's format needs safetensors: "
                              "pip install elastic-train[hf]", url=url) from e
    rep = _Reporter(progress)
    url, step = run_and_step(url, step)
    storage = Storage(url, storage_options)
    raw_config = _config_bytes(storage, config)
    sel = _select(storage, step, rep)
    if module is None and len(sel.modules) > 1:
        raise CheckpointError(f"the checkpoint of step {sel.info.step} holds the modules {', '.join(sel.modules)}: "
                              f"say which one is the Hugging Face model (module=...; the CLI's --module)",
                              url=storage.url)
    name = module if module is not None else sel.modules[0]
    if name not in sel.modules:
        raise CheckpointError(f"the checkpoint of step {sel.info.step} has no module {name!r}; its modules: "
                              f"{', '.join(sel.modules)}", url=storage.url)
    sel.modules = [name]
    modules, count, size = _read_modules(storage, sel, rep)
    # safetensors wants contiguous tensors that share no storage (tied weights are two entries here).
    state = {key: tensor.contiguous() for key, tensor in modules[name].items()}
    out = os.path.abspath(os.fspath(out))
    parent = os.path.dirname(out)
    try:
        os.makedirs(parent, exist_ok=True)
        staging = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}.", dir=parent)
        try:
            # from_pretrained refuses safetensors without the "format" metadata.
            save_file(state, os.path.join(staging, WEIGHTS), metadata={"format": "pt"})
            with open(os.path.join(staging, "config.json"), "wb") as f:
                f.write(raw_config)
            if os.path.isdir(out):
                for entry in (WEIGHTS, "config.json"):
                    os.replace(os.path.join(staging, entry), os.path.join(out, entry))
            else:
                os.replace(staging, out)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    except OSError as e:
        raise StorageError(f"cannot write {out}: {type(e).__name__}: {e}", url=storage.url) from e
    rep.info(f"wrote {out}: {WEIGHTS} ({_size(os.path.getsize(os.path.join(out, WEIGHTS)))}) and config.json")
    info = sel.info
    return ExportResult(out=out, step=info.step, generation=info.generation, world_size=info.world_size,
                        source=info.path, modules=[name], tensors=count, bytes=size, nested=False,
                        skipped=sel.skipped)
