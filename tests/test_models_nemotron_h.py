"""nemotron_h equals transformers' NemotronHForCausalLM on a tiny checkpoint with every block kind
(Mamba2 M, attention *, MLP -, MoE E), alone, batched, chunked and under --max-kv-size."""

import shutil

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from tests.family_suite import (  # noqa: F401  (the shared tests run here)
    Family,
    build_tiny,
    kv_chunks,
    one_thread,
    test_a_prefix_hit_gives_the_tokens_of_a_cold_prompt,
    test_batched_sequences_match_each_run_alone,
    test_chunked_prefill_matches_transformers,
    test_four_sequences_decode_batched_equal_each_alone,
    test_fp8_kv_cache_stays_near_the_model_dtype_cache,
    test_full_prompt_forward_matches_transformers,
    test_max_kv_size_chunks_match_dense_reference,
    test_prefill_then_decode_matches_transformers,
    test_prefilling_and_decoding_sequences_share_a_batch,
    test_restore_after_a_failed_step,
    test_serves_the_checkpoint_by_its_model_type,
    test_trim_leaves_recurrent_state_untouched,
)
from tests.reference import chunked_logits, load_kestrel

from kestrel.models.nemotron_h import NemotronHForCausalLM

COVERS = ("nemotron_h",)
# shared checks that do not apply here, and why
OPT_OUTS = {
    "test_sliding_window_chunks_match_transformers": "its attention layers attend to every key",
}

MODEL_CLS = transformers.NemotronHForCausalLM
CONFIG = dict(
    vocab_size=256,
    hidden_size=64,
    hybrid_override_pattern="M*-EM*EM",
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=96,
    ssm_state_size=16,
    mamba_num_heads=8,
    mamba_head_dim=16,
    n_groups=2,
    conv_kernel=4,
    chunk_size=8,  # shorter than the prompts: the SSD scan runs over several chunks
    n_routed_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    moe_shared_expert_intermediate_size=48,
    moe_latent_size=32,
    n_group=2,
    topk_group=1,
    routed_scaling_factor=1.5,
)
PROMPT = [(i * 37 + 11) % 256 for i in range(30)]


def perturb(model) -> None:
    # the Mamba2 scalars and the router's correction bias initialise to constants
    for name, p in model.named_parameters():
        if name.endswith(("A_log", ".D", "dt_bias")):
            p.add_(torch.randn_like(p) * 0.3)
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            b.add_(torch.randn_like(b) * 0.1)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    family = Family(
        MODEL_CLS,
        transformers.NemotronHConfig(**CONFIG),
        PROMPT,
        tweak=perturb,
        decode_prefill=11,
        windows={"full_attention": None},
    )
    return build_tiny(family, tmp_path_factory.mktemp("nemotron_h"))


kv_chunk = kv_chunks([(chunk, 2) for chunk in (1, 5, 10)])


def test_loads_by_model_type_with_a_cache_per_block_kind(tiny):
    model = tiny.model
    assert isinstance(model, NemotronHForCausalLM)
    kinds = [spec.kind for spec in model.cache_specs()]
    assert kinds == ["recurrent", "full", "none", "none", "recurrent", "full", "none", "recurrent"]
    # K and V of the 2 attention layers only: 2 kv heads x head_dim 16, fp32
    assert model.kv_bytes_per_token(torch.float32) == 2 * 2 * (2 * 16) * 4


def test_mlx_lm_stacked_experts_load_as_the_per_expert_tensors(tiny, tmp_path):
    # mlx-lm saves Nemotron-H's routed experts stacked, (E, out, in): `mixer.switch_mlp.fc1` the
    # up projections, `fc2` the down ones
    tensors = load_file(str(tiny.folder / "model.safetensors"))
    stacked = {k: v for k, v in tensors.items() if ".experts." not in k}
    for layer in {k.split(".mixer.experts.")[0] for k in tensors if ".mixer.experts." in k}:
        for proj, mlx in (("up_proj", "fc1"), ("down_proj", "fc2")):
            parts = [tensors[f"{layer}.mixer.experts.{e}.{proj}.weight"] for e in range(8)]
            stacked[f"{layer}.mixer.switch_mlp.{mlx}.weight"] = torch.stack(parts)
    assert len(stacked) < len(tensors)
    shutil.copytree(tiny.folder, tmp_path / "mlx")
    save_file(stacked, str(tmp_path / "mlx" / "model.safetensors"))
    expected = chunked_logits(tiny.model, PROMPT, len(PROMPT))
    torch.testing.assert_close(chunked_logits(load_kestrel(tmp_path / "mlx"), PROMPT, 7), expected)
