"""Routed experts (R3, engine side): the narrow dtype, the recorder on HF routers of both
transformers layouts, assembling a batched decode's routes per sample, SGLang's encoding, the
native engine's recording on a tiny Qwen3-MoE, and the row field through the queue's wire format."""

from __future__ import annotations

import base64
from pathlib import Path

import numpy as np
import pytest
import torch

from relax_hpc.data.rows import ROUTED_EXPERTS_FIELD, row_to_sample, sample_to_row
from relax_hpc.data.sample import Sample
from relax_hpc.engines.base import SamplingParams
from relax_hpc.engines.native import NativeEngine
from relax_hpc.engines.routed_experts import (
    RoutingRecorder,
    assemble_routes,
    decode_sglang_routes,
    expert_index_dtype,
    moe_routing_shape,
)
from relax_hpc.models.hf import load_causal_lm
from relax_hpc.models.tiny_moe import write_tiny_moe_model
from relax_hpc.transfer.wire_decode import materialize_blocks
from relax_hpc.transfer.wire_encode import blocks_to_wire, encode_blocks


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_moe_model(tmp_path_factory.mktemp("moe") / "tiny-moe", seed=0)


def test_expert_index_dtype_is_the_narrowest_that_fits() -> None:
    # 256 experts: indices 0..255 fit uint8; 257 need int16; 40000 exceed int16's 32767.
    assert expert_index_dtype(8) == expert_index_dtype(256) == torch.uint8
    assert expert_index_dtype(257) == expert_index_dtype(32768) == torch.int16
    assert expert_index_dtype(40000) == torch.int32
    with pytest.raises(ValueError, match="at least one expert"):
        expert_index_dtype(0)


class _LinearGateBlock(torch.nn.Module):
    """transformers 4.x's sparse block shape: `gate` is a Linear returning logits."""

    def __init__(self, weight: list[list[float]]) -> None:
        super().__init__()
        self.gate = torch.nn.Linear(2, len(weight), bias=False)
        self.gate.weight.data = torch.tensor(weight, dtype=torch.float32)
        self.experts = torch.nn.ModuleList()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.gate(x.reshape(-1, x.shape[-1]))
        return x


class _TwoLayerMoe(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.config = type("Config", (), {"num_experts_per_tok": 2, "num_experts": 3})()
        # Logits of a token x = (a, b): layer 0 -> (a, b, a + b); layer 1 -> (-a, -b, 0).
        self.layers = torch.nn.ModuleList([_LinearGateBlock([[1, 0], [0, 1], [1, 1]]),
                                           _LinearGateBlock([[-1, 0], [0, -1], [0, 0]])])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def test_recorder_takes_topk_of_linear_gate_logits_per_layer() -> None:
    model = _TwoLayerMoe()
    # Token (1, 2): layer 0 logits (1, 2, 3) -> top-2 experts [2, 1]; layer 1 (-1, -2, 0) -> [2, 0].
    # Token (3, -1): layer 0 (3, -1, 2) -> [0, 2]; layer 1 (-3, 1, 0) -> [1, 2].
    x = torch.tensor([[[1.0, 2.0], [3.0, -1.0]]])  # [batch 1, seq 2, hidden 2]
    with RoutingRecorder(model) as recorder:
        model(x)
        routes = recorder.take(1, 2)
    assert routes.tolist() == [[[[2, 1], [2, 0]], [[0, 2], [1, 2]]]]
    model(x)  # hooks are gone after the block: nothing is recorded, nothing raises
    assert recorder.num_layers == 2


def test_recorder_refuses_a_dense_model(tiny_model_dir: Path) -> None:
    with pytest.raises(ValueError, match="routing_replay = false for a dense model"):
        NativeEngine(tiny_model_dir, record_routing=True)


def test_assemble_routes_takes_prompt_then_fed_tokens() -> None:
    # Two samples left-padded to width 3: prompts of 3 and 1 tokens; 1 layer, top-1; the route
    # values name the position: prefill columns 10, 11, 12; decode steps 20, 21.
    prefill = torch.tensor([[10, 11, 12], [10, 11, 12]]).reshape(2, 3, 1, 1)
    steps = [torch.full((2, 1, 1, 1), 20), torch.full((2, 1, 1, 1), 21)]
    # Sample 0: 3 prompt + 2 generated tokens -> prompt columns and step 0 (its last token unfed).
    # Sample 1: 1 prompt token (column 12) + 3 generated -> steps 0 and 1.
    got = assemble_routes(prefill, steps, [3, 1], [2, 3], torch.uint8)
    assert [g.flatten().tolist() for g in got] == [[10, 11, 12, 20], [12, 20, 21]]
    assert all(g.dtype == torch.uint8 for g in got)
    with pytest.raises(ValueError, match="do not fit"):
        assemble_routes(prefill, steps, [4, 1], [1, 1], torch.uint8)


def _b64(values: list[int]) -> str:
    return base64.b64encode(np.array(values, dtype=np.int32).tobytes()).decode()


def test_decode_sglang_routes() -> None:
    # 2 tokens x 2 layers x top-2, row-major: token 0 = [[5, 1], [0, 7]], token 1 = [[3, 0], [7, 1]].
    routes = decode_sglang_routes(_b64([5, 1, 0, 7, 3, 0, 7, 1]), num_layers=2, top_k=2, num_experts=8,
                                  num_tokens=2)
    assert routes.dtype == torch.uint8
    assert routes.tolist() == [[[5, 1], [0, 7]], [[3, 0], [7, 1]]]
    assert decode_sglang_routes("", 2, 2, 8).shape == (0, 2, 2)
    with pytest.raises(ValueError, match="not a whole number"):
        decode_sglang_routes(_b64([1, 2, 3]), 2, 2, 8)
    with pytest.raises(ValueError, match="expected 3"):
        decode_sglang_routes(_b64([5, 1, 0, 7]), 2, 2, 8, num_tokens=3)
    with pytest.raises(ValueError, match=r"outside \[0, 8\)"):
        decode_sglang_routes(_b64([5, 1, 0, 8]), 2, 2, 8)
    with pytest.raises(ValueError, match="not base64"):
        decode_sglang_routes("not base64!", 2, 2, 8)


def test_native_engine_records_the_routing_of_every_fed_token(moe_dir: Path) -> None:
    engine = NativeEngine(moe_dir, record_routing=True)
    prompts = [[4, 5, 13, 10, 16], [7, 8], [4, 5, 13, 10, 16]]  # the first twice: one prefill for both rows
    gens = engine.generate(prompts, SamplingParams(max_new_tokens=6, temperature=1.0), seed=0)
    model = load_causal_lm(moe_dir)
    for g in gens:
        sequence = g.prompt_ids + g.token_ids
        assert g.routed_experts is not None and g.routed_experts.dtype == torch.uint8
        # A full forward over the whole sequence routes each position as the cached decode did.
        with torch.no_grad(), RoutingRecorder(model) as recorder:
            model(input_ids=torch.tensor([sequence]))
            full = recorder.take(1, len(sequence))[0]
        assert torch.equal(g.routed_experts.long(), full[:-1])
    plain = NativeEngine(moe_dir).generate(prompts, SamplingParams(max_new_tokens=6), seed=0)
    assert all(g.routed_experts is None for g in plain)
    assert [g.token_ids for g in plain] == [g.token_ids for g in gens]  # recording changes nothing


def _sample(routes: torch.Tensor | None) -> Sample:
    return Sample(prompt_ids=[1, 2], response_ids=[3, 4, 5], rollout_log_probs=[-0.5, -1.0, -1.5],
                  weight_version=2, group_id=0, prompt_index=7, routed_experts=routes)


def test_routes_travel_in_rows_and_through_the_wire() -> None:
    routes = torch.arange(4 * 2 * 2, dtype=torch.uint8).reshape(4, 2, 2)  # 5 tokens - 1
    row = sample_to_row(_sample(routes))
    assert ROUTED_EXPERTS_FIELD not in sample_to_row(_sample(None))
    assert row[ROUTED_EXPERTS_FIELD].dtype == torch.uint8
    frames: list = []
    descs = blocks_to_wire(encode_blocks([row]), frames)
    (back,) = materialize_blocks(descs, frames)
    received = back[ROUTED_EXPERTS_FIELD]
    assert isinstance(received, torch.Tensor) and received.dtype == torch.uint8
    assert torch.equal(received, routes)
    sample = row_to_sample(back)
    assert sample.routed_experts is not None and torch.equal(sample.routed_experts, routes)
    assert row_to_sample(sample_to_row(_sample(None))).routed_experts is None


def test_moe_routing_shape_counts_the_sparse_layers(moe_dir: Path, tmp_path: Path) -> None:
    import json

    assert moe_routing_shape(moe_dir) == (2, 2, 8)
    config = json.loads((moe_dir / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "mlp_only_layers": [0]}))
    assert moe_routing_shape(tmp_path) == (1, 2, 8)
    dense = {k: v for k, v in config.items() if k not in ("num_experts", "num_local_experts")}
    (tmp_path / "config.json").write_text(json.dumps(dense))
    with pytest.raises(ValueError, match="not a mixture-of-experts model"):
        moe_routing_shape(tmp_path)


def test_sglang_engine_attaches_the_routes_of_each_reply(moe_dir: Path) -> None:
    from relax_hpc.engines.base import Generation
    from relax_hpc.engines.http.client import EngineHttpError
    from relax_hpc.engines.sglang.engine import SGLangEngine

    engine = SGLangEngine.__new__(SGLangEngine)  # no server: only the reply parsing is under test
    engine.model_path, engine.base_url = moe_dir, "http://127.0.0.1:1"
    routes = np.arange(4 * 2 * 2, dtype=np.int32).reshape(4, 2, 2) % 8  # prompt 3 + output 2 - 1 fed tokens
    reply = [{"meta_info": {"routed_experts": base64.b64encode(routes.tobytes()).decode()}}]
    generation = Generation(prompt_ids=[1, 2, 3], token_ids=[4, 5], logprobs=[-1.0, -1.0], finish_reason="length",
                            weight_version=0)
    engine._attach_routes([generation], reply)
    assert generation.routed_experts is not None and generation.routed_experts.dtype == torch.uint8
    assert generation.routed_experts.tolist() == routes.tolist()
    with pytest.raises(EngineHttpError, match="--enable-return-routed-experts"):
        engine._attach_routes([generation], [{"meta_info": {}}])
