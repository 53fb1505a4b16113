"""Memory-constrained mode (runtime/weight_stream.py): greedy output token-exact with the engine
that holds every weight, dense and MoE, also with the smallest budget that fits (an expert ring
of one expert per half, so routed experts stream in many chunks) and under KV preemption to the
host tier; with weights_in_host_memory, steps copy from a host copy and read no file; bytes read
counted exactly (each layer once per step; MoE: only the routed experts); checkpoints with
experts stored fused stream alike, and half-precision checkpoints converted as they are read;
budgets too small, a device other than CPU or CUDA, a checkpoint that is not float and a
truncated checkpoint refused clearly; reads run on the background reader thread, the next layer's
read issued before the current layer computes."""

import json
import re
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from safetensors import safe_open
from safetensors.torch import save_file

from helpers import CallCounter, assert_idle_and_clean, greedy_requests, make_engine, random_prompts
from runtime import Engine
from runtime import weight_stream
from runtime.weight_stream import READER_THREAD
from tiny_models import save_fused_experts

MAX_TOKENS = 16
PROMPTS = random_prompts((1, 5, 17, 33, 64), seed=3)
DENSE = ["llama", "smollm", "phi3", "granite", "olmo3", "gemma", "gemma2", "gemma3"]
MOE = ["mixtral", "olmoe", "qwen2_moe", "qwen3_moe"]
PLENTY = 1 << 30


def smallest_budget(model_dir) -> int:
    """The budget that just fits: resident parts, two layer slots and (MoE) one expert per ring half."""
    streamer = make_engine(model_dir, weight_budget_bytes=PLENTY).weights
    return streamer.resident_bytes + 2 * streamer.slot_bytes + 2 * streamer.expert_bytes


def stored_layer_bytes(model_dir, experts: bool) -> int:
    """Stored bytes of the decoder layers' streamed tensors in the checkpoint (norms stay
    resident), routed experts included or not."""
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        return sum(f.get_tensor(n).nbytes for n in f.keys() if n.startswith("model.layers.")
                   and not n.endswith("norm.weight") and (experts or ".experts." not in n))


def assert_same_tokens(expected, completions):
    for want, got in zip(expected, completions):
        assert got.token_ids == want.token_ids, got.id
        assert got.logprobs == pytest.approx(want.logprobs, abs=1e-5)


@pytest.mark.parametrize("family", DENSE + MOE)
def test_streamed_output_matches_the_resident_engine(tiny, family):
    directory = tiny.dir(family)
    expected = make_engine(directory).generate(greedy_requests(PROMPTS, MAX_TOKENS))
    budget = smallest_budget(directory)
    engine = make_engine(directory, weight_budget_bytes=budget)
    assert engine.weights.budget_used == budget
    assert engine.weights.ring_experts == (1 if family in MOE else 0)
    assert_same_tokens(expected, engine.generate(greedy_requests(PROMPTS, MAX_TOKENS)))
    assert engine.stats.generated_tokens == sum(c.completion_tokens for c in expected)
    assert_idle_and_clean(engine)


def test_streamed_output_matches_under_kv_preemption_to_the_host_tier(tiny):
    directory = tiny.dir("qwen3_moe")
    prompts = random_prompts((10, 15, 20, 15, 30, 12, 14, 40, 100), seed=21)  # 30 blocks of KV at the end
    expected = make_engine(directory).generate(greedy_requests(prompts, 40))
    engine = make_engine(directory, num_blocks=10, weight_budget_bytes=PLENTY)
    suspend = CallCounter(engine.scheduler, "suspend")
    assert_same_tokens(expected, engine.generate(greedy_requests(prompts, 40)))
    assert len(suspend) >= 1
    assert_idle_and_clean(engine)


def test_dense_reads_every_layer_once_per_step(tiny):
    directory = tiny.dir("llama")
    engine = make_engine(directory, weight_budget_bytes=PLENTY)
    engine.generate(greedy_requests(PROMPTS, MAX_TOKENS))
    per_step = stored_layer_bytes(directory, experts=True)
    first_layer = stored_layer_bytes(directory, experts=True) // engine.spec.num_layers  # equal layers
    stats = engine.stats
    # The last layer of each step also starts reading the next step's first layer.
    assert stats.steps * per_step <= stats.weight_bytes_read <= stats.steps * per_step + first_layer
    assert stats.weight_bytes_per_token == stats.weight_bytes_read / stats.generated_tokens


def test_moe_reads_only_the_routed_experts(tiny):
    """One sequence, one token per step: each sparse layer reads exactly top_k experts a step."""
    directory = tiny.dir("qwen3_moe")
    engine = make_engine(directory, weight_budget_bytes=PLENTY)
    engine.generate(greedy_requests([PROMPTS[0]], MAX_TOKENS))  # a one-token prompt
    moe, stats = engine.spec.moe, engine.stats
    experts_per_step = sum(moe.sparse_layers) * moe.top_k * engine.weights.expert_bytes
    per_step = stored_layer_bytes(directory, experts=False) + experts_per_step
    assert stats.steps == MAX_TOKENS
    assert stats.steps * per_step <= stats.weight_bytes_read <= (stats.steps + 1) * per_step
    assert moe.top_k < moe.num_experts
    assert stats.weight_bytes_read < stats.steps * stored_layer_bytes(directory, experts=True)


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_a_budget_too_small_names_each_term(tiny, family):
    directory = tiny.dir(family)
    with pytest.raises(ValueError) as error:
        make_engine(directory, weight_budget_bytes=smallest_budget(directory) - 1)
    message = str(error.value)
    assert "resident parts" in message and "2 layer slots" in message
    assert ("expert ring" in message) == (family == "qwen3_moe")


class SynchronousCopies:
    """runtime.weight_stream's device copies as CPU stand-ins (the CUDA one needs a GPU:
    benchmarks/gpu_check.py): each copy lands in a twin buffer and then (poison_hosts) poisons its
    host buffer, so a layer that computed on the host buffer, or on a twin overwritten before its
    layer was done with it, would change the tokens. Host buffers that must outlive their copy
    (host_copy) are left as they are."""

    def __init__(self, poison_hosts=True):
        self.copies, self.in_use, self.poison_hosts = [], set(), poison_hosts
        self.hosts = set()  # data pointers of the host buffers copied from

    def to_device(self, pairs, buffer):
        assert buffer not in self.in_use, f"buffer {buffer}'s twin overwritten while still in use"
        for host, twin in pairs:
            assert twin.data_ptr() != host.data_ptr()
            twin.copy_(host)
            self.hosts.add(host.data_ptr())
        for host, _ in pairs:
            if self.poison_hosts:
                host.fill_(255)  # NaN weights, were a layer to read them
        self.copies.append(buffer)
        self.in_use.add(buffer)

    def release(self, buffer):
        self.in_use.remove(buffer)

    def wait_copied(self, buffer):
        pass


@pytest.mark.parametrize("family", ["llama", "qwen2_moe"])
def test_layers_compute_on_the_device_twins_of_the_slots(tiny, family, monkeypatch):
    """The CUDA protocol's logic on CPU: reads fill host buffers, each is copied to its twin
    before its layer (or expert chunk) runs, and a twin is rewritten only after it was released."""
    directory = tiny.dir(family)
    expected = make_engine(directory).generate(greedy_requests(PROMPTS, MAX_TOKENS))
    copies = SynchronousCopies()
    monkeypatch.setattr(weight_stream, "device_copies", lambda device: copies)
    engine = make_engine(directory, weight_budget_bytes=smallest_budget(directory))
    assert_same_tokens(expected, engine.generate(greedy_requests(PROMPTS, MAX_TOKENS)))
    assert not copies.in_use
    assert {0, 1} <= set(copies.copies)
    assert ({2, 3} <= set(copies.copies)) == (family in MOE)


@pytest.mark.parametrize("family", ["llama", "qwen2_moe", "qwen3_moe"])
@pytest.mark.parametrize("budget", ["smallest", "plenty"])
def test_host_copy_streams_from_host_memory_without_reading_the_files(tiny, family, budget, monkeypatch):
    """weights_in_host_memory's protocol on CPU (stand-in copies): the layers and routed experts
    are read once, then every step copies from the host copy to the twins; tokens stay exact,
    with one expert per ring half (many chunks) and with every expert in one chunk (runs of
    consecutive experts copied together)."""
    directory = tiny.dir(family)
    expected = make_engine(directory).generate(greedy_requests(PROMPTS, MAX_TOKENS))
    copies = SynchronousCopies(poison_hosts=False)
    monkeypatch.setattr(weight_stream, "device_copies", lambda device: copies)
    engine = make_engine(directory, weight_budget_bytes=smallest_budget(directory) if budget == "smallest" else PLENTY,
                         weights_in_host_memory=True)
    streamer = engine.weights
    assert streamer.host_bytes >= stored_layer_bytes(directory, experts=True)
    file_reads = CallCounter(streamer, "_read")
    assert_same_tokens(expected, engine.generate(greedy_requests(PROMPTS, MAX_TOKENS)))
    assert len(file_reads) == 0
    assert not copies.in_use and ({2, 3} & set(copies.copies) != set()) == (family in MOE)
    host_buffers = {t.data_ptr() for t in streamer._slots} | {b.data_ptr() for b, _ in streamer._host_experts.values()}
    assert copies.hosts and all(any(0 <= h - b < streamer.host_bytes for b in host_buffers) for h in copies.hosts)
    layers = sum(t.numel() for t in streamer._slots)
    if family in MOE:  # only the routed experts: more than the layers, less than every expert
        assert engine.stats.steps * layers < engine.stats.weight_bytes_read < engine.stats.steps * streamer.host_bytes
    else:
        assert engine.stats.weight_bytes_read == engine.stats.steps * layers


def test_host_copy_needs_a_cuda_device_and_a_budget(tiny):
    with pytest.raises(ValueError, match="CUDA device"):
        make_engine(tiny.dir("llama"), weight_budget_bytes=PLENTY, weights_in_host_memory=True)
    with pytest.raises(ValueError, match="give weight_budget_bytes"):
        make_engine(tiny.dir("llama"), weights_in_host_memory=True)


def test_streaming_on_a_device_other_than_cpu_or_cuda_is_refused(tiny):
    # CUDA streaming (pinned slots, a copy stream) is checked by benchmarks/gpu_check.py.
    with pytest.raises(NotImplementedError, match="CPU and CUDA, not meta"):
        Engine(tiny.dir("llama"), device="meta", weight_budget_bytes=PLENTY)


def test_streaming_defaults_to_a_large_batch(tiny):
    engine = make_engine(tiny.dir("llama"), weight_budget_bytes=PLENTY)
    assert (engine.scheduler.max_num_seqs, engine.scheduler.max_num_batched_tokens) == (256, 2048)


def test_reads_run_on_the_reader_thread_one_layer_ahead(tiny, monkeypatch):
    engine = make_engine(tiny.dir("qwen3_moe"), weight_budget_bytes=PLENTY)
    streamer = engine.weights
    readers, ahead = set(), []
    read = streamer._read

    def recording_read(*args):
        readers.add(threading.current_thread().name)
        read(*args)

    monkeypatch.setattr(streamer, "_read", recording_read)
    for i, layer in enumerate(engine.model.layers):
        # While layer i computes, the read of the layer after it has been issued.
        layer.self_attn.register_forward_hook(lambda *_, i=i: ahead.append((i, streamer._pending[0])))
    engine.generate(greedy_requests(PROMPTS, 4))
    assert readers and all(name.startswith(READER_THREAD) for name in readers)
    layers = engine.spec.num_layers
    assert ahead and all(following == (i + 1) % layers for i, following in ahead)


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_experts_stored_fused_stream_alike(tiny, family, tmp_path):
    """save_pretrained stores one tensor per expert; a checkpoint of transformers 5's in-memory
    tensors stores them fused ([E, 2I, H]): each expert is then a slice of one stored tensor."""
    per_expert = tiny.dir(family)
    fused = save_fused_experts(per_expert, tmp_path / "fused")
    expected = make_engine(per_expert).generate(greedy_requests(PROMPTS, MAX_TOKENS))
    engine = make_engine(fused, weight_budget_bytes=smallest_budget(fused))
    assert_same_tokens(expected, engine.generate(greedy_requests(PROMPTS, MAX_TOKENS)))


def stored_as(source, directory, convert) -> Path:
    """A copy of the checkpoint at `source` with each tensor passed through `convert`."""
    directory.mkdir()
    shutil.copy(source / "config.json", directory / "config.json")
    with safe_open(str(source / "model.safetensors"), framework="pt") as f:
        save_file({name: convert(name, f.get_tensor(name)) for name in f.keys()},
                  str(directory / "model.safetensors"))
    return directory


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
@pytest.mark.parametrize("stored", [torch.bfloat16, torch.float16])
def test_a_checkpoint_stored_in_half_precision_streams_converted(tiny, family, stored, tmp_path):
    """Most published checkpoints are bf16: each piece read is converted into the fp32 slot, and
    the output is the resident engine's on the same checkpoint (which converts at load)."""
    directory = stored_as(tiny.dir(family), tmp_path / "half", lambda name, t: t.to(stored))
    expected = make_engine(directory).generate(greedy_requests(PROMPTS, MAX_TOKENS))
    engine = make_engine(directory, weight_budget_bytes=smallest_budget(directory))
    assert_same_tokens(expected, engine.generate(greedy_requests(PROMPTS, MAX_TOKENS)))
    steps, read = engine.stats.steps, engine.stats.weight_bytes_read  # stored (half) bytes
    assert steps * stored_layer_bytes(directory, False) <= read <= (steps + 1) * stored_layer_bytes(directory, True)


def test_a_step_failing_part_way_through_the_experts_leaves_no_read_in_flight(tiny, monkeypatch):
    """The next chunk's read into the other ring half, issued before a failure: it must have
    landed before the generator lets go, or it could overwrite what the next step reads there."""
    directory = tiny.dir("qwen3_moe")
    streamer = make_engine(directory, weight_budget_bytes=smallest_budget(directory)).weights
    half = streamer._ring[1]
    landed = []
    read = streamer._read

    def slow_into_half_1(extent, dest):
        address = torch.frombuffer(dest, dtype=torch.uint8).data_ptr()
        if half.data_ptr() <= address < half.data_ptr() + half.numel():
            time.sleep(0.2)
            read(extent, dest)
            landed.append(extent)
        else:
            read(extent, dest)

    monkeypatch.setattr(streamer, "_read", slow_into_half_1)
    chunks = streamer.experts(0, [0, 1, 2])
    next(chunks)  # computing on expert 0; expert 1 is being read into half 1
    chunks.close()  # the step failed here
    assert len(landed) == len(streamer._expert_copies(0, [1], streamer._ring_views[1], 1))


def test_waiting_for_reads_waits_for_every_one_even_after_one_failed():
    pool = ThreadPoolExecutor(2)
    done = threading.Event()

    def failing():
        raise EOFError("checkpoint file ended early")

    def slow():
        time.sleep(0.2)
        done.set()

    with pytest.raises(EOFError):
        weight_stream._wait([pool.submit(failing), pool.submit(slow)])
    assert done.is_set()


@pytest.mark.parametrize("family", ["gemma", "gemma3"])
def test_gemmas_offset_norms_stream_in_bf16(tiny, family):
    """Gemma's norms scale by 1 + weight, added once at load: in bf16 the sum stays fp32
    (RMSNorm.fp32_scale) as in the resident engine, so the tokens are the resident engine's."""
    directory = tiny.dir(family)
    expected = make_engine(directory, dtype=torch.bfloat16).generate(greedy_requests(PROMPTS, MAX_TOKENS))
    engine = make_engine(directory, dtype=torch.bfloat16, weight_budget_bytes=PLENTY)
    assert_same_tokens(expected, engine.generate(greedy_requests(PROMPTS, MAX_TOKENS)))
    norms = [m for m in engine.model.modules() if type(m).__name__ == "RMSNorm"]
    assert norms and all(m.fp32_scale and m.weight.dtype == torch.float32 for m in norms)
    # RoPE tables in bf16, as the resident engine holds them, not fp32 in the budget.
    tables = {name: b.dtype for name, b in engine.model.named_buffers() if name.startswith("rope_")}
    assert tables and set(tables.values()) == {torch.bfloat16}


def test_a_checkpoint_that_is_not_float_is_not_implemented(tiny, tmp_path):
    directory = stored_as(tiny.dir("llama"), tmp_path / "int8", lambda name, t: t.to(torch.int8)
                          if name == "model.layers.0.self_attn.q_proj.weight" else t)
    with pytest.raises(NotImplementedError, match=rf"{re.escape(str(directory))}: .*q_proj.weight is stored as I8"):
        make_engine(directory, weight_budget_bytes=PLENTY)


@pytest.mark.parametrize("family,tensor,stored", [
    ("llama", "model.embed_tokens.weight", lambda t: t[:1]),  # resident: would broadcast
    ("llama", "model.embed_tokens.weight", lambda t: t[:-8]),  # resident: rows past it garbage
    ("llama", "model.norm.weight", lambda t: t[:1]),
    ("llama", "model.layers.0.mlp.down_proj.weight", lambda t: t.t()),  # same bytes, other layout
    ("llama", "model.layers.1.self_attn.k_proj.weight", lambda t: t[:-1]),  # one of q|k|v short
    ("gemma", "model.layers.0.input_layernorm.weight", lambda t: t[:-1]),  # resident layer norm
    ("mixtral", "model.layers.0.block_sparse_moe.experts.1.w2.weight", lambda t: t[:-1]),  # one expert short
])
def test_tensors_the_config_does_not_describe_are_refused_when_streaming(tiny, tmp_path, family, tensor, stored):
    """As loading every weight refuses them (tests/test_engine_exact.py), before any step."""
    directory = stored_as(tiny.dir(family), tmp_path / "misshapen",
                          lambda name, t: stored(t).contiguous() if name == tensor else t)
    with pytest.raises(ValueError, match="in the checkpoint; the config makes it"):
        make_engine(directory, weight_budget_bytes=PLENTY)


def moved_rows(first, second, count):
    """Moves the last `count` rows of tensor `first` to the front of `second`: their sum of
    rows unchanged."""
    def convert(name, t, tensors):
        if name == first:
            return t[:-count].contiguous()
        if name == second:
            return torch.cat([tensors[first][-count:], t])
        return t
    return convert


@pytest.mark.parametrize("family,change", [
    # rows of q read as k: transformers refuses it (size mismatch), and so must we
    ("llama", moved_rows("model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight", 16)),
    ("llama", moved_rows("model.layers.1.mlp.gate_proj.weight", "model.layers.1.mlp.up_proj.weight", 8)),
    ("mixtral", moved_rows("model.layers.0.block_sparse_moe.experts.1.w1.weight",
                           "model.layers.0.block_sparse_moe.experts.1.w3.weight", 4)),
    # a part of another width: torch.cat failed naming nothing
    ("llama", lambda name, t, _: torch.cat([t, t[:, :4]], 1) if name.endswith("0.self_attn.v_proj.weight") else t),
    ("mixtral", lambda name, t, _: t[:, :-2].contiguous() if name.endswith("experts.2.w3.weight") else t),
], ids=["q-rows-as-k", "gate-rows-as-up", "expert-gate-rows-as-up", "v-wider", "expert-up-narrower"])
@pytest.mark.parametrize("budget", [None, PLENTY], ids=["resident", "streamed"])
def test_each_part_of_a_packed_weight_is_checked(tiny, tmp_path, family, change, budget):
    source = tiny.dir(family)
    with safe_open(str(source / "model.safetensors"), framework="pt") as f:
        tensors = {name: f.get_tensor(name) for name in f.keys()}
    directory = stored_as(source, tmp_path / "parts", lambda name, t: change(name, t, tensors))
    with pytest.raises(ValueError, match=r"\) \+ \(.* in the checkpoint; the config makes it \("):
        make_engine(directory, weight_budget_bytes=budget)


def _edit_header(weights: Path, edit) -> None:
    """Rewrite a safetensors file's JSON header with `edit(header)`, its data left as it is."""
    raw = weights.read_bytes()
    size = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + size])
    edit(header)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    weights.write_bytes(len(text).to_bytes(8, "little") + text + raw[8 + size:])


def _shift_span(tensor: str, by: int):
    def edit(header):
        start, end = header[tensor]["data_offsets"]
        header[tensor]["data_offsets"] = [start + by, end + by]
    return edit


_O_PROJ = "model.layers.{}.self_attn.o_proj.weight"
BROKEN_FILES = {  # the weights file, broken in ways safetensors' own checks find (streaming missed them)
    "cut-short": lambda w: w.write_bytes(w.read_bytes()[:-1000]),
    "empty": lambda w: w.write_bytes(b""),
    "header-cut": lambda w: w.write_bytes(w.read_bytes()[:100]),
    "header-not-json": lambda w: w.write_bytes((8).to_bytes(8, "little") + b"{broken!" + w.read_bytes()[16:]),
    "fp32-bytes-labelled-bf16": lambda w: _edit_header(w, lambda h: h[_O_PROJ.format(0)].update(dtype="BF16")),
    "span-overlapping-the-next": lambda w: _edit_header(w, _shift_span(_O_PROJ.format(0), 4)),
    "two-tensors-one-span": lambda w: _edit_header(
        w, lambda h: h[_O_PROJ.format(1)].update(data_offsets=h[_O_PROJ.format(0)]["data_offsets"])),
}


@pytest.mark.parametrize("budget", [None, PLENTY], ids=["resident", "streamed"])
@pytest.mark.parametrize("breakage", BROKEN_FILES)
def test_a_broken_weights_file_is_refused_naming_it(tiny, tmp_path, breakage, budget):
    """Streamed, a file cut to its first bytes failed with a bare struct.error or JSONDecodeError,
    and one whose header gave tensors wrong or overlapping spans loaded, its steps reading other
    tensors' bytes (other tokens, or NaN rows): the in-memory load refused them all."""
    directory = tmp_path / breakage
    shutil.copytree(tiny.dir("llama"), directory)
    weights = directory / "model.safetensors"
    BROKEN_FILES[breakage](weights)
    with pytest.raises(ValueError, match=rf"{re.escape(str(directory))}/model.safetensors: not a readable safetensors file"):
        make_engine(directory, weight_budget_bytes=budget)


def test_a_checkpoint_cut_short_under_a_running_engine_fails_its_step_loudly(tiny, tmp_path):
    directory = tmp_path / "cut-later"
    shutil.copytree(tiny.dir("llama"), directory)
    engine = make_engine(directory, weight_budget_bytes=PLENTY)
    weights = directory / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])  # the same file, which the engine holds open
    with pytest.raises(EOFError, match=r"checkpoint file ended \d+ bytes early"):
        engine.generate(greedy_requests(PROMPTS[:1], 2))
