"""The job spec schema: one frozen dataclass per TOML table, every default defined here once.

Adding a key is one line: a typed field with its default (or ``required()``) and its checks.
The loader (``relax_hpc.spec.loader``) walks these type hints, so the supported field types
are: str, int, float, bool, Literal[...], list[str], list[float], list[Literal[...]], ``X | None``
(the key may be absent) and nested dataclasses (sub-tables). docs/spec.md describes every key.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args

from relax_hpc.spec.constraints import (
    MAX_COUNT,
    MAX_CPUS_PER_NODE,
    MAX_LOCAL_WORKERS,
    MAX_MEMORY_MB,
    MAX_NODES,
    MAX_RETRIES,
    MAX_SEED,
    MAX_SIGNAL_GRACE_S,
    MAX_STEPS,
    MAX_TIMEOUT_S,
    MAX_TOKENS,
    Check,
    at_least,
    at_most_gpus_per_node,
    each,
    exact_length,
    greater_than,
    non_empty,
    reward_function,
    slurm_memory,
    slurm_time,
    within,
)
from relax_hpc.spec.secret_urls import notify_urls
from relax_hpc.spec.text_checks import (
    bind_mounts,
    container_image,
    env_assignments,
    items,
    job_name,
    plain_text,
    sbatch_options,
    slurm_constraint,
    slurm_name,
    slurm_names,
)

__all__ = [
    "ALGORITHMS",
    "CHECKS",
    "GROUP_NORMALISED_ALGORITHMS",
    "AlgorithmName",
    "AlgorithmSpec",
    "CheckpointSpec",
    "ClusterSpec",
    "ComponentSpec",
    "ContainerSpec",
    "CriticSpec",
    "DataSpec",
    "JobInfoSpec",
    "JobSpec",
    "MetricsSpec",
    "ModelSpec",
    "NOTIFY_EVENTS",
    "NotifyEvent",
    "NotifySpec",
    "RewardSpec",
    "MegatronSpec",
    "RolloutSpec",
    "SGLangSpec",
    "SecuritySpec",
    "TrainSpec",
]

# Field metadata key under which a field's checks are stored.
CHECKS = "checks"
# Field metadata key marking a key whose values are secrets: a problem report shows them
# redacted (relax_hpc/spec/secret_urls.py), and so does the resolved spec (render.py).
SECRET = "secret"

# To add an algorithm, add its name here; ALGORITHMS (and the allowed values of
# algorithm.name) follow from this one line.
AlgorithmName = Literal["grpo", "dr_grpo", "gspo", "sapo", "opd"]
ALGORITHMS: tuple[str, ...] = get_args(AlgorithmName)
# How a step's rewards become advantages ([algorithm] advantage; relax_hpc/algos/estimators.py).
AdvantageEstimator = Literal["group", "rloo", "reinforce_pp", "reinforce_pp_baseline", "gae"]
# How trainer ranks hold the model ([train] strategy; relax_hpc/backends/parallel.py).
TrainStrategy = Literal["ddp", "fsdp2"]
# Algorithms whose advantage compares samples of the same prompt, so a group needs >= 2.
GROUP_NORMALISED_ALGORITHMS: tuple[str, ...] = ALGORITHMS


def required(*checks: Check) -> Any:
    """A key the spec must set."""
    return field(metadata={CHECKS: checks})


def setting(default: object, *checks: Check) -> Any:
    """A key with an immutable default."""
    return field(default=default, metadata={CHECKS: checks})


def setting_from(factory: Callable[[], object], *checks: Check) -> Any:
    """A key whose default is built fresh for each spec (lists, sub-tables)."""
    return field(default_factory=factory, metadata={CHECKS: checks})


def secret_setting_from(factory: Callable[[], object], *checks: Check) -> Any:
    """A key like ``setting_from`` whose values are never printed as written (SECRET)."""
    return field(default_factory=factory, metadata={CHECKS: checks, SECRET: True})


@dataclass(frozen=True, kw_only=True)
class JobInfoSpec:
    """[job]: identity of the run and how its roles share hardware."""

    name: str = required(job_name)
    # None: runs/<name>, see JobSpec.job_dir(); written into the #SBATCH --output line.
    output_dir: str | None = setting(None, non_empty, plain_text)
    seed: int = setting(1, within(0, MAX_SEED))
    mode: Literal["colocate", "async"] = setting("colocate")


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """[model]: the policy model (a Hugging Face model directory)."""

    path: str = required(non_empty, plain_text)
    build_tiny_if_missing: bool = setting(False)
    # The architecture build_tiny_if_missing writes: "qwen3" (text), "qwen3_tools" (text with a
    # tool format: relax_hpc/models/tiny_tools.py) or a tiny multimodal one.
    tiny_arch: Literal["qwen3", "qwen3_tools", "qwen2_5_vl", "qwen3_vl", "qwen2_5_omni",
                       "qwen3_omni"] = setting("qwen3")
    # The architecture of the model at `path` (a `make-tiny` family), for where its config.json is
    # not readable: `relax-hpc rehearse` builds a tiny model of it. Unset: read from config.json.
    arch: Literal["qwen3", "qwen3_moe", "qwen2_5_vl", "qwen3_vl", "qwen2_5_omni", "qwen3_omni"] | None = setting(None)
    dtype: Literal["float32", "bfloat16", "float16"] = setting("float32")


@dataclass(frozen=True, kw_only=True)
class DataSpec:
    """[data]: the prompt dataset (JSON lines or Parquet); keys may be dotted ("a.b")."""

    path: str = required(non_empty, plain_text)
    prompt_key: str = setting("prompt", non_empty, plain_text)
    label_key: str = setting("label", non_empty, plain_text)
    metadata_keys: list[str] = setting_from(list, items(plain_text))  # empty: every other top-level column
    prompt_template: str | None = setting(None, non_empty)  # "{question}\n{choices}": row fields
    apply_chat_template: bool = setting(False)  # wrap string prompts as a user message
    system_prompt: str | None = setting(None, non_empty)
    image_key: str | None = setting(None, non_empty, plain_text)
    audio_key: str | None = setting(None, non_empty, plain_text)
    video_key: str | None = setting(None, non_empty, plain_text)
    drop_media: bool = setting(False)  # blank every medium (a control run: does the model use them?)
    max_media_bytes: int = setting(64 << 20, within(1, 1 << 40))  # per file / cell, checked before reading
    video_fps: float = setting(2.0, within(0, 240, low_open=True))  # frames sampled per second of video
    max_frames: int = setting(32, within(1, 4096))  # per video, sampled uniformly over the clip
    max_media_seconds: float = setting(600.0, within(0, 86400, low_open=True))  # per audio / video clip
    # Write the data set named here at `path` when it does not exist (the tiny omni task,
    # relax_hpc.media.synthetic: an answer needs the image, the tone or the flashes).
    build_if_missing: Literal["tiny_omni"] | None = setting(None)
    shuffle: bool = setting(True)
    max_prompt_tokens: int = setting(512, within(1, MAX_TOKENS))


@dataclass(frozen=True, kw_only=True)
class SGLangSpec:
    """[rollout.sglang]: the SGLang servers of `engine = "sglang"` (docs/engines.md)."""

    # The interpreter that runs `python -m sglang.launch_server` (SGLang pins its own torch and
    # transformers, so it often lives in its own environment); None: the one running relax-hpc.
    python: str | None = setting(None, non_empty, plain_text)
    tp_size: int = setting(1, within(1, MAX_COUNT))  # GPUs (tensor-parallel ranks) per engine
    mem_fraction_static: float | None = setting(None, within(0, 1, low_open=True, high_open=True))
    context_length: int | None = setting(None, within(1, MAX_TOKENS))
    # How each weight version reaches the servers: "auto" is "tensor" when colocated, else
    # "distributed" (a torch.distributed group, in buckets); "disk" writes a safetensors directory.
    weight_update: Literal["auto", "distributed", "tensor", "disk"] = setting("auto")
    update_bucket_mb: int = setting(512, within(1, MAX_MEMORY_MB))
    startup_timeout_s: float = setting(900.0, within(0, MAX_TIMEOUT_S, low_open=True))
    max_restarts: int = setting(3, within(0, MAX_RETRIES))  # per engine; a dead server past this is left dead
    extra_args: list[str] = setting_from(list, items(plain_text))  # more launch_server flags, e.g. "--chunked-prefill-size=4096"


@dataclass(frozen=True, kw_only=True)
class RolloutSpec:
    """[rollout]: generation of responses."""

    engine: Literal["native", "sglang"] = setting("native")
    prompts_per_step: int = setting(16, within(1, MAX_COUNT))
    n_samples_per_prompt: int = setting(8, within(1, MAX_COUNT))
    max_new_tokens: int = setting(64, within(1, MAX_TOKENS))
    temperature: float = setting(1.0, greater_than(0))
    top_p: float = setting(1.0, within(0, 1, low_open=True))
    top_k: int = setting(0, within(0, MAX_TOKENS))  # 0 disables top-k
    stop: list[str] = setting_from(list)  # stop strings; EOS always stops
    num_engines: int = setting(1, within(1, MAX_COUNT))
    chunks_per_engine: int = setting(1, within(1, 64))
    dynamic_sampling: bool = setting(False)  # DAPO: drop all-equal-reward groups, over-sample
    max_sampling_rounds: int = setting(4, within(1, MAX_COUNT))  # generation rounds per step to fill it
    # Agentic rollouts (docs/agents.md): a multi-turn environment, a custom generate function,
    # or an agent workflow behind the OpenAI-compatible proxy ("package.module:Name" paths).
    env: str | None = setting(None, non_empty, plain_text)
    generate: str | None = setting(None, non_empty, plain_text)
    max_turns: int = setting(4, within(1, MAX_COUNT))  # model turns per episode
    max_total_tokens: int = setting(256, within(1, MAX_TOKENS))  # response budget: model + observation tokens
    agent: str | None = setting(None, non_empty, plain_text)
    agent_mode: Literal["inline", "subproc"] = setting("inline")
    agent_turn_discount: float = setting(1.0, within(0, 1))
    agent_export_style: Literal["individual", "concat"] = setting("individual")
    agent_subproc_max_workers: int = setting(4, within(1, MAX_LOCAL_WORKERS))
    agent_session_timeout_s: float = setting(600.0, within(0, MAX_TIMEOUT_S, low_open=True))
    sglang: SGLangSpec = setting_from(SGLangSpec)

    @property
    def on_sglang(self) -> bool:
        """The engines are SGLang servers (engine = "sglang"): their own interpreter, requests over
        HTTP, weights pushed to them; otherwise the native engine, in the rollout's processes."""
        return self.engine == "sglang"


@dataclass(frozen=True, kw_only=True)
class AlgorithmSpec:
    """[algorithm]: advantage estimator and policy loss."""

    name: AlgorithmName = setting("grpo")
    # group (GRPO's), rloo, reinforce_pp, reinforce_pp_baseline (docs/algorithms/)
    advantage: AdvantageEstimator = setting("group")
    normalize_std: bool = setting(True)  # False gives Dr.GRPO's advantage
    clip_eps_low: float = setting(0.2, at_least(0))
    clip_eps_high: float = setting(0.2, at_least(0))
    kl_coef: float = setting(0.0, at_least(0))
    kl_estimator: Literal["k1", "k2", "k3", "low_var_kl"] = setting("low_var_kl")
    loss_agg: Literal["seq_mean_token_mean", "token_mean"] = setting("seq_mean_token_mean")
    entropy_coef: float = setting(0.0, at_least(0))
    max_staleness: int = setting(0, within(0, MAX_STEPS))
    dual_clip_c: float | None = setting(None, greater_than(1))  # cap the loss at -c*A for A < 0
    tis_cap: float | None = setting(None, greater_than(0))  # truncated importance sampling cap
    sapo_tau_pos: float = setting(1.0, greater_than(0))
    sapo_tau_neg: float = setting(1.05, greater_than(0))
    opd_teacher_path: str | None = setting(None, non_empty, plain_text)  # HF dir of the teacher (name = "opd")
    opd_coef: float = setting(1.0, at_least(0))  # lambda of A_t - lambda*(logp_student - logp_teacher)
    routing_replay: bool = setting(False)  # R3: the trainer replays the experts the engine routed to (MoE)
    # DAPO's overlong shaping (docs/algorithms/dapo_overlong.md): truncated samples get loss mask 0,
    overlong_filter: bool = setting(False)
    # and a penalty falling linearly to -overlong_penalty over the last overlong_buffer_len tokens
    # before rollout.max_new_tokens (0: no penalty)
    overlong_buffer_len: int = setting(0, within(0, MAX_TOKENS))
    overlong_penalty: float = setting(1.0, at_least(0))
    # advantage = "gae" (PPO with the [critic] role; docs/algorithms/gae.md)
    gamma: float = setting(1.0, within(0, 1))  # discount per token
    lam: float = setting(1.0, within(0, 1))  # GAE's lambda
    value_clip_eps: float | None = setting(0.5, greater_than(0))  # the value loss's clip; unset: unclipped


@dataclass(frozen=True, kw_only=True)
class RewardSpec:
    """[reward]: how responses are scored."""

    function: str = required(plain_text, reward_function)  # built-in name or "package.module:function"
    type_key: str | None = setting(None, non_empty, plain_text)  # metadata key naming a per-sample reward
    concurrency: int = setting(16, within(1, MAX_COUNT))
    timeout_s: float = setting(60.0, within(0, MAX_TIMEOUT_S, low_open=True))
    # plain rewards' processes; None: one per CPU
    worker_processes: int | None = setting(None, within(0, MAX_LOCAL_WORKERS))
    worker_memory_mb: int = setting(4096, within(0, MAX_MEMORY_MB))  # each worker's address-space cap; 0: none
    ifbench_keyword_match: Literal["reference", "whole_word"] = setting("reference")  # IFEval keywords
    remote_url: str | None = setting(None, non_empty, plain_text)
    remote_max_retries: int = setting(3, within(0, MAX_RETRIES))
    genrm_prompt: str | None = setting(None, non_empty)  # {question} {answer} {label}
    # the judge's HF dir, served in the rollout process
    genrm_model_path: str | None = setting(None, non_empty, plain_text)
    # or a judge engine server (relax-hpc serve-engine, SGLang)
    genrm_url: str | None = setting(None, non_empty, plain_text)
    # the judge's tokenizer; required with genrm_url
    genrm_tokenizer_path: str | None = setting(None, non_empty, plain_text)
    # the judge server's bearer token (what `serve-engine --token-file` wrote); None: the job's own
    genrm_token_file: str | None = setting(None, non_empty, plain_text)


@dataclass(frozen=True, kw_only=True)
class MegatronSpec:
    """[train.megatron]: how `backend = "megatron"` splits the model over the trainer ranks.

    The data-parallel size is what is left: num_processes / (tensor * pipeline * context).
    """

    tensor_parallel: int = setting(1, within(1, MAX_COUNT))
    pipeline_parallel: int = setting(1, within(1, MAX_COUNT))
    context_parallel: int = setting(1, within(1, MAX_COUNT))
    expert_parallel: int = setting(1, within(1, MAX_COUNT))
    sequence_parallel: bool = setting(False)  # needs tensor_parallel > 1
    distributed_optimizer: bool = setting(False)  # optimizer state sharded over data-parallel ranks
    recompute: Literal["none", "selective", "full"] = setting("none")  # activation recomputation


@dataclass(frozen=True, kw_only=True)
class TrainSpec:
    """[train]: the optimisation loop."""

    backend: Literal["torch", "megatron"] = setting("torch")
    steps: int = required(within(1, MAX_STEPS))
    lr: float = setting(1e-6, greater_than(0))
    weight_decay: float = setting(0.0, at_least(0))
    adam_betas: list[float] = setting_from(
        lambda: [0.9, 0.999], exact_length(2), each(within(0, 1, high_open=True))
    )
    grad_clip: float = setting(1.0, at_least(0))  # 0 disables clipping
    micro_batch_size: int = setting(8, within(1, MAX_COUNT))
    mini_batches: int = setting(1, within(1, MAX_COUNT))  # optimizer steps per rollout batch
    num_processes: int = setting(1, within(1, MAX_COUNT))  # data-parallel trainer processes
    strategy: TrainStrategy = setting("ddp")  # replicated, or sharded over the ranks
    actor_fwd_role: bool = setting(False)  # old log-probs from a separate ActorFwd role
    reference_role: bool = setting(False)  # reference log-probs from a separate Reference role
    advantages_role: bool = setting(False)  # group advantages from a separate Advantages role
    device: Literal["auto", "cpu", "cuda"] = setting("auto")
    megatron: MegatronSpec = setting_from(MegatronSpec)


@dataclass(frozen=True, kw_only=True)
class CriticSpec:
    """[critic]: PPO's value model, its own role and optimizer (advantage = "gae")."""

    model_path: str | None = setting(None, non_empty, plain_text)  # unset: [model] path with a fresh value head
    lr: float = setting(1e-5, greater_than(0))
    warmup_steps: int = setting(0, within(0, MAX_STEPS))  # the actor does not train during the first N steps
    micro_batch_size: int = setting(8, within(1, MAX_COUNT))
    grad_clip: float = setting(1.0, at_least(0))  # 0 disables clipping
    num_processes: int = setting(1, within(1, MAX_COUNT))  # the critic's data-parallel ranks
    strategy: TrainStrategy | None = setting(None)  # how they hold the value model; unset: [train] strategy
    backend: Literal["torch", "megatron"] | None = setting(None)  # unset: [train] backend
    megatron: MegatronSpec | None = setting(None)  # [critic.megatron], backend "megatron"; unset: [train.megatron]


@dataclass(frozen=True, kw_only=True)
class CheckpointSpec:
    """[checkpoint]: when to save and whether to resume."""

    save_interval: int = setting(50, within(1, MAX_STEPS))
    keep_last: int = setting(2, within(1, MAX_STEPS))
    resume: bool = setting(True)


@dataclass(frozen=True, kw_only=True)
class MetricsSpec:
    """[metrics]: where step metrics go: JSONL, TensorBoard, W&B, ClearML and MLflow (offline by default,
    written under the job directory; docs/operations.md, "Metrics sinks")."""

    tensorboard: bool = setting(True)
    jsonl: bool = setting(True)
    plot: bool = setting(True)
    plot_every_steps: int = setting(20, within(0, MAX_STEPS))  # redraw the plots during the run; 0: at the end only
    wandb_project: str | None = setting(None, plain_text)  # unset: no W&B
    wandb_mode: Literal["offline", "online"] = setting("offline")  # offline: JOBDIR/wandb, `wandb sync` later
    clearml_project: str | None = setting(None, plain_text)  # unset: no ClearML; offline session in JOBDIR/clearml
    mlflow_experiment: str | None = setting(None, non_empty, plain_text)  # unset: no MLflow
    mlflow_tracking_uri: str | None = setting(None, non_empty, plain_text)  # unset: file store in JOBDIR/mlflow/mlruns
    trajectory_archive: bool = setting(False)  # every trained sample to JOBDIR/trajectories (HDF5)


# What a job alerts its owner about ([notify] events; relax_hpc/driver/alerts.py sends them).
NotifyEvent = Literal["started", "requeued", "preempted", "role_restarted", "save_failed", "failed", "finished",
                      "reward_milestone"]
NOTIFY_EVENTS: tuple[str, ...] = get_args(NotifyEvent)


@dataclass(frozen=True, kw_only=True)
class NotifySpec:
    """[notify]: alerts to the job's owner through Apprise URLs (docs/operations.md, "Alerts")."""

    # Apprise URLs ("ntfy://ntfy.sh/topic", "slack://A/B/C"); empty, with no urls_file: no alerts.
    urls: list[str] = secret_setting_from(list, notify_urls)
    # A file of URLs, one a line, read when the job starts; owner-only (keeps them out of the job dir).
    urls_file: str | None = setting(None, non_empty, plain_text)
    events: list[NotifyEvent] = setting_from(
        lambda: ["started", "requeued", "preempted", "role_restarted", "save_failed", "failed", "finished",
                 "reward_milestone"])
    min_interval_s: float = setting(60.0, within(0, MAX_TIMEOUT_S))  # per event kind; 0: no limit
    reward_milestones: list[float] = setting_from(list)  # alert once when reward/mean first reaches each


@dataclass(frozen=True, kw_only=True)
class HealthSpec:
    """[health]: every role sends a heartbeat; a role that dies or falls silent is restarted in
    place, and the run restarts from its newest checkpoint when that cannot heal it
    (docs/operations.md, "Health")."""

    heartbeat_s: float = setting(10.0, within(0.1, MAX_TIMEOUT_S))  # how often each role reports
    stale_s: float = setting(120.0, within(0.5, MAX_TIMEOUT_S))  # silent this long: hung, restarted
    # The failure of one role that is not restarted in place (the run restarts globally instead).
    max_in_place_restarts: int = setting(3, within(1, MAX_COUNT))
    max_global_restarts: int = setting(3, within(0, MAX_COUNT))  # then the run fails


@dataclass(frozen=True, kw_only=True)
class SecuritySpec:
    """[security]: how the transfer queue protects what crosses the network between nodes
    (docs/transfer-queue.md, "Authentication"). Every connection is authenticated with the job
    secret in every mode."""

    # "curve": every byte through CURVE; "encrypt": each message under AES-256-GCM with a
    # per-session key handed out through CURVE (as fast or faster for samples of 1 MiB, slower and
    # heavier on the server for an omni step's 12 MB rows: docs/transfer-queue.md);
    # "authenticate": integrity only (AES-GMAC tags), for a network the site declares private.
    payload: Literal["curve", "encrypt", "authenticate"] = setting("curve")


@dataclass(frozen=True, kw_only=True)
class FederationSpec:
    """[federation]: the driver of a submitted job grows it by itself when rollout is the
    bottleneck, and gives the engines back when they do not pay (docs/federation.md, "Growing by
    itself"). Off unless max_engines > 0."""

    max_engines: int = setting(0, within(0, MAX_COUNT))  # engines of the one grow job it submits; 0: off
    partition: str | None = setting(None, slurm_names)  # unset: the rollout component's
    qos: str | None = setting(None, slurm_name)
    time: str | None = setting(None, slurm_time)  # the grow job's limit; unset: the rollout component's
    min_step_gain: float = setting(0.1, within(0.0, 10.0))  # keep the grow job only if steps got this much faster
    window_steps: int = setting(10, within(2, 10_000))  # steps measured before and after a grow


@dataclass(frozen=True, kw_only=True)
class ComponentSpec:
    """[cluster.trainer] / [cluster.rollout] / [cluster.forward]: one hetjob component."""

    # Every string here is written into an #SBATCH line, so each has a pattern (text_checks.py).
    nodes: int = setting(1, within(1, MAX_NODES))
    gpus_per_node: int = setting(0, at_least(0), at_most_gpus_per_node)
    cpus_per_node: int = setting(2, within(1, MAX_CPUS_PER_NODE))
    memory: str | None = setting(None, slurm_memory)  # Slurm --mem, e.g. "64G"
    partition: str | None = setting(None, slurm_names)  # "gpu" or "gpu,gpu-long"
    time: str = setting("01:00:00", slurm_time)
    account: str | None = setting(None, slurm_name)
    qos: str | None = setting(None, slurm_name)
    constraint: str | None = setting(None, slurm_constraint)  # a feature expression, e.g. "h100"
    extra_sbatch: list[str] = setting_from(list, sbatch_options)  # extra "#SBATCH" options, e.g. "--exclusive"
    # Memory of each GPU, in GB: `validate` refuses a layout whose predicted bytes per GPU exceed it.
    gpu_memory_gb: float = setting(80.0, within(0, 4096, low_open=True))


@dataclass(frozen=True, kw_only=True)
class ClusterSpec:
    """[cluster]: the Slurm layout; the forward/reference component is optional."""

    trainer: ComponentSpec = setting_from(ComponentSpec)
    rollout: ComponentSpec = setting_from(ComponentSpec)
    forward: ComponentSpec | None = setting(None)
    # Rollout engines run on the trainer's nodes and GPUs ([cluster.rollout] unused); needs job.mode = "colocate".
    colocate: bool = setting(False)
    # Slurm sends USR1 this long before the time limit; the driver checkpoints and the job requeues.
    signal_grace_s: int = setting(120, within(10, MAX_SIGNAL_GRACE_S))
    # How long the batch script waits for every node's Ray worker to join before failing the job.
    ray_join_timeout_s: int = setting(300, within(10, MAX_TIMEOUT_S))
    requeue: bool = setting(True)  # --requeue and `scontrol requeue` after a pre-emption checkpoint


@dataclass(frozen=True, kw_only=True)
class ContainerSpec:
    """[container]: run every Slurm step in an Apptainer image (unset image: on the host)."""

    image: str | None = setting(None, non_empty, container_image)  # a .sif file (or any apptainer exec target)
    binds: list[str] = setting_from(list, bind_mounts)  # apptainer --bind "src[:dst[:opts]]"
    env: list[str] = setting_from(list, env_assignments)  # "NAME=VALUE", set inside the container


@dataclass(frozen=True, kw_only=True)
class JobSpec:
    """A whole, validated job spec (the root of the TOML document)."""

    job: JobInfoSpec = required()
    model: ModelSpec = required()
    data: DataSpec = required()
    rollout: RolloutSpec = setting_from(RolloutSpec)
    algorithm: AlgorithmSpec = setting_from(AlgorithmSpec)
    reward: RewardSpec = required()
    train: TrainSpec = required()
    critic: CriticSpec | None = setting(None)  # required by, and only with, algorithm.advantage = "gae"
    checkpoint: CheckpointSpec = setting_from(CheckpointSpec)
    metrics: MetricsSpec = setting_from(MetricsSpec)
    notify: NotifySpec = setting_from(NotifySpec)
    federation: FederationSpec = setting_from(FederationSpec)
    health: HealthSpec = setting_from(HealthSpec)
    security: SecuritySpec = setting_from(SecuritySpec)
    cluster: ClusterSpec = setting_from(ClusterSpec)
    container: ContainerSpec = setting_from(ContainerSpec)

    def job_dir(self, base: Path | None = None) -> Path:
        """The job directory as an absolute path.

        ``job.output_dir`` when set, else ``runs/<job.name>``; a relative path is taken
        relative to ``base`` (default: the current working directory).
        """
        out = self.job.output_dir
        chosen = Path(out).expanduser() if out is not None else Path("runs") / self.job.name
        return chosen if chosen.is_absolute() else (base or Path.cwd()) / chosen
