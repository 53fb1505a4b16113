"""A PEFT LoRA adapter merged at load: greedy output is token-exact with transformers + PEFT
running the adapter unmerged on the same base weights."""

import json

import pytest
from safetensors.torch import load_file, save_file
import torch

from helpers import assert_matches, greedy_requests, make_engine, random_prompts
from tiny_models import hf_greedy, image_text_config, make_lora_adapter

PROMPTS = random_prompts((5, 17, 40), seed=11)
MAX_TOKENS = 16
ALL_LINEARS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.mark.parametrize("family,config", [
    ("llama", dict(r=4, lora_alpha=8, target_modules=ALL_LINEARS)),
    ("qwen2", dict(r=2, lora_alpha=3, target_modules=["k_proj", "up_proj"], use_rslora=True)),
    ("phi3", dict(r=4, lora_alpha=4, target_modules=["qkv_proj", "down_proj"])),  # stored packed
], ids=["llama-every-linear", "qwen2-some-rslora", "phi3-packed"])
def test_merged_adapter_matches_peft(tiny, tmp_path, family, config):
    base = tiny.dir(family)
    oracle = make_lora_adapter(base, tmp_path / "adapter", **config)
    assert_adapter_matches(base, tmp_path / "adapter", oracle)


def assert_adapter_matches(base, adapter, oracle):
    engine = make_engine(base, lora=adapter)
    plain = make_engine(base)
    changed = False
    for prompt, ours, without in zip(PROMPTS, engine.generate(greedy_requests(PROMPTS, MAX_TOKENS)),
                                     plain.generate(greedy_requests(PROMPTS, MAX_TOKENS))):
        tokens, logprobs = hf_greedy(oracle, prompt, MAX_TOKENS)
        assert_matches(ours, tokens, logprobs, max_tokens=MAX_TOKENS)
        changed |= ours.token_ids != without.token_ids
    assert changed  # the adapter mattered


def test_adapters_that_change_more_than_the_linears_are_refused(tiny, tmp_path):
    base = tiny.dir("llama")
    make_lora_adapter(base, tmp_path / "dora", r=2, lora_alpha=2, target_modules=["q_proj"], use_dora=True)
    with pytest.raises(NotImplementedError, match="use_dora=True"):
        make_engine(base, lora=tmp_path / "dora")
    with pytest.raises(FileNotFoundError, match="not a LoRA adapter directory"):
        make_engine(base, lora=tmp_path)
    with pytest.raises(NotImplementedError, match="weight streaming"):
        make_engine(base, lora=tmp_path / "dora", weight_budget_bytes=10 ** 6)
    config = json.loads((tmp_path / "dora" / "adapter_config.json").read_text())
    assert config["use_dora"]


@pytest.mark.parametrize("option,value", [("alora_invocation_tokens", [5, 6]), ("layer_replication", [[0, 1]]),
                                          ("init_lora_weights", "pissa"), ("init_lora_weights", "pissa_niter_4"),
                                          ("init_lora_weights", "olora"), ("init_lora_weights", "corda"),
                                          ("init_lora_weights", "loftq")])
def test_adapters_whose_tensors_do_not_say_what_they_change_are_refused(tiny, tmp_path, option, value):
    """Plain lora_A / lora_B tensors, but activated LoRA applies only from its invocation tokens
    on, layer replication to another stack of layers, and PiSSA-like initialisations to a base
    PEFT first changes (W - B0 @ A0): merging would change the wrong thing."""
    base = tiny.dir("llama")
    make_lora_adapter(base, tmp_path / option, r=2, lora_alpha=2, target_modules=["q_proj"])
    config_path = tmp_path / option / "adapter_config.json"
    config_path.write_text(json.dumps({**json.loads(config_path.read_text()), option: value}))
    with pytest.raises(NotImplementedError, match=f"LoRA adapter option {option}="):
        make_engine(base, lora=tmp_path / option)


def test_an_adapter_whose_tensors_disagree_with_its_rank_is_refused(tiny, tmp_path):
    """r scales the update (alpha / r): tensors of another rank than the config's would merge
    at the wrong scale, where PEFT refuses to load them."""
    base = tiny.dir("llama")
    make_lora_adapter(base, tmp_path / "adapter", r=4, lora_alpha=8, target_modules=["q_proj"])
    path = tmp_path / "adapter" / "adapter_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "r": 8}))
    with pytest.raises(ValueError, match="A and B have rank 4 and 4; adapter_config.json says r=8"):
        make_engine(base, lora=tmp_path / "adapter")


def test_an_adapter_of_some_layers_matches_peft(tiny, tmp_path):
    """layers_to_transform only chooses which layers' linears are adapted."""
    base = tiny.dir("llama")
    oracle = make_lora_adapter(base, tmp_path / "adapter", r=4, lora_alpha=8, target_modules=ALL_LINEARS,
                          layers_to_transform=[1])
    assert_adapter_matches(base, tmp_path / "adapter", oracle)


@pytest.mark.parametrize("selection", [
    {"target_modules": ["q_proj"]}, {"target_modules": r".*\.q_proj"}, {"layers_to_transform": [1]},
    {"layers_to_transform": 0, "layers_pattern": "layers"}, {"exclude_modules": ["v_proj"]},
    {"exclude_modules": r"model\.layers\.0\..*"}], ids=str)
def test_an_adapter_whose_config_selects_fewer_linears_than_its_tensors_is_refused(tiny, tmp_path, selection):
    """PEFT adapts only the linears adapter_config.json selects and ignores the other tensors;
    merging them all ran another model than PEFT's, with no word (a hand-edited or converted
    adapter: PEFT's own save_pretrained writes no such thing)."""
    base = tiny.dir("llama")
    make_lora_adapter(base, tmp_path / "adapter", r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    path = tmp_path / "adapter" / "adapter_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **selection}))
    with pytest.raises(ValueError, match="which adapter_config.json does not select"):
        make_engine(base, lora=tmp_path / "adapter")


def test_an_adapter_selected_by_a_regex_or_with_exclusions_matches_peft(tiny, tmp_path):
    """The selection check takes what PEFT selects: a regex on the whole name, and exclusions."""
    base = tiny.dir("llama")
    oracle = make_lora_adapter(base, tmp_path / "regex", r=4, lora_alpha=8,
                               target_modules=r"model\.layers\.[01]\.self_attn\.(q|v)_proj")
    assert_adapter_matches(base, tmp_path / "regex", oracle)
    oracle = make_lora_adapter(base, tmp_path / "excluding", r=4, lora_alpha=8, target_modules=ALL_LINEARS,
                               exclude_modules=["down_proj"], layers_to_transform=[0], layers_pattern="layers")
    assert_adapter_matches(base, tmp_path / "excluding", oracle)


def test_a_block_diagonal_lora_is_refused_by_name(tiny, tmp_path):
    """BD-LoRA stores its block-diagonal factor compactly: it failed a shape check blaming r."""
    from peft.tuners.lora.config import BdLoraConfig

    base = tiny.dir("llama")
    make_lora_adapter(base, tmp_path / "adapter", r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                      use_bdlora=BdLoraConfig(target_modules_bd_a=["q_proj"], nblocks=2, match_strict=False))
    with pytest.raises(NotImplementedError, match="LoRA adapter option use_bdlora="):
        make_engine(base, lora=tmp_path / "adapter")


@pytest.mark.parametrize("kind", ["gemma3", "mistral3"])
def test_an_image_text_models_adapter_matches_peft(tmp_path, kind):
    """PEFT names the language model's linears as the image-text checkpoint does; the vision
    tower's (q_proj and v_proj match there too) change nothing a text prompt runs."""
    import transformers

    torch.manual_seed(0)
    transformers.AutoModelForImageTextToText.from_config(image_text_config(kind)).save_pretrained(tmp_path / "base")
    base_model = transformers.AutoModelForImageTextToText.from_pretrained(tmp_path / "base").eval()
    oracle = make_lora_adapter(tmp_path / "base", tmp_path / "adapter", base_model=base_model, r=4,
                          lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])
    names = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    assert any("vision_tower" in name for name in names)
    assert_adapter_matches(tmp_path / "base", tmp_path / "adapter", oracle)


def test_an_adapter_under_older_tensor_names_matches_peft(tiny, tmp_path):
    """Mixtral's router under transformers 4's block_sparse_moe.gate, as its checkpoints name it."""
    base = tiny.dir("mixtral")
    oracle = make_lora_adapter(base, tmp_path / "adapter", r=4, lora_alpha=8, target_modules=["q_proj", "gate"])
    path = tmp_path / "adapter" / "adapter_model.safetensors"
    save_file({name.replace(".mlp.gate.", ".block_sparse_moe.gate."): tensor
               for name, tensor in load_file(path).items()}, path)
    assert any("block_sparse_moe" in name for name in load_file(path))
    assert_adapter_matches(base, tmp_path / "adapter", oracle)


def test_lora_on_moe_experts_is_refused_as_such(tiny, tmp_path):
    base = tiny.dir("qwen3_moe")
    make_lora_adapter(base, tmp_path / "adapter", r=4, lora_alpha=8, target_modules=[],
                 target_parameters=["mlp.experts.gate_up_proj"])
    with pytest.raises(NotImplementedError, match="LoRA on MoE experts is not supported"):
        make_engine(base, lora=tmp_path / "adapter")
    config_path = tmp_path / "adapter" / "adapter_config.json"
    config = json.loads(config_path.read_text())
    # As PEFT's "all-linear" writes it: the experts' own parameter names, and a rank_pattern
    config_path.write_text(json.dumps({**config, "target_parameters": ["down_proj", "gate_up_proj"],
                                       "rank_pattern": {r".*\.gate_up_proj": 4}}))
    with pytest.raises(NotImplementedError, match="LoRA on MoE experts is not supported"):
        make_engine(base, lora=tmp_path / "adapter")
    config_path.write_text(json.dumps({**config, "target_parameters": None}))
    with pytest.raises(NotImplementedError, match=r"LoRA on MoE experts is not supported \(model.layers.0.mlp.experts\)"):
        make_engine(base, lora=tmp_path / "adapter")


def test_broken_adapter_files_are_refused_naming_the_file(tiny, tmp_path):
    base = tiny.dir("llama")
    oracle = make_lora_adapter(base, tmp_path / "good", r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    oracle.save_pretrained(tmp_path / "bin", safe_serialization=False)

    def broken(name, change):
        directory = tmp_path / name
        directory.mkdir()
        for file in ("adapter_config.json", "adapter_model.safetensors"):
            (directory / file).write_bytes((tmp_path / "good" / file).read_bytes())
        change(directory)
        return directory

    def config_with(**values):
        def change(directory):
            path = directory / "adapter_config.json"
            path.write_text(json.dumps({**json.loads(path.read_text()), **values}))
        return change

    def without(tensor_name):
        def change(directory):
            path = directory / "adapter_model.safetensors"
            save_file({k: v for k, v in load_file(path).items() if tensor_name not in k}, path)
        return change

    cases = [
        (tmp_path / "bin", NotImplementedError, "adapter_model.bin"),
        (broken("garbage", lambda d: (d / "adapter_model.safetensors").write_bytes(b"x" * 64)),
         ValueError, "adapter_model.safetensors: not a readable safetensors file"),
        (broken("json", lambda d: (d / "adapter_config.json").write_text("{oops")),
         ValueError, "adapter_config.json: not valid JSON"),
        (broken("r0", config_with(r=0)), ValueError, "r must be a positive integer, got r=0"),
        (broken("alpha", config_with(lora_alpha="8")), ValueError, "lora_alpha must be a number"),
        (broken("lone_b", without("layers.0.self_attn.q_proj.lora_A")), ValueError,
         "layers.0.self_attn.q_proj.lora_B.weight has no matching lora_A / lora_B"),
    ]
    for adapter, error, message in cases:
        with pytest.raises(error, match=message):
            make_engine(base, lora=adapter)


def test_a_request_is_not_migrated_between_adapters_that_differ_only_in_their_config(tiny, tmp_path):
    """The same A and B with another lora_alpha merge into other weights."""
    base = tiny.dir("llama")
    make_lora_adapter(base, tmp_path / "alpha8", r=4, lora_alpha=8, target_modules=ALL_LINEARS)
    (tmp_path / "alpha2").mkdir()
    (tmp_path / "alpha2" / "adapter_model.safetensors").write_bytes(
        (tmp_path / "alpha8" / "adapter_model.safetensors").read_bytes())
    config = json.loads((tmp_path / "alpha8" / "adapter_config.json").read_text())
    (tmp_path / "alpha2" / "adapter_config.json").write_text(json.dumps({**config, "lora_alpha": 2}))
    source, target = make_engine(base, lora=tmp_path / "alpha8"), make_engine(base, lora=tmp_path / "alpha2")
    source.submit(greedy_requests(PROMPTS[:1], MAX_TOKENS)[0])
    source.step()
    with pytest.raises(ValueError, match="other weights"):
        target.migrate_in(source.migrate_out("r0"))


def test_which_linears_an_adapter_config_selects_is_peft_s_answer():
    """runtime.lora._selects against PEFT's own check, over target_modules (names, suffixes,
    regexes), exclude_modules and layers_to_transform with and without layers_pattern."""
    import itertools

    from peft import LoraConfig
    from peft.tuners.tuners_utils import check_target_module_exists

    from runtime.lora import _selects

    modules = [f"model.{stack}.{layer}.{part}" for stack in ("layers", "language_model.layers", "h")
               for layer in (0, 1, 12) for part in ("self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj")]
    modules += ["lm_head", "model.layers.1.block_sparse_moe.gate", "model.layers.0.mlp.experts.3.w1"]
    targets = [["q_proj"], ["q_proj", "down_proj"], ["model.layers.0.self_attn.q_proj", "v_proj"],
               r".*\.(q|v)_proj", r"model\.layers\.1\..*", ["self_attn.v_proj"], ["w1", "gate"]]
    excludes = [None, ["v_proj"], r".*\.0\..*"]
    layer_options = [(None, None), ([1], None), (0, None), ([0, 12], "layers"), ([1], ["h", "layers"]), ([1], "blocks")]
    cases = 0
    for target, exclude, (layers, pattern) in itertools.product(targets, excludes, layer_options):
        if isinstance(target, str) and layers is not None:  # PEFT refuses the config
            continue
        peft_config = LoraConfig(target_modules=target, exclude_modules=exclude, layers_to_transform=layers,
                                 layers_pattern=pattern)
        ours = {"target_modules": target, "exclude_modules": exclude, "layers_to_transform": layers,
                "layers_pattern": pattern}
        for module in modules:
            expected = check_target_module_exists(peft_config, module)
            expected = bool(expected) and type(expected).__name__ != "_ExcludedModule"
            assert _selects(ours, module) == expected, (ours, module)
            cases += 1
    assert cases > 1000
    # PEFT expands "all-linear" (any case) before this check: every linear but the output layer.
    for spelling in ("all-linear", "ALL-Linear"):
        assert _selects({"target_modules": spelling}, "model.layers.0.self_attn.q_proj")
        assert not _selects({"target_modules": spelling}, "lm_head")
