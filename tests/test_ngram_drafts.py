"""Greedy decodes that guess their next tokens from earlier n-grams and verify the guesses in the
same step (runtime/speculate.py) generate exactly the tokens they would one step at a time."""

import pytest

from helpers import assert_idle_and_clean, make_engine, random_prompts
from runtime import Request, SamplingParams
from runtime.sampling import SampledToken
from runtime.speculate import NgramIndex, accepted

# A phrase said three times: the continuation of a tiny random model loops too.
REPEATING = [random_prompts((9,), seed=seed)[0] * 3 for seed in range(4)]


def test_a_draft_follows_the_latest_earlier_occurrence_of_the_longest_suffix_seen():
    index = NgramIndex()
    # (2, 3) ended earlier at 3 and at 7: the latest wins.
    assert index.propose([1, 2, 3, 9, 1, 2, 3, 7, 5, 2, 3], 3) == [7, 5, 2]
    # (4, 2, 3) ended at 3, (2, 3) later at 7: the longer n-gram wins.
    assert NgramIndex().propose([4, 2, 3, 8, 1, 2, 3, 9, 4, 2, 3], 2) == [8, 1]
    assert NgramIndex().propose([1, 2, 3, 4, 5], 4) == []  # the suffix itself is no earlier occurrence
    assert NgramIndex().propose([5, 5, 5], 4) == [5]  # (5, 5) ended at 2: one token follows it so far


def test_the_index_grows_with_the_tokens_it_is_given():
    index, tokens = NgramIndex(), [1, 2, 3, 4]
    assert index.propose(tokens, 4) == []
    tokens += [9, 1, 2]
    assert index.propose(tokens, 4) == [3, 4, 9, 1]
    tokens += [3, 8]
    assert index.propose(tokens, 4) == []  # (3, 8) is new
    tokens += [1, 2, 3]
    assert index.propose(tokens, 1) == [8]  # (1, 2, 3) last ended before 8


def test_a_draft_token_stands_only_after_every_one_before_it_was_verified():
    a, b, c, x = (SampledToken(t) for t in (10, 11, 12, 99))
    assert accepted([a, b, c], [10, 11]) == [a, b, c]
    assert accepted([a, b, c], [10, 99]) == [a, b]
    assert accepted([x, b, c], [10, 11]) == [x]  # its own token differs: no guess stands


@pytest.mark.parametrize("family", ["llama", "gemma2", "qwen3", "mixtral"])
def test_drafted_greedy_matches_transformers(tiny, family):
    """Sliding windows (Gemma 2) and expert routing (Mixtral) see draft rows as decode rows."""
    engine = make_engine(tiny.dir(family))
    requests = [Request(f"r{i}", prompt_token_ids=p, params=SamplingParams(max_tokens=40))
                for i, p in enumerate(REPEATING)]
    for prompt, completion in zip(REPEATING, engine.generate(requests)):
        tokens, _ = tiny.greedy(family, prompt, 40)
        assert completion.token_ids == tokens
    assert engine.stats.accepted_draft_tokens > 0
    assert engine.stats.generated_tokens == sum(len(tiny.greedy(family, p, 40)[0]) for p in REPEATING)
    assert_idle_and_clean(engine)


def _mixed_requests(prompt_ids_of, eos_token):
    """Drafting and non-drafting requests, ending every way a drafted sequence can."""
    prompts = REPEATING + random_prompts((5, 30), seed=7)
    cases = [dict(max_tokens=1), dict(max_tokens=2), dict(max_tokens=7), dict(max_tokens=37),
             dict(max_tokens=60, ignore_eos=True), dict(max_tokens=30, stop_token_ids=[eos_token]),
             dict(max_tokens=30, temperature=0.8, seed=3), dict(max_tokens=30, logprobs=2),
             dict(max_tokens=30, n=2), dict(max_tokens=30, repetition_penalty=1.2)]
    return [Request(f"r{i}-{j}", prompt_token_ids=prompt_ids_of(p), params=SamplingParams(**case))
            for i, p in enumerate(prompts) for j, case in enumerate(cases)]


def _outcome(completion):
    return completion.error, [(o.token_ids, o.finish_reason, o.stop_reason) for o in completion.outputs]


def _logprobs(completion):
    return [lp for o in completion.outputs for lp in o.logprobs or ()]


@pytest.mark.parametrize("cpu_kernels", ["cpp", "torch"])
@pytest.mark.parametrize("num_blocks", [256, 12])
def test_drafts_change_no_request_of_a_mixed_batch(tiny, num_blocks, cpu_kernels, monkeypatch):
    """Against the same engine without drafts: greedy requests stopped by length, a stop token
    or the context's end, and requests that do not draft (sampled, logprobs, n > 1, penalties)
    beside them; with a cache so small that sequences are preempted and drafts find no room; on
    the C++ kernels (one ragged decode group) and torch's (groups of similar context)."""
    monkeypatch.setenv("BATCHGEN_CPU_KERNELS", cpu_kernels)
    directory = tiny.dir("llama")
    # The context's end (12 blocks of 16) falls inside some drafts' reach.
    prompt_ids_of = (lambda p: p) if num_blocks == 256 else (lambda p: (p * 7)[:150])
    outcomes, logprobs = {}, {}
    for drafts in (False, True):
        engine = make_engine(directory, num_blocks=num_blocks, max_num_seqs=6, ngram_drafts=drafts)
        completions = engine.generate(_mixed_requests(prompt_ids_of, eos_token=2))
        outcomes[drafts] = [_outcome(c) for c in completions]
        logprobs[drafts] = [lp for c in completions for lp in _logprobs(c)]
        stats = engine.stats
        assert (stats.accepted_draft_tokens > 0) == drafts
        assert (stats.draft_tokens > stats.accepted_draft_tokens) == drafts  # wrong guesses too
        assert_idle_and_clean(engine)
    assert outcomes[True] == outcomes[False]
    # (a row's rounding may change with the number of rows in its step)
    assert len(logprobs[True]) == len(logprobs[False])
    assert max(abs(a - b) for a, b in zip(logprobs[True], logprobs[False])) < 1e-4


def test_drafted_greedy_on_the_triton_kernels(tiny):
    """Triton's paged decode attention (here in its interpreter) takes draft rows as decode rows."""
    from kernels.backend import forced_triton

    directory = tiny.dir("llama")
    requests = [Request(f"r{i}", prompt_token_ids=p, params=SamplingParams(max_tokens=16))
                for i, p in enumerate(REPEATING[:2])]
    expected = make_engine(directory, ngram_drafts=False).generate(requests)
    with forced_triton():
        engine = make_engine(directory)
        got = engine.generate(requests)
    assert [c.token_ids for c in got] == [c.token_ids for c in expected]
    assert engine.stats.accepted_draft_tokens > 0


def test_drafted_text_and_stop_strings_match_undrafted(tiny_chat):
    """A stop string can end a sequence in the middle of its verified drafts: the tokens after it
    are dropped, the text cut as without drafts."""
    directory = tiny_chat.dir("llama")
    prompt = "the cat sat on the mat, the cat sat on the mat, the cat sat on the mat,"
    stops = [[], [" the"], ["at"], ["mat,", "cat"], ["zzz"]]
    results = {}
    for drafts in (False, True):
        engine = make_engine(directory, ngram_drafts=drafts)
        requests = [Request(f"s{i}-{keep}", prompt=prompt, params=SamplingParams(max_tokens=48, stop=stop,
                                                                         include_stop_str_in_output=keep))
                    for i, stop in enumerate(stops) for keep in (False, True)]
        results[drafts] = [(c.text, c.token_ids, c.finish_reason, c.outputs[0].stop_reason)
                           for c in engine.generate(requests)]
        assert (engine.stats.accepted_draft_tokens > 0) == drafts
    assert results[True] == results[False]


def test_a_draft_never_preempts_another_sequence(tiny):
    engine = make_engine(tiny.dir("llama"), num_blocks=5)
    prompts = random_prompts((47, 20), seed=3)
    for name, prompt in zip("ab", prompts):
        engine.submit(Request(name, prompt_token_ids=prompt, params=SamplingParams(max_tokens=5)))
    engine.step()  # both prefilled: 47 tokens in 3 blocks of 16, 20 in 2
    scheduler = engine.scheduler
    a, b = scheduler.running
    assert scheduler.blocks.num_free == 0 and len(a.block_table) == 3
    # Its next token takes position 47, the last of its 3 blocks: a guess after it needs a 4th.
    assert scheduler.reserve_draft(a, 4) == 0
    assert scheduler.running == [a, b] and b.counters["preemptions"] == 0 and len(a.block_table) == 3


def _looping_requests(seed: int, count: int, max_tokens: int) -> list[Request]:
    """Greedy requests whose prompts repeat a short phrase: many guesses, many of them wrong."""
    prompts = random_prompts((4,) * count, seed=seed)
    return [Request(f"loop{i}", prompt_token_ids=(p * 6)[:10 + 3 * i],
                    params=SamplingParams(max_tokens=max_tokens, ignore_eos=True))
            for i, p in enumerate(prompts)]


def test_blocks_of_rejected_guesses_go_back_after_the_step(tiny):
    """A guess's KV block is reserved for the step that verifies it; past the tokens a sequence
    took, its table keeps no block (a suspended sequence would park it, and resume wanting it)."""
    engine = make_engine(tiny.dir("llama"), block_size=2)
    for request in _looping_requests(seed=5, count=3, max_tokens=40):
        engine.submit(request)
    blocks = engine.scheduler.blocks
    while engine.has_unfinished():
        engine.step()
        for seq in engine.scheduler.running:
            assert len(seq.block_table) <= blocks.blocks_needed(seq.num_tokens), seq.request_id
    assert engine.stats.draft_tokens > engine.stats.accepted_draft_tokens > 0
    assert_idle_and_clean(engine)


def test_a_drafted_sequence_suspended_for_room_resumes_and_matches_undrafted(tiny):
    """Under a cache too small for all: sequences that guessed are suspended to the host tier and
    swap back in (they once parked their rejected guesses' blocks, and a swap-in that found room
    for their tokens found none for those: the step raised)."""
    directory = tiny.dir("llama")
    # (phrase length, prompt length, max_tokens): a case the drafts fuzzer found.
    shapes = [(4, 27, 15), (3, 24, 44), (2, 8, 47), (2, 20, 25)]
    phrases = random_prompts(tuple(n for n, _, _ in shapes), seed=6)
    requests = [Request(f"loop{i}", prompt_token_ids=(phrase * 20)[:length],
                        params=SamplingParams(max_tokens=max_tokens, ignore_eos=True))
                for i, (phrase, (_, length, max_tokens)) in enumerate(zip(phrases, shapes))]
    outcomes = {}
    for drafts in (False, True):
        engine = make_engine(directory, num_blocks=22, block_size=4, max_num_seqs=8,
                             max_num_batched_tokens=32, ngram_drafts=drafts)
        swapped_in = []
        swap_in = engine.scheduler.swap_in
        engine.scheduler.swap_in = lambda seq: swapped_in.append(seq) or swap_in(seq)
        outcomes[drafts] = [c.token_ids for c in engine.generate(requests)]
        assert swapped_in
        assert (engine.stats.accepted_draft_tokens > 0) == drafts
        assert_idle_and_clean(engine)
    assert outcomes[True] == outcomes[False]


def test_guess_rows_keep_within_the_step_token_budget(tiny):
    engine = make_engine(tiny.dir("llama"), max_num_batched_tokens=3)
    rows = []
    run = engine.runner.run
    engine.runner.run = lambda batch: rows.append(batch.num_tokens) or run(batch)
    engine.generate(_looping_requests(seed=2, count=2, max_tokens=30))
    assert engine.stats.accepted_draft_tokens > 0
    assert max(rows) <= 3
