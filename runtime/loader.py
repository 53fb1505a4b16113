"""Load an HF safetensors directory into our CausalLM, packing q|k|v and gate|up (and stacking
MoE experts)."""

import dataclasses
import hashlib
import json
import logging
from pathlib import Path

import torch
from safetensors import safe_open

from runtime.config import load_hf_config, model_spec, rope_cos_sin
from runtime.model import CausalLM, Linear, RMSNorm
from runtime.moe import per_expert_names

_log = logging.getLogger(__name__)

# Our packed parameter -> the HF parameters concatenated (along dim 0) to form it.
_PACKED = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    "shared_expert.gate_up_proj": ("shared_expert.gate_proj", "shared_expert.up_proj"),  # Qwen2-MoE
}
# Older tensor names -> the names transformers 5 uses (its conversion mapping renames them too),
# and an image-text model's language model -> a text model's names.
_RENAMES = {".block_sparse_moe.": ".mlp.",  # Mixtral
            "language_model.model.": "model.", "language_model.lm_head.": "lm_head.",
            "model.language_model.": "model."}


# Stored types read (converted to the engine's dtype as they are read), by safetensors' names.
STORED_FLOATS = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64}


# A base model's own save (LlamaModel's, not LlamaForCausalLM's) names its tensors without the
# "model." prefix, which transformers adds back when a causal LM loads it.
_BASE_MODEL_TENSORS = ("embed_tokens.", "layers.", "norm.")


def canonical_name(name: str) -> str:
    for old, new in _RENAMES.items():
        name = name.replace(old, new)
    return "model." + name if name.startswith(_BASE_MODEL_TENSORS) else name


def safetensors_files(model_dir: Path) -> list[Path]:
    """The files transformers reads: model.safetensors, else the shards its index names (an
    index left over from an earlier sharded save sits beside a newer model.safetensors), else
    every *.safetensors file."""
    single = model_dir / "model.safetensors"
    if single.exists():
        return [single]
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError):
            raise ValueError(f"{index}: not a safetensors index (a JSON object with a weight_map)") from None
        if not shards:
            raise ValueError(f"{index}: its weight_map names no tensors")
        return [model_dir / shard for shard in shards]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {model_dir}{pickled_note(model_dir)}")
    return files


def pickled_note(model_dir: Path) -> str:
    """What to do about a folder's pickled weights (pytorch_model.bin), which are not read: "" if
    it holds none."""
    pickled = sorted(p.name for p in model_dir.glob("*.bin"))
    return (f" ({pickled[0]} is a pickled checkpoint, which is not read: save the model with "
            f"save_pretrained(..., safe_serialization=True))" if pickled else "")


def weights_digest(files: list[Path]) -> str:
    """SHA-256 of the whole of `files`: two checkpoints differ in it wherever their bytes
    differ, such as one layer that a partial fine-tune or a merged adapter changed (a sample of
    spans missed those). Reads every byte, about a second a GB."""
    digest = hashlib.sha256()
    chunk = bytearray(1 << 24)
    for path in files:
        digest.update(path.stat().st_size.to_bytes(8, "little"))  # where one file ends
        with open(path, "rb") as f:
            while read := f.readinto(chunk):
                digest.update(memoryview(chunk)[:read])
    return digest.hexdigest()


def alias_tied_embedding(tensors: dict, tied: bool) -> None:
    """A tied model may store its one matrix as `lm_head.weight` alone (transformers loads it
    into both): read the embedding from it."""
    if tied and "model.embed_tokens.weight" not in tensors and "lm_head.weight" in tensors:
        tensors["model.embed_tokens.weight"] = tensors["lm_head.weight"]


def missing_tensor(model_dir: Path, name: str) -> KeyError:
    why = (" (a base model saved without its head: transformers would make one at random; save the "
           "...ForCausalLM model, or one with tie_word_embeddings)") if name == "lm_head.weight" else ""
    return KeyError(f"{model_dir}: the checkpoint has no tensor {name!r}{why}")


def refuse_twice(seen: dict, name: str, path: Path) -> None:
    """Two weight files holding one tensor (a stale copy beside the model): which is meant?"""
    if name in seen:
        raise ValueError(f"{path.parent}: tensor {name!r} is stored in more than one weight file "
                         f"({path.name} and another); keep one copy of the model in the folder")


class _Checkpoint:
    """Tensors by HF name across all shards, read lazily (memory-mapped)."""

    def __init__(self, model_dir: Path, tied: bool):
        files = safetensors_files(model_dir)
        self.model_dir = model_dir
        self._handles = [open_safetensors(f) for f in files]
        self._where: dict[str, tuple] = {}
        for handle, path in zip(self._handles, files):
            for name in handle.keys():
                refuse_twice(self._where, canonical_name(name), path)
                self._where[canonical_name(name)] = (handle, name)
        alias_tied_embedding(self._where, tied)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def shape(self, name: str) -> tuple[int, ...]:
        handle, stored_name = self._where[name]
        return tuple(handle.get_slice(stored_name).get_shape())

    def get(self, name: str) -> torch.Tensor:
        if name not in self._where:
            raise missing_tensor(self.model_dir, name)
        handle, stored_name = self._where[name]
        tensor = handle.get_tensor(stored_name)
        if tensor.dtype not in STORED_FLOATS.values():  # int8, fp8, packed 4-bit: would load as garbage
            raise NotImplementedError(f"{self.model_dir}: {stored_name} is stored as {tensor.dtype}: quantised "
                                      f"checkpoints are not supported (floats only: {', '.join(STORED_FLOATS)})")
        return tensor


def open_safetensors(path: Path):
    """`path` opened by safetensors, which checks its header (each tensor's bytes match its shape
    and type, no two overlap, they fill the file); any error names the file."""
    with open(path, "rb"):  # safetensors reports any file it cannot open as missing (unreadable too)
        pass
    try:
        return safe_open(str(path), framework="pt")
    except Exception as exc:  # safetensors' own errors name no file (a truncated shard, say)
        raise ValueError(f"{path}: not a readable safetensors file ({exc})") from None


def hf_sources(our_name: str, checkpoint) -> list[str]:
    """HF tensor names in `checkpoint` (anything that answers `in`) that make up one of our
    parameters: the packed tensor itself where the checkpoint stores it so (Phi-3), else its
    parts."""
    name = our_name if our_name.startswith("lm_head") else "model." + our_name
    if name in checkpoint:
        return [name]
    for packed, parts in _PACKED.items():
        if f".{packed}." in name:
            return [name.replace(packed, part) for part in parts]
    return [name]


def qkv_rows(spec) -> list[int]:
    """The rows of q, k and v in a packed q|k|v weight."""
    return [spec.num_heads * spec.head_dim] + [spec.num_kv_heads * spec.head_dim] * 2


def packed_part(hf_name: str, spec) -> tuple[str, slice]:
    """Our parameter holding an HF linear (named without its "model." prefix), and the rows
    of it that are that linear's: a part of q|k|v or gate|up, or all of it."""
    for packed, parts in _PACKED.items():
        for index, part in enumerate(parts):
            if hf_name.endswith("." + part):
                if "qkv" in packed:
                    sizes = qkv_rows(spec)
                elif "shared_expert" in packed:
                    sizes = [spec.moe.shared_expert_size] * 2
                else:
                    sizes = [spec.intermediate_size] * 2
                start = sum(sizes[:index])
                return hf_name[:-len(part)] + packed, slice(start, start + sizes[index])
    return hf_name, slice(None)


def check_stored_shapes(where, name: str, sources: list[str], stored: list[tuple[int, ...]], shape,
                        spec) -> None:
    """That the stored tensors `sources` (of shapes `stored`), concatenated along their first
    dimension as loading concatenates them, make our parameter `name` of `shape` part by part:
    q, k and v the rows the config's heads give them, gate and up half each. Their sum alone
    would let rows moved from one part to another load as a wrong model (transformers refuses
    them), and a part of another width fail in torch.cat naming nothing."""
    shape = tuple(shape)
    if len(sources) == 1:
        expected = [shape]
    else:
        rows = qkv_rows(spec) if ".q_proj." in sources[0] else [shape[0] // len(sources)] * len(sources)
        expected = [(part, *shape[1:]) for part in rows]
    stored = [tuple(s) for s in stored]
    if stored != expected:  # a [1, hidden] embedding too, which copy_ would broadcast
        raise ValueError(f"{where}: {name} is {' + '.join(map(str, stored))} in the checkpoint; "
                         f"the config makes it {' + '.join(map(str, expected))}")


def build_model(model_dir: str | Path, device: torch.device | str = "cpu",
                dtype: torch.dtype = torch.float32, stream_layers: bool = False,
                max_positions: int | None = None) -> CausalLM:
    """The model's structure with RoPE tables set and parameters allocated, not yet read.
    stream_layers: the decoder layers' parameters stay on the meta device, for
    runtime/weight_stream.py to bind to its slots; their norms are allocated (a few KB a layer,
    resident, so Gemma's 1 + weight is added once, not on every read). max_positions: the
    longest context it will run (its RoPE tables cover no more), at most the model's."""
    config = load_hf_config(model_dir)
    spec = model_spec(config)
    if spec.tie_word_embeddings and _stores_its_own_head(Path(model_dir)):
        spec = dataclasses.replace(spec, tie_word_embeddings=False)
    # Only the positions a context can reach: a 1M-position model's tables are gigabytes.
    rope_tables = rope_cos_sin(config, spec.head_dim, min(spec.max_position_embeddings,
                                                          max_positions or spec.max_position_embeddings))
    with torch.device("meta"):
        model = CausalLM(spec, rope_tables).to(dtype)
    for name, child in model.named_children():
        if not (stream_layers and name == "layers"):
            child.to_empty(device=device)
    if stream_layers:
        for module in model.layers.modules():
            if isinstance(module, RMSNorm):
                module.to_empty(device=device)
    # In the model's dtype, as transformers casts them at use (also what a streamed model keeps),
    # or fp32 where it rotates in fp32 (OLMo 2).
    table_dtype = torch.float32 if spec.rope_in_fp32 else dtype
    model.set_rope_tables({name: (cos.to(device, table_dtype), sin.to(device, table_dtype))
                           for name, (cos, sin) in rope_tables.items()})
    if spec.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    return model.eval()


def _stores_its_own_head(model_dir: Path) -> bool:
    """A checkpoint whose config ties the head to the embedding but which stores a head that
    differs from it: transformers then keeps the two apart, and so do we."""
    checkpoint = _Checkpoint(model_dir, tied=False)
    embedding, head = "model.embed_tokens.weight", "lm_head.weight"
    if embedding not in checkpoint or head not in checkpoint:
        return False
    if torch.equal(checkpoint.get(embedding), checkpoint.get(head)):
        return False
    _log.warning("%s: the config ties lm_head.weight to the embedding, but the checkpoint stores a "
                 "different one; using the stored head, as transformers does", model_dir)
    return True


def offset_norms(model: CausalLM, offset: float) -> None:
    """Norms that scale by offset + weight (Gemma's; OLMo 2's with offset 0), added once, here:
    in fp32 as transformers adds it; in bf16 / fp16 the sum stays fp32, applied before rounding
    (RMSNorm.fp32_scale)."""
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, RMSNorm):
                scale = module.weight.float() + offset
                if module.weight.dtype == torch.float32:
                    module.weight.copy_(scale)
                else:
                    module.weight = torch.nn.Parameter(scale, requires_grad=False)
                    module.fp32_scale = True


def load_model(model_dir: str | Path, device: torch.device | str = "cpu",
               dtype: torch.dtype = torch.float32, lora: str | Path | None = None,
               max_positions: int | None = None) -> CausalLM:
    """The model, its weights read; with `lora` (a PEFT adapter directory) merged into them.
    max_positions: as build_model's."""
    model_dir = Path(model_dir)
    model = build_model(model_dir, device, dtype, max_positions=max_positions)
    checkpoint = _Checkpoint(model_dir, model.spec.tie_word_embeddings)

    def read(name: str, sources: list[str], shape) -> torch.Tensor:
        tensors = [checkpoint.get(src) for src in sources]
        check_stored_shapes(model_dir, name, sources, [t.shape for t in tensors], shape, model.spec)
        return torch.cat(tensors) if len(tensors) > 1 else tensors[0]

    with torch.no_grad():
        for name, param in model.named_parameters():  # tied weights are listed once
            sources = hf_sources(name, checkpoint)
            per_expert = (per_expert_names(checkpoint, sources[0], model.spec.moe)
                          if ".experts." in name else None)
            if per_expert is None:  # one tensor, q|k|v or gate|up parts, or MoE experts fused
                stored = read(name, sources, param.shape)
            else:  # MoE experts stored one at a time, stacked: [experts, ...]
                stored = torch.stack([read(name, parts, param.shape[1:]) for parts in per_expert])
            param.copy_(stored)
    if lora is not None:
        from runtime.lora import merge_lora  # imported here: runtime.lora builds on this module
        merge_lora(model, lora)
    if model.spec.norm_scale_in_fp32:
        offset_norms(model, model.spec.norm_offset)
    for module in model.modules():
        if isinstance(module, Linear):
            module.pack()
    return model
