"""Wrapping a rank's model for ScalingConfig: DDP with an optional compression hook, or FSDP2
with its precision and memory options; with tensor parallelism, the user's TP plan and then
FSDP2's replicate or fully_shard over the data-parallel dimension (`wrap_tensor_parallel`).

Every DDP model gets `stamp_end_of_backward`, so straggler scoring sees only this rank's compute
(the end of its backward, before any wait for a peer) whatever hook sends the gradients. Without
compression no Python comm hook is registered: DDP's built-in C++ all-reduce runs.

The bucket layout is fixed at wrap time (see `_fix_bucket_layout`), without
`find_unused_parameters`: a recovered generation reduces every step in the layout the fault-free
run used, and no step pays the unused-parameter search (nor prints DDP's warning about it).

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
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import nn

from elastic._worker.mesh import TP_DIM, GenerationMesh
from elastic._worker.step_timer import StepTimer, stamp_end_of_backward
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
        from torch.distributed.device_mesh import init_device_mesh
        return _fully_shard(model, mesh=init_device_mesh(device.type, (world_size,)), scaling=scaling,
                            shard_modules=shard_modules), None
    from torch.nn.parallel import DistributedDataParallel
    device_ids = [device.index] if device.type == "cuda" else None
    ddp = DistributedDataParallel(model, device_ids=device_ids)
    compression = None
    if scaling.grad_compression == "bf16":
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook

        # Registered through a function of our own: DDP refuses bf16_compress_hook itself (by
        # identity) without CUDA and NCCL, though the hook runs on gloo. No annotations: DDP
        # checks them against dist.GradBucket, and postponed evaluation turns them into strings.
        def bf16_hook(state, bucket):
            return bf16_compress_hook(state, bucket)
        ddp.register_comm_hook(None, bf16_hook)
    elif scaling.grad_compression == "powersgd":
        compression = PowerSGDCompression(scaling, seed)
        ddp.register_comm_hook(compression.state, compression.hook)
    if compression is None:
        # PowerSGD restarts with each generation, so a recovered run is not bitwise the
        # fault-free one with it whatever the layout; its restored residuals rely on DDP's own
        # rebuild after the first step (PowerSGDCompression.hook).
        _fix_bucket_layout(ddp)
    stamp_end_of_backward(ddp, timer)
    return ddp, compression


def _fix_bucket_layout(ddp: nn.Module) -> None:
    """One gradient-bucket layout in every generation, a function of the parameters alone.

    DDP re-buckets gradients by the order they became ready in its wrapper's first backward.
    Every generation builds a new wrapper, so a recovered run would reduce its first step in the
    initial layout where the fault-free run used the rebuilt one; with 3+ ranks the ring
    all-reduce then sums elements in another order and the models drift apart. The earlier fix,
    `find_unused_parameters=True`, turns the rebuild off, but costs every step a traversal of the
    autograd graph and an all-reduce of the used-parameter map (and DDP warns about it when no
    parameter is unused). Instead the reducer is handed every parameter, in parameter order, as
    its "rebuilt" order now (what DDP's own Join hook does for ranks that joined early): it
    rebuilds once, at the first forward, into the same layout in every generation, and never
    again. Parameters unused in the forward still fail DDP's check at the next step, as in any
    DDP job without find_unused_parameters.
    """
    ddp.reducer._push_all_rebuilt_params()   # type: ignore[union-attr,operator]


def wrap_tensor_parallel(model: nn.Module, *, generation_mesh: GenerationMesh, scaling: ScalingConfig,
                         parallelize: Callable[[nn.Module, Any], Any] | None,
                         shard_modules: list[nn.Module] | None = None) -> nn.Module:
    """The user's TP plan on the replica's ranks (`parallelize(model, mesh["tp"])`), then the
    data-parallel dimension: FSDP2's `replicate` (strategy "ddp": every replica holds the TP
    shards whole, so any survivor of the same TP rank is a warm source) or `fully_shard` on
    "dp_shard" (strategy "fsdp": torchtitan's FSDP x TP) or on ("dp_replicate", "dp_shard")
    (strategy "hsdp": torchtitan's HSDP, called at T = 1 too). All keep the parameters DTensors
    of the mesh, which checkpoints save and reshard to another layout.

    torch DDP is not used: it takes plain tensors, so a TP model would reach its state dict as
    each rank's local shards (torch's own DDP x TP path, `_pre_dp_module_transform`, does that),
    and a checkpoint could not be resharded to another TP degree.
    """
    mesh = generation_mesh.mesh()
    if generation_mesh.tensor_parallel:          # HSDP at T = 1 wraps on the mesh with no TP plan
        assert parallelize is not None, "prepare_model refuses T > 1 without a plan"
        parallelize(model, mesh[TP_DIM])
    dp_mesh = generation_mesh.dp_mesh()
    if scaling.strategy in ("fsdp", "hsdp"):     # hsdp: the 2-D (dp_replicate, dp_shard) mesh
        return _fully_shard(model, mesh=dp_mesh, scaling=scaling, shard_modules=shard_modules)
    from torch.distributed._composable.replicate_with_fsdp import replicate
    replicate(model, mesh=dp_mesh)
    return model


def _fully_shard(model: nn.Module, *, mesh: Any, scaling: ScalingConfig,
                 shard_modules: list[nn.Module] | None) -> nn.Module:
    """FSDP2 over `mesh` (the world, or the data-parallel dimension of a 2-D one): each module
    in `shard_modules` (default: every child of every ModuleList, i.e. the transformer blocks)
    becomes its own shard unit, then the root."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
    device = mesh.device_type
    low = low_precision_dtype(scaling.precision)
    # Gradients are reduced in fp32 whatever the compute dtype: a bf16 sum over many ranks
    # loses the small updates.
    mp = MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32) if low else MixedPrecisionPolicy()
    # Pinned host memory needs CUDA; on a CPU run the offload only changes where the optimizer runs.
    offload = CPUOffloadPolicy(pin_memory=device == "cuda") if scaling.fsdp_cpu_offload else OffloadPolicy()
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
