"""The engine: one loop — drain submissions, schedule, run the model, sample, post-process —
over sequence coroutines. Callers submit from any thread and collect completions as they finish;
the sequence primitives (suspend, resume, evict, migrate; fork happens for n > 1) are public."""

import atexit
import collections
import contextlib
import functools
import inspect
import json
import logging
import operator
import os
import queue
import secrets
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from jinja2 import TemplateError

import kernels
from runtime.chat import ChatRules
from runtime.config import load_hf_config, model_spec
from runtime.default_model import default_model_dir
from runtime.estimate import exact_length
from runtime.kv_cache import BlockManager, HostKVPool, KVCache, block_hash
from runtime.loader import build_model, load_model, safetensors_files, weights_digest
from runtime.lora import ADAPTER_WEIGHTS
from runtime.moe import moe_blocks
from runtime.numbers import check_number, check_whole, is_whole
from runtime.request import (ChatOptions, Completion, CompletionWaiter, Request, SampleOutput, Timings,
                             check_request_types, content_texts, request_list)
from runtime.runner import ModelRunner, ScoredPrompts
from runtime.sampling import (DEFAULT_MAX_LOGPROBS, SampledToken, SampleRow, SamplingParams, logits_failure,
                              over_max_logprobs, sample)
from runtime.scheduler import Scheduler
from runtime.speculate import DRAFT_BELOW_ROWS, DRAFT_ROWS, accepted
from runtime.sequence import Event, Sequence, Status, StopRule
from runtime.step_lock import StepLock
from runtime.structured import Grammars, UnfollowableGrammar, allowed_tokens
from runtime.tokenizer import load_tokenizer
from runtime.weight_stream import WeightStreamer

log = logging.getLogger(__name__)

# Why an engine refuses a LoRA adapter with weight_budget_bytes (the CLI refuses the flags so too).
LORA_WITH_STREAMING = "is not supported: the adapter is merged into weights held in memory"
# The dtypes a model runs in on every device, by the names configs and flags give them.
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Batch limits: memory-constrained mode defaults to a large batch, so that each layer read from
# disk serves as many tokens as possible (module-based batching).
DEFAULT_BATCH = {"max_num_seqs": 64, "max_num_batched_tokens": 512}
STREAMING_BATCH = {"max_num_seqs": 256, "max_num_batched_tokens": 2048}
SCORE_ROWS = 256  # prompt positions scored at once: [256, vocab] fp32 logits (50 MB for SmolLM2)
POLL_SLICE_S = 0.1  # a waiting poll() looks up this often: has the loop died, stopped, run dry?
# The layout of a migrate_out state, raised when it changes: a state another release exported
# (a Beam job updated while its sequences were resident) is refused, not misread.
STATE_FORMAT = 2
# Engines whose loop runs (start()): stopped at interpreter exit. A daemon loop thread inside a
# torch op while the interpreter finalizes aborts the process ("terminate called without an
# active exception", status 134 instead of the script's own).
_LOOPING: "weakref.WeakSet[Engine]" = weakref.WeakSet()


@atexit.register
def _stop_looping_engines() -> None:
    for engine in list(_LOOPING):
        engine.stop()


def on_a_passing_thread(build, *args, **kwargs):
    """build(*args, **kwargs) on a thread that ends with it, for the parallel work of setting up
    (copying weights in, zeroing the KV cache). OpenMP keeps a pool of workers for every thread
    that has run a parallel region, as long as that thread lives; with two pools on these cores
    every parallel region waits on sleeping workers (a decode step at batch 3: 42 → 59 ms when
    the loop of `start()` stepped on a thread other than the one that loaded the model). So only
    the thread that steps keeps a pool."""
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="batchgen-setup") as setup:
        return setup.submit(build, *args, **kwargs).result()


def _device_of(device: str | torch.device) -> torch.device:
    try:
        return torch.device(device)
    except (RuntimeError, TypeError) as bad:
        raise ValueError(f"device={device!r}: not a torch device ({bad})") from None


def _usable_device(device: str | torch.device, dtype: torch.dtype) -> torch.device:
    """The torch device to run on, a CUDA one numbered (the one current now, for good); a
    ValueError where this torch sees no GPU, or the Triton kernels take no such dtype."""
    usable = _device_of(device)
    if usable.type != "cuda":
        return usable
    if not torch.cuda.is_available():
        raise ValueError(f"device={device!r}: this torch ({torch.__version__}) sees no CUDA device "
                         f"(a CPU build, or no GPU or driver)")
    if dtype not in kernels.TRITON_DTYPES:
        raise ValueError(f"dtype={dtype}: CUDA runs the Triton kernels, which take "
                         f"{', '.join(map(str, kernels.TRITON_DTYPES))}")
    return usable if usable.index is not None else torch.device("cuda", torch.cuda.current_device())


def _kv_cache_blocks(device: torch.device, kv_cache_bytes: int, block_bytes: int) -> int:
    """How many KV blocks kv_cache_bytes holds: at least 2, within the device's whole memory
    (checked before any weight is read: torch failed on it after the load, with a message
    about storage sizes)."""
    num_blocks = kv_cache_bytes // block_bytes
    if num_blocks < 2:
        raise ValueError(f"kv_cache_bytes={kv_cache_bytes} holds fewer than 2 blocks of {block_bytes} bytes")
    kv_bytes, memory = num_blocks * block_bytes, _memory_bytes(device)
    if kv_bytes > memory:
        raise ValueError(f"kv_cache_bytes: a KV cache of {kv_bytes / 2**30:.1f} GiB does not fit in "
                         f"this {device.type} device's {memory / 2**30:.1f} GiB of memory")
    return num_blocks


def _memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _dtype_of(dtype: torch.dtype | str) -> torch.dtype:
    """A dtype the model runs in: one of DTYPES, by value or by name (a config's, a flag's), or
    float64 on CPU (a reference)."""
    if isinstance(dtype, str) and dtype in DTYPES:
        return DTYPES[dtype]
    if dtype in (*DTYPES.values(), torch.float64):
        return dtype
    raise ValueError(f"dtype={dtype!r}: give one of {sorted(DTYPES)} (or torch.float64)")


class InvalidPrompt(ValueError):
    """A request the engine answers with an error completion instead of running; `prompt_tokens`:
    the prompt's length where it was tokenized (its error row's usage)."""

    def __init__(self, message: str, prompt_tokens: int = 0):
        super().__init__(message)
        self.prompt_tokens = prompt_tokens


def _token_ids(value) -> list[int] | None:
    """A list of ints from a list/tuple of integer-likes (numpy ints too); None if it is not."""
    if not isinstance(value, (list, tuple)) or any(isinstance(t, bool) for t in value):
        return None
    try:
        return [operator.index(t) for t in value]
    except TypeError:
        return None


def _check_text(where: str, text: str) -> None:
    """Tokenizers take only text UTF-8 can hold; a lone surrogate (JSON's "\\ud800") is not."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidPrompt(f"{where} is not valid Unicode text (lone surrogate at index {exc.start})") from None


def _decode(tokenizer, token_ids: list[int], skip_special_tokens: bool = True) -> str:
    return tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)


def _bad_word_token_ids(tokenizer, vocab_size: int, words: tuple[str, ...]) -> tuple[tuple[int, ...], ...]:
    """The token ids of each bad word as vLLM reads it: as it tokenizes alone and, where that
    gives another first token but as many tokens, after a space (the word inside a text)."""
    if tokenizer is None:
        raise ValueError("bad_words: need a model with a tokenizer")
    ids = []
    for word in words:
        _check_text("bad_words", word)
        alone, spaced = (tuple(tokenizer.encode(text, add_special_tokens=False))
                         for text in (word.lstrip(), " " + word.lstrip()))
        if not alone:
            raise ValueError(f"bad_words: {word!r} gives no tokens")
        ids.append(alone)
        if spaced and spaced[0] != alone[0] and len(spaced) == len(alone):
            ids.append(spaced)
    outside = sorted({t for word_ids in ids for t in word_ids if t >= vocab_size})
    if outside:  # the tokenizer knows tokens the model has no logit for (added ones)
        raise ValueError(f"bad_words: the tokenizer gives token ids {outside[:5]} past the "
                         f"model's {vocab_size}-token vocabulary")
    return tuple(ids)


def _stamp(path: Path) -> tuple[int, int] | None:
    """A file's size and modification time, None once it is gone."""
    try:
        stat = path.stat()
    except OSError:
        return None
    return stat.st_size, stat.st_mtime_ns


def _seq_id(request_id: str, sample_index: int) -> str:
    # Every sample's index, 0 too: request "r#1" then never names request "r"'s second sample
    # (the host KV tier and the held sequences are keyed by it).
    return f"{request_id}#{sample_index}"


@dataclass
class _RequestState:
    request_id: str
    prompt_tokens: int
    n: int
    timings: Timings
    seqs: list[Sequence] = field(default_factory=list)
    outputs: dict[int, SampleOutput] = field(default_factory=dict)
    # prompt_logprobs: sample 0's (prompt ids, logprobs, ranks, top logprobs), once it finished
    scored_prompt: tuple[list, list, list, list] | None = None
    arriving_kv: dict[str, torch.Tensor] = field(default_factory=dict)  # migrated in, not yet parked


@dataclass
class EngineStats:
    steps: int = 0
    failed_requests: int = 0  # ended by an error in their own sampling or stop handling
    prefill_tokens: int = 0
    decode_tokens: int = 0
    forward_seconds: float = 0.0
    expert_calls: int = 0  # MoE: expert matmuls run (one per expert with tokens, per layer and step)
    expert_tokens: int = 0  # MoE: tokens those calls processed
    # Steps with no prefill in them: the decode phase, for model-FLOPs utilisation.
    decode_steps: int = 0
    decode_step_seconds: float = 0.0
    decode_step_tokens: int = 0  # tokens they generated
    decode_step_context: int = 0  # sum of those tokens' attended context lengths (attention FLOPs)
    generated_tokens: int = 0  # tokens sampled, all sequences
    weight_bytes_read: int = 0  # memory-constrained mode: weight bytes read from the checkpoint
    screened_rows: int = 0  # greedy rows the logit screen took (greedy_screen)
    screen_misses: int = 0  # of them, rows its bound could not clear: full fp32 logits computed
    draft_tokens: int = 0  # guessed tokens verified (ngram_drafts); each a decode row
    accepted_draft_tokens: int = 0  # of them, the sequences' next tokens (taken, not dropped)

    @property
    def weight_bytes_per_token(self) -> float:
        return self.weight_bytes_read / self.generated_tokens if self.generated_tokens else 0.0

    @property
    def tokens_per_expert_call(self) -> float:
        """How many tokens expert-level batching gave each expert call, on average."""
        return self.expert_tokens / self.expert_calls if self.expert_calls else 0.0


@dataclass
class RequestLoad:
    """One in-flight request's share of an engine's work (`Engine.workload`)."""
    request_id: str
    where: str  # its sequences' queue: "waiting", "running", "suspended" or "held"
    remaining_tokens: float  # tokens still to generate, all samples, as the estimator expects
    context_tokens: int  # tokens whose KV it holds or will compute


class Engine:
    # The least each size argument takes (None, where allowed, means its default).
    _SIZE_FLOORS = {"kv_cache_bytes": 0, "host_kv_bytes": 0, "weight_budget_bytes": 0,
                    "block_size": 1, "max_num_seqs": 1, "max_num_batched_tokens": 1,
                    # A context of one token holds a prompt and nothing it could generate.
                    "max_model_len": 2, "num_threads": 1, "max_logprobs": -1}

    _SWITCHES = ("enable_prefix_caching", "weights_in_host_memory", "ngram_drafts", "greedy_screen")

    @classmethod
    @functools.cache
    def _keyword_defaults(cls) -> dict:
        """The engine's keyword arguments and their defaults, from its signature."""
        return {name: p.default for name, p in inspect.signature(cls).parameters.items() if p.kind is p.KEYWORD_ONLY}

    @classmethod
    def check_args(cls, **engine_args) -> None:
        """TypeError for an argument the engine does not take; ValueError for one of those
        given that is out of its domain: a size that is not a whole number at least its floor
        (a NaN budget would compare false everywhere, i.e. no budget), a switch that is not a
        bool ("no" would be true), an unknown admission order or preemption mode, a device torch
        cannot name, a dtype the engine does not run, options that exclude each other. Beam glue
        and EnginePool call it before any engine starts, so a bad value fails there rather than
        in an engine process."""
        known = cls._keyword_defaults()
        unknown = sorted(engine_args.keys() - known.keys())
        if unknown:
            raise TypeError(f"engine_args: unknown {unknown}; runtime.Engine takes {', '.join(known)}")
        for name in cls._SWITCHES:
            value = engine_args.get(name)
            if value is not None and not isinstance(value, bool):
                raise ValueError(f"{name} must be True or False, got {value!r}")
        streaming = engine_args.get("weight_budget_bytes") is not None
        if engine_args.get("weights_in_host_memory") and not streaming:
            raise ValueError("weights_in_host_memory streams weights: give weight_budget_bytes too")
        if streaming and engine_args.get("lora") is not None:
            raise NotImplementedError(f"a LoRA adapter with weight streaming {LORA_WITH_STREAMING}")
        for name, floor in cls._SIZE_FLOORS.items():
            value = engine_args.get(name)
            if value is not None:
                check_whole(name, value, floor)
        if "device" in engine_args:
            _device_of(engine_args["device"])
        if "dtype" in engine_args:
            _dtype_of(engine_args["dtype"])
        Scheduler.check_modes(engine_args.get("admission", "fifo"), engine_args.get("preemption", "suspend"))

    @classmethod
    def canonical_args(cls, **engine_args) -> dict:
        """engine_args checked (check_args), without those given at their default, a size as a
        Python int, a dtype as its torch.dtype and a device as torch names it: every spelling of
        one configuration is one (the Beam glue starts one engine a configuration)."""
        cls.check_args(**engine_args)
        for name in cls._SIZE_FLOORS.keys() & engine_args.keys():
            if engine_args[name] is not None:
                engine_args[name] = operator.index(engine_args[name])  # np.int64(8) is 8
        if "dtype" in engine_args:
            engine_args["dtype"] = _dtype_of(engine_args["dtype"])
        if "device" in engine_args:  # "cuda" runs on cuda:0 in a new process; "cpu:0" is "cpu"
            device = _device_of(engine_args["device"])
            engine_args["device"] = "cpu" if device.type == "cpu" else f"{device.type}:{device.index or 0}"
        defaults = cls._keyword_defaults()
        return {name: value for name, value in engine_args.items() if value != defaults[name]}

    def __init__(self, model: str | Path | None = None, *, max_num_seqs: int | None = None,
                 max_num_batched_tokens: int | None = None, block_size: int = 16,
                 kv_cache_bytes: int = 2 << 30, host_kv_bytes: int = 2 << 30,
                 admission: str = "fifo", preemption: str = "suspend",
                 enable_prefix_caching: bool = True, max_model_len: int | None = None,
                 device: str | torch.device = "cpu", dtype: torch.dtype | str = torch.float32,
                 num_threads: int | None = None, weight_budget_bytes: int | None = None,
                 weights_in_host_memory: bool = False, greedy_screen: bool | None = None,
                 lora: str | Path | None = None, max_logprobs: int = DEFAULT_MAX_LOGPROBS, ngram_drafts: bool = True):
        """weight_budget_bytes: memory-constrained mode (runtime/weight_stream.py): the decoder
        layers stream from the safetensors files, and the weights held in memory (resident
        parts, two layer slots, the MoE expert ring) stay within this many bytes. The KV cache
        (kv_cache_bytes, host_kv_bytes) is budgeted apart. max_num_seqs and
        max_num_batched_tokens then default to STREAMING_BATCH.

        weights_in_host_memory (CUDA, with weight_budget_bytes): read the streamed layers into
        pinned host memory once and stream each step from there, not from the files; host RAM
        must hold the checkpoint.

        greedy_screen: greedy rows without logprobs take the argmax of a bf16 screen of the
        vocabulary verified in fp32 (runtime/logit_screen.py), not full fp32 logits; the tokens
        are the same. It keeps bf16 copies of the lm_head (on CPU two, each half its size).
        None (the default): on where bf16 matmuls run on matrix units
        (kernels.bf16_matmul_is_fast), for fp32 weights held whole.

        lora: a PEFT LoRA adapter directory, merged into the weights at load (runtime/lora.py).

        max_logprobs: the most `logprobs` and `prompt_logprobs` a request may ask for (vLLM's
        default, 20; -1: the whole vocabulary). Each is a dict a position: a whole vocabulary's
        at every position of a long prompt would run the engine out of memory.

        ngram_drafts: while few sequences decode, greedy ones guess their next tokens from where
        their last ones appeared before and verify the guesses in the same step
        (runtime/speculate.py); the tokens are the same, in fewer steps."""
        self.check_args(kv_cache_bytes=kv_cache_bytes, host_kv_bytes=host_kv_bytes,
                        weight_budget_bytes=weight_budget_bytes, block_size=block_size,
                        max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                        max_model_len=max_model_len, num_threads=num_threads, max_logprobs=max_logprobs,
                        admission=admission, preemption=preemption, device=device, dtype=dtype,
                        enable_prefix_caching=enable_prefix_caching, ngram_drafts=ngram_drafts,
                        greedy_screen=greedy_screen, weights_in_host_memory=weights_in_host_memory,
                        lora=lora)
        self.max_logprobs = max_logprobs
        if num_threads:
            torch.set_num_threads(num_threads)
        if isinstance(model, str) and "://" in model:  # Path() would fold "gs://b/m" into "gs:/b/m"
            raise ValueError(f"{model}: a URI; runtime.Engine reads a local model directory "
                             f"(batchgen_beam.model_sources.resolve_model fetches gs:// ones)")
        self.model_dir = Path(model).expanduser() if model is not None else default_model_dir()
        dtype = _dtype_of(dtype)
        self.device = _usable_device(device, dtype)
        streaming = weight_budget_bytes is not None
        if streaming and self.device.type not in ("cpu", "cuda"):
            raise NotImplementedError(f"weight streaming runs on CPU and CUDA, not {self.device.type}")
        kernels.prepare(self.device)  # the C++ kernel's build (once per machine) outside any step
        batch = STREAMING_BATCH if streaming else DEFAULT_BATCH
        if max_num_seqs is None:
            max_num_seqs = batch["max_num_seqs"]
        if max_num_batched_tokens is None:
            max_num_batched_tokens = batch["max_num_batched_tokens"]
        # The cache's size and the longest context come from the config, before any weight is read.
        spec = model_spec(load_hf_config(self.model_dir))
        block_bytes = KVCache.bytes_per_block(spec, block_size, dtype)
        num_blocks = _kv_cache_blocks(self.device, kv_cache_bytes, block_bytes)
        # A lone sequence must always fit in the cache, so the cache bounds the context too.
        self.max_model_len = min(max_model_len or spec.max_position_embeddings,
                                 spec.max_position_embeddings, num_blocks * block_size)
        # Before the weights: a broken tokenizer file fails the start in seconds, not after a load.
        self.tokenizer = load_tokenizer(self.model_dir)
        self._chat = ChatRules(self.tokenizer) if self.tokenizer is not None else None
        self._load_weights(dtype, lora, weight_budget_bytes, weights_in_host_memory)
        self._dtype = dtype
        if greedy_screen is None:
            greedy_screen = (not streaming and dtype == torch.float32 and self.model.logits_grow_with_head
                             and kernels.bf16_matmul_is_fast(self.device))
        if greedy_screen and streaming:
            raise ValueError("greedy_screen keeps a bf16 copy of the lm_head, outside weight_budget_bytes")
        if greedy_screen:
            on_a_passing_thread(self.model.screen_logits)  # its bf16 copies are parallel ops
        self.spec = self.model.spec
        self._moe_blocks = moe_blocks(self.model)

        self.kv = on_a_passing_thread(KVCache, self.spec, num_blocks, block_size, dtype, self.device)
        self.scheduler = Scheduler(
            BlockManager(num_blocks, block_size, enable_prefix_caching), self.kv,
            HostKVPool(host_kv_bytes // block_bytes, pin_memory=self.device.type == "cuda"),
            max_num_seqs, max_num_batched_tokens, admission, preemption)
        self.runner = ModelRunner(self.model, self.kv, self.device)
        self.ngram_drafts = ngram_drafts
        # Neither holds the engine (a cycle): a dropped engine frees its KV cache at once, not
        # at the collector's next pass. Bad words' token ids are cached for the requests that
        # use the same words (a job-wide list), while per-record lists come and go.
        self._bad_word_ids = functools.lru_cache(maxsize=1024)(
            functools.partial(_bad_word_token_ids, self.tokenizer, self.spec.vocab_size))
        self.stop_rule = self._make_stop_rule()
        self.stats = EngineStats()

        self._lock = StepLock()  # engine state: scheduler, sequences; held for a step
        self._ids_lock = threading.Lock()  # request ids in flight; never held for long
        self._inbox: queue.SimpleQueue[_RequestState | dict] = queue.SimpleQueue()
        self._outbox: queue.Queue[Completion] = queue.Queue()
        self._requests: dict[str, _RequestState | None] = {}  # None: submitted, not yet drained
        self._waiters: dict[str, CompletionWaiter] = {}
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._wake = threading.Event()
        self._failure: BaseException | None = None

    def _load_weights(self, dtype: torch.dtype, lora, weight_budget_bytes: int | None,
                      weights_in_host_memory: bool) -> None:
        """The model, with its weights in memory or (weight_budget_bytes) streamed by
        self.weights; the stamps of the files read, by which migrations know the weights."""
        if weight_budget_bytes is not None:
            self.model = on_a_passing_thread(build_model, self.model_dir, self.device, dtype,
                                             stream_layers=True, max_positions=self.max_model_len)
            self.weights = WeightStreamer(self.model, self.model_dir, weight_budget_bytes,
                                          host_copy=weights_in_host_memory)
        else:
            self.model = on_a_passing_thread(load_model, self.model_dir, self.device, dtype, lora,
                                             max_positions=self.max_model_len)
            self.weights = None
        weight_files = ([self.model_dir / "config.json", *safetensors_files(self.model_dir)]
                        + ([Path(lora) / "adapter_config.json", Path(lora) / ADAPTER_WEIGHTS]
                           if lora is not None else []))
        self._loaded_files = {path: _stamp(path) for path in weight_files}

    def _make_stop_rule(self) -> StopRule:
        tokenizer, tokenizer_eos = self.tokenizer, self._tokenizer_eos_token_id()
        eos_ids = {*self._configured_eos_token_ids(), *([tokenizer_eos] if tokenizer_eos is not None else [])}
        if tokenizer is None:
            return StopRule(frozenset(eos_ids), self.max_model_len, None)
        return StopRule(frozenset(eos_ids), self.max_model_len, functools.partial(_decode, tokenizer),
                        Grammars(tokenizer, self.spec.vocab_size), getattr(tokenizer, "backend_tokenizer", None),
                        tokenizer_eos)

    def _tokenizer_eos_token_id(self) -> int | None:
        """The tokenizer's eos_token, which vLLM stops at beside the configs' ids: a chat
        fine-tune's tokenizer may name <|im_end|> where its configs still name the base model's
        <|endoftext|>."""
        eos = getattr(self.tokenizer, "eos_token_id", None)
        return eos if isinstance(eos, int) and eos < self.spec.vocab_size else None

    def _configured_eos_token_ids(self) -> list[int]:
        gen_config = self.model_dir / "generation_config.json"
        if gen_config.exists():
            try:
                eos = json.loads(gen_config.read_text()).get("eos_token_id")
            except (ValueError, AttributeError) as exc:
                raise ValueError(f"{gen_config}: not a generation config (a JSON object): {exc}") from None
            if eos is not None:
                eos = list(eos) if isinstance(eos, list) else [eos]
                if not all(isinstance(t, int) and not isinstance(t, bool) for t in eos):
                    raise ValueError(f"{gen_config}: eos_token_id must be a token id or a list of them, "
                                     f"got {eos!r}")
                return eos
        return list(self.spec.eos_token_ids)

    # ---- submitting ----------------------------------------------------------------------
    def submit(self, request: Request) -> None:
        """Queue a request (thread-safe). Invalid sampling values raise ValueError; a bad prompt
        yields an error completion instead."""
        self._submit(request, waiter=None)

    def _submit(self, request: Request, waiter: CompletionWaiter | None) -> None:
        """submit(), for `waiter`'s generate() call where given (which has claimed the id)."""
        self._check_request(request)
        timings = Timings(submitted=time.perf_counter())
        error, prompt_tokens = None, 0
        try:
            prompt_ids = self._prompt_token_ids(request)
        except InvalidPrompt as bad:
            error, prompt_tokens = str(bad), bad.prompt_tokens
        except Exception as exc:  # noqa: BLE001 - the tokenizer failed on this request alone
            log.exception("request %r: could not tokenize its prompt", request.id)
            error = f"prompt: could not be tokenized ({type(exc).__name__}: {exc})"
        if error is not None:
            self._reserve_id(request.id, waiter)
            self._complete(Completion.failed(request.id, error, timings, prompt_tokens, invalid=True))
            return
        state = _RequestState(request.id, len(prompt_ids), request.params.n, timings)
        state.seqs.append(self._new_sequence(request.id, 0, prompt_ids, request.params))
        self._reserve_id(request.id, waiter, queued=state)
        self._wake.set()

    def _check_request(self, request: Request) -> None:
        check_request_types(request)
        self.check_params(request.params)

    def check_params(self, params: SamplingParams) -> None:
        """ValueError for sampling values this engine cannot honour (a job's defaults can be
        checked so before any record runs)."""
        if params.stop and self.tokenizer is None:
            raise ValueError("stop: stop strings need a model with a tokenizer")
        if params.structured and self.tokenizer is None:
            raise ValueError("json_schema, regex, choice: structured output needs a model with a tokenizer")
        if params.n > self.scheduler.blocks.num_blocks:
            # Samples fork together once the prompt is computed, each soon writing a block of its own.
            raise ValueError(f"n: must be <= the KV cache's {self.scheduler.blocks.num_blocks} blocks, "
                             f"got {params.n}")
        for name in ("logprobs", "prompt_logprobs"):
            wanted = getattr(params, name)
            if wanted is not None and wanted > self.spec.vocab_size:
                raise ValueError(f"{name}: must be <= the vocabulary's {self.spec.vocab_size} tokens, "
                                 f"got {wanted}")
            if over_max_logprobs(wanted, self.max_logprobs):
                raise ValueError(f"{name}: must be <= the engine's max_logprobs, {self.max_logprobs} "
                                 f"(an engine argument, as vLLM's), got {wanted}")
        for name, ids in (("logit_bias", [t for t, _ in params.logit_bias]),
                          ("allowed_token_ids", params.allowed_token_ids)):
            outside = [t for t in ids if t >= self.spec.vocab_size]
            if outside:
                raise ValueError(f"{name}: token ids must be < the vocabulary's {self.spec.vocab_size}, "
                                 f"got {outside[0]}")
        if params.bad_words:
            self._bad_word_ids(params.bad_words)

    def _reserve_id(self, request_id: str, waiter: CompletionWaiter | None = None,
                    queued: "_RequestState | None" = None) -> None:
        """Claim the id (one a generate() call waits on only for that call's `waiter`); with
        `queued`, also queue its state for the loop, in the same breath, so a primitive never
        finds the id claimed but its sequences nowhere."""
        with self._ids_lock:
            if request_id in self._requests or self._waiters.get(request_id, waiter) is not waiter:
                raise ValueError(f"request id {request_id!r} is already in flight")
            self._requests[request_id] = None
            if queued is not None:
                self._inbox.put(queued)

    def _prompt_token_ids(self, request: Request) -> list[int]:
        given = [x for x in (request.prompt, request.messages, request.prompt_token_ids) if x is not None]
        if len(given) != 1:
            raise InvalidPrompt("give exactly one of prompt, messages, prompt_token_ids")
        if request.prompt_token_ids is not None:
            ids = _token_ids(request.prompt_token_ids)
            if ids is None or not all(0 <= t < self.spec.vocab_size for t in ids):
                raise InvalidPrompt(f"prompt_token_ids must be a list of integers in [0, {self.spec.vocab_size})")
        elif self.tokenizer is None:
            raise InvalidPrompt("this model has no tokenizer: give prompt_token_ids")
        elif request.messages is not None:
            ids = self._encode_chat(request.messages, request.chat)
        else:
            if not isinstance(request.prompt, str):
                raise InvalidPrompt(f"prompt must be a string, got {type(request.prompt).__name__}")
            if not request.prompt.strip():
                raise InvalidPrompt("prompt is empty")
            _check_text("prompt", request.prompt)
            ids = self.tokenizer.encode(request.prompt)
        if not ids:
            raise InvalidPrompt("prompt is empty")
        outside = sorted({t for t in ids if t >= self.spec.vocab_size})
        if outside:  # the tokenizer knows tokens the model has no embedding for (added ones)
            raise InvalidPrompt(f"prompt: the tokenizer gave token ids {outside[:5]} past the model's "
                                f"{self.spec.vocab_size}-token vocabulary")
        keep = request.params.truncate_prompt_tokens
        if keep is not None:  # the end of a prompt is what its continuation follows (vLLM's rule)
            ids = ids[-(self.max_model_len - 1 if keep == -1 else keep):]
        if len(ids) >= self.max_model_len:
            raise InvalidPrompt(f"prompt has {len(ids)} tokens; the context holds {self.max_model_len} "
                                "(prompt plus at least one generated token; truncate_prompt_tokens "
                                "keeps only a prompt's last tokens)", prompt_tokens=len(ids))
        return ids

    def _encode_chat(self, messages: list[dict], options: ChatOptions) -> list[int]:
        if self.tokenizer.chat_template is None:
            raise InvalidPrompt("this model's tokenizer has no chat template: give a prompt")
        if not messages or not all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                   and content_texts(m.get("content")) is not None for m in messages):
            raise InvalidPrompt("messages must be a non-empty list of {role: str, content: str or "
                                "a list of text parts}")
        for i, message in enumerate(messages):
            for text in content_texts(message["content"]):
                _check_text(f"messages[{i}].content", text)
        try:
            text = self.tokenizer.apply_chat_template(
                self._chat.conversation(messages), tokenize=False,
                add_generation_prompt=options.add_generation_prompt,
                continue_final_message=options.continue_final_message, **options.template_kwargs)
        except TemplateError as refused:  # templates raise on what they do not take (roles out of turn)
            raise InvalidPrompt(f"messages: the model's chat template refused them ({refused})") from None
        except ValueError as refused:  # continue_final_message: the last message is not in the text
            raise InvalidPrompt(f"messages: {refused}") from None
        return self.tokenizer.encode(text, add_special_tokens=False)

    def _new_sequence(self, request_id: str, index: int, token_ids: list[int],
                      params: SamplingParams, num_prompt_tokens: int | None = None,
                      grammar=None) -> Sequence:
        seed = params.seed if params.seed is not None else secrets.randbits(64)
        # Modulo 2**64: distinct int64 seeds draw distinct streams, as do distinct uint64 ones; the
        # sample's index as a spawn key, apart from the seed (a list [seed, index] would make
        # seed s's second sample seed s + 2**32's first).
        generator = np.random.Generator(np.random.PCG64(
            np.random.SeedSequence(seed % (1 << 64), spawn_key=(index,))))
        return Sequence(_seq_id(request_id, index), request_id, index, token_ids,
                        num_prompt_tokens if num_prompt_tokens is not None else len(token_ids),
                        params, generator, self.stop_rule, grammar)

    # ---- the loop ------------------------------------------------------------------------
    def _on_device(self):
        """Triton launches a kernel on the current CUDA device, not its tensors': make it the
        engine's for a step, on whichever thread steps."""
        return torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext()

    def step(self) -> bool:
        """Run one scheduling step. False when there was nothing to run."""
        return self._step() == "ran"

    def _step(self) -> str:
        """One step; what it found: "ran"; "idle" (nothing to run, nothing that could be, or a
        request submitted since it looked, for the next); or "stuck" (requests it holds, none
        of them runnable). Decided within the step: after it, another caller's submit and step
        could make a stuck engine look busy, or a busy one stuck."""
        with self._lock.step(), self._on_device():
            self._drain_inbox()
            batch = self.scheduler.schedule()
            if not batch:
                with self._ids_lock:  # None: submitted after the drain
                    stuck = any(state is not None for state in self._requests.values())
                return "stuck" if stuck else "idle"
            if self.ngram_drafts:
                self._draft(batch)
            now = time.perf_counter()
            for seq in batch.decodes + [s for s, _ in batch.prefills]:
                timings = self._requests[seq.request_id].timings
                timings.first_scheduled = timings.first_scheduled or now
            hidden, samplers, prompts = self.runner.run(batch)
            if prompts is not None:
                self._score_prompts(prompts)
            self.stats.steps += 1
            self.stats.decode_tokens += batch.num_decode_rows
            self.stats.prefill_tokens += batch.num_tokens - batch.num_decode_rows
            self.stats.forward_seconds += time.perf_counter() - now
            self.stats.expert_calls = sum(b.expert_calls for b in self._moe_blocks)
            self.stats.expert_tokens = sum(b.expert_tokens for b in self._moe_blocks)
            if self.weights is not None:
                self.stats.weight_bytes_read = self.weights.bytes_read
            lengths = None if batch.prefills else [s.num_tokens for s in batch.decodes]
            self._postprocess(batch, hidden, samplers)
            if not batch.prefills:  # the whole step, sampling included
                self.stats.decode_steps += 1
                self.stats.decode_step_seconds += time.perf_counter() - now
                # The tokens it generated (not the rows of rejected drafts), and the positions
                # each attended to: a sequence's j-th new token to its length before plus j.
                for seq, length in zip(batch.decodes, lengths):
                    taken = seq.num_tokens - length
                    self.stats.decode_step_tokens += taken
                    self.stats.decode_step_context += taken * length + taken * (taken - 1) // 2
            return "ran"

    @torch.inference_mode()
    def _score_prompts(self, prompts: ScoredPrompts) -> None:
        """Each scored position's logprob of the prompt token after it, its rank (and the top k
        there), in slices of SCORE_ROWS rows: a long prompt never holds [tokens, vocab] logits
        at once."""
        start = 0
        for seq, count in prompts.seqs:
            k = seq.params.prompt_logprobs
            for lo in range(start, start + count, SCORE_ROWS):
                rows = prompts.hidden[lo:min(start + count, lo + SCORE_ROWS)]
                logprobs = torch.log_softmax(self.model.compute_logits(rows).float(), dim=-1)
                first = len(seq.prompt_logprobs) + 1  # the prompt token the first row predicts
                targets = torch.tensor(seq.token_ids[first:first + len(rows)], device=logprobs.device)
                chosen = logprobs.gather(1, targets[:, None])
                seq.prompt_logprobs += chosen[:, 0].tolist()
                # vLLM's rank: how many tokens are at least as likely (ties rank it lower)
                seq.prompt_ranks += (logprobs >= chosen).sum(dim=1).tolist()
                if k:
                    top = logprobs.topk(k, dim=1)
                    seq.prompt_top_logprobs += [dict(zip(ids, values)) for ids, values
                                                in zip(top.indices.tolist(), top.values.tolist())]
            start += count

    def _drain_inbox(self) -> None:
        while True:
            try:
                state = self._inbox.get_nowait()
            except queue.Empty:
                return
            self._requests[state.request_id] = state
            for seq in state.seqs:
                if not seq.is_finished:
                    self.scheduler.add(seq, state.arriving_kv.pop(seq.seq_id, None))

    def _postprocess(self, batch, hidden: torch.Tensor, samplers: list[Sequence]) -> None:
        sampling = {id(s) for s in samplers}
        for seq, num in batch.prefills:
            if id(seq) not in sampling:
                seq.send(Event.PREFILLED, num)
                self._register_full_blocks(seq)
        rows, row_seqs = [], []
        for row, seq in enumerate(samplers):
            group = [seq]
            if seq.params.n > 1 and not seq.forked:
                group += self._fork(seq)
            rows += [row] * len(group)
            row_seqs += group
        if len(rows) != len(samplers):
            hidden = hidden[torch.tensor(rows, device=hidden.device)]
        tokens = self._sample(hidden, row_seqs)
        now = time.perf_counter()
        start = 0
        while start < len(row_seqs):  # a drafted sequence's rows follow each other
            seq = row_seqs[start]
            draft = batch.drafts.get(seq, ())
            verified, start = tokens[start:start + 1 + len(draft)], start + 1 + len(draft)
            taken = self._take(seq, accepted(verified, draft) if draft else verified, now)
            self.stats.generated_tokens += taken
            self.stats.accepted_draft_tokens += max(taken - 1, 0)
            if draft and seq.block_table:  # (a finished sequence has released its table)
                self.scheduler.release_unused(seq)

    def _take(self, seq: Sequence, tokens: list[SampledToken], now: float) -> int:
        """A sequence's tokens of this step, in order, until it finishes; how many it took."""
        if seq.request_id not in self._requests:
            return 0  # another of its samples failed the request earlier in this step
        timings = self._requests[seq.request_id].timings
        for taken, token in enumerate(tokens):
            if token.error is not None:
                self._fail_request(seq.request_id, f"sampling failed ({token.error})", invalid=token.invalid)
                return taken
            timings.first_token = timings.first_token or now
            try:  # the stop rule and the final text run the tokenizer on this request's tokens
                seq.send(Event.TOKEN, token)
                self._register_full_blocks(seq)
                if seq.is_finished:
                    self._finish_sequence(seq)
                    return taken + 1
            except UnfollowableGrammar as exc:  # the request's own grammar: no traceback to log
                self._fail_request(seq.request_id, f"{seq.params.structured_field}: {exc}", invalid=True)
                return taken + 1
            except Exception as exc:  # noqa: BLE001 - fail this request, keep serving the rest
                log.exception("request %r failed after token %d", seq.request_id, seq.num_generated)
                self._fail_request(seq.request_id, f"{type(exc).__name__}: {exc}")
                return taken + 1
        return len(tokens)

    def _draft(self, batch) -> None:
        """Guesses for the step's greedy decodes while its rows are few (runtime/speculate.py):
        up to DRAFT_ROWS, for those with the most tokens left, as far as free KV blocks hold."""
        if batch.prefills or len(batch.decodes) >= DRAFT_BELOW_ROWS:
            return
        room = min(DRAFT_ROWS, self.scheduler.max_num_batched_tokens - batch.num_tokens)
        if room <= 0:
            return
        for seq in sorted(batch.decodes, key=lambda s: s.num_generated - s.params.max_tokens):
            p = seq.params
            if not (p.argmax_only and p.n == 1):
                continue
            # Never past its last token: max_tokens, or the context's end.
            limit = min(room, p.max_tokens - seq.num_generated - 1, self.max_model_len - seq.num_tokens - 1)
            if limit <= 0:
                continue
            draft = seq.ngrams.propose(seq.token_ids, limit)
            draft = draft[:self.scheduler.reserve_draft(seq, len(draft))]
            if draft:
                batch.drafts[seq] = draft
                self.stats.draft_tokens += len(draft)
                room -= len(draft)
                if room == 0:
                    return

    @torch.inference_mode()
    def _sample(self, hidden: torch.Tensor, seqs: list[Sequence]) -> list[SampledToken]:
        """One token per row: rows that need only the argmax take the model's (which it may screen
        for); the others sample from their full logits."""
        plain = [s.params.argmax_only for s in seqs]
        if all(plain):  # the common case: no rows to pick apart
            return self._greedy(hidden)
        tokens: list[SampledToken | None] = [None] * len(seqs)
        sample_rows = {}
        for row, seq in enumerate(seqs):
            if not plain[row]:
                try:
                    sample_rows[row] = self._sample_row_for(seq)
                except Exception as exc:  # noqa: BLE001 - the engine fails this row's request alone
                    tokens[row] = SampledToken(-1, error=f"{type(exc).__name__}: {exc}")

        def of(rows):
            return hidden[torch.tensor(rows, device=hidden.device)]

        greedy = [row for row, is_plain in enumerate(plain) if is_plain]
        if greedy:
            for row, token in zip(greedy, self._greedy(of(greedy))):
                tokens[row] = token
        if sample_rows:
            logits = self.model.compute_logits(of(list(sample_rows)))
            for row, token in zip(sample_rows, sample(logits, list(sample_rows.values()))):
                tokens[row] = token
        return tokens

    def _sample_row_for(self, seq: Sequence) -> SampleRow:
        """Its params and RNG; to adjust its logits, its tokens so far and the tokens that
        would end it before min_tokens."""
        p = seq.params
        if not p.adjusts_logits:
            return SampleRow(p, seq.generator)
        # EOS too under ignore_eos, as vLLM bans it
        banned = seq.ending_ids if seq.num_generated < p.min_tokens else None
        split = seq.num_prompt_tokens
        allowed = None if seq.grammar is None else allowed_tokens(seq.grammar, self.spec.vocab_size)
        return SampleRow(p, seq.generator, seq.token_ids[:split], seq.token_ids[split:], banned, allowed,
                         seq.logit_bias, seq.permitted, self._bad_word_ids(p.bad_words) if p.bad_words else ())

    def _greedy(self, hidden: torch.Tensor) -> list[SampledToken]:
        ids, chosen, misses = self.model.greedy_tokens(hidden)
        if self.model.logit_screen is not None:
            self.stats.screened_rows += len(ids)
            self.stats.screen_misses += misses
        tokens = [SampledToken(token) for token in ids.tolist()]
        # A row whose logits are NaN (or -inf throughout) gives no token: the model failed there.
        # One check over the batch: the rows it flags, rare, are the only ones looked at again.
        for row in (chosen.isnan() | (chosen == float("-inf"))).nonzero()[:, 0].tolist():
            tokens[row] = SampledToken(-1, error=logits_failure(chosen[row].item()))
        return tokens

    def _fail_request(self, request_id: str, error: str, invalid: bool = False) -> None:
        """End a request that broke a step (`invalid`: by its own values): its sequences leave
        the scheduler (their KV freed) and it completes as an error; the batch carries on."""
        state = self._requests[request_id]
        for seq in state.seqs:
            self.scheduler.remove(seq)
            seq.end("error")
        self.stats.failed_requests += 1
        state.timings.finished = time.perf_counter()
        self._complete(Completion.failed(request_id, error, state.timings, state.prompt_tokens,
                                         invalid=invalid))

    def _register_full_blocks(self, seq: Sequence) -> None:
        bs = self.kv.block_size
        for i in range(len(seq.block_hashes), seq.num_computed // bs):
            parent = seq.block_hashes[-1] if seq.block_hashes else None
            digest = block_hash(parent, seq.token_ids[i * bs:(i + 1) * bs])
            self.scheduler.blocks.register(seq.block_table[i], digest)
            seq.block_hashes.append(digest)

    def _fork(self, parent: Sequence) -> list[Sequence]:
        """n > 1: the other samples share the prompt's KV blocks (copy-on-write). They are made
        first and joined to the engine's state after, so an interrupt while they are made (an
        engine stepped by a generate() call) leaves the parent unforked, to fork again."""
        children = []
        for index in range(1, parent.params.n):
            # A copy of the parent's matcher (microseconds), not a compile on the step thread.
            matcher = parent.grammar.deep_copy() if parent.grammar is not None else None
            child = self._new_sequence(parent.request_id, index, list(parent.token_ids), parent.params,
                                       grammar=matcher)
            child.send(Event.ADMITTED)
            child.send(Event.PREFILLED, parent.num_computed)
            child.block_table, child.block_hashes = list(parent.block_table), list(parent.block_hashes)
            children.append(child)
        for child in children:
            self.scheduler.blocks.share(child.block_table)
        self.scheduler.running.extend(children)
        self._requests[parent.request_id].seqs.extend(children)
        parent.forked = True
        return children

    def _finish_sequence(self, seq: Sequence) -> None:
        self.scheduler.remove(seq)
        if not exact_length(seq.params) and seq.finish_reason in ("stop", "length"):
            self.scheduler.estimator.observe(seq.num_generated, natural=seq.finish_reason == "stop")
        state = self._requests[seq.request_id]
        if seq.text is None:
            seq.text = seq.completion_text(seq.generated_ids) if self.tokenizer is not None else ""
        logprobs = seq.logprobs if seq.params.logprobs is not None else None
        state.outputs[seq.sample_index] = SampleOutput(
            seq.sample_index, seq.generated_ids, seq.text, seq.finish_reason, logprobs,
            seq.top_logprobs if seq.params.logprobs else None, seq.stop_reason)
        if seq.sample_index == 0 and seq.params.prompt_logprobs is not None:
            state.scored_prompt = (seq.prompt_ids, seq.prompt_logprobs,
                                   seq.prompt_ranks, seq.prompt_top_logprobs)
        if len(state.outputs) == state.n:
            state.timings.finished = time.perf_counter()
            outputs = [state.outputs[i] for i in range(state.n)]
            completion = Completion(state.request_id, outputs, state.prompt_tokens, state.timings)
            if state.scored_prompt is not None:
                prompt_ids, logprobs, ranks, top = state.scored_prompt
                completion.prompt_token_ids = prompt_ids
                completion.prompt_logprobs = [None, *logprobs]
                completion.prompt_ranks = [None, *ranks]
                completion.prompt_top_logprobs = [None, *top] if seq.params.prompt_logprobs else None
            self._complete(completion)

    def _complete(self, completion: Completion) -> None:
        """Deliver and stop tracking, as one step: a collector never sees neither."""
        with self._ids_lock:
            del self._requests[completion.id]
            self._deliver(completion)

    def _deliver(self, completion: Completion) -> None:
        waiter = self._waiters.pop(completion.id, None)
        if waiter is not None:
            waiter.add(completion)
        else:
            self._outbox.put(completion)

    # ---- collecting ----------------------------------------------------------------------
    def has_unfinished(self) -> bool:
        return bool(self._requests)

    def _anything_left(self) -> bool:
        with self._ids_lock:
            return bool(self._requests) or not self._outbox.empty()

    def poll(self, timeout: float | None = None) -> list[Completion]:
        """Completions finished so far. Without a background loop, the calling thread runs steps
        until one finishes (or nothing is left). With one, it waits up to `timeout` for one —
        even when nothing is in flight yet, as other threads may submit — or, with no timeout,
        as long as something is in flight; a wait ends early where the loop is stopped, and
        raises where it died."""
        if timeout is not None:
            check_number("timeout", timeout, 0)
        completions = []
        try:
            if self._thread is None:
                while self._outbox.empty() and self.has_unfinished():
                    self._step_or_stall(lambda: not self._outbox.empty())
            elif self._outbox.empty() and (timeout is not None or self.has_unfinished()):
                deadline = None if timeout is None else time.monotonic() + timeout
                while True:  # in slices: the loop may die, be stopped, or its work migrate away
                    self._raise_failure()
                    left = POLL_SLICE_S if deadline is None else min(POLL_SLICE_S, deadline - time.monotonic())
                    try:
                        completions.append(self._outbox.get(timeout=max(left, 0.0)))
                        break
                    except queue.Empty:
                        if (self._thread is None or (deadline is None and not self.has_unfinished())
                                or (deadline is not None and time.monotonic() >= deadline)):
                            break
            self._take_finished(completions)
        except BaseException:  # an interrupt: what was taken goes back, for the next poll
            self._put_back(completions)
            raise
        return completions

    def finished(self) -> list[Completion]:
        """Completions already finished, without running a step or waiting: for a caller that
        drives `step()` itself and must stay responsive between steps."""
        completions = []
        try:
            self._take_finished(completions)
        except BaseException:
            self._put_back(completions)
            raise
        return completions

    def _take_finished(self, into: list[Completion]) -> None:
        while True:
            try:
                into.append(self._outbox.get_nowait())
            except queue.Empty:
                return

    def _put_back(self, completions) -> None:
        for completion in completions:
            self._outbox.put(completion)

    def completions(self):
        """Iterate completions as they finish until nothing is in flight. Those a poll took that
        a caller leaving the loop did not read go back, for its next poll."""
        while self._anything_left():
            taken = collections.deque(self.poll(timeout=0.1))
            try:
                while taken:
                    yield taken.popleft()
            finally:
                self._put_back(taken)

    def generate(self, requests: list[Request]) -> list[Completion]:
        """Submit all, wait for all; results in request order."""
        requests = request_list(requests)
        if not requests:
            return []
        for request in requests:  # all of them before any: none is left in flight by a raise
            self._check_request(request)
        waiter = CompletionWaiter([r.id for r in requests])
        if len(waiter.pending) != len(requests):
            raise ValueError("request ids must be unique")
        try:  # from the claim on: an interrupt right after it must give the ids back too
            with self._ids_lock:  # claimed in one step: two calls with an id in common, one fails
                clash = [i for i in waiter.pending if i in self._requests or i in self._waiters]
                if not clash:
                    self._waiters.update(dict.fromkeys(waiter.pending, waiter))
            if clash:
                raise ValueError(f"request ids already in flight: {clash[:5]}")
            for request in requests:
                self._submit(request, waiter)
            while not waiter.done.is_set():
                if self._thread is None:
                    self._step_or_stall(waiter.done.is_set)
                else:
                    waiter.done.wait(0.1)
                    self._raise_failure()
        except KeyboardInterrupt:  # a notebook's stop button: the same call can run again
            self._withdraw(waiter.pending)
            raise
        finally:  # after a failure, stop routing the rest to this waiter
            with self._ids_lock:
                for request_id in list(waiter.pending):
                    if self._waiters.get(request_id) is waiter:
                        del self._waiters[request_id]
        return [waiter.results[r.id] for r in requests]

    def _withdraw(self, request_ids) -> None:
        """Drop these requests, those still in the engine."""
        with self._lock.held():
            for request_id in list(request_ids):
                try:
                    state, live = self._take_out(request_id, "withdrawn: its generate() call was interrupted")
                except KeyError:  # finished meanwhile, or never submitted
                    continue
                for seq in state.seqs:  # a finished one too, where the interrupt came before its end was booked
                    self.scheduler.remove(seq)
                for seq in live:
                    seq.end("abort")

    def _step_or_stall(self, done) -> None:
        """A step for a caller without a background loop, who waits until `done()`; raises
        where the engine can make no progress and the caller's wait is not over (another
        caller's step may have ended it)."""
        if self._step() == "stuck" and not done():
            held = len(self.scheduler.held)
            raise RuntimeError(f"no progress possible: {held} sequence(s) held by suspend() "
                               "need resume()" if held else "engine stalled with requests in flight")

    # ---- background loop -----------------------------------------------------------------
    def start(self) -> "Engine":
        """Run the loop on a background thread; submit and collect from any thread."""
        if self._thread is None:
            self._stopping.clear()
            self._thread = threading.Thread(target=self._loop, name="batchgen-engine", daemon=True)
            self._thread.start()
            _LOOPING.add(self)
        return self

    def stop(self) -> None:
        if self._thread is not None:
            self._stopping.set()
            self._wake.set()
            self._thread.join()
            self._thread = None
            _LOOPING.discard(self)

    def __enter__(self) -> "Engine":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _loop(self) -> None:
        try:
            while not self._stopping.is_set():
                if not self.step():
                    self._wake.wait(0.05)
                    self._wake.clear()
        except BaseException as failure:  # surfaced to every caller waiting on this engine
            self._failure = failure

    @property
    def failure(self) -> BaseException | None:
        """What ended the background loop, if it died (a bug); then every call that waits on
        the engine raises RuntimeError("engine loop failed") from it. (submit() still takes
        requests: the Beam face's engine server hands what it took to the engine replacing it.)"""
        return self._failure

    def _raise_failure(self) -> None:
        if self._failure is not None:
            raise RuntimeError("engine loop failed") from self._failure

    # ---- primitives ----------------------------------------------------------------------
    def _live_sequences(self, request_id: str) -> list[Sequence]:
        with self._ids_lock:  # submit() claims an id and queues its request in one step
            claimed = request_id in self._requests
        self._drain_inbox()  # so a claimed id's request is in the inbox, if not taken in yet
        state = self._requests.get(request_id) if claimed else None
        if state is None:
            raise KeyError(f"request {request_id!r} is not in flight in this engine")
        return [s for s in state.seqs if not s.is_finished]

    def suspend(self, request_id: str) -> int:
        """Move the request's running sequences' KV to the host tier and hold them there
        until resume(). Returns how many were suspended."""
        with self._lock.held():
            running = [s for s in self._live_sequences(request_id) if s in self.scheduler.running]
            needed = sum(len(s.block_table) for s in running)
            if not self.scheduler.host.can_hold(needed):  # all of its samples, or none
                raise ValueError(f"request {request_id!r}: the host KV tier cannot hold its {needed} "
                                 f"block(s); nothing was suspended")
            for seq in running:
                self.scheduler.suspend(seq, hold=True)
            return len(running)

    def resume(self, request_id: str) -> int:
        with self._lock.held():
            held = [s for s in self._live_sequences(request_id) if s.seq_id in self.scheduler.held]
            for seq in held:
                self.scheduler.resume(seq)
            self._wake.set()
            return len(held)

    @functools.cached_property
    def weights_id(self) -> str:
        """What a migrated request must continue on: these weights, not another model's or
        adapter's, computed in this dtype. Digested at the first migration, not at start: it
        reads every byte of the checkpoint. Files saved again since the engine loaded them
        (a notebook's new fine-tune) no longer say what it runs: then no other engine's id."""
        if any(_stamp(path) != stamp for path, stamp in self._loaded_files.items()):
            return f"changed since loaded {secrets.token_hex(16)}"
        return weights_digest(list(self._loaded_files)) + f" {self._dtype}"

    def reset_prefix_cache(self) -> int:
        """Forget the cached prefixes of finished requests, so that a rerun of the same prompts
        computes them again (a benchmark's next round); returns how many blocks it forgot."""
        with self._lock.held():
            return self.scheduler.blocks.reset_prefix_cache()

    def evict(self, request_id: str) -> int:
        """Drop the request's KV; its sequences recompute it when re-admitted."""
        with self._lock.held():
            evictable = [s for s in self._live_sequences(request_id)
                         if s.status in (Status.PREFILLING, Status.DECODING, Status.SUSPENDED)]
            for seq in evictable:
                self.scheduler.evict(seq)
            return len(evictable)

    def migrate_out(self, request_id: str, with_kv: bool = False) -> dict:
        """Take a request out of this engine: a picklable state that `migrate_in` on another
        engine (same model) continues exactly where it stopped. with_kv: sequences that have
        computed KV take it along (host tensors) and arrive suspended instead of recomputing."""
        weights = self.weights_id  # before the request is out: reading the checkpoint may fail
        migrated = None
        try:
            with self._lock.held():
                state, live = self._take_out(request_id, "migrated out of this engine: its completion "
                                                         "comes from the engine it migrated to")
                exported = []
                for seq in live:
                    kv = self._export_kv(seq) if with_kv else None
                    self.scheduler.remove(seq)
                    exported.append(seq.export_state(kv))
                    seq.send(Event.MIGRATED)
                migrated = {"format": STATE_FORMAT, "request_id": request_id, "weights": weights,
                            "prompt_tokens": state.prompt_tokens, "n": state.n,
                            "timings": state.timings.carried(), "outputs": dict(state.outputs),
                            "scored_prompt": state.scored_prompt, "sequences": exported}
        except KeyboardInterrupt:  # held while the lock was, raised as it let go: the state,
            if migrated is not None:  # the request's only copy, never reached the caller
                self.migrate_in(migrated)  # so it runs on here
            raise
        return migrated

    def _take_out(self, request_id: str, why: str) -> tuple[_RequestState, list[Sequence]]:
        """The request, no longer the engine's, and its live sequences, still scheduled (call
        with the lock held). A generate() call waiting on it gets a failed completion saying
        why: it must not wait forever."""
        live = self._live_sequences(request_id)
        with self._ids_lock:
            state = self._requests.pop(request_id)
            waiter = self._waiters.pop(request_id, None)
        if waiter is not None:
            waiter.add(Completion.failed(request_id, why, state.timings))
        return state, live

    def _export_kv(self, seq: Sequence) -> torch.Tensor | None:
        if seq.seq_id in self.scheduler.host:  # suspended or held: already on the host
            return self.scheduler.host.take(seq.seq_id)
        if seq.status in (Status.PREFILLING, Status.DECODING) and seq.num_computed:
            computed = self.scheduler.blocks.blocks_needed(seq.num_computed)
            return self.kv.read_blocks(seq.block_table[:computed], pin_memory=False)
        return None

    def migrate_in(self, migrated: dict) -> None:
        """Continue a migrated-out request here, under migrated["request_id"] (which a caller may
        change: the sequences follow it)."""
        self._check_migrated(migrated)
        request_id = migrated["request_id"]
        state = _RequestState(request_id, migrated["prompt_tokens"], migrated["n"],
                              Timings.arrived(migrated["timings"]), outputs=dict(migrated["outputs"]),
                              scored_prompt=migrated.get("scored_prompt"))
        renamed = [{**s, "request_id": request_id, "seq_id": _seq_id(request_id, s["sample_index"])}
                   for s in migrated["sequences"]]
        state.seqs = [Sequence.from_state(s, self.stop_rule) for s in renamed]
        state.arriving_kv = {s["seq_id"]: s["kv"] for s in renamed if "kv" in s}
        self._reserve_id(request_id, queued=state)
        self._wake.set()

    def _check_migrated(self, migrated: dict) -> None:
        """ValueError for a state this engine could never finish: it would wait here forever,
        and hold up what comes after it."""
        if not isinstance(migrated, dict) or not isinstance(migrated.get("request_id"), str):
            raise ValueError(f"migrate_in: not a migrate_out state (a dict with a string request_id), "
                             f"got {type(migrated).__name__}")
        request_id, n = migrated["request_id"], migrated.get("n")
        if migrated.get("format") != STATE_FORMAT:
            raise ValueError(f"migrate_in {request_id!r}: a state of another release (format "
                             f"{migrated.get('format')}; this engine reads {STATE_FORMAT})")
        shape = self._state_shape_error(migrated)
        if shape:
            raise ValueError(f"migrate_in {request_id!r}: not a migrate_out state ({shape})")
        sequences, outputs = migrated["sequences"], migrated["outputs"]
        # Live sequences and finished outputs make up the n samples, or sample 0 alone stands
        # for all n before it forks them.
        unforked = len(sequences) == 1 and not outputs and not sequences[0].get("forked", True)
        complete = unforked or sequences and len(sequences) + len(outputs) == n
        if not isinstance(n, int) or n < 1 or not complete or not isinstance(migrated.get("timings"), dict):
            raise ValueError(f"migrate_in {request_id!r}: not a migrate_out state ({len(sequences)} "
                             f"sequence(s) and {len(outputs)} finished output(s) for n={n})")
        if migrated.get("weights") != self.weights_id:
            raise ValueError(f"migrate_in {request_id!r}: it was running on other weights (another model, "
                             f"LoRA adapter or dtype) than this engine's")
        params = sequences[0].get("params")
        if not isinstance(params, SamplingParams):
            raise ValueError(f"migrate_in {request_id!r}: not a migrate_out state (no SamplingParams)")
        try:  # as submit() checks a request
            self.check_params(params)
        except ValueError as exc:
            raise ValueError(f"migrate_in {request_id!r}: {exc}") from None
        if n > self.scheduler.blocks.num_blocks:
            raise ValueError(f"migrate_in {request_id!r}: n={n} is more than the KV cache's "
                             f"{self.scheduler.blocks.num_blocks} blocks")
        longest = max((len(s["token_ids"]) for s in sequences), default=0)
        if longest >= self.max_model_len:
            raise ValueError(f"migrate_in {request_id!r}: {longest} tokens; this engine's context "
                             f"holds {self.max_model_len}")
        layout, dtype = self.kv.block_layout()
        for kv in (s["kv"] for s in sequences if s.get("kv") is not None):
            if (*kv.shape[:2], *kv.shape[3:]) != layout or kv.dtype != dtype:
                raise ValueError(f"migrate_in {request_id!r}: its KV is laid out {tuple(kv.shape)} "
                                 f"{kv.dtype}, this engine's blocks {layout} {dtype} (another "
                                 f"block size or model)")

    def _state_shape_error(self, migrated: dict) -> str | None:
        """What in a state is not as migrate_out makes it (a field missing, of another type, or
        a token the model has no embedding for), or None: what later failed a step instead."""
        if not isinstance(migrated.get("outputs"), dict):
            return "outputs must be a dict"
        prompt_tokens = migrated.get("prompt_tokens")
        if not is_whole(prompt_tokens, 1):
            return "prompt_tokens must be a whole number >= 1"
        sequences = migrated.get("sequences")
        if not isinstance(sequences, list) or not sequences or not all(isinstance(s, dict) for s in sequences):
            return "sequences must be a non-empty list of sequence states"
        return next(filter(None, (Sequence.state_error(s, self.spec.vocab_size) for s in sequences)), None)

    def sequence_counts(self) -> dict[str, int]:
        """How many sequences wait, run and are suspended: a reading for progress reports, taken
        without the step lock (a step may be moving one between queues)."""
        sched = self.scheduler
        return {"waiting": len(sched.waiting), "running": len(sched.running), "suspended": len(sched.suspended)}

    def workload(self) -> list[RequestLoad]:
        """What each in-flight request still needs: where its sequences are and the tokens they
        are expected to generate (runtime/estimate.py; an unforked n > 1 request counts n)."""
        with self._lock.held():
            self._drain_inbox()
            sched = self.scheduler
            queues = {"waiting": sched.waiting, "running": sched.running,
                      "suspended": sched.suspended, "held": sched.held.values()}
            where = {id(seq): name for name, queue in queues.items() for seq in queue}
            loads = []
            with self._ids_lock:  # submit() adds ids from other threads
                requests = list(self._requests.items())
            for request_id, state in requests:
                live = [s for s in state.seqs if not s.is_finished] if state else []
                if not live:
                    continue
                remaining = sum(min(sched.estimator.remaining(s.params, s.num_generated),
                                    self.max_model_len - s.num_tokens)
                                * (1 if s.forked else s.params.n) for s in live)
                loads.append(RequestLoad(request_id, where.get(id(live[0]), "waiting"), remaining,
                                         sum(s.num_tokens for s in live)))
            return loads
