"""The optimizer of the Megatron backend: Megatron's own on CUDA, ``torch.optim.AdamW`` on CPU.

On CUDA, ``get_megatron_optimizer`` (Adam with decoupled weight decay, fp32 main parameters under
bf16, the distributed optimizer with ``[train.megatron] distributed_optimizer``). Its checkpoint
state is its own ``sharded_state_dict``.

On CPU, Megatron's optimizer cannot run: ``get_megatron_optimizer`` builds ``device='cuda'``
tensors, and ``Float16OptimizerWithFloat16Params`` (its bf16 wrapper) accepts only
``torch.cuda.*Tensor`` parameters (a CPU bf16 parameter is a TypeError) and builds its unit loss
scale on CUDA. So ``CpuAdamW`` is ``torch.optim.AdamW`` doing what that wrapper does: for every
bf16 or fp16 parameter it keeps a float32 master copy (the model's parameters are the compute
copy), the float32 gradient Megatron's DDP keeps in ``param.main_grad``
(``grad_reduce_in_fp32``) becomes the master's ``.grad``, AdamW steps the masters, and each
master is copied back into its parameter. Without the masters an update below the parameter's
bf16 spacing (lr 1e-6 on weights of 1e-2 and up) rounds away. A float32 parameter is its own
master. Gradient clipping is the torch backend's: the norm is taken over every gradient of the
model, each counted once (not the copies of a parameter that tensor-parallel ranks or tied
pipeline stages share), all-reduced over the model-parallel group.

Its state is saved as ShardedTensors that mirror the parameters'
(``megatron.core.dist_checkpointing.optimizer``), so it reshards with them (save at TP=2, load
at TP=1): the AdamW moments, and the float32 masters under Megatron's own key prefix
(``optimizer.state.fp32_param``), so a resumed run continues from the masters, not from their
bf16 rounding.
"""

from __future__ import annotations

import math
from typing import Any, Protocol

import torch
import torch.distributed as dist

STEP_KEY = "optimizer_step"
MASTERS_KEY = "fp32_masters"
MASTER_PREFIX = "optimizer.state.fp32_param"  # the key prefix of megatron-core's own masters


class TrainOptimizer(Protocol):
    def zero_grad(self) -> None: ...

    def step(self) -> float:
        """Clip and apply the reduced gradients; return the gradient norm before clipping."""
        ...

    def sharded_state_dict(self, model_state: dict[str, Any]) -> dict[str, Any]: ...

    def load_state(self, loaded: dict[str, Any]) -> None: ...

    def offload(self) -> int: ...

    def onload(self) -> None: ...

    def state_tensors(self) -> dict[str, list[torch.Tensor]]:
        """This rank's optimizer tensors by kind ("masters", "optimizer"), for memory records."""
        ...


def clip_coefficient(norm: float, max_norm: float) -> float:
    """What gradients are multiplied by: torch's ``clip_grad_norm_`` rule (0 disables clipping)."""
    if max_norm <= 0 or not math.isfinite(norm):
        return 1.0
    return min(max_norm / (norm + 1e-6), 1.0)


class CpuAdamW:
    """``torch.optim.AdamW`` over float32 masters of a Megatron DDP model; see the module docstring."""

    def __init__(self, model: Any, *, lr: float, betas: tuple[float, float], weight_decay: float,
                 grad_clip: float) -> None:
        self.model = model
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.masters = [float32_master(p) for p in self.params]
        self.optimizer = torch.optim.AdamW(self.masters, lr=lr, betas=betas, weight_decay=weight_decay)
        self.grad_clip = grad_clip

    def master(self, param: torch.Tensor) -> torch.Tensor:
        """The float32 tensor AdamW steps for ``param`` (``param`` itself when it is float32)."""
        for p, m in zip(self.params, self.masters):
            if p is param:
                return m
        raise KeyError("not a trained parameter of this optimizer's model")

    def _low_precision(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(p, m) for p, m in zip(self.params, self.masters) if m is not p]

    def zero_grad(self) -> None:
        self.model.zero_grad_buffer()
        for m in self.masters:
            m.grad = None

    def grad_norm(self) -> float:
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
        from megatron.core.transformer.module import param_is_not_shared

        squares = torch.zeros((), dtype=torch.float64)
        for p in self.params:
            if param_is_not_shared(p) and param_is_not_tensor_parallel_duplicate(p):
                squares += p.main_grad.detach().double().pow(2).sum().cpu()
        group = parallel_state.get_model_parallel_group()
        if dist.get_world_size(group) > 1:
            dist.all_reduce(squares, group=group)
        return float(squares.sqrt())

    def step(self) -> float:
        norm = self.grad_norm()
        coefficient = clip_coefficient(norm, self.grad_clip)
        for p, m in zip(self.params, self.masters):
            grad = p.main_grad.float()  # float32 already (grad_reduce_in_fp32); a no-op then
            m.grad = grad if coefficient == 1.0 else grad * coefficient
        self.optimizer.step()
        with torch.no_grad():
            for p, m in self._low_precision():
                p.copy_(m)  # the compute copy: the master rounded to the parameter's dtype
        for m in self.masters:
            m.grad = None
        return norm

    def _ensure_state(self) -> None:
        """AdamW creates its state at the first step; a checkpoint loads into zeros of that shape."""
        for m in self.masters:
            if m not in self.optimizer.state:
                self.optimizer.state[m] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(m),
                                           "exp_avg_sq": torch.zeros_like(m)}

    def sharded_state_dict(self, model_state: dict[str, Any]) -> dict[str, Any]:
        from megatron.core.dist_checkpointing.optimizer import (
            get_param_id_to_sharded_param_map,
            make_sharded_optimizer_tensor,
            optim_state_to_sharding_state,
        )

        self._ensure_state()
        state = self.optimizer.state_dict()
        steps = {float(s["step"]) for s in state["state"].values()}
        if len(steps) != 1:
            raise RuntimeError(f"AdamW parameters disagree on their step count: {sorted(steps)}")
        # AdamW numbers the masters in order, as the mapping numbers the parameters they copy.
        mapping = get_param_id_to_sharded_param_map(model_state, self.params)
        masters = {str(i): make_sharded_optimizer_tensor(mapping[i], m, prefix=MASTER_PREFIX)
                   for i, (p, m) in enumerate(zip(self.params, self.masters)) if m is not p}
        optim_state_to_sharding_state(state, mapping, exclude_keys=("step",))
        return {"optimizer": state, STEP_KEY: steps.pop(), MASTERS_KEY: masters}

    def load_state(self, loaded: dict[str, Any]) -> None:
        state = loaded["optimizer"]
        step = torch.tensor(float(loaded[STEP_KEY]))
        for param_state in state["state"].values():
            param_state["step"] = step.clone()
        groups = self.optimizer.state_dict()["param_groups"]
        for group, saved in zip(groups, state["param_groups"]):
            saved["params"] = group["params"]  # this process's ids, whatever the saved layout
        self.optimizer.load_state_dict(state)
        masters = loaded.get(MASTERS_KEY, {})
        with torch.no_grad():
            for i, (p, m) in enumerate(zip(self.params, self.masters)):
                if m is not p:
                    m.copy_(masters[str(i)])
                    p.copy_(m)

    def offload(self) -> int:
        return 0  # the state is in host memory already

    def state_tensors(self) -> dict[str, list[torch.Tensor]]:
        moments = [v for state in self.optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
        return {"masters": [m for p, m in self._low_precision()], "optimizer": moments}

    def onload(self) -> None:
        return None


def float32_master(param: torch.Tensor) -> torch.Tensor:
    """A float32 copy of a bf16/fp16 parameter carrying its tensor-parallel attributes (as
    Megatron's ``Float16OptimizerWithFloat16Params`` makes one); a float32 parameter itself."""
    if param.dtype == torch.float32:
        return param
    if param.dtype not in (torch.bfloat16, torch.float16):
        raise TypeError(f"the megatron backend trains float32, bfloat16 or float16 parameters, not {param.dtype}")
    from megatron.core import tensor_parallel

    master = param.detach().clone().float()
    tensor_parallel.copy_tensor_model_parallel_attributes(master, param)
    if hasattr(param, "shared"):
        master.shared = param.shared  # type: ignore[attr-defined]
    return master


class MegatronAdam:
    """Megatron's optimizer (CUDA): Adam, clipping, and the distributed optimizer when asked."""

    def __init__(self, model: Any, *, lr: float, betas: tuple[float, float], weight_decay: float,
                 grad_clip: float, dtype: torch.dtype, distributed: bool) -> None:
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        config = OptimizerConfig(
            optimizer="adam", lr=lr, min_lr=lr, weight_decay=weight_decay, adam_beta1=betas[0],
            adam_beta2=betas[1], clip_grad=grad_clip, bf16=dtype == torch.bfloat16,
            fp16=dtype == torch.float16, params_dtype=dtype, use_distributed_optimizer=distributed,
        )
        self.model = model
        self.optimizer = get_megatron_optimizer(config, [model])
        for group in self.optimizer.param_groups:
            group["lr"] = lr  # no scheduler: a constant rate, as in the torch backend
        self.device = torch.device("cuda", torch.cuda.current_device())

    def zero_grad(self) -> None:
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()

    def step(self) -> float:
        succeeded, grad_norm, _ = self.optimizer.step()
        if not succeeded:
            raise RuntimeError("Megatron's optimizer skipped the step (the gradients were not finite)")
        return float(grad_norm or 0.0)

    def sharded_state_dict(self, model_state: dict[str, Any]) -> dict[str, Any]:
        return {"optimizer": self.optimizer.sharded_state_dict(model_state)}

    def load_state(self, loaded: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(loaded["optimizer"])

    def _inner_states(self) -> list[dict[Any, Any]]:
        chained = getattr(self.optimizer, "chained_optimizers", [self.optimizer])
        return [inner.optimizer.state for inner in chained if hasattr(inner, "optimizer")]

    def _move(self, target: torch.device) -> int:
        moved = 0
        for states in self._inner_states():
            for state in states.values():
                for key, value in state.items():
                    if isinstance(value, torch.Tensor) and value.device != target and key != "step":
                        if value.device.type != "cpu":
                            moved += value.numel() * value.element_size()
                        state[key] = value.to(target)
        return moved

    def offload(self) -> int:
        return self._move(torch.device("cpu"))

    def state_tensors(self) -> dict[str, list[torch.Tensor]]:
        """Adam's moments, and the float32 masters megatron-core keeps for bf16/fp16 parameters
        (its `shard_fp32_from_float16_groups`, or the distributed optimizer's shards of them)."""
        chained = getattr(self.optimizer, "chained_optimizers", [self.optimizer])
        masters = [t for inner in chained for group in getattr(inner, "shard_fp32_from_float16_groups",
                                                               getattr(inner, "fp32_from_float16_groups", []))
                   for t in group]
        moments = [v for states in self._inner_states() for state in states.values()
                   for v in state.values() if isinstance(v, torch.Tensor)]
        return {"masters": masters, "optimizer": moments}

    def onload(self) -> None:
        self._move(self.device)


def make_optimizer(model: Any, *, lr: float, betas: tuple[float, float], weight_decay: float,
                   grad_clip: float, dtype: torch.dtype, device: str,
                   distributed: bool) -> TrainOptimizer:
    if torch.device(device).type == "cuda":
        return MegatronAdam(model, lr=lr, betas=betas, weight_decay=weight_decay, grad_clip=grad_clip,
                            dtype=dtype, distributed=distributed)
    return CpuAdamW(model, lr=lr, betas=betas, weight_decay=weight_decay, grad_clip=grad_clip)
