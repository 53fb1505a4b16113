"""Mixture-of-experts models (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE): greedy output token-exact
with transformers (logprobs within 1e-4), also in chunked prefill; expert-level batching (each
expert runs once per layer and step, on the tokens of every resident sequence) checked through
the counts the grouped-experts kernel returns; the kernel against a per-token reference; and
checkpoints that store experts fused or one by one load the same weights."""


import json
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import runtime.moe
from helpers import BatchSpy, assert_idle_and_clean, assert_matches, greedy_requests, make_engine, random_prompts
from kernels import grouped_experts, route, silu_and_mul
from runtime.config import MoESpec, load_hf_config, model_spec
from runtime.loader import load_model
from tiny_models import MOE_FAMILIES, hf_greedy, hf_model, make_tiny_model, save_fused_experts

MAX_TOKENS = 16
LENGTHS = (1, 5, 17, 33, 64)
PROMPTS = random_prompts(LENGTHS, seed=7)


def check_all(tiny, family, prompts, completions, **overrides):
    for prompt, completion in zip(prompts, completions):
        tokens, logprobs = tiny.greedy(family, prompt, MAX_TOKENS, **overrides)
        assert_matches(completion, tokens, logprobs, max_tokens=MAX_TOKENS)


class ExpertSpy:
    """Records the per-expert token counts of every grouped-experts call the model makes."""

    def __init__(self, monkeypatch):
        self.counts: list[list[int]] = []

        def spy(*args):
            out, counts = grouped_experts(*args)
            self.counts.append(counts.tolist())
            return out, counts

        monkeypatch.setattr(runtime.moe, "grouped_experts", spy)


# (qkv bias, o_proj bias, q/k norm, per head, clip_qkv, sliding windows, MoESpec) of the tiny models
SPECS = {
    "mixtral": (False, False, False, True, None, (24, 24), MoESpec(4, 2, 32, True, 0, (True, True), False)),
    "qwen2_moe": (True, False, False, True, None, (24, None), MoESpec(6, 2, 32, False, 48, (False, True))),
    "qwen3_moe": (True, True, True, True, None, (None, None), MoESpec(8, 3, 32, True, 0, (True, False))),
    "olmoe": (False, False, True, False, 1.5, (None, None), MoESpec(8, 2, 32, False, 0, (True, True))),
}


@pytest.mark.parametrize("family", sorted(MOE_FAMILIES))
def test_spec_reads_each_familys_options(tiny, family):
    spec = model_spec(load_hf_config(tiny.dir(family)))
    assert (spec.qkv_bias, spec.o_bias, spec.qk_norm, spec.qk_norm_per_head, spec.clip_qkv,
            spec.sliding_windows, spec.moe) == SPECS[family]


@pytest.mark.parametrize("family", sorted(MOE_FAMILIES))
def test_greedy_matches_transformers(tiny, family, monkeypatch):
    engine = make_engine(tiny.dir(family))
    spy = ExpertSpy(monkeypatch)
    completions = engine.generate(greedy_requests(PROMPTS, MAX_TOKENS))
    check_all(tiny, family, PROMPTS, completions)

    moe = engine.spec.moe
    sparse_layers = sum(moe.sparse_layers)
    tokens = engine.stats.prefill_tokens + engine.stats.decode_tokens
    # One kernel call per sparse layer and step, on all the step's tokens, k experts each.
    assert len(spy.counts) == sparse_layers * engine.stats.steps
    assert engine.stats.expert_tokens == sum(map(sum, spy.counts)) == tokens * moe.top_k * sparse_layers
    assert engine.stats.expert_calls == sum(n > 0 for counts in spy.counts for n in counts)
    assert_idle_and_clean(engine)


@pytest.mark.parametrize("family", sorted(MOE_FAMILIES))
def test_chunked_prefill_matches_transformers(tiny, family):
    engine = make_engine(tiny.dir(family), max_num_batched_tokens=8)
    batches = BatchSpy(engine)
    completions = engine.generate(greedy_requests(PROMPTS, MAX_TOKENS))
    check_all(tiny, family, PROMPTS, completions)
    assert max(step["num_tokens"] for step in batches.steps) <= 8
    assert len(batches.prefill_chunks(f"r{LENGTHS.index(64)}")) >= 8
    assert_idle_and_clean(engine)


def test_every_token_in_every_expert(tiny, monkeypatch):
    """2 experts, top-2: each expert runs once per layer and step, on all the step's tokens
    (decode rows and prefill chunks of every resident sequence together)."""
    overrides = dict(num_local_experts=2, num_experts_per_tok=2)
    engine = make_engine(tiny.dir("mixtral", **overrides))
    spy = ExpertSpy(monkeypatch)
    completions = engine.generate(greedy_requests(PROMPTS, MAX_TOKENS))
    check_all(tiny, "mixtral", PROMPTS, completions, **overrides)

    layers, steps = engine.spec.num_layers, engine.stats.steps
    tokens = engine.stats.prefill_tokens + engine.stats.decode_tokens
    assert all(counts[0] == counts[1] > 0 for counts in spy.counts)
    assert engine.stats.expert_calls == 2 * layers * steps
    assert engine.stats.expert_tokens == 2 * layers * tokens
    # The first step prefills every prompt at once: one call per expert takes all their tokens.
    assert spy.counts[0] == [sum(LENGTHS)] * 2
    assert engine.stats.tokens_per_expert_call == tokens / steps


def test_experts_without_tokens_cost_no_call(tiny, monkeypatch):
    """32 experts, top-1, a few tokens per step: most experts get none and are not called."""
    overrides = dict(num_experts=32, num_experts_per_tok=1)
    engine = make_engine(tiny.dir("olmoe", **overrides))
    spy = ExpertSpy(monkeypatch)
    prompts = random_prompts((3, 2), seed=8)
    completions = engine.generate(greedy_requests(prompts, MAX_TOKENS))
    check_all(tiny, "olmoe", prompts, completions, **overrides)

    assert all(len(counts) == 32 and counts.count(0) >= 32 - 5 for counts in spy.counts)
    calls = sum(n > 0 for counts in spy.counts for n in counts)
    assert engine.stats.expert_calls == calls < 32 * len(spy.counts)


# ---- the kernel ----------------------------------------------------------------------------

def per_token_reference(hidden, ids, weights, gate_up_proj, down_proj):
    """Each token through each of its experts one at a time, in float64."""
    out = torch.zeros(hidden.shape, dtype=torch.float64)
    for t in range(hidden.shape[0]):
        for e, w in zip(ids[t].tolist(), weights[t].double()):
            x = silu_and_mul(gate_up_proj[e].double() @ hidden[t].double())
            out[t] += w * (down_proj[e].double() @ x)
    return out


@pytest.mark.parametrize("hidden_size,inter", [(12, 10), (16, 8)])  # per-expert loop; grouped_mm
@pytest.mark.parametrize("tokens,experts,top_k", [(1, 4, 2), (7, 5, 2), (40, 8, 3), (3, 16, 1), (0, 4, 2)])
def test_grouped_experts_matches_a_per_token_loop(tokens, experts, top_k, hidden_size, inter):
    g = torch.Generator().manual_seed(tokens * 100 + experts)
    hidden = torch.randn(tokens, hidden_size, generator=g)
    gate_up_proj = torch.randn(experts, 2 * inter, hidden_size, generator=g) * 0.3
    down_proj = torch.randn(experts, hidden_size, inter, generator=g) * 0.3
    weights, ids = route(torch.randn(tokens, experts, generator=g), top_k, renormalize=top_k > 1)

    out, counts = grouped_experts(hidden, ids, weights, gate_up_proj, down_proj)
    assert out.shape == hidden.shape and out.dtype == hidden.dtype
    torch.testing.assert_close(out.double(), per_token_reference(hidden, ids, weights, gate_up_proj, down_proj),
                               atol=1e-5, rtol=1e-5)
    assert counts.tolist() == torch.bincount(ids.flatten(), minlength=experts).tolist()
    if tokens * top_k < experts:
        assert (counts == 0).any()


def test_route_softmax_then_top_k():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    probs = logits.softmax(-1)[0]
    weights, ids = route(logits, 2, renormalize=False)
    assert ids.tolist() == [[1, 2]]
    torch.testing.assert_close(weights[0], probs[[1, 2]])
    weights, _ = route(logits, 2, renormalize=True)
    torch.testing.assert_close(weights[0], probs[[1, 2]] / probs[[1, 2]].sum())


# ---- checkpoint formats --------------------------------------------------------------------

@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_fused_and_per_expert_checkpoints_load_the_same(tiny, family, tmp_path):
    """save_pretrained writes one tensor per expert (Mixtral's `block_sparse_moe.experts.{e}.w1`,
    the others' `mlp.experts.{e}.gate_proj`); transformers 5 holds them fused
    (`mlp.experts.gate_up_proj` [E, 2I, H]). A checkpoint of its in-memory tensors loads alike."""
    per_expert = tiny.dir(family)
    fused = save_fused_experts(per_expert, tmp_path / "fused")

    ours = load_model(per_expert).state_dict()
    from_fused = load_model(fused).state_dict()
    assert ours.keys() == from_fused.keys()
    for name in ours:
        assert torch.equal(ours[name], from_fused[name]), name
    assert ours["layers.1.mlp.experts.gate_up_proj"].shape == (SPECS[family][-1].num_experts, 2 * 32, 64)


@pytest.mark.parametrize("budget", [None, 1 << 30], ids=["resident", "streamed"])
@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_experts_stored_both_fused_and_per_expert_are_refused(tiny, family, tmp_path, budget):
    """A checkpoint holding a layer's experts in both layouts (a stale copy beside the model) loaded
    the fused copy and ignored the other, where transformers fails: which one is meant?"""
    both = tmp_path / "both"
    shutil.copytree(tiny.dir(family), both)
    fused = load_file(str(save_fused_experts(tiny.dir(family), tmp_path / "fused") / "model.safetensors"))
    tensors = load_file(str(both / "model.safetensors"))
    tensors.update({name: t for name, t in fused.items() if ".experts.down_proj" in name})
    save_file(tensors, str(both / "model.safetensors"))
    with pytest.raises(ValueError, match=rf"{re.escape(str(both))}: the checkpoint stores '.*experts.down_proj' both fused and per "
                                         rf"expert \('.*experts.0.(w2|down_proj).weight', ...\); keep one"):
        make_engine(both, weight_budget_bytes=budget)


@pytest.mark.parametrize("budget", [None, 1 << 30], ids=["resident", "streamed"])
@pytest.mark.parametrize("family, edit, message", [
    ("mixtral", "a fifth expert", r"stores more experts than the config's 4 \('.*experts.4.w1.weight'"),
    ("qwen2_moe", "a fused seventh expert", r"experts.gate_up_proj'? is \(7, 64, 64\)"),
    ("qwen2_moe", {"shared_expert_intermediate_size": 0},
     r"stores a shared expert \('.*shared_expert.down_proj.weight', \[64, 48\]\), which the config has none of"),
])
def test_a_checkpoint_with_experts_the_config_lacks_is_refused(tiny, tmp_path, budget, family, edit, message):
    """Loading only what the config names ran another model than the checkpoint's: a per-expert
    checkpoint's extra expert, or a shared expert under shared_expert_intermediate_size 0, were
    ignored, where transformers refuses (its stacked experts' sizes differ)."""
    model = tmp_path / "model"
    if edit == "a fused seventh expert":
        save_fused_experts(tiny.dir(family), model)
        tensors = load_file(str(model / "model.safetensors"))
        tensors = {n: torch.cat([t, t[:1]]) if n.endswith("experts.gate_up_proj") else t for n, t in tensors.items()}
    else:
        shutil.copytree(tiny.dir(family), model)
        tensors = load_file(str(model / "model.safetensors"))
    if edit == "a fifth expert":
        tensors.update({n.replace(".experts.0.", ".experts.4."): t.clone()
                        for n, t in tensors.items() if ".experts.0." in n})
    save_file(tensors, str(model / "model.safetensors"))
    if isinstance(edit, dict):
        config = json.loads((model / "config.json").read_text())
        (model / "config.json").write_text(json.dumps({**config, **edit}))
    with pytest.raises(ValueError, match=message):
        make_engine(model, weight_budget_bytes=budget)


@pytest.mark.parametrize("family, edit, message", [
    ("mixtral", {"num_experts_per_tok": 5}, "num_experts_per_tok must be a whole number in 1..4"),
    ("qwen3_moe", {"num_experts_per_tok": -1}, "num_experts_per_tok must be a whole number in 1..8"),
    ("qwen3_moe", {"num_experts_per_tok": 0}, "num_experts_per_tok must be a whole number in 1..8"),
    ("qwen2_moe", {"decoder_sparse_step": 0}, "decoder_sparse_step must be a whole number >= 1"),
])
def test_router_settings_out_of_range_are_refused_at_start(tiny, tmp_path, family, edit, message):
    """More experts per token than there are failed inside the first step with torch's "selected
    index k out of range", and left the engine stuck; decoder_sparse_step 0 divided by zero."""
    model = tmp_path / "model"
    shutil.copytree(tiny.dir(family), model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, **edit}))
    with pytest.raises(ValueError, match=message):
        make_engine(model)


@pytest.mark.parametrize("budget", [None, 1 << 30], ids=["resident", "streamed"])
def test_a_qwen2_moe_saved_with_a_zero_wide_shared_expert_loads(tmp_path, budget):
    """transformers builds the shared expert even at shared_expert_intermediate_size 0 and saves
    it 0 wide (its gate too): nothing the config lacks, so not refused as a stray one."""
    model = make_tiny_model("qwen2_moe", tmp_path / "model", shared_expert_intermediate_size=0)
    assert load_file(str(model / "model.safetensors"))["model.layers.1.mlp.shared_expert.down_proj.weight"].numel() == 0
    engine = make_engine(model, weight_budget_bytes=budget)
    oracle = hf_model(model)
    for prompt, completion in zip(PROMPTS[:3], engine.generate(greedy_requests(PROMPTS[:3], MAX_TOKENS))):
        assert completion.token_ids == hf_greedy(oracle, prompt, MAX_TOKENS)[0]


def test_decoder_sparse_step_is_not_read_where_no_layer_may_be_sparse(tiny, tmp_path):
    """Every layer in mlp_only_layers: transformers never reads the step, 0 included."""
    model = tmp_path / "model"
    shutil.copytree(tiny.dir("qwen3_moe"), model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "mlp_only_layers": [0, 1], "decoder_sparse_step": 0}))
    assert model_spec(load_hf_config(model)).moe.sparse_layers == (False, False)
