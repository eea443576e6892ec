"""The main job: pretrain a small GPT on an elastic group of Ray workers.

    python examples/pretrain.py --storage runs/pretrain --workers 2:3 --steps 200 --checkpoint-every 50

Starts a local Ray instance (or joins the cluster in RAY_ADDRESS), checkpoints to --storage and
resumes from it when run again. The local Ray is the run's own (elastic.local_ray): SIGKILL of this
script leaves the run going to its end, and running it again with the same storage and flags
attaches to the live run and exits with its status. Trains on the Parquet token corpus at --data URL, or on a
synthetic one written under <storage>/corpus/ on the first run and reused afterwards. Kill a
worker (its pid is in <storage>/status.json) and watch the run re-form and go on. With --gpu
each worker trains on one GPU of its own (NCCL), which --precision fp16 needs. With --tp T the
model is split over replicas of T ranks by tensor parallelism (gpt.parallelize_gpt; --workers then
counts ranks, in multiples of T), and --sequence-parallel splits the sequence between its blocks too.
With --pp P each replica is a pipeline of P stages (gpt.pipeline_split_points; --workers in
multiples of T x P), trained by --pp-schedule over --microbatches micro-batches of each batch.

Exit codes: 0 finished, or stopped on request (`elastic stop <storage>`, SIGTERM, `ray job stop`:
a checkpoint committed; run again to resume); 1 failed; 2 bad flags or storage that cannot be
written; 3 the loop stopped before --steps; 4 the storage is in use by another live run (see
--takeover).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import gpt
from elastic import (
    CheckpointConfig,
    ConfigError,
    DatasetError,
    ElasticTrainer,
    FailureConfig,
    LRScalingConfig,
    RunConflictError,
    ScalingConfig,
    StorageError,
    local_ray,
)
from elastic._worker.fault_gate import BITFLIP_REQUESTS_KEY, HOLD_AT_KEY, BitFlipRequests, HoldAt
from elastic.progress import ProgressDisplay

EXIT_STOPPED_EARLY = 3
EXIT_STORAGE_IN_USE = 4


def parse_workers(text: str) -> tuple[int, int]:
    low, _, high = text.partition(":")
    try:
        return int(low), int(high or low)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--workers must be MIN:MAX or N, got {text!r}") from None


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}")
    return value


def positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text!r}")
    return value


def non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {text!r}")
    return value


def parse_fail_at(text: str) -> tuple[int, int]:
    rank, sep, step = text.partition(":")
    try:
        if sep and int(rank) >= 0 and int(step) >= 1:
            return int(rank), int(step)
    except ValueError:
        pass
    raise argparse.ArgumentTypeError(f"--fail-at must be RANK:STEP (rank >= 0, step >= 1), got {text!r}")


def parse_hold_at(text: str) -> HoldAt:
    try:
        return HoldAt.parse(text)
    except ConfigError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--storage", required=True, help="run directory: local path, file://, or s3://bucket/prefix")
    p.add_argument("--takeover", action="store_true",
                   help="take the storage over from a run that still looks alive (its lease is fresh); "
                        "without it a second run on the same storage refuses to start")
    p.add_argument("--data", metavar="URL",
                   help="folder of Parquet token shards (local, file:// or s3://); default: a synthetic corpus "
                        "written under <storage>/corpus/ on the first run and reused on resume")
    p.add_argument("--workers", type=parse_workers, default=(2, 2),
                   help="MIN:MAX workers (default 2:2); ranks, in multiples of --tp")
    p.add_argument("--spare-workers", type=int, default=0, metavar="N",
                   help="hot spares beyond MAX: idle workers that replace a lost one at once")
    p.add_argument("--node-agents", action="store_true",
                   help="carry the controller's polls through one agent actor per node (for runs of hundreds "
                        "of workers and more: ScalingConfig.node_agents)")
    p.add_argument("--steps", type=int, default=200, help="total optimizer steps of the run")
    p.add_argument("--checkpoint-every", type=int, default=50, help="commit a checkpoint every K steps")
    p.add_argument("--strategy", choices=("ddp", "fsdp", "hsdp"), default="ddp",
                   help="over the data-parallel dimension (the replicas, with --tp); hsdp needs --hsdp-shard-size")
    p.add_argument("--hsdp-shard-size", type=positive_int, default=None, metavar="S",
                   help="--strategy hsdp: FSDP2 shards over S replicas and replicates across the shard groups "
                        "(ScalingConfig.hsdp_shard_size); --workers in multiples of S x --tp")
    p.add_argument("--tp", type=positive_int, default=1, metavar="T",
                   help="tensor parallelism: split the model over replicas of T ranks (ScalingConfig."
                        "tensor_parallel_size; the model's n_heads must divide by T); default 1: none")
    p.add_argument("--pp", type=positive_int, default=1, metavar="P",
                   help="pipeline parallelism: each replica is a pipeline of P stages (ScalingConfig."
                        "pipeline_parallel_size; --workers in multiples of --tp x P); default 1: none")
    p.add_argument("--pp-schedule", choices=("gpipe", "1f1b", "interleaved1f1b"), default="1f1b",
                   help="with --pp: the pipeline schedule (interleaved1f1b runs 2 stages per rank)")
    p.add_argument("--microbatches", type=positive_int, default=None, metavar="M",
                   help="with --pp: micro-batches per batch (--batch-size must divide by M); default P")
    p.add_argument("--sequence-parallel", action="store_true",
                   help="with --tp: also split the sequence between the transformer blocks (the model's "
                        "seq_len must divide by T): less activation memory, the same communication volume")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model-size", choices=sorted(gpt.MODEL_SIZES), default="small")
    p.add_argument("--batch-size", type=int, default=8,
                   help="samples per worker per step (per micro-batch with --lr-mode constant_global_batch)")
    p.add_argument("--lr", type=positive_float, default=3e-3, help="AdamW LR (the base LR of --lr-mode)")
    p.add_argument("--lr-mode", choices=("none", "linear", "constant_global_batch"), default="none",
                   help="none: the LR and per-worker batch stay fixed; linear: LR scales with the global batch; "
                        "constant_global_batch: gradient accumulation keeps the global batch fixed")
    p.add_argument("--base-world-size", type=int, default=None,
                   help="world size at which --lr is right (global batch = this x --batch-size); default: MAX "
                        "workers for linear, the lcm of MIN..MAX for constant_global_batch")
    p.add_argument("--warmup-steps", type=int, default=0, help="initial LR warmup, in global steps")
    p.add_argument("--rescale-warmup-steps", type=int, default=0,
                   help="linear mode: ramp a raised LR over this many steps after a rescale")
    p.add_argument("--schedule", choices=("constant", "cosine"), default="cosine", help="LR after the warmup")
    p.add_argument("--heartbeat-timeout", type=float, default=10.0,
                   help="seconds before a silent worker is declared hung")
    p.add_argument("--cpus-per-worker", type=float, default=1.0)
    p.add_argument("--sync-checkpoints", action="store_true", help="block training while a checkpoint uploads")
    p.add_argument("--in-memory-every", type=lambda v: None if v == "none" else int(v), default=10, metavar="K|none",
                   help="FSDP: copy the shards to a neighbour's host memory every K steps ('none': off)")
    p.add_argument("--quiet", action="store_true",
                   help="no live progress (else a bar with steps/s and ETA on a terminal with rich installed, "
                        "a line every 5 s otherwise)")
    p.add_argument("--loader-workers", type=non_negative_int, default=0, metavar="N",
                   help="DataLoader worker processes per worker, fetching batches ahead (0: in the training process)")
    p.add_argument("--gpu", action="store_true",
                   help="one GPU per worker: ScalingConfig(use_gpu=True), NCCL and CUDA (default: CPU and gloo)")
    p.add_argument("--precision", choices=("fp32", "bf16", "fp16"), default="fp32",
                   help="bf16 autocast (CPU or GPU), fp16 with loss scaling (needs --gpu)")
    p.add_argument("--grad-compression", choices=("none", "bf16", "powersgd"), default="none",
                   help="DDP gradient compression hook")
    p.add_argument("--activation-checkpointing", action="store_true",
                   help="recompute each transformer block's activations in backward")
    p.add_argument("--fsdp-reshard-after-forward", action=argparse.BooleanOptionalAction, default=True,
                   help="FSDP: free gathered parameters after forward (--no-...: ZeRO-2-like)")
    p.add_argument("--fsdp-cpu-offload", action="store_true", help="FSDP: keep shards and optimizer state on the CPU")
    p.add_argument("--fail-at", type=parse_fail_at, metavar="RANK:STEP",
                   help="fault injection (chaos tests): the loop of rank RANK raises InjectedUserError at step "
                        "STEP, in the run's first generation only; by default a user error fails the run")
    p.add_argument("--hold-at", type=parse_hold_at, metavar="STEP:FILE",
                   help="fault injection (tests): every rank waits after step STEP until FILE exists, "
                        "so a fault injected from outside lands at that step (the framework's fault gate)")
    p.add_argument("--bitflip-requests", metavar="DIR",
                   help="fault injection (chaos tests): a worker that finds DIR/pid-<its pid> flips one bit of one "
                        "parameter at its next step boundary (silent data corruption on request)")
    args = p.parse_args(argv)
    if args.precision == "fp16" and not args.gpu:
        p.error("--precision fp16 needs --gpu (its GradScaler runs on the GPU); add --gpu, "
                "or use --precision bf16 on CPU")
    if args.sequence_parallel and args.tp == 1:
        p.error("--sequence-parallel splits the sequence over the ranks of a tensor-parallel replica; "
                "add --tp T (T > 1), or leave it out")
    if args.pp == 1 and (args.microbatches is not None or args.pp_schedule != "1f1b"):
        p.error("--microbatches and --pp-schedule shape a pipeline: add --pp P (P > 1), or leave them out")
    if args.pp > 1 and args.sequence_parallel:
        p.error("--sequence-parallel is not supported with --pp yet (a stage's activations would leave it split "
                "along the sequence); leave one of them out")
    return args


def lr_config(args: argparse.Namespace) -> LRScalingConfig | None:
    """The LR rule the flags ask for (None for --lr-mode none); invalid values raise ConfigError."""
    if args.lr_mode == "none":
        return None
    # The rule counts data-parallel replicas (the ranks of a replica read one batch).
    low, high = (n // (args.tp * args.pp) for n in args.workers)
    base = args.base_world_size
    if base is None:
        base = high if args.lr_mode == "linear" else math.lcm(*range(max(low, 1), high + 1))
    return LRScalingConfig(base_world_size=base, base_lr=args.lr, warmup_steps=args.warmup_steps,
                           rescale_warmup_steps=args.rescale_warmup_steps, mode=args.lr_mode, schedule=args.schedule)


def scaling_config(args: argparse.Namespace) -> ScalingConfig:
    """The workers, hardware and strategy the flags ask for; invalid values raise ConfigError.
    With --gpu each worker also reserves one GPU (the runtime adds it to the worker's bundle)."""
    low, high = args.workers
    return ScalingConfig(min_workers=low, max_workers=high, spare_workers=args.spare_workers,
                         use_gpu=args.gpu, strategy=args.strategy,
                         resources_per_worker={"CPU": args.cpus_per_worker}, precision=args.precision,
                         grad_compression=None if args.grad_compression == "none" else args.grad_compression,
                         fsdp_reshard_after_forward=args.fsdp_reshard_after_forward,
                         fsdp_cpu_offload=args.fsdp_cpu_offload, node_agents=args.node_agents,
                         tensor_parallel_size=args.tp, pipeline_parallel_size=args.pp,
                         hsdp_shard_size=args.hsdp_shard_size)


def model_config(args: argparse.Namespace) -> gpt.GPTConfig:
    """The model the flags ask for; a model that --tp (and --sequence-parallel) or --pp cannot split
    raises ConfigError here, in the driver, instead of in every rank once the workers have started."""
    model_cfg = gpt.GPTConfig.named(args.model_size)
    gpt.check_tensor_parallel(model_cfg, args.tp, sequence_parallel=args.sequence_parallel)
    if args.pp > 1:
        gpt.pipeline_split_points(model_cfg, args.pp * (2 if args.pp_schedule == "interleaved1f1b" else 1))
    return model_cfg


class InjectedUserError(Exception):
    """Raised on purpose by --fail-at: a bug in user code, as the runtime sees it."""


class _FailAt:
    """The TrainContext as the loop sees it, except that report() raises at the armed step."""

    def __init__(self, ctx, step: int):
        self._ctx, self._step = ctx, step

    def __getattr__(self, name):
        return getattr(self._ctx, name)

    def report(self, **metrics):
        if self._ctx.step + 1 == self._step:     # ctx.step counts completed steps
            raise InjectedUserError(f"--fail-at: rank {self._ctx.rank} fails at step {self._step}")
        return self._ctx.report(**metrics)


def failing_loop(rank: int, step: int, generation: int):
    def train_loop(ctx):
        armed = ctx.rank == rank and ctx.generation == generation
        gpt.train_loop(_FailAt(ctx, step) if armed else ctx)
    return train_loop


def prepare_corpus(args: argparse.Namespace) -> str:
    """The corpus URL of the run, checked here so a bad --data fails before any worker starts."""
    from elastic import ParquetTokens
    model_cfg = gpt.GPTConfig.named(args.model_size)
    url = args.data
    if url is None:
        url = args.storage.rstrip("/") + "/corpus"
    if "://" not in url:
        url = os.path.abspath(url)      # the workers may run in another directory
    if args.data is None:
        if gpt.ensure_synthetic_corpus(url, model_cfg.seq_len, model_cfg.vocab, seed=args.seed) and not args.quiet:
            print(f"wrote a synthetic corpus to {url}", flush=True)
    dataset = ParquetTokens(url, model_cfg.seq_len)
    if not args.quiet:
        print(f"data: {dataset!r}", flush=True)
    return url


def storage_refused(error: Exception) -> int:
    """The exit code (and the line on stderr) of a run its storage refused: another live run holds
    it (RunConflictError), or it cannot be written (StorageConfigError, a ConfigError)."""
    if isinstance(error, RunConflictError):
        print(f"storage in use: {error}", file=sys.stderr)
        return EXIT_STORAGE_IN_USE
    print(f"configuration error: {error}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        model_config(args)      # before the corpus is written and any worker starts
    except ConfigError as error:
        print(f"configuration error: {error}", file=sys.stderr)
        return 2
    try:
        data_url = prepare_corpus(args)
    except (DatasetError, StorageError) as e:
        print(f"data: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    low, high = args.workers
    train_loop = gpt.train_loop
    if args.fail_at is not None:
        from checkpointing import read_fence
        # The run's first generation follows the newest one on storage (generations keep
        # growing across runs on the same storage).
        fence = read_fence(args.storage)
        train_loop = failing_loop(*args.fail_at, generation=0 if fence is None else fence + 1)
    try:
        trainer = ElasticTrainer(
            train_loop,
            train_loop_config={"model_size": args.model_size, "batch_size": args.batch_size, "lr": args.lr,
                               "activation_checkpointing": args.activation_checkpointing, "data": data_url,
                               HOLD_AT_KEY: args.hold_at, "loader_workers": args.loader_workers,
                               BITFLIP_REQUESTS_KEY: BitFlipRequests(args.bitflip_requests)
                               if args.bitflip_requests else None,
                               "sequence_parallel": args.sequence_parallel, "pp_schedule": args.pp_schedule,
                               "microbatches": args.microbatches or args.pp},
            scaling=scaling_config(args),
            checkpoint=CheckpointConfig(storage=args.storage, every_n_steps=args.checkpoint_every,
                                        async_save=not args.sync_checkpoints, takeover=args.takeover,
                                        in_memory_every_n_steps=args.in_memory_every),
            failure=FailureConfig(heartbeat_timeout_s=args.heartbeat_timeout),
            lr=lr_config(args), total_steps=args.steps, seed=args.seed, progress=ProgressDisplay(quiet=args.quiet))
    except ConfigError as error:
        print(f"configuration error: {error}", file=sys.stderr)
        return 2
    local = None if os.environ.get("RAY_ADDRESS") or not local_ray.supported() else local_ray.LocalRay(args.storage)
    try:
        trainer.claim_storage()      # refused in seconds, before a local Ray is started for nothing
    except RunConflictError as error:
        # The live run may be this same job run again, after its driver was killed: on a cluster
        # (RAY_ADDRESS: `ray job submit`), or on the local Ray this script started for the storage.
        # fit() attaches to it and returns its Result, or refuses with what differs.
        if not os.environ.get("RAY_ADDRESS") and (local is None or local.address() is None):
            return storage_refused(error)
    except ConfigError as error:
        return storage_refused(error)
    if not os.environ.get("RAY_ADDRESS"):
        import ray
        gpus = None     # Ray counts them itself
        if args.gpu:
            import torch
            # A worker waits for its GPU forever: fail now when this machine cannot seat MIN.
            gpus = torch.cuda.device_count()
            if gpus < low:
                print(f"--gpu: this machine has {gpus} CUDA device(s), --workers {low}:{high} needs one per "
                      f"worker; lower MIN, or leave out --gpu to train on CPU", file=sys.stderr)
                return 2
        # Logical CPUs: one per worker even on a small machine, so MAX workers and the hot spares
        # always fit (a spare reserves a worker's resources: without its CPUs it would stay pending).
        workers = high + args.spare_workers
        cpus = max(os.cpu_count() or 1, math.ceil(workers * args.cpus_per_worker))
        if local is not None:
            # The run's own Ray (elastic.local_ray): a SIGKILLed driver leaves the run going, and
            # this script run again with the same storage attaches to it; the run's end stops it.
            try:
                address, _ = local.connect(num_cpus=cpus, num_gpus=gpus)
            except local_ray.LocalRayError as error:
                print(f"local Ray: {error}", file=sys.stderr)
                return 1
            ray.init(address=address, include_dashboard=False)
        else:
            # address="local": a Ray of its own, even when another one runs on this machine (the
            # cluster to join is given by RAY_ADDRESS, as `ray job submit` does).
            local_ray.quiet_local_ray_auth()   # Ray's token-auth notice, on every start: see its docstring
            ray.init(address="local", num_cpus=cpus, num_gpus=gpus, include_dashboard=False)
    refused = False
    try:
        result = trainer.fit()
    except (RunConflictError, ConfigError) as error:
        refused = True          # a live run of another configuration: not this job's to end
        return storage_refused(error)
    finally:
        if local is not None and not refused:
            local.stop()        # the run ended (or Ctrl-C ended it): nothing of its Ray is left
    s = result.summary
    print()
    print(json.dumps({k: s.get(k) for k in ("status", "final_step", "loss_first", "loss_last", "world_size_history",
                                            "recoveries", "checkpoints", "resumed_from", "wall_s", "goodput",
                                            "model_sha256")}, indent=1))
    if result.status == "stopped":
        # A success, as asked for: `ray job list` shows SUCCEEDED, a scheduler does not retry it.
        print(f"stopped on request at step {result.final_step} of {args.steps}, checkpoint committed; "
              f"run again with --storage {args.storage} to resume", file=sys.stderr)
        return 0
    if result.status == "stopped_early":
        print(f"stopped early: the loop returned at step {result.final_step} of {args.steps}", file=sys.stderr)
        return EXIT_STOPPED_EARLY
    if not result.ok:
        print(f"run failed: {type(result.error).__name__}: {result.error}", file=sys.stderr)
        if result.error_traceback:
            print(result.error_traceback, file=sys.stderr)
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
