"""The fused paths are the layers' own (`fuse`, and a `fused` flag their forward reads): after
`fuse_model` no module carries a method of its own, so the model that runs is the classes one
reads; the fused model computes the unfused one's logits; and a pipeline stage's stand-in layers
keep the checkpoint's parameter names and what the model reads of its layers."""

import pytest
import torch

from kestrel.cache.sequence import SequenceCache
from kestrel.distributed.pipeline import ReceivingLayer, RemoteLayer, decoder_layers, split_stages
from kestrel.kernels.backend import Backend
from kestrel.models.batch import ForwardBatch, SeqChunk
from kestrel.models.layers.fused import fuse_model
from kestrel.models.layers.linear import Linear
from test_paged_cache import tiny_model

# llama (q/k/v, gate/up, norms), gemma3 (q/k norms, sandwich norms), gemma4 (its attention and
# router), glm4_moe_lite (MLA's two down-projections), nemotron_h (Mamba2 beside attention)
FAMILIES = ["llama", "gemma3", "gemma4", "glm4_moe_lite", "nemotron_h"]
METHODS = {"forward", "add_norm", "norm_add", "project"}


def logits(model, ids: list[int]) -> torch.Tensor:
    """Every row's logits of one sequence's prompt, through the dense caches."""
    n, device = len(ids), next(model.parameters()).device
    rows = torch.arange(n, device=device)
    chunk = SeqChunk(SequenceCache(model.cache_specs()), 0, n)
    batch = ForwardBatch(torch.tensor(ids, device=device), rows, [chunk], rows)
    with torch.no_grad():
        return model(batch)


@pytest.mark.parametrize("backend", list(Backend))
@pytest.mark.parametrize("family", FAMILIES)
def test_fusing_gives_no_module_a_method_of_its_own(family, backend):
    model = tiny_model(family)
    fuse_model(model, backend)
    for name, module in model.named_modules():
        assert not METHODS & set(vars(module)), name
    fused = {type(m).__name__ for m in model.modules() if getattr(m, "fused", False)}
    assert "RMSNorm" in fused
    assert ("Linear" in fused) == (backend is Backend.TRITON)  # only Triton has a GEMV


@pytest.mark.parametrize("backend", list(Backend))
@pytest.mark.parametrize("family", FAMILIES)
def test_fused_model_gives_the_unfused_logits(family, backend):
    ids = [(i * 37 + 11) % 97 for i in range(12)]
    want = logits(tiny_model(family), ids)
    model = tiny_model(family)
    fuse_model(model, backend)
    torch.testing.assert_close(logits(model, ids), want, rtol=1e-5, atol=1e-5)


def test_fused_projections_are_views_of_one_weight():
    model = tiny_model("llama")
    fuse_model(model, Backend.TORCH)
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    assert attn.fused and mlp.fused
    for group in ([attn.q_proj, attn.k_proj, attn.v_proj], [mlp.gate_proj, mlp.up_proj]):
        assert len({linear.weight.untyped_storage().data_ptr() for linear in group}) == 1


def test_every_projection_is_a_kestrel_linear():
    model = tiny_model("gemma4")
    plain = [n for n, m in model.named_modules() if type(m) is torch.nn.Linear]
    assert plain == []
    assert isinstance(model.lm_head, Linear)


@pytest.mark.parametrize("family", ["gemma4", "nemotron_h"])
def test_a_stage_keeps_its_layers_names_and_what_the_model_reads_of_them(family):
    whole = tiny_model(family)
    names = [n for n, _ in whole.named_parameters(remove_duplicate=False)]
    stage = split_stages(tiny_model(family), 1, 2)  # no forward: no process group needed
    first, end = stage.stage_layers
    layers = decoder_layers(stage)
    assert [n for n, _ in stage.named_parameters(remove_duplicate=False)] == names
    assert all(isinstance(layers[i], RemoteLayer) for i in range(first))
    assert isinstance(layers[first], ReceivingLayer) and end == len(layers)
    assert stage.cache_specs() == whole.cache_specs()  # windows, read through the stand-ins
    assert stage.state_layout() == whole.state_layout()  # recurrent state stays whole
    held = [shape if first <= i < end else None for i, shape in enumerate(whole.kv_layout())]
    assert stage.kv_layout() == held
    for name, module in stage.named_modules():
        assert not METHODS & set(vars(module)), name
    assert "hidden" not in vars(stage) and "kv_layout" not in vars(stage)
