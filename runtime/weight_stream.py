"""Memory-constrained mode (`Engine(weight_budget_bytes=...)`): the decoder layers' weights stay
in the safetensors files and stream, layer by layer, into two preallocated layer slots: while
layer i computes, background reader threads read layer i+1 into the other slot. An MoE layer's
slot holds attention, router and any dense or shared expert; its routed experts stream apart,
only those the step's routing selected (so only after the router ran), through a double-buffered
expert ring: when they fill more than one ring half, the next chunk reads while one computes.
Embeddings, norms, LM head and RoPE tables stay resident and count against the budget.

Reads go through os.preadv straight into the slot buffers, not through a memory map: a mapped
file's touched pages count as this process's resident memory, which would blur the budget. The
reads do go through the OS page cache (not our RSS); a warm cache makes them memory copies. A
tensor stored in another float type than the engine runs (a bf16 checkpoint, an fp32 engine) is
read piece by piece into a reader's staging buffer and converted into the slot from there.

On CUDA the slots and the ring are pinned host buffers that the reads fill, each with a device
twin that the layers compute on; a copy stream moves a slot to its twin (`_DeviceCopies`), so the
copy of layer i overlaps the kernels of layer i-1 still queued on the compute stream. The budget
then bounds the weights held on the device.

With `host_copy` (CUDA only) the streamed weights are read from the files once, into pinned host
memory laid out like the slots (experts as the fused checkpoint: every gate_up, then every down),
and each step copies straight from there to the device twins: no file reads per step, so the copy
engine's bandwidth, not the page cache's, bounds a step. Host RAM must then hold the checkpoint.
"""

import json
import os
import struct
import threading
import weakref
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from kernels import expert_ffn
from kernels.moe import combine, sort_by_expert
from runtime.loader import (STORED_FLOATS, alias_tied_embedding, canonical_name, check_stored_shapes,
                            hf_sources, missing_tensor, offset_norms, open_safetensors, refuse_twice,
                            safetensors_files)
from runtime.model import CausalLM
from runtime.moe import SparseMoeBlock, per_expert_names

READER_THREAD = "batchgen-weights"
# Reader threads: one copies from the page cache at ~2.6 GB/s here, two at ~3.9 GB/s. Reads are
# cut into pieces of _PIECE bytes, dealt out in turn, so each thread gets an equal share.
READERS = 2
_PIECE = 8 << 20
_ALIGN = 64  # bytes: each tensor in a slot starts on a cache line


@dataclass(frozen=True)
class Extent:
    """A run of bytes in a checkpoint file: one stored tensor, or one expert's slice of a fused one."""
    fd: int
    offset: int
    nbytes: int
    dtype: torch.dtype  # as stored

    def loaded_nbytes(self, dtype: torch.dtype, stored_bytes: int | None = None) -> int:
        """Bytes that `stored_bytes` of it (default all) take once converted to `dtype`."""
        stored = self.nbytes if stored_bytes is None else stored_bytes
        return stored // self.dtype.itemsize * dtype.itemsize


class _Index:
    """Where each stored tensor's bytes are, from the safetensors headers."""

    def __init__(self, model_dir: Path, spec):
        self.model_dir, self.spec = model_dir, spec
        self.fds: list[int] = []
        weakref.finalize(self, _close_all, self.fds)
        # fd, offset, bytes, stored type, shape
        self._tensors: dict[str, tuple[int, int, int, str, tuple[int, ...]]] = {}
        for path in safetensors_files(model_dir):
            # The in-memory load's checks of the header, found now, not by the step that reads it
            # (a file cut short, spans that overlap or do not match their shapes).
            open_safetensors(path)
            fd = os.open(path, os.O_RDONLY)
            self.fds.append(fd)
            (size,) = struct.unpack("<Q", os.pread(fd, 8, 0))
            header = json.loads(os.pread(fd, size, 8))
            for name, meta in header.items():
                if name != "__metadata__":
                    start, end = meta["data_offsets"]
                    refuse_twice(self._tensors, canonical_name(name), path)
                    self._tensors[canonical_name(name)] = (fd, 8 + size + start, end - start, meta["dtype"],
                                                           tuple(meta["shape"]))
        alias_tied_embedding(self._tensors, spec.tie_word_embeddings)

    def __contains__(self, name: str) -> bool:
        return name in self._tensors

    def shape(self, name: str) -> tuple[int, ...]:
        return self._tensors[name][4]

    def extent(self, name: str) -> Extent:
        if name not in self._tensors:
            raise missing_tensor(self.model_dir, name)
        fd, offset, nbytes, stored, _ = self._tensors[name]
        if stored not in STORED_FLOATS:
            raise NotImplementedError(f"{self.model_dir}: weight streaming reads float checkpoints "
                                      f"({', '.join(STORED_FLOATS)}): {name} is stored as {stored}")
        return Extent(fd, offset, nbytes, STORED_FLOATS[stored])

    def param_extents(self, name: str, shape: torch.Size) -> list[Extent]:
        """The extents that make up our parameter `name` (its HF tensors, packed q|k|v or gate|up
        one after another), checked to make its shape."""
        sources = hf_sources(name, self)
        extents = [self.extent(src) for src in sources]
        self._check_shape(name, sources, shape)
        return extents

    def expert_extents(self, hf_name: str, moe, shape: tuple[int, ...]) -> list[list[Extent]]:
        """Per expert, the extents that make up its slice of the stacked tensor `hf_name`
        (`….experts.gate_up_proj` or `….experts.down_proj`, `shape` [E, ...]), stored fused or
        per expert."""
        per_expert = per_expert_names(self, hf_name, moe)
        if per_expert is not None:
            extents = [[self.extent(part) for part in parts] for parts in per_expert]
            for parts in per_expert:
                self._check_shape(hf_name, parts, shape[1:])
            return extents
        whole = self.extent(hf_name)
        self._check_shape(hf_name, [hf_name], shape)
        size = whole.nbytes // moe.num_experts
        return [[Extent(whole.fd, whole.offset + e * size, size, whole.dtype)] for e in range(moe.num_experts)]

    def _check_shape(self, name: str, sources: list[str], shape) -> None:
        check_stored_shapes(self.model_dir, name, sources, [self._tensors[src][4] for src in sources],
                            shape, self.spec)


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def _nbytes(param: torch.Tensor) -> int:
    return param.numel() * param.element_size()


@dataclass
class _Binding:
    """One streamed parameter of a layer: where it lives in the module and in a slot."""
    module: nn.Module
    attr: str
    meta: nn.Parameter  # put back after the layer ran: a stale slot is never used silently
    offset: int
    extents: list[Extent]


class WeightStreamer:
    """Binds each decoder layer's parameters to a slot just before the layer runs (forward
    pre-hook) and unbinds them after; reads the next layer meanwhile. `bytes_read` counts every
    byte streamed: read from the checkpoint, or (host_copy) copied from host memory to the device."""

    def __init__(self, model: CausalLM, model_dir: str | Path, budget_bytes: int, host_copy: bool = False):
        spec = model.spec
        self.dtype = model.embed_tokens.weight.dtype
        self._element = torch.empty((), dtype=self.dtype).element_size()
        self._index = _Index(Path(model_dir), spec)
        self.bytes_read = 0
        self._count_lock = threading.Lock()  # reader threads add to bytes_read
        self._local = threading.local()  # a reader's staging buffer
        self.num_layers = spec.num_layers
        self._plans = [self._plan_layer(model, i) for i in range(spec.num_layers)]
        self.slot_bytes = max(map(_layer_bytes, self._plans), default=0)
        self.device = model.embed_tokens.weight.device
        self._pinned = self.device.type == "cuda"  # host buffers a copy stream reads asynchronously
        self._copies = device_copies(self.device)
        if host_copy and self._copies is None:
            raise ValueError("host_copy streams from host memory to a CUDA device; on CPU the budget "
                             "is host memory itself")
        self.host_copy = host_copy
        self._pool = ThreadPoolExecutor(max_workers=READERS, thread_name_prefix=READER_THREAD)
        self._pending: tuple[int, int, list[Future]] | None = None  # (layer, slot, reads) in flight
        # Queued reads hold this streamer, so it dies with none pending, possibly on a reader
        # thread, which cannot join itself: no waiting.
        weakref.finalize(self, self._pool.shutdown, wait=False)
        self._read_resident(model)
        if spec.norm_scale_in_fp32:  # after the read, so bf16 norms can turn fp32 (offset_norms)
            offset_norms(model, spec.norm_offset)
        self.resident_bytes = (sum(_nbytes(p) for p in model.parameters() if not p.is_meta)
                               + sum(_nbytes(b) for b in model.buffers()))
        blocks = [(i, layer.mlp) for i, layer in enumerate(model.layers) if isinstance(layer.mlp, SparseMoeBlock)]
        self.expert_bytes = 3 * spec.moe.intermediate_size * spec.hidden_size * self._element if blocks else 0
        self.ring_experts = self._ring_size(budget_bytes, spec.moe.num_experts if blocks else 0)

        # Where each step's layer reads land: two host slots, or (host_copy) one buffer per layer.
        sizes = [_layer_bytes(plan) for plan in self._plans] if host_copy else [self.slot_bytes] * 2
        self._slots = [torch.empty(size, dtype=torch.uint8, pin_memory=self._pinned) for size in sizes]
        self._slot_views = [memoryview(s.numpy()) for s in self._slots]
        self._device_slots = [torch.empty(self.slot_bytes, dtype=torch.uint8, device=self.device)
                              if self._copies else self._slots[slot] for slot in range(2)]
        self._bound_slot = 0  # the slot of the layer running now
        self._bound = [[self._params_in(slot, plan) for slot in range(2)] for plan in self._plans]
        self._experts, self._host_experts = {}, {}  # MoE layers: see _init_ring
        if blocks:
            self._init_ring(spec, blocks)
        if host_copy:
            self._fill_host_copy()
        for i, layer in enumerate(model.layers):
            layer.register_forward_pre_hook(lambda module, args, i=i: self._before(i))
            layer.register_forward_hook(lambda module, args, out, i=i: self._after(i))

    # ---- planning ------------------------------------------------------------------------
    def _plan_layer(self, model: CausalLM, i: int) -> list[_Binding]:
        plan, offset = [], 0
        for name, param in model.layers[i].named_parameters():
            if ".experts." in name or not param.is_meta:  # routed experts: the ring; norms: resident
                continue
            extents = self._index.param_extents(f"layers.{i}.{name}", param.shape)
            module_name, _, attr = name.rpartition(".")
            plan.append(_Binding(model.layers[i].get_submodule(module_name), attr, param, offset, extents))
            offset = _aligned(offset + _nbytes(param))
        return plan

    def _read_resident(self, model: CausalLM) -> None:
        """The parameters outside the layers, read once like the slots (no mapped pages left);
        on CUDA through a host buffer each."""
        copies, staged = [], []
        for name, param in model.named_parameters():  # tied weights are listed once
            if not param.is_meta:
                host = param.detach()
                if host.device.type != "cpu":
                    host = torch.empty(param.shape, dtype=param.dtype)
                    staged.append((param, host))
                view = memoryview(host.view(-1).view(torch.uint8).numpy())
                copies += self._back_to_back(self._index.param_extents(name, param.shape), view, 0)
        _wait(self._submit(copies))
        for param, host in staged:
            param.detach().copy_(host)
        self.bytes_read = 0  # counts what streaming reads, from here on

    def _fill_host_copy(self) -> None:
        """host_copy: every layer and every routed expert read into host memory, once."""
        copies = [copy for i in range(self.num_layers) for copy in self._layer_copies(i, self._slot_views[i])]
        for layer, (gate_ups, _) in self._experts.items():
            experts = range(len(gate_ups))
            copies += self._expert_copies(layer, experts, self._host_experts[layer][1], len(experts))
        _wait(self._submit(copies))
        self.host_bytes = sum(s.numel() for s in self._slots) + sum(h.numel() for h, _ in self._host_experts.values())
        self.bytes_read = 0  # counts what steps stream to the device, from here on

    def _ring_size(self, budget: int, num_experts: int) -> int:
        """Experts per ring half: as many as the budget leaves room for, up to all of them."""
        fixed, expert = self.resident_bytes + 2 * self.slot_bytes, self.expert_bytes
        per_half = min(num_experts, (budget - fixed) // (2 * expert)) if num_experts else 0
        if fixed > budget or (num_experts and per_half < 1):
            ring = f" + expert ring 2 x 1 expert x {expert:,}" if num_experts else ""
            raise ValueError(f"weight_budget_bytes={budget:,} is too small: resident parts (embeddings, "
                             f"norms, LM head, RoPE tables) {self.resident_bytes:,} + 2 layer slots "
                             f"x {self.slot_bytes:,}{ring} = {fixed + 2 * expert:,} bytes")
        return per_half

    @property
    def budget_used(self) -> int:
        """Bytes of weights this mode holds in memory: resident parts, layer slots, expert ring."""
        return self.resident_bytes + 2 * self.slot_bytes + 2 * self.ring_experts * self.expert_bytes

    def _init_ring(self, spec, blocks) -> None:
        moe, hidden, count = spec.moe, spec.hidden_size, self.ring_experts
        shapes = {"gate_up_proj": (moe.num_experts, 2 * moe.intermediate_size, hidden),
                  "down_proj": (moe.num_experts, hidden, moe.intermediate_size)}
        for i, block in blocks:  # self._experts: layer -> (gate_up extents, down extents) per expert
            self._experts[i] = tuple(self._index.expert_extents(f"model.layers.{i}.mlp.experts.{kind}",
                                                                moe, shape)
                                     for kind, shape in shapes.items())
            block.experts = StreamedExperts(self, i, moe.num_experts)
        self._gate_up_bytes = 2 * moe.intermediate_size * hidden * self._element
        # Routed experts, read per step into the ring's host halves, or (host_copy) held per layer.
        self._ring = [torch.empty(count * self.expert_bytes, dtype=torch.uint8, pin_memory=self._pinned)
                      for _ in range(0 if self.host_copy else 2)]
        self._ring_views = [memoryview(half.numpy()) for half in self._ring]
        if self.host_copy:  # layer -> (buffer, its view)
            for i in self._experts:
                buffer = torch.empty(moe.num_experts * self.expert_bytes, dtype=torch.uint8, pin_memory=self._pinned)
                self._host_experts[i] = (buffer, memoryview(buffer.numpy()))
        self._device_ring = [torch.empty(count * self.expert_bytes, dtype=torch.uint8, device=self.device)
                             if self._copies else self._ring[half] for half in range(2)]
        split = count * self._gate_up_bytes
        self._ring_tensors = [(half[:split].view(self.dtype).view(count, 2 * moe.intermediate_size, hidden),
                               half[split:].view(self.dtype).view(count, hidden, moe.intermediate_size))
                              for half in self._device_ring]

    def _back_to_back(self, extents: list[Extent], dest: memoryview, offset: int) -> list[tuple[Extent, memoryview]]:
        """Copies of the extents into dest one after another from offset (packed q|k|v, gate|up),
        each taking its size in the engine's dtype."""
        copies = []
        for extent in extents:
            size = extent.loaded_nbytes(self.dtype)
            copies.append((extent, dest[offset:offset + size]))
            offset += size
        return copies

    def _params_in(self, slot: int, plan: list[_Binding]) -> list[nn.Parameter]:
        return [nn.Parameter(self._device_slots[slot][b.offset:b.offset + _nbytes(b.meta)].view(self.dtype)
                             .view(b.meta.shape), requires_grad=False) for b in plan]

    # ---- reading (on the reader threads) -------------------------------------------------
    def _submit(self, copies: list[tuple[Extent, memoryview]]) -> list[Future]:
        """Start reading each extent into its destination, spread over the reader threads."""
        pieces = []
        for e, dest in copies:
            for at in range(0, e.nbytes, _PIECE):
                piece = Extent(e.fd, e.offset + at, min(_PIECE, e.nbytes - at), e.dtype)
                start = e.loaded_nbytes(self.dtype, at)
                pieces.append((piece, dest[start:start + piece.loaded_nbytes(self.dtype)]))
        return [self._pool.submit(self._read_all, pieces[r::READERS]) for r in range(READERS)]

    def _read_all(self, pieces: list[tuple[Extent, memoryview]]) -> None:
        for extent, dest in pieces:
            self._read(extent, dest)

    def _read(self, extent: Extent, dest: memoryview) -> None:
        """One piece (at most _PIECE stored bytes) into dest, converted if stored in another type."""
        converting = extent.dtype != self.dtype
        target = self._staging()[:extent.nbytes] if converting else dest
        done = 0
        while done < extent.nbytes:  # preadv may return short
            n = os.preadv(extent.fd, [target[done:extent.nbytes]], extent.offset + done)
            if n == 0:
                raise EOFError(f"checkpoint file ended {extent.nbytes - done} bytes early")
            done += n
        if converting:
            torch.frombuffer(dest, dtype=self.dtype).copy_(torch.frombuffer(target, dtype=extent.dtype))
        self._count(extent.nbytes)

    def _staging(self) -> memoryview:
        """This reader thread's buffer for pieces that need converting."""
        if not hasattr(self._local, "staging"):
            self._local.staging = memoryview(bytearray(_PIECE))
        return self._local.staging

    def _read_layer(self, i: int, slot: int) -> list[Future]:
        if self.host_copy:
            return []  # in host memory already: `_before` copies it
        if self._copies:
            self._copies.wait_copied(slot)  # the slot's last layer is on the device
        return self._submit(self._layer_copies(i, self._slot_views[slot]))

    def _read_experts(self, layer: int, experts: list[int], half: int) -> list[Future]:
        if self._copies:
            self._copies.wait_copied(2 + half)
        return self._submit(self._expert_copies(layer, experts, self._ring_views[half], self.ring_experts))

    def _layer_copies(self, i: int, view: memoryview) -> list[tuple[Extent, memoryview]]:
        """Layer i's parameters into view at their planned offsets (packed ones part after part)."""
        return [copy for binding in self._plans[i]
                for copy in self._back_to_back(binding.extents, view, binding.offset)]

    def _expert_copies(self, layer: int, experts, view: memoryview, capacity: int
                       ) -> list[tuple[Extent, memoryview]]:
        """The experts' weights into view, which holds `capacity` of them as the fused checkpoint
        does: the n-th expert's gate_up n-th of all gate_ups, its down n-th of the downs after."""
        gate_ups, downs = self._experts[layer]
        down_start, down_bytes = capacity * self._gate_up_bytes, self._gate_up_bytes // 2
        copies = []
        for pos, expert in enumerate(experts):
            copies += self._back_to_back(gate_ups[expert], view, pos * self._gate_up_bytes)
            copies += self._back_to_back(downs[expert], view, down_start + pos * down_bytes)
        return copies

    # ---- the compute side ----------------------------------------------------------------
    def _before(self, i: int) -> None:
        slot = self._wait_for(i)
        if self.host_copy:
            host = self._slots[i]
            self._copies.to_device([(host, self._device_slots[slot][:host.numel()])], slot)
            self._count(host.numel())
        elif self._copies:
            self._copies.to_device([(self._slots[slot], self._device_slots[slot])], slot)
        self._bound_slot = slot
        for binding, param in zip(self._plans[i], self._bound[i][slot]):
            binding.module._parameters[binding.attr] = param
        following = (i + 1) % self.num_layers  # after the last layer: the next step's first
        self._pending = (following, 1 - slot, self._read_layer(following, 1 - slot))

    def _after(self, i: int) -> None:
        for binding in self._plans[i]:
            binding.module._parameters[binding.attr] = binding.meta
        if self._copies:
            self._copies.release(self._bound_slot)

    def _wait_for(self, i: int) -> int:
        """The slot holding layer i, once read: the prefetched one, or (first step, or after a
        step failed part-way) read now."""
        pending, self._pending = self._pending, None
        if pending is not None:
            layer, slot, reads = pending
            _wait(reads)
            if layer == i:
                return slot
        _wait(self._read_layer(i, 0))
        return 0

    def experts(self, layer: int, chosen: list[int]):
        """Yields (chunk of expert ids, their gate_up [n, 2I, H], their down [n, H, I]) for the
        chosen experts in order, reading the next chunk into the other ring half meanwhile."""
        chunks = [chosen[j:j + self.ring_experts] for j in range(0, len(chosen), self.ring_experts)]
        if not chunks:
            return
        reads = [] if self.host_copy else self._read_experts(layer, chunks[0], 0)
        try:
            for j, chunk in enumerate(chunks):
                half = j % 2
                _wait(reads)
                if self.host_copy:
                    self._copies.to_device(self._host_expert_copies(layer, chunk, half), 2 + half)
                elif self._copies:
                    self._copies.to_device([(self._ring[half], self._device_ring[half])], 2 + half)
                if j + 1 < len(chunks) and not self.host_copy:
                    # Its half held chunk j-1: computed (CUDA: copied) by now.
                    reads = self._read_experts(layer, chunks[j + 1], 1 - half)
                gate_up, down = self._ring_tensors[half]
                yield chunk, gate_up[:len(chunk)], down[:len(chunk)]
                if self._copies:  # the caller has queued chunk j's kernels
                    self._copies.release(2 + half)
        finally:  # a step failed part-way: no read may land in a half the next step fills
            futures.wait(reads)

    def _host_expert_copies(self, layer: int, chunk: list[int], half: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(host, device) pairs that put the chunk's experts in ring half `half`: one pair per run
        of consecutive expert ids for the gate_ups and one for the downs."""
        host, ring = self._host_experts[layer][0], self._device_ring[half]
        gate_up, down = self._gate_up_bytes, self._gate_up_bytes // 2
        host_downs, ring_downs = (len(host) // self.expert_bytes) * gate_up, self.ring_experts * gate_up
        pairs, pos = [], 0
        for run in _consecutive_runs(chunk):
            first, n = run[0], len(run)
            pairs.append((host[first * gate_up:(first + n) * gate_up], ring[pos * gate_up:(pos + n) * gate_up]))
            pairs.append((host[host_downs + first * down:host_downs + (first + n) * down],
                          ring[ring_downs + pos * down:ring_downs + (pos + n) * down]))
            pos += n
        self._count(len(chunk) * self.expert_bytes)
        return pairs

    def _count(self, nbytes: int) -> None:
        with self._count_lock:
            self.bytes_read += nbytes


def device_copies(device: torch.device) -> "_DeviceCopies | None":
    """What moves the host buffers to the device: nothing on CPU, where the layers read them."""
    return _DeviceCopies(device) if device.type == "cuda" else None


class _DeviceCopies:
    """Host buffer -> device twin copies on a side stream, ordered by events: a copy waits until
    the compute stream is done with the twin's previous contents, the compute stream waits for
    the copy, and a host buffer is refilled only after its last copy finished. Buffers are
    numbered: 0 and 1 the layer slots, 2 and 3 the expert ring halves."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self._copied: dict[int, torch.cuda.Event] = {}
        self._released: dict[int, torch.cuda.Event] = {}

    def to_device(self, pairs: list[tuple[torch.Tensor, torch.Tensor]], buffer: int) -> None:
        """Copy each (host, twin) pair; `buffer` numbers the twin they fill."""
        compute = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self.stream):
            if buffer in self._released:
                self.stream.wait_event(self._released[buffer])
            for host, twin in pairs:
                twin.copy_(host, non_blocking=True)
            self._copied[buffer] = self.stream.record_event()
        compute.wait_event(self._copied[buffer])

    def release(self, buffer: int) -> None:
        """The compute stream's work on `buffer`'s twin is queued: a later copy waits for it."""
        self._released[buffer] = torch.cuda.current_stream(self.device).record_event()

    def wait_copied(self, buffer: int) -> None:
        if buffer in self._copied:
            self._copied[buffer].synchronize()


class StreamedExperts(nn.Module):
    """runtime.moe.Experts' call over streamed weights: only experts with routed tokens are read."""

    def __init__(self, streamer: WeightStreamer, layer: int, num_experts: int):
        super().__init__()
        self.streamer, self.layer, self.num_experts = streamer, layer, num_experts

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        order, token_of_pair, counts = sort_by_expert(ids, self.num_experts)
        rows = x[token_of_pair]
        out = torch.empty_like(rows)
        starts = [0] + counts.cumsum(0).tolist()
        for chunk, gate_up, down in self.streamer.experts(self.layer, counts.nonzero().flatten().tolist()):
            lo, hi = starts[chunk[0]], starts[chunk[-1] + 1]  # sorted by expert: one run of rows
            out[lo:hi] = expert_ffn(rows[lo:hi], gate_up, down, counts[chunk])
        return combine(x, out, weights, order, token_of_pair), counts


def _layer_bytes(plan: list[_Binding]) -> int:
    return max((_aligned(b.offset + _nbytes(b.meta)) for b in plan), default=0)


def _consecutive_runs(ids: list[int]) -> list[list[int]]:
    """[1, 2, 3, 7, 8] -> [[1, 2, 3], [7, 8]]."""
    runs = []
    for i in ids:
        if runs and i == runs[-1][-1] + 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    return runs


def _wait(reads: list[Future]) -> None:
    futures.wait(reads)  # all of them, even where one failed: none may land later
    for read in reads:
        read.result()  # a reader's exception surfaces here


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)
