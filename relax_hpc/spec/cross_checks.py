"""Checks that involve several keys: combinations that cannot run, even though each key is fine.

Each check reads resolved values (defaults applied) by TOML path and returns problems keyed
by the key to change, naming the other keys in the message. A check whose inputs are
themselves invalid stays silent: those keys are already reported, and a second message
about the same value would only add noise.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

from relax_hpc.spec.errors import SpecProblem, show_value
from relax_hpc.spec.schema import GROUP_NORMALISED_ALGORITHMS
from relax_hpc.spec.slurm_values import slurm_time_to_seconds

__all__ = ["CROSS_CHECKS", "Resolved"]

# More divisors than this are summarised; the report must stay one line per problem.
_MAX_LISTED_DIVISORS = 12
# Beyond this (a typo, surely) the divisors are not searched for.
_MAX_DIVISIBLE = 10**10


class Resolved:
    """Resolved spec values by TOML path (``"train.mini_batches"``), with defaults applied."""

    def __init__(self, values: Mapping[str, Any], invalid: object) -> None:
        self._values = values
        self._invalid = invalid

    def get(self, *keys: str) -> tuple[Any, ...] | None:
        """The values of ``keys``, or None when any of them is missing or invalid."""
        found = tuple(self._values.get(key, self._invalid) for key in keys)
        return None if any(value is self._invalid for value in found) else found


def _colocate_is_on_policy(spec: Resolved) -> list[SpecProblem]:
    got = spec.get("job.mode", "algorithm.max_staleness")
    if got is None or got[0] != "colocate" or got[1] == 0:
        return []
    message = (
        'must be 0 when job.mode = "colocate" (rollout and training take turns, so rollout cannot run ahead); '
        'set max_staleness = 0 or use mode = "async"'
    )
    return [SpecProblem(key="algorithm.max_staleness", value=show_value(got[1]), message=message)]


def _divisors(number: int) -> str | None:
    """The divisors of ``number`` as text; None when too large to list quickly."""
    if number > _MAX_DIVISIBLE:
        return None
    # Pairs (d, number // d) up to the square root.
    small = [d for d in range(1, math.isqrt(number) + 1) if number % d == 0]
    found = sorted(set(small + [number // d for d in small]))
    listed = ", ".join(str(d) for d in found[:_MAX_LISTED_DIVISORS])
    return listed + (", ..." if len(found) > _MAX_LISTED_DIVISORS else "")


def _samples_split_into_mini_batches(spec: Resolved) -> list[SpecProblem]:
    got = spec.get("rollout.prompts_per_step", "rollout.n_samples_per_prompt", "train.mini_batches")
    if got is None:
        return []
    prompts, samples, mini_batches = got
    total = prompts * samples
    if total % mini_batches == 0:
        return []
    message = (
        "must divide the samples of one step, rollout.prompts_per_step * rollout.n_samples_per_prompt"
        f" = {prompts} * {samples} = {total}"
    )
    return [SpecProblem("train.mini_batches", show_value(mini_batches), message, allowed=_divisors(total))]


def _groups_have_two_samples(spec: Resolved) -> list[SpecProblem]:
    got = spec.get("algorithm.name", "algorithm.advantage", "rollout.n_samples_per_prompt")
    if got is None or got[0] not in GROUP_NORMALISED_ALGORITHMS or got[1] in ("reinforce_pp", "gae") or got[2] >= 2:
        return []
    message = (
        f'must be >= 2 with algorithm.name = "{got[0]}" and advantage = "{got[1]}": the advantage compares the '
        'samples of one prompt, and a group of one has no baseline (advantage = "reinforce_pp" needs no group, nor does "gae")'
    )
    return [SpecProblem(key="rollout.n_samples_per_prompt", value=show_value(got[2]), message=message)]


def _reinforce_pp_kl_in_the_reward(spec: Resolved) -> list[SpecProblem]:
    got = spec.get("algorithm.advantage", "algorithm.kl_coef")
    if got is None or got[0] != "reinforce_pp" or got[1] == 0:
        return []
    message = ('with advantage = "reinforce_pp" would be a KL loss, while REINFORCE++ puts its KL in the reward, '
               'which is not built yet: set kl_coef = 0, or use advantage = "reinforce_pp_baseline", whose '
               "authors take the KL as a loss (docs/algorithms/reinforce_pp.md)")
    return [SpecProblem(key="algorithm.kl_coef", value=show_value(got[1]), message=message)]


def _overlong_buffer_fits(spec: Resolved) -> list[SpecProblem]:
    got = spec.get("algorithm.overlong_buffer_len", "rollout.max_new_tokens")
    if got is None or got[0] <= got[1]:
        return []
    message = (f"must be <= rollout.max_new_tokens = {got[1]}: the penalty falls over the last overlong_buffer_len "
               "tokens before that limit")
    return [SpecProblem(key="algorithm.overlong_buffer_len", value=show_value(got[0]), message=message)]


def _overlong_shaping_needs_one_turn(spec: Resolved) -> list[SpecProblem]:
    got = spec.get("algorithm.overlong_filter", "algorithm.overlong_buffer_len", "rollout.env",
                   "rollout.generate", "rollout.agent")
    if got is None or not (got[0] or got[1] > 0) or not any(got[2:]):
        return []
    key = "algorithm.overlong_filter" if got[0] else "algorithm.overlong_buffer_len"
    message = ("measures a response against rollout.max_new_tokens, which bounds one generation; a multi-turn "
               "episode (rollout.env, generate or agent) is bounded by max_total_tokens and its turns: "
               "turn it off for agentic rollouts")
    return [SpecProblem(key=key, value="true" if got[0] else show_value(got[1]), message=message)]


def _agent_drives_alone(spec: Resolved) -> list[SpecProblem]:
    got = spec.get("rollout.agent", "rollout.env", "rollout.generate")
    if got is None or not got[0] or not (got[1] or got[2]):
        return []
    message = ("cannot be combined with rollout.env or rollout.generate: an agent drives the conversation itself "
               "through the proxy; set either agent, or env/generate")
    return [SpecProblem(key="rollout.agent", value=show_value(got[0]), message=message)]


def _fits_on_gpus(spec: Resolved, count_key: str, component: str, reason: str) -> list[SpecProblem]:
    got = spec.get(count_key, f"cluster.{component}.nodes", f"cluster.{component}.gpus_per_node")
    if got is None:
        return []
    count, nodes, gpus = got
    if gpus == 0 or count <= nodes * gpus:
        return []
    product = f"cluster.{component}.nodes * cluster.{component}.gpus_per_node = {nodes} * {gpus} = {nodes * gpus}"
    message = (
        f"must be <= {product} ({reason}); "
        f"lower it or raise nodes / gpus_per_node in [cluster.{component}]"
    )
    return [SpecProblem(key=count_key, value=show_value(count), message=message)]


def _trainer_processes_fit(spec: Resolved) -> list[SpecProblem]:
    return _fits_on_gpus(spec, "train.num_processes", "trainer", "trainer processes each need a GPU")


def _rollout_engines_fit(spec: Resolved) -> list[SpecProblem]:
    got = spec.get("cluster.colocate", "rollout.engine", "rollout.sglang.tp_size")
    if got is None:
        return []
    colocate, engine, tp_size = got
    if engine == "sglang" and tp_size > 1:
        return _engine_gpus_fit(spec, "trainer" if colocate else "rollout", tp_size)
    if colocate:
        # Colocated engines have no component of their own: they take turns with the trainer on its GPUs.
        reason = "with cluster.colocate = true the rollout engines run on the trainer's GPUs, each needing one"
        return _fits_on_gpus(spec, "rollout.num_engines", "trainer", reason)
    return _fits_on_gpus(spec, "rollout.num_engines", "rollout", "rollout engines each need a GPU")


def _engine_gpus_fit(spec: Resolved, component: str, tp_size: int) -> list[SpecProblem]:
    """SGLang engines of `tp_size` GPUs each: one engine's ranks share a node, and all must fit."""
    got = spec.get("rollout.num_engines", f"cluster.{component}.nodes", f"cluster.{component}.gpus_per_node")
    if got is None:
        return []
    engines, nodes, gpus = got
    if gpus == 0:
        return []
    if tp_size > gpus:
        message = (f"must be <= cluster.{component}.gpus_per_node = {gpus}: one engine's tensor-parallel ranks "
                   f"share a node; lower it or raise gpus_per_node in [cluster.{component}]")
        return [SpecProblem("rollout.sglang.tp_size", show_value(tp_size), message)]
    per_node = gpus // tp_size
    if engines <= nodes * per_node:
        return []
    message = (f"must be <= {nodes * per_node}: each engine takes rollout.sglang.tp_size = {tp_size} GPUs of one "
               f"node, and cluster.{component} has {nodes} node(s) * {gpus} GPUs; lower it, lower tp_size or add "
               f"nodes / gpus_per_node in [cluster.{component}]")
    return [SpecProblem("rollout.num_engines", show_value(engines), message)]


def _megatron_sizes_divide_processes(spec: Resolved) -> list[SpecProblem]:
    got = spec.get("train.backend", "train.num_processes", "train.megatron.tensor_parallel",
                   "train.megatron.pipeline_parallel", "train.megatron.context_parallel",
                   "train.megatron.expert_parallel")
    if got is None or got[0] != "megatron":
        return []
    _, processes, tp, pp, cp, ep = got
    model_parallel = tp * pp * cp
    if processes % model_parallel:
        message = (f"must be a multiple of tensor_parallel * pipeline_parallel * context_parallel = {tp} * {pp} * "
                   f"{cp} = {model_parallel} in [train.megatron] (the data-parallel size is what is left)")
        return [SpecProblem("train.num_processes", show_value(processes), message)]
    if processes % (tp * pp * ep):
        message = (f"must divide train.num_processes / (tensor_parallel * pipeline_parallel) = "
                   f"{processes // (tp * pp)}: the expert-parallel ranks come from the data-parallel ones")
        return [SpecProblem("train.megatron.expert_parallel", show_value(ep), message)]
    return []


def _megatron_context_parallel_unsupported(spec: Resolved) -> list[SpecProblem]:
    # The backend refuses it wherever it runs (backends/megatron_data.py: MegatronLayout.problems),
    # with or without Transformer Engine, so whether this machine could import TE does not matter.
    got = spec.get("train.backend", "train.megatron.context_parallel")
    if got is None or got[0] != "megatron" or got[1] == 1:
        return []
    message = ("is not supported by this version of the megatron backend: context parallelism needs Transformer "
               "Engine's attention and a split of each sequence over the ranks, which the backend does not do "
               "yet; set context_parallel = 1 (tensor_parallel or pipeline_parallel split a large model)")
    return [SpecProblem("train.megatron.context_parallel", show_value(got[1]), message)]


def _megatron_tensor_parallel_in_node(spec: Resolved) -> list[SpecProblem]:
    got = spec.get("train.backend", "train.megatron.tensor_parallel", "cluster.trainer.gpus_per_node")
    if got is None or got[0] != "megatron" or got[2] == 0 or got[1] <= got[2]:
        return []
    message = (f"must be <= cluster.trainer.gpus_per_node = {got[2]}: tensor-parallel ranks exchange activations "
               "every layer and must share a node; use pipeline_parallel across nodes instead")
    return [SpecProblem("train.megatron.tensor_parallel", show_value(got[1]), message)]


def _megatron_table_needs_megatron(spec: Resolved) -> list[SpecProblem]:
    got = spec.get("train.backend", "train.megatron.tensor_parallel", "train.megatron.pipeline_parallel",
                   "train.megatron.context_parallel", "train.megatron.expert_parallel",
                   "train.megatron.sequence_parallel", "train.megatron.distributed_optimizer",
                   "train.megatron.recompute", "algorithm.routing_replay")
    if got is None:
        return []
    backend, tp, pp, cp, ep, sp, dist_opt, recompute, replay = got
    problems = []
    if backend != "megatron":
        sizes = {"tensor_parallel": tp, "pipeline_parallel": pp, "context_parallel": cp, "expert_parallel": ep}
        for key, size in sizes.items():
            if size != 1:
                message = (f'splits the model only with train.backend = "megatron", not "{backend}"; set '
                           f'backend = "megatron" or remove it')
                problems.append(SpecProblem(f"train.megatron.{key}", show_value(size), message))
        if replay:
            message = (f'needs train.backend = "megatron" (the torch backend routes afresh), not "{backend}"; '
                       'set backend = "megatron" or routing_replay = false')
            problems.append(SpecProblem("algorithm.routing_replay", "true", message))
    if replay and backend == "megatron" and (recompute == "full" or cp > 1):
        what = 'recompute = "full"' if recompute == "full" else f"context_parallel = {cp}"
        message = (f"cannot be combined with train.megatron.{what}: the replayed experts are set for the "
                   "forward pass of whole sequences, which full recomputation repeats outside it and context "
                   "parallelism splits; use recompute = \"selective\" or \"none\" and context_parallel = 1")
        problems.append(SpecProblem("algorithm.routing_replay", "true", message))
    if sp and tp == 1:
        message = ("needs train.megatron.tensor_parallel > 1 (it splits activations over the tensor-parallel "
                   "ranks); raise tensor_parallel or set sequence_parallel = false")
        problems.append(SpecProblem("train.megatron.sequence_parallel", "true", message))
    return problems


def _distributed_optimizer_needs_cuda(spec: Resolved) -> list[SpecProblem]:
    got = spec.get("train.backend", "train.megatron.distributed_optimizer", "train.device")
    if got is None or got[0] != "megatron" or not got[1] or got[2] != "cpu":
        return []
    message = ('needs CUDA: on CPU the megatron backend trains with torch.optim.AdamW over its own parameters; '
               'set distributed_optimizer = false or device = "cuda"')
    return [SpecProblem("train.megatron.distributed_optimizer", "true", message)]


def _shared_gpus_take_turns(spec: Resolved) -> list[SpecProblem]:
    got = spec.get("cluster.colocate", "job.mode")
    if got is None or not got[0] or got[1] == "colocate":
        return []
    message = (
        f'needs job.mode = "colocate", not "{got[1]}": rollout engines that share the trainer\'s GPUs must '
        'take turns with training; set mode = "colocate" in [job] or colocate = false'
    )
    return [SpecProblem(key="cluster.colocate", value="true", message=message)]


def _cuda_needs_gpus(spec: Resolved) -> list[SpecProblem]:
    got = spec.get("train.device", "cluster.trainer.gpus_per_node")
    if got is None or got[0] != "cuda" or got[1] > 0:
        return []
    message = (
        "needs GPUs, but cluster.trainer.gpus_per_node = 0; "
        'set gpus_per_node in [cluster.trainer] or use device = "auto" or "cpu"'
    )
    return [SpecProblem(key="train.device", value=show_value(got[0]), message=message)]


def _grace_fits_time_limit(spec: Resolved) -> list[SpecProblem]:
    # The pre-emption signal must arrive after the job starts, with time left to train.
    got = spec.get("cluster.signal_grace_s", "cluster.trainer.time")
    if got is None:
        return []
    grace, time_text = got
    limit = slurm_time_to_seconds(time_text)
    if grace < limit:
        return []
    message = (
        f"must be below cluster.trainer.time = {time_text!r} ({limit} s): Slurm sends the checkpoint "
        "signal this many seconds before the limit; lower it or raise the time limit"
    )
    return [SpecProblem(key="cluster.signal_grace_s", value=show_value(grace), message=message)]


def _opd_has_a_teacher(spec: Resolved) -> list[SpecProblem]:
    got = spec.get("algorithm.name", "algorithm.opd_teacher_path")
    if got is None or got[0] != "opd" or got[1] is not None:
        return []
    message = ('is required when algorithm.name = "opd": set it to the teacher\'s Hugging Face '
               "model directory (on-policy distillation pulls the student toward it)")
    return [SpecProblem(key="algorithm.opd_teacher_path", value=None, message=message)]


def _remote_reward_has_a_url(spec: Resolved) -> list[SpecProblem]:
    # The reward hub refuses it at the first scored sample (relax_hpc/rewards/hub.py).
    got = spec.get("reward.function", "reward.remote_url")
    if got is None or got[0] != "remote_rm" or got[1] is not None:
        return []
    message = ('is required when reward.function = "remote_rm": set it to the reward server\'s URL, '
               'e.g. "http://host:port/path"')
    return [SpecProblem(key="reward.remote_url", value=None, message=message)]


def _clip_floor_is_positive(spec: Resolved) -> list[SpecProblem]:
    # The policy loss refuses it at the first step (relax_hpc/algos/losses.py: loss_config_problems).
    got = spec.get("algorithm.clip_eps_low")
    if got is None or got[0] < 1:
        return []
    message = "must be below 1: the ratio is clipped from below at 1 - clip_eps_low, which must stay positive"
    return [SpecProblem(key="algorithm.clip_eps_low", value=show_value(got[0]), message=message)]


def _genrm_has_a_judge(spec: Resolved) -> list[SpecProblem]:
    got = spec.get("reward.function", "reward.genrm_model_path", "reward.genrm_url", "reward.genrm_tokenizer_path",
                   "reward.genrm_token_file")
    if got is None:
        return []
    function, model_path, url, tokenizer_path, token_file = got
    if token_file is not None and url is None:
        message = ("is only used with reward.genrm_url (the judge server's bearer token); remove it, or set "
                   "genrm_url to the server it belongs to")
        return [SpecProblem(key="reward.genrm_token_file", value=show_value(token_file), message=message)]
    if model_path is not None and url is not None:
        message = ("cannot be set together with reward.genrm_model_path: the judge is either served in the "
                   "rollout process (genrm_model_path) or by an engine server (genrm_url); keep one")
        return [SpecProblem(key="reward.genrm_url", value=show_value(url), message=message)]
    if url is not None and not url.startswith(("http://", "https://")):
        message = ("must be an engine server's base URL starting with http:// or https://, "
                   'e.g. "http://judge-node:30000"')
        return [SpecProblem(key="reward.genrm_url", value=show_value(url), message=message)]
    if url is not None and tokenizer_path is None:
        message = ("is required with reward.genrm_url: the judge server takes token ids, so rollout needs the "
                   "judge's tokenizer; set it to the judge's Hugging Face directory or hub name")
        return [SpecProblem(key="reward.genrm_tokenizer_path", value=None, message=message)]
    if function == "genrm" and model_path is None and url is None:
        message = ('is required when reward.function = "genrm": set genrm_model_path to the judge\'s Hugging Face '
                   'directory (served in the rollout process) or genrm_url = "http://host:port" (an engine server)')
        return [SpecProblem(key="reward.genrm_model_path", value=None, message=message)]
    return []


def _reference_role_has_a_use(spec: Resolved) -> list[SpecProblem]:
    got = spec.get("train.reference_role", "algorithm.kl_coef")
    if got is None or not got[0] or got[1] > 0:
        return []
    message = ("computes reference log-probs that nothing uses: set algorithm.kl_coef > 0 for the "
               "KL loss, or reference_role = false")
    return [SpecProblem(key="train.reference_role", value="true", message=message)]


def _gae_and_critic_go_together(spec: Resolved) -> list[SpecProblem]:
    got = spec.get("algorithm.advantage", "critic")
    if got is None or (got[0] == "gae") == (got[1] is not None):
        return []
    if got[0] == "gae":
        message = ("needs a [critic] table: PPO's advantages come from a learned value model; add [critic] "
                   '(its keys have defaults, docs/spec.md) or choose another advantage')
        return [SpecProblem(key="algorithm.advantage", value='"gae"', message=message)]
    message = (f'is used only with algorithm.advantage = "gae", not "{got[0]}": set advantage = "gae" for PPO '
               "with a critic, or remove the [critic] table")
    return [SpecProblem(key="critic", value=None, message=message)]


def _gae_writes_the_advantages(spec: Resolved) -> list[SpecProblem]:
    got = spec.get("algorithm.advantage", "train.advantages_role", "algorithm.name", "train.steps", "critic")
    if got is None or got[0] != "gae":
        return []
    problems = []
    if got[1]:
        problems.append(SpecProblem(key="train.advantages_role", value="true", message=(
            'cannot be combined with algorithm.advantage = "gae": the critic role writes each token\'s advantage; '
            "set advantages_role = false")))
    if got[2] == "opd":
        problems.append(SpecProblem(key="algorithm.name", value='"opd"', message=(
            'cannot be combined with algorithm.advantage = "gae": on-policy distillation shapes a per-sample '
            'advantage; use name = "grpo" (PPO-clip), "gspo" or "sapo" with GAE')))
    if got[4] is not None and got[4].warmup_steps >= got[3]:
        problems.append(SpecProblem(key="critic.warmup_steps", value=show_value(got[4].warmup_steps), message=(
            f"must be below train.steps = {got[3]}: the actor does not train during the critic's warm-up")))
    return problems


def _critic_processes_fit(spec: Resolved) -> list[SpecProblem]:
    """On GPUs each critic rank takes one of the forward component's when the cluster has one,
    else one of the trainer's beside the trainer's own ranks (roles/critic_roles.py places them)."""
    got = spec.get("critic.num_processes", "train.device", "train.num_processes")
    if got is None or got[1] == "cpu":
        return []
    count, _, trainer_ranks = got
    forward = spec.get("cluster.forward.nodes", "cluster.forward.gpus_per_node")
    component, others = ("forward", 0) if forward is not None else ("trainer", trainer_ranks)
    sizes = forward if forward is not None else spec.get("cluster.trainer.nodes", "cluster.trainer.gpus_per_node")
    if sizes is None or sizes[1] == 0 or count + others <= sizes[0] * sizes[1]:
        return []
    nodes, gpus = sizes
    beside = f" beside train.num_processes = {trainer_ranks} trainer ranks" if others else ""
    message = (f"needs {count} GPUs of [cluster.{component}]{beside}, which has {nodes} * {gpus} = {nodes * gpus} "
               f"(each critic rank takes a GPU there); lower it, raise nodes / gpus_per_node in "
               f"[cluster.{component}]" + ("" if forward is not None else ", or add a [cluster.forward] component")
               + ', or use train.device = "cpu"')
    return [SpecProblem(key="critic.num_processes", value=show_value(count), message=message)]


def _critic_megatron_layout(spec: Resolved) -> list[SpecProblem]:
    """The Megatron critic (backends/megatron_value.py) splits its model by tensor parallelism only."""
    got = spec.get("critic", "train.backend", "train.megatron")
    if got is None or got[0] is None:
        return []
    critic, train_backend, train_megatron = got
    backend = critic.backend or train_backend
    if backend != "megatron":
        if critic.megatron is None:
            return []
        return [SpecProblem("critic.megatron", None, f'is used only with critic.backend = "megatron", not "{backend}"'
                            '; set backend = "megatron" in [critic] or remove [critic.megatron]')]
    layout = critic.megatron or train_megatron
    unset = "" if critic.megatron else " (unset [critic.megatron] takes [train.megatron]'s; add it to set the critic's)"
    problems = []
    if critic.num_processes % layout.tensor_parallel:
        problems.append(SpecProblem("critic.megatron.tensor_parallel", show_value(layout.tensor_parallel), (
            f"must divide critic.num_processes = {critic.num_processes} (the critic's data-parallel size is what "
            f"is left){unset}")))
    for name in ("pipeline_parallel", "context_parallel", "expert_parallel"):
        if getattr(layout, name) != 1:
            problems.append(SpecProblem(f"critic.megatron.{name}", show_value(getattr(layout, name)), (
                f"must be 1: the Megatron critic splits its model by tensor parallelism only{unset}")))
    for name, why in (("sequence_parallel", "its value head reads whole hidden states"),
                      ("distributed_optimizer", "its optimizer state is not sharded")):
        if getattr(layout, name):
            problems.append(SpecProblem(f"critic.megatron.{name}", "true", f"must be false: {why}{unset}"))
    return problems


def _stale_after_several_heartbeats(spec: Resolved) -> list[SpecProblem]:
    got = spec.get("health.heartbeat_s", "health.stale_s")
    if got is None or got[1] >= 2 * got[0]:
        return []
    message = (f"must be at least twice health.heartbeat_s = {show_value(got[0])}: a role is declared hung "
               "after this long without a heartbeat, so one late heartbeat must not restart it; raise stale_s "
               "or lower heartbeat_s")
    return [SpecProblem(key="health.stale_s", value=show_value(got[1]), message=message)]


CROSS_CHECKS: tuple[Callable[[Resolved], list[SpecProblem]], ...] = (
    _colocate_is_on_policy,
    _reference_role_has_a_use,
    _opd_has_a_teacher,
    _genrm_has_a_judge,
    _remote_reward_has_a_url,
    _clip_floor_is_positive,
    _samples_split_into_mini_batches,
    _groups_have_two_samples,
    _reinforce_pp_kl_in_the_reward,
    _overlong_buffer_fits,
    _overlong_shaping_needs_one_turn,
    _agent_drives_alone,
    _trainer_processes_fit,
    _shared_gpus_take_turns,
    _rollout_engines_fit,
    _megatron_sizes_divide_processes,
    _megatron_tensor_parallel_in_node,
    _megatron_context_parallel_unsupported,
    _megatron_table_needs_megatron,
    _distributed_optimizer_needs_cuda,
    _cuda_needs_gpus,
    _grace_fits_time_limit,
    _stale_after_several_heartbeats,
    _gae_and_critic_go_together,
    _gae_writes_the_advantages,
    _critic_processes_fit,
    _critic_megatron_layout,
)
