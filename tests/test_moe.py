"""The shared MoE layer equals transformers' MoE blocks (softmax and sigmoid/grouped routing)."""

import pytest
import torch
import transformers
from tests.reference import assert_close
from transformers.models.exaone_moe import modeling_exaone_moe
from transformers.models.qwen2_moe import modeling_qwen2_moe

from kestrel.models.layers.moe import SparseMoE, expert_slot, route_topk

HIDDEN, INTER, EXPERTS, TOP_K = 32, 16, 8, 2


def _randomize(module: torch.nn.Module, seed: int = 0) -> None:
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in list(module.parameters()) + list(module.buffers()):
            p.copy_(torch.randn_like(p) * 0.3)


def _copy_into(ours: SparseMoE, theirs: torch.nn.Module, rename: dict[str, str]) -> None:
    state = {}
    for name, t in theirs.state_dict().items():
        for old, new in rename.items():
            name = name.replace(old, new)
        state[name] = t
    ours.load_state_dict(state, strict=True)


def exaone_pair():
    config = transformers.ExaoneMoeConfig(
        hidden_size=HIDDEN,
        moe_intermediate_size=INTER,
        num_experts=EXPERTS,
        num_experts_per_tok=TOP_K,
        n_group=4,
        topk_group=2,
        num_shared_experts=2,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
    )
    theirs = modeling_exaone_moe.ExaoneMoeSparseMoEBlock(config).eval()
    ours = SparseMoE(
        HIDDEN,
        INTER,
        EXPERTS,
        TOP_K,
        scoring="sigmoid",
        routed_scaling=2.5,
        n_group=4,
        topk_group=2,
        correction_bias=True,
        shared_intermediate=2 * INTER,
    )
    _randomize(theirs)
    _copy_into(ours, theirs, {})
    return ours, theirs


def qwen2_pair():
    config = transformers.Qwen2MoeConfig(
        hidden_size=HIDDEN,
        moe_intermediate_size=INTER,
        num_experts=EXPERTS,
        num_experts_per_tok=TOP_K,
        shared_expert_intermediate_size=24,
        norm_topk_prob=False,
    )
    theirs = modeling_qwen2_moe.Qwen2MoeSparseMoeBlock(config).eval()
    ours = SparseMoE(
        HIDDEN, INTER, EXPERTS, TOP_K, normalize=False, shared_intermediate=24, shared_gate=True
    )
    _randomize(theirs)
    _copy_into(ours, theirs, {"shared_expert.": "shared_experts."})
    return ours, theirs


@pytest.mark.parametrize("pair", [exaone_pair, qwen2_pair])
@pytest.mark.parametrize("tokens", [1, 3, 40])  # 1 and 3 take the gathered path, 40 the grouped one
def test_sparse_moe_matches_transformers(pair, tokens):
    ours, theirs = pair()
    x = torch.randn(1, tokens, HIDDEN)
    with torch.no_grad():
        assert_close(ours(x[0]), theirs(x)[0])


def test_gathered_and_grouped_expert_paths_agree():
    # one token (TOP_K pairs <= EXPERTS) takes the gathered path, five at once the grouped one
    ours, _ = exaone_pair()
    x = torch.randn(5, HIDDEN)
    weights, ids = ours.route(x)
    assert TOP_K <= EXPERTS < 5 * TOP_K
    with torch.no_grad():
        grouped = ours.experts(x, weights, ids)
        gathered = [
            ours.experts(x[i : i + 1], weights[i : i + 1], ids[i : i + 1]) for i in range(5)
        ]
    assert_close(torch.cat(gathered), grouped)


def test_group_limited_routing_picks_only_kept_groups():
    # 4 groups of 2; the best two groups by top-2 sum are 3 and 1, so expert 0 (alone high) loses
    logits = torch.tensor([[5.0, -9, 2, 2, -9, -9, 3, 3]])
    weights, ids = route_topk(logits, 2, "sigmoid", n_group=4, topk_group=2)
    assert set(ids[0].tolist()) <= {2, 3, 6, 7}
    assert set(ids[0].tolist()) == {6, 7}
    assert_close(weights.sum(-1), torch.ones(1))


def test_correction_bias_steers_choice_but_not_weights():
    logits = torch.tensor([[1.0, 0.0, -1.0, -2.0]])
    bias = torch.tensor([0.0, 0.0, 0.0, 5.0])
    weights, ids = route_topk(logits, 1, "sigmoid", correction_bias=bias, normalize=False)
    assert ids.tolist() == [[3]]
    assert_close(weights, torch.sigmoid(torch.tensor([[-2.0]])))


def test_expert_slot_maps_per_expert_tensors():
    slot = expert_slot("model.layers.1.mlp.experts.3.up_proj.weight", INTER)
    assert slot.name == "model.layers.1.mlp.experts.gate_up_proj"
    assert slot.index == (3, slice(INTER, 2 * INTER))
    assert expert_slot(
        "model.layers.1.block_sparse_moe.experts.0.w2.weight", INTER, "w1", "w3", "w2"
    ).index == (0,)
    assert expert_slot("model.layers.1.mlp.gate.weight", INTER) is None
