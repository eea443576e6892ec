"""Wrapping a rank's model for ScalingConfig: DDP with an optional compression hook, or FSDP2
with its precision and memory options.

Every DDP hook is composed with `timed_comm_hook`, so straggler scoring still sees only this
rank's compute (the hook's launch marks the end of backward) whatever the hook sends.

PowerSGD's state (error feedback, warm-start P/Q matrices, iteration count) is per rank and
only valid for the group it was built in: a rank's residual is the part of *its* gradients the
low-rank average has not sent yet, relative to the averages of that world size. After a rescale
a lost rank's residual is gone and the survivors' residuals belong to the old world size, so a
new generation starts from zero error feedback and restarts the warm-up of plain all-reduce
(`ScalingConfig.powersgd_warmup_steps`). Only a checkpoint restored at the world size it was
saved at gives every rank back its own residual (`PowerSGDCompression.load_bytes`).
"""
from __future__ import annotations

import io
import logging
from typing import Any

import numpy as np
import torch
from torch import nn

from elastic._worker.step_timer import StepTimer, timed_comm_hook
from elastic.config import ScalingConfig

log = logging.getLogger("elastic.wrap")

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def low_precision_dtype(precision: str) -> torch.dtype | None:
    return _DTYPES.get(precision)


class PowerSGDCompression:
    """PowerSGD with error feedback for one generation, restorable from a same-size checkpoint."""

    def __init__(self, scaling: ScalingConfig, seed: int) -> None:
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
        self._psgd = psgd
        self.state = psgd.PowerSGDState(
            process_group=None, matrix_approximation_rank=scaling.powersgd_rank,
            start_powerSGD_iter=scaling.powersgd_warmup_steps, use_error_feedback=True, warm_start=True,
            random_seed=seed % (2 ** 32))
        self._fresh = {"iter": 0, "rng": np.random.RandomState(seed % (2 ** 32)).get_state(),
                       "error_dict": {}, "p_memory_dict": {}, "q_memory_dict": {}}
        self._pending: dict[str, Any] | None = None
        self._steps = 0   # steps this DDP instance has communicated

    def hook(self, state, bucket):
        # Buckets are launched from the highest index down; bucket 0 (`is_last`) ends a step.
        if self._steps >= 1 and self._pending is not None:
            self._install(self._pending)
            self._pending = None
        if bucket.is_last():
            self._steps += 1
        if self._pending is not None:
            # Under PowerSGD a freshly wrapped DDP rebuilds its buckets after its first step (see
            # wrap_model), so restored per-bucket residuals fit only from the second step on;
            # this step is plain all-reduce.
            from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
            # None: the default group, as torch's hook takes it (its annotation leaves None out).
            return allreduce_hook(None, bucket)  # type: ignore[arg-type]
        error = self.state.error_dict.get(bucket.index())
        if error is not None and error.numel() != bucket.buffer().numel():
            log.warning("PowerSGD state does not fit bucket %d (%d vs %d elements); resetting it",
                        bucket.index(), error.numel(), bucket.buffer().numel())
            self._install(self._fresh)
        return self._psgd.powerSGD_hook(state, bucket)

    def _install(self, saved: dict[str, Any]) -> None:
        s = self.state
        s.iter = int(saved["iter"])
        s.rng.set_state(saved["rng"])
        s.error_dict = dict(saved["error_dict"])
        s.p_memory_dict = dict(saved["p_memory_dict"])
        s.q_memory_dict = dict(saved["q_memory_dict"])

    def to_bytes(self) -> bytes:
        """This rank's state for a checkpoint (per rank: the residuals differ between ranks)."""
        s = self.state
        if self._pending is not None:
            saved = self._pending     # restored but not yet installed: still the state to keep
        else:
            saved = {"iter": s.iter, "rng": s.rng.get_state(),
                     **{k: {i: t.detach().cpu() for i, t in getattr(s, k).items()}
                        for k in ("error_dict", "p_memory_dict", "q_memory_dict")}}
        buffer = io.BytesIO()
        torch.save(saved, buffer)
        return buffer.getvalue()

    def load_bytes(self, raw: bytes, device: torch.device) -> None:
        """Restore this rank's state saved at the same world size (installed after DDP's first step)."""
        saved = torch.load(io.BytesIO(raw), weights_only=False)
        for key in ("error_dict", "p_memory_dict", "q_memory_dict"):
            saved[key] = {int(i): t.to(device) for i, t in saved[key].items()}
        self._pending = saved

    @property
    def compressing(self) -> bool:
        return self._pending is None and self.state.iter >= self.state.start_powerSGD_iter


def wrap_model(model: nn.Module, *, device: torch.device, world_size: int, scaling: ScalingConfig,
               timer: StepTimer, seed: int,
               shard_modules: list[nn.Module] | None = None) -> tuple[nn.Module, PowerSGDCompression | None]:
    """The wrapped model for this generation, and its PowerSGD state when that is on."""
    if scaling.strategy == "fsdp":
        return _fully_shard(model, device=device, world_size=world_size, scaling=scaling,
                            shard_modules=shard_modules), None
    from torch.nn.parallel import DistributedDataParallel
    device_ids = [device.index] if device.type == "cuda" else None
    # DDP normally re-buckets gradients by their ready order after a wrapper's first step.
    # Every generation builds a new wrapper, so a recovered run would reduce one step with the
    # initial layout where the fault-free run used the rebuilt one; with 3+ ranks the ring
    # allreduce then sums elements in another order and the models drift apart.
    # find_unused_parameters turns the rebuild off: one fixed layout in every generation.
    # Not with PowerSGD: find_unused adds an all-reduce of the used-parameter map per step, issued
    # from the autograd thread, while PowerSGD issues its second all-reduce from a future's
    # callback; their order then differs between ranks and gloo aborts on the mismatched sizes
    # (seen with 3 ranks). PowerSGD restarts with each generation anyway, so a recovered run is
    # not bitwise the fault-free one with it, whatever the bucket layout.
    ddp = DistributedDataParallel(model, device_ids=device_ids,
                                  find_unused_parameters=scaling.grad_compression != "powersgd")
    compression = None
    if scaling.grad_compression == "bf16":
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook
        ddp.register_comm_hook(None, timed_comm_hook(timer, bf16_compress_hook))
    elif scaling.grad_compression == "powersgd":
        compression = PowerSGDCompression(scaling, seed)
        ddp.register_comm_hook(compression.state, timed_comm_hook(timer, compression.hook))
    else:
        ddp.register_comm_hook(None, timed_comm_hook(timer))
    return ddp, compression


def _fully_shard(model: nn.Module, *, device: torch.device, world_size: int, scaling: ScalingConfig,
                 shard_modules: list[nn.Module] | None) -> nn.Module:
    """FSDP2: each module in `shard_modules` (default: every child of every ModuleList, i.e. the
    transformer blocks) becomes its own shard unit, then the root."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
    mesh = init_device_mesh(device.type, (world_size,))
    low = low_precision_dtype(scaling.precision)
    # Gradients are reduced in fp32 whatever the compute dtype: a bf16 sum over many ranks
    # loses the small updates.
    mp = MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32) if low else MixedPrecisionPolicy()
    # Pinned host memory needs CUDA; on a CPU run the offload only changes where the optimizer runs.
    offload = CPUOffloadPolicy(pin_memory=device.type == "cuda") if scaling.fsdp_cpu_offload else OffloadPolicy()
    options: dict[str, Any] = dict(mesh=mesh, mp_policy=mp, offload_policy=offload,
                                   reshard_after_forward=scaling.fsdp_reshard_after_forward)
    units = shard_modules if shard_modules is not None else [
        child for m in model.modules() if isinstance(m, nn.ModuleList) for child in m]
    for unit in units:
        fully_shard(unit, **options)
    fully_shard(model, **options)      # in place: the same module, its class now an FSDPModule subclass
    return model


def _key(rank: int) -> str:
    return f"powersgd_rank{rank}"


def compression_extra(compression: PowerSGDCompression | None, rank: int) -> dict[str, Any]:
    """Checkpoint extras: this rank's PowerSGD state under a key of its own (each rank writes
    only its own key, so the checkpoint holds every rank's residual)."""
    return {_key(rank): compression.to_bytes()} if compression is not None else {}


def load_with_compression_state(manager, compression: PowerSGDCompression | None, rank: int, world_size: int,
                                device: torch.device, build) -> tuple[dict, Any]:
    """Load the latest checkpoint into `build(extra_keys)`; with PowerSGD, also this rank's state
    when the checkpoint was saved at this world size (otherwise compression starts fresh).

    Asking for a key the checkpoint lacks fails the load (a run that turned PowerSGD on when it
    resumed): then the load is redone without it.
    """
    from checkpointing import CheckpointError, StorageError
    committed = manager.committed() if compression is not None else []
    wanted = {_key(rank): b""} if committed and committed[-1].world_size == world_size else {}
    state = build(wanted)
    try:
        loaded = manager.load_latest(state)
    except CheckpointError as error:
        if not wanted or isinstance(error, StorageError):
            raise
        log.warning("checkpoint has no PowerSGD state for rank %d (%s); starting compression afresh", rank, error)
        wanted, state = {}, build({})
        loaded = manager.load_latest(state)
    raw = state["extra"].get(_key(rank)) if wanted else None
    if compression is not None and loaded is not None and raw and loaded.world_size == world_size:
        compression.load_bytes(raw, device)
    return state, loaded
