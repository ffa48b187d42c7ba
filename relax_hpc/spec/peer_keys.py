"""Other frameworks' names for our keys, so that an unknown key written from habit gets ours.

A user coming from verl, TRL, slime, Megatron or vLLM writes ``max_response_length`` or
``rollout.n``; the loader reports it as unknown and, from here, names the key of ours that means
the same thing. A name is listed only where the meaning truly matches (or the hint says how to
convert it); names that are ours in another table get "belongs in [table]" from the loader instead.

    peer_hint("data.max_response_length")
    # "max_response_length is verl's name; ours is rollout.max_new_tokens"
"""

from __future__ import annotations

__all__ = ["PEER_KEYS", "peer_hint"]


def _ours(who: str, key: str) -> str:
    return f"{who} name; ours is {key}"


# A bare name, or "table.name" where the name means something else elsewhere.
PEER_KEYS: dict[str, str] = {
    # Generation lengths.
    "max_response_length": _ours("verl's", "rollout.max_new_tokens"),
    "response_length": _ours("verl's", "rollout.max_new_tokens"),
    "max_completion_length": _ours("TRL's", "rollout.max_new_tokens"),
    "rollout_max_response_len": _ours("slime's", "rollout.max_new_tokens"),
    "max_tokens": _ours("vLLM's sampling", "rollout.max_new_tokens"),
    "max_prompt_length": _ours("verl's and TRL's", "data.max_prompt_tokens"),
    "rollout_max_prompt_len": _ours("slime's", "data.max_prompt_tokens"),
    # Batch sizes.
    "rollout.n": _ours("verl's", "rollout.n_samples_per_prompt"),
    "num_generations": _ours("TRL's", "rollout.n_samples_per_prompt"),
    "train_batch_size": _ours("verl's (prompts per step)", "rollout.prompts_per_step"),
    "rollout_batch_size": _ours("slime's", "rollout.prompts_per_step"),
    "ppo_mini_batch_size": ("verl's name, in prompts per optimizer step; ours is train.mini_batches, the "
                            "optimizer steps per step: rollout.prompts_per_step / ppo_mini_batch_size"),
    "global_batch_size": ("Megatron's and slime's name, in samples per optimizer step; ours is "
                          "train.mini_batches = rollout.prompts_per_step * rollout.n_samples_per_prompt / "
                          "global_batch_size"),
    "ppo_micro_batch_size_per_gpu": _ours("verl's", "train.micro_batch_size"),
    # Parallel layout.
    "tensor_model_parallel_size": _ours("Megatron's", "train.megatron.tensor_parallel"),
    "rollout.tensor_model_parallel_size": _ours("verl's rollout", "rollout.sglang.tp_size"),
    "rollout_num_gpus_per_engine": _ours("slime's", "rollout.sglang.tp_size"),
    "pipeline_model_parallel_size": _ours("Megatron's", "train.megatron.pipeline_parallel"),
    "context_parallel_size": _ours("Megatron's", "train.megatron.context_parallel"),
    "expert_model_parallel_size": _ours("Megatron's", "train.megatron.expert_parallel"),
    "gpu_memory_utilization": _ours("vLLM's", "rollout.sglang.mem_fraction_static"),
    # Optimisation.
    "learning_rate": _ours("TRL's", "train.lr"),
    "max_grad_norm": _ours("TRL's", "train.grad_clip"),
    "clip_grad": _ours("Megatron's", "train.grad_clip"),
    "total_training_steps": _ours("verl's", "train.steps"),
    "max_steps": _ours("TRL's", "train.steps"),
    "num_rollout": _ours("slime's", "train.steps"),
    "save_freq": _ours("verl's", "checkpoint.save_interval"),
    "save_steps": _ours("TRL's", "checkpoint.save_interval"),
    # The algorithm.
    "adv_estimator": _ours("verl's", "algorithm.name"),
    "kl_loss_coef": _ours("verl's", "algorithm.kl_coef"),
    "beta": _ours("TRL's KL", "algorithm.kl_coef"),
    "use_kl_loss": "verl's switch; ours is on when algorithm.kl_coef > 0",
    "kl_loss_type": _ours("verl's", "algorithm.kl_estimator"),
    "entropy_coeff": _ours("verl's", "algorithm.entropy_coef"),
    "loss_agg_mode": _ours("verl's", "algorithm.loss_agg"),
    "clip_ratio": "verl's name; ours are algorithm.clip_eps_low and algorithm.clip_eps_high",
    "clip_ratio_low": _ours("verl's", "algorithm.clip_eps_low"),
    "clip_ratio_high": _ours("verl's", "algorithm.clip_eps_high"),
    "epsilon": _ours("TRL's", "algorithm.clip_eps_low"),
    "epsilon_high": _ours("TRL's", "algorithm.clip_eps_high"),
    "eps_clip": _ours("slime's", "algorithm.clip_eps_low"),
    "eps_clip_high": _ours("slime's", "algorithm.clip_eps_high"),
    # Model and data.
    "hf_checkpoint": _ours("slime's", "model.path"),
    "model_name_or_path": _ours("TRL's", "model.path"),
    "input_key": _ours("slime's", "data.prompt_key"),
}


def peer_hint(key: str) -> str | None:
    """What an unknown ``key`` (a TOML path) is called here, when it is another framework's name."""
    name = key.rpartition(".")[2]
    table = key.partition(".")[0] if "." in key else ""
    # The exact path, then the name under its top-level table (rollout.n), then the name alone.
    for candidate in (key, f"{table}.{name}", name):
        if candidate in PEER_KEYS:
            return f"{candidate} is {PEER_KEYS[candidate]}"
    return None
