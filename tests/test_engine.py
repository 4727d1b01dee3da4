"""The batching engine (engine/core.py under engine/client.py) through LLM.generate_batch and the Engine API: every
request gets exactly what LLM.generate gives it alone, whatever the batch, the page pool, the prefill chunk or the
prefix cache do."""
from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from conftest import random_gpu_llm, token_prompts
from redline.engine import Engine, EngineFull, RequestOutput
from redline.runner.decode_graphs import BATCH_BUCKETS
from redline.generate import LLM, GenerationOptions
from redline.model import Transformer

PROMPTS = ["def fibonacci(n):", "The quick brown fox", "A", "Llama models read tokens, predict the next one, and stop "
           "at the end of a turn. A tokenizer turns text into ids, and ids back into the same text."]


def alone(llm: LLM, prompts, **settings) -> list[list[int]]:
    return [llm.generate(p, **settings).token_ids for p in prompts]


def test_generate_batch_gives_each_prompt_its_tokens_alone(llm):
    want = [llm.generate(p, max_new_tokens=24, ignore_eos=True) for p in PROMPTS]
    got = llm.generate_batch(PROMPTS, max_new_tokens=24, ignore_eos=True)
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    assert [r.text for r in got] == [r.text for r in want]
    assert all(r.finish_reason == "length" and len(r.token_ids) == 24 for r in got)
    stats = llm.engine.stats()
    assert stats.requests_finished >= 4 and stats.running == 0 and stats.kv_pages_used == 0


def test_a_pool_too_small_for_all_preempts_and_recomputes_the_same_tokens(llm):
    prompts = token_prompts(llm, 6, 20)
    want = alone(llm, prompts, max_new_tokens=30, ignore_eos=True)
    engine = Engine(llm, max_kv_tokens=160, page_size=4)  # 6 x ~75 tokens would need 450
    handles = [engine.add_request(p, GenerationOptions(max_new_tokens=30, ignore_eos=True)) for p in prompts]
    assert [h.result(timeout=120).token_ids for h in handles] == want
    assert engine.stats().preemptions > 0
    assert engine.pool.num_free == engine.pool.num_pages
    engine.shutdown()


def test_chunked_prefill_gives_the_same_tokens(llm):
    prompts = token_prompts(llm, 3, 50)
    want = alone(llm, prompts, max_new_tokens=12, ignore_eos=True)
    engine = Engine(llm, prefill_chunk=16, page_size=8)
    results = [h.result(timeout=120) for h in [engine.add_request(p, GenerationOptions(max_new_tokens=12,
                                                                                     ignore_eos=True))
                                               for p in prompts]]
    assert [r.token_ids for r in results] == want
    engine.shutdown()


def test_greedy_and_seeded_rows_in_one_batch_each_get_their_own_result(llm):
    options = [GenerationOptions(max_new_tokens=20, ignore_eos=True),
               GenerationOptions(max_new_tokens=20, ignore_eos=True, temperature=0.9, seed=11),
               GenerationOptions(max_new_tokens=20, ignore_eos=True, temperature=1.3, top_k=50, top_p=0.9, seed=5),
               GenerationOptions(max_new_tokens=20, ignore_eos=True, temperature=0.9, seed=12)]
    prompts = [PROMPTS[0], PROMPTS[0], PROMPTS[1], PROMPTS[0]]
    want = [llm.generate(p, o) for p, o in zip(prompts, options)]
    got = llm.generate_batch(prompts, options)
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    assert [r.text for r in got] == [r.text for r in want]
    assert len({tuple(r.token_ids) for r in got[:2] + got[3:]}) == 3  # greedy, seed 11 and seed 12 differ
    # In a different batch (other neighbours, other order) the seeded request still draws the same text.
    again = llm.generate_batch([PROMPTS[3], PROMPTS[1], PROMPTS[0]], [options[0], options[2], options[1]])
    assert again[2].text == want[1].text and again[1].token_ids == want[2].token_ids


def test_abort_frees_the_pages_and_ends_the_stream(llm):
    engine = Engine(llm, page_size=4)
    start = engine.pool.num_free
    keep = engine.add_request(PROMPTS[1], GenerationOptions(max_new_tokens=10, ignore_eos=True))
    handle = engine.add_request(PROMPTS[3], GenerationOptions(max_new_tokens=200, ignore_eos=True))
    outputs = iter(handle)
    first = next(outputs)
    assert first.finish_reason is None and first.prompt_tokens == len(handle.prompt_token_ids)
    engine.abort(handle)
    rest = list(outputs)
    assert rest[-1].finish_reason == "abort"
    assert 1 <= len(first.token_ids) + sum(len(o.token_ids) for o in rest) < 200
    assert handle.result().finish_reason == "abort"
    assert keep.result(timeout=60).token_ids == llm.generate(PROMPTS[1], max_new_tokens=10, ignore_eos=True).token_ids
    engine.shutdown()
    assert engine.pool.num_free == start
    engine.abort(handle)  # aborting a finished request does nothing


def test_prefix_cache_hits_give_the_same_tokens_as_misses(llm):
    shared = token_prompts(llm, 1, 70)[0]
    prompts = [shared + [5, 6, 7], shared + [9], shared[:66]]
    options = GenerationOptions(max_new_tokens=15, ignore_eos=True)
    first_reply = llm.generate(prompts[0], options).token_ids
    prompts.append(prompts[0] + first_reply + [11, 12])  # a second turn: the first reply's pages are cached too
    want = [first_reply] + alone(llm, prompts[1:], max_new_tokens=15, ignore_eos=True)
    engine = Engine(llm, page_size=8)
    first = engine.add_request(prompts[0], options)
    assert first.result(timeout=60).token_ids == want[0]
    handles = [engine.add_request(p, options) for p in prompts[1:]]
    assert [h.result(timeout=60).token_ids for h in handles] == want[1:]
    # Whole pages only (8 of the shared 70 tokens' pages), never a prompt's last token; the second turn also hits
    # the pages of the first reply's tokens (73 + 14 computed: 10 full pages).
    assert [list(h)[0].cached_tokens for h in handles] == [64, 64, 80]
    stats = engine.stats()
    assert stats.prefix_cache_hits == 208 and stats.prefix_cache_queries == sum(len(p) for p in prompts)
    engine.shutdown()


def test_a_prompt_longer_than_the_context_is_refused_and_others_run_on(llm):
    engine = Engine(llm)
    running = engine.add_request(PROMPTS[0], GenerationOptions(max_new_tokens=16, ignore_eos=True))
    with pytest.raises(ValueError, match="context is 256") as info:
        engine.add_request(list(range(3, 3 + 300)))
    assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("")
    with pytest.raises(ValueError, match="speculate"):
        engine.add_request("x", GenerationOptions(draft="prompt_lookup"))
    assert running.result(timeout=60).token_ids == llm.generate(PROMPTS[0], max_new_tokens=16,
                                                                ignore_eos=True).token_ids
    with pytest.raises(ValueError, match="context"):
        llm.generate_batch([PROMPTS[0], list(range(3, 300))])  # checked before any request starts
    engine.shutdown()


def test_a_request_the_pool_cannot_hold_is_refused(llm):
    engine = Engine(llm, max_kv_tokens=32, page_size=8)
    with pytest.raises(ValueError, match="raise max_kv_tokens"):
        engine.add_request(PROMPTS[3], GenerationOptions(max_new_tokens=30))
    engine.shutdown()


def test_stop_strings_eos_and_the_stream_pieces_match_generate(llm):
    text = llm.generate(PROMPTS[0], max_new_tokens=40, ignore_eos=True).text
    stop = text[len(text) // 2:len(text) // 2 + 3]
    want = llm.generate(PROMPTS[0], max_new_tokens=40, stop=[stop], ignore_eos=True)
    engine = Engine(llm)
    handle = engine.add_request(PROMPTS[0], GenerationOptions(max_new_tokens=40, stop=(stop,), ignore_eos=True))
    pieces = list(handle)
    assert "".join(p.text for p in pieces) == want.text and pieces[-1].finish_reason == want.finish_reason == "stop"
    assert handle.result().token_ids == want.token_ids
    assert all(p.finish_reason is None for p in pieces[:-1]) and all(isinstance(p, RequestOutput) for p in pieces)
    # With EOS on, the run ends where generate's does.
    plain = llm.generate(PROMPTS[2], max_new_tokens=60)
    assert engine.add_request(PROMPTS[2], GenerationOptions(max_new_tokens=60)).result().token_ids == plain.token_ids
    engine.shutdown()


def test_logprobs_match_the_model(llm):
    prompt = llm.encode_prompt(PROMPTS[1])
    engine = Engine(llm)
    options = GenerationOptions(max_new_tokens=3, ignore_eos=True, logprobs=True, top_logprobs=3,
                                prompt_logprobs=True)
    outputs = list(engine.add_request(prompt, options))
    tokens = [t for o in outputs for t in o.token_ids]
    ids = torch.tensor([prompt + tokens])
    llm.model.setup_caches(1, 64)
    with torch.inference_mode():
        logprobs = torch.log_softmax(llm.model(ids, torch.arange(ids.shape[1])).float()[0], dim=-1)  # (T, V)
    want = [logprobs[len(prompt) - 1 + i, t].item() for i, t in enumerate(tokens)]
    assert [x for o in outputs for x in o.logprobs] == pytest.approx(want, abs=1e-4)
    tops = [x for o in outputs for x in o.top_logprobs]
    assert all(len(top) == 3 and max(top, key=top.get) == t for top, t in zip(tops, tokens))  # greedy: the best
    first = outputs[0].prompt_logprobs
    assert first[0] is None and len(first) == len(prompt)
    assert first[1:] == pytest.approx([logprobs[i, prompt[i + 1]].item() for i in range(len(prompt) - 1)], abs=1e-4)
    assert all(o.prompt_logprobs is None for o in outputs[1:])
    engine.shutdown()
    chunked = Engine(llm, prefill_chunk=3, page_size=4)  # the prompt scored over several chunks
    again = list(chunked.add_request(prompt, options))
    assert again[0].prompt_logprobs == pytest.approx(first, abs=1e-5)
    chunked.shutdown()
    with pytest.raises(ValueError, match="top_logprobs"):
        GenerationOptions(top_logprobs=21)


def test_add_request_from_eight_threads(llm):
    prompts = token_prompts(llm, 8, 5)
    want = alone(llm, prompts, max_new_tokens=10, ignore_eos=True)
    engine = Engine(llm)
    got: dict[int, list[int]] = {}
    barrier = threading.Barrier(8)

    def client(i: int) -> None:
        barrier.wait()
        handle = engine.add_request(prompts[i], GenerationOptions(max_new_tokens=10, ignore_eos=True))
        got[i] = [t for o in handle for t in o.token_ids]

    threads = [threading.Thread(target=client, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert [got[i] for i in range(8)] == want
    assert engine.stats().requests_finished == 8
    engine.shutdown()


def test_add_request_from_an_asyncio_loop(llm):
    prompts = token_prompts(llm, 4, 9)
    want = alone(llm, prompts, max_new_tokens=10, ignore_eos=True)
    engine = Engine(llm)

    async def one(prompt):
        handle = engine.add_request(prompt, GenerationOptions(max_new_tokens=10, ignore_eos=True))
        return [t async for o in handle for t in o.token_ids]

    async def main():
        ticks = 0

        async def ticker():  # the loop keeps running while requests stream
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0)

        tick = asyncio.ensure_future(ticker())
        results = await asyncio.gather(*(one(p) for p in prompts))
        tick.cancel()
        return results, ticks

    results, ticks = asyncio.run(main())
    assert results == want and ticks > 1
    engine.shutdown()


def test_max_queue_and_shutdown(llm):
    engine = Engine(llm, max_queue=1, max_running=1)
    with engine.paused():  # hold the engine thread off, so both requests are still queued
        first = engine.add_request("A", GenerationOptions(max_new_tokens=2))
        with pytest.raises(EngineFull, match="max_queue"):
            engine.add_request("B", GenerationOptions(max_new_tokens=2))
    engine.shutdown()
    assert first.result(timeout=10).finish_reason in ("length", "eos")
    with pytest.raises(RuntimeError, match="shut down"):
        engine.add_request("C")
    slow = Engine(llm)
    handle = slow.add_request(PROMPTS[3], GenerationOptions(max_new_tokens=200, ignore_eos=True))
    next(iter(handle))
    slow.shutdown(timeout=0)
    assert handle.result().finish_reason == "abort" and slow.pool.num_free == slow.pool.num_pages


def test_a_failed_step_ends_its_requests_with_an_error_and_the_engine_serves_on(llm, monkeypatch):
    engine = Engine(llm)
    calls = {"n": 0}
    real = engine.core._run

    def flaky(chunks):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("device lost\nsecond line")
        return real(chunks)

    monkeypatch.setattr(engine.core, "_run", flaky)
    handle = engine.add_request(PROMPTS[0], GenerationOptions(max_new_tokens=8, ignore_eos=True))
    outputs = list(handle)
    assert outputs[-1].finish_reason == "error" and outputs[-1].error == "RuntimeError: device lost"
    with pytest.raises(RuntimeError, match="device lost"):
        handle.result()
    again = engine.add_request(PROMPTS[0], GenerationOptions(max_new_tokens=8, ignore_eos=True))
    assert again.result(timeout=60).token_ids == llm.generate(PROMPTS[0], max_new_tokens=8,
                                                              ignore_eos=True).token_ids
    assert engine.pool.num_free == engine.pool.num_pages
    engine.shutdown()


def test_compiled_decode_steps_give_the_eager_tokens(compiled_llm, llm):
    engine = Engine(compiled_llm)
    assert engine.graphs is not None and llm.engine.graphs is None
    prompts = token_prompts(llm, 3, 6)
    options = [GenerationOptions(max_new_tokens=6, ignore_eos=True),
               GenerationOptions(max_new_tokens=6, ignore_eos=True, temperature=0.8, seed=3),
               GenerationOptions(max_new_tokens=6, ignore_eos=True)]
    want = [llm.generate(p, o).token_ids for p, o in zip(prompts, options)]
    steps = []
    real = engine.graphs.run
    engine.graphs.run = lambda *args: steps.append(len(args[0])) or real(*args)
    with engine.paused():  # all three arrive before the first step
        handles = [engine.add_request(p, o) for p, o in zip(prompts, options)]
    assert [h.result(timeout=300).token_ids for h in handles] == want
    assert steps and set(steps) == {3}  # three rows padded to the bucket of 4, a scratch page for the fourth
    engine.shutdown()
    assert engine.pool.num_free == engine.pool.num_pages - 1  # the scratch page stays held


def test_decode_steps_launched_ahead_give_each_request_its_tokens_alone(compiled_llm, llm):
    """Each decode step is launched before the step before it is read, whenever the rows go on: rows that end by
    a stop string meanwhile are dropped, new pages are taken ahead, and a pool too small for that preempts."""
    prompts = token_prompts(llm, 4, 9)
    lengths = (25, 9, 31, 17)
    stop = llm.generate(prompts[2], max_new_tokens=31, ignore_eos=True).text[12:16]  # ends it early
    options = [GenerationOptions(max_new_tokens=n, ignore_eos=True, stop=[stop] if i == 2 else [],
                                 temperature=0.7 if i == 1 else 0.0, seed=5) for i, n in enumerate(lengths)]
    want = [llm.generate(p, o) for p, o in zip(prompts, options)]
    assert want[2].finish_reason == "stop" and len(want[2].token_ids) < 31
    for kv_tokens in (2048, 88):  # 88: too few pages for all four to the end
        engine = Engine(compiled_llm, max_kv_tokens=kv_tokens, page_size=4)
        with engine.paused():  # all four arrive before the first step
            handles = [engine.add_request(p, o) for p, o in zip(prompts, options)]
        got = [h.result(timeout=300) for h in handles]
        assert [r.token_ids for r in got] == [r.token_ids for r in want]
        assert [r.text for r in got] == [r.text for r in want]
        assert [r.finish_reason for r in got] == [r.finish_reason for r in want]
        assert engine.steps_followed > 10
        assert (kv_tokens == 88) == (engine.stats().preemptions > 0)
        engine.shutdown()
        assert engine.pool.num_free == engine.pool.num_pages - 1  # the scratch page stays held


def test_an_abort_while_a_step_is_launched_ahead_ends_only_that_request(compiled_llm, llm):
    prompts = token_prompts(llm, 2, 5)
    want = llm.generate(prompts[0], max_new_tokens=40, ignore_eos=True).token_ids
    engine = Engine(compiled_llm, page_size=4)
    with engine.paused():
        keep = engine.add_request(prompts[0], GenerationOptions(max_new_tokens=40, ignore_eos=True))
        drop = engine.add_request(prompts[1], GenerationOptions(max_new_tokens=40, ignore_eos=True))
    for piece in drop:
        if piece.token_ids:
            engine.abort(drop)
            break
    assert keep.result(timeout=300).token_ids == want
    dropped = drop.result(timeout=60)
    assert dropped.finish_reason == "abort" and len(dropped.token_ids) < 40
    engine.shutdown()
    assert engine.pool.num_free == engine.pool.num_pages - 1


@pytest.mark.parametrize("ops", [False, True])
def test_a_fusing_llm_runs_one_row_steps_through_its_fused_decode(tiny_llm_checkpoint, llm, monkeypatch, ops):
    """An LLM that fuses its batch-1 decode hands the engine's compiled one-row steps to a FusedDecode of its model
    around the paged attention (on the CPU its ops run their references), and they give generate's tokens; two rows
    at once take the model's own step. With the pool's attention ops (the GPU's), each layer's one-row attention is
    redline::paged_decode_attention_qkv, inside the compiled step."""
    from redline import kernels
    from redline.runner.paged import registered_paged_ops
    from redline.kernels import attention as kernel_attention
    from redline.kernels import fused_decode

    fusing = LLM.load(tiny_llm_checkpoint[0], device="cpu", compile=True, kernels=False)  # no CPU kernels under them
    kernels.use_kernels(fusing.model)
    monkeypatch.setattr(fusing.runner, "fuse", True)  # kernels and fuse need a GPU; their CPU paths are references
    traced = []
    original = fused_decode.fused_block
    monkeypatch.setattr(fused_decode, "fused_block", lambda *a: traced.append(1) or original(*a))
    prompts = token_prompts(llm, 2, 6)
    want = alone(llm, prompts, max_new_tokens=6, ignore_eos=True)
    splits = []
    split = kernel_attention.split_rotated_qkv  # the paged decode's own rope, where the op does not take over
    monkeypatch.setattr(kernel_attention, "split_rotated_qkv", lambda *a: splits.append(1) or split(*a))
    engine = Engine(fusing, page_size=4)
    assert isinstance(engine.graphs.step_model, kernels.FusedDecode)
    if ops:
        engine.paged.kv.ops = registered_paged_ops()
    first = engine.add_request(prompts[0], GenerationOptions(max_new_tokens=6, ignore_eos=True))
    assert first.result(timeout=600).token_ids == want[0]
    assert traced  # the one-row step was traced through the fused blocks
    assert bool(splits) != ops  # with the ops, redline::paged_decode_attention_qkv ropes and writes the pages
    with engine.paused():
        handles = [engine.add_request(p, GenerationOptions(max_new_tokens=6, ignore_eos=True)) for p in prompts]
    assert [h.result(timeout=600).token_ids for h in handles] == want
    engine.shutdown()


def test_capture_graphs_is_a_no_op_without_graphs(llm):
    engine = Engine(llm, page_size=8)
    assert engine.capture_graphs() == 0  # an eager LLM has no decode graphs
    engine.add_request(PROMPTS[0], GenerationOptions(max_new_tokens=2)).result(timeout=60)
    assert engine.capture_graphs() == 0
    engine.shutdown()


def test_warm_up_leaves_the_engine_as_new(llm):
    prompts = token_prompts(llm, 3, 30)
    want = alone(llm, prompts, max_new_tokens=8, ignore_eos=True)
    engine = Engine(llm, page_size=8, prefill_chunk=64)
    steps = []
    engine.core.step_listener = lambda chunks, seconds: steps.append([c.length for c in chunks])
    engine.warm_up()
    # An eager CPU engine compiles nothing: a short request alone and two together, not a full chunk.
    assert sum(map(sum, steps)) < 64 and any(len(s) > 1 for s in steps)
    stats = engine.stats()
    assert (stats.requests_finished, stats.prompt_tokens_total, stats.generation_tokens_total) == (0, 0, 0)
    assert (stats.prefix_cache_queries, stats.running, stats.kv_pages_used) == (0, 0, 0)
    handles = [engine.add_request(p, GenerationOptions(max_new_tokens=8, ignore_eos=True)) for p in prompts]
    assert [h.result(timeout=120).token_ids for h in handles] == want
    assert engine.stats().requests_finished == 3
    engine.shutdown()


def test_a_compiled_cpu_engines_short_warm_up_compiles_what_serving_needs(compiled_llm, llm):
    """A compiled CPU engine warms up on short requests too, and they compile every decode step it will run: steps
    of other batch sizes and longer contexts afterwards compile nothing new."""
    from torch._dynamo.utils import counters

    prompts = token_prompts(llm, 5, 40)  # 40..44 tokens, longer than the warm-up's
    want = alone(llm, prompts, max_new_tokens=6, ignore_eos=True)
    engine = Engine(compiled_llm, page_size=4)
    steps = []
    engine.core.step_listener = lambda chunks, seconds: steps.append([c.length for c in chunks])
    engine.warm_up()
    assert sum(map(sum, steps)) < 64
    compiled = counters["stats"]["unique_graphs"]
    with engine.paused():  # five rows decode together, in a bucket the warm-up never ran
        handles = [engine.add_request(p, GenerationOptions(max_new_tokens=6, ignore_eos=True)) for p in prompts]
    assert [h.result(timeout=300).token_ids for h in handles] == want
    assert counters["stats"]["unique_graphs"] == compiled
    engine.shutdown()


def test_compiled_prefill_steps_give_the_same_tokens(llm):
    from torch._dynamo.utils import counters

    prompts = token_prompts(llm, 5, 23)  # 23..51 tokens: chunks of every size, some that sample nothing
    options = [GenerationOptions(max_new_tokens=10, ignore_eos=True),
               GenerationOptions(max_new_tokens=10, ignore_eos=True, temperature=0.9, seed=3)] * 2 + \
        [GenerationOptions(max_new_tokens=10, ignore_eos=True)]
    want = [llm.generate(p, o).token_ids for p, o in zip(prompts, options)]
    engine = Engine(llm, page_size=8, prefill_chunk=40, compile_prefill=True)
    assert engine.paged.kv.ops is not None  # the attention ops (their CPU path is the references)
    sizes = []
    real = engine.paged.prefill_step
    engine.paged.prefill_step = lambda model, kv, bias, ids, *rest: sizes.append(
        (ids.shape[1], rest[2].shape[0], rest[-1].shape[0])) or real(model, kv, bias, ids, *rest)
    torch._dynamo.reset()  # no graph of prefill_logits from an earlier test
    graphs = counters["stats"]["unique_graphs"]
    alone = engine.add_request(prompts[0], options[0])  # a step of one sequence, one logit row
    assert alone.result(timeout=600).token_ids == want[0]
    handles = [engine.add_request(p, o) for p, o in zip(prompts, options)]
    assert [h.result(timeout=600).token_ids for h in handles] == want
    engine.shutdown()
    assert len({n for n, _, _ in sizes}) >= 4  # steps of several token counts, of one and of several sequences...
    assert min(min(size) for size in sizes) >= 2  # (padded: no size of 0 or 1, which would specialize)
    assert counters["stats"]["unique_graphs"] - graphs == 1  # ...all served by one graph


def test_prefill_graph_steps_give_the_same_tokens(llm):
    """One-chunk steps (a request alone, a second turn served mostly from the prefix cache) run padded to a token
    bucket with a padding sequence in the scratch page; every request gets the tokens generate gives it alone. The
    padded steps and the steps of several chunks share one compiled graph (the staging buffers pass its guards)."""
    from torch._dynamo.utils import counters

    prompts = token_prompts(llm, 4, 9) + [list(range(3, 70))]  # 9..30 tokens, and 67 (chunks of 40 and 27)
    options = [GenerationOptions(max_new_tokens=8, ignore_eos=True),
               GenerationOptions(max_new_tokens=8, ignore_eos=True, temperature=0.9, seed=3)] * 2 + \
        [GenerationOptions(max_new_tokens=8, ignore_eos=True)]
    turn = prompts[0] + llm.generate(prompts[0], options[0]).token_ids + [5, 6, 7]  # shares its first pages
    want = [llm.generate(p, o).token_ids for p, o in zip(prompts + [turn], options + [options[0]])]
    engine = Engine(llm, page_size=8, prefill_chunk=40, compile_prefill=True, prefill_graphs=True)
    buckets = []
    real = engine.paged.prefill_graphs.logits
    engine.paged.prefill_graphs.logits = lambda chunk, bucket: buckets.append((chunk.length, bucket)) or real(chunk, bucket)
    torch._dynamo.reset()  # no graph of prefill_logits from an earlier test
    graphs = counters["stats"]["unique_graphs"]
    got = [engine.add_request(p, o).result(timeout=600).token_ids for p, o in zip(prompts, options)]
    hits = engine.stats().prefix_cache_hits
    second = engine.add_request(turn, options[0]).result(timeout=600)
    assert got + [second.token_ids] == want and engine.stats().prefix_cache_hits > hits
    with engine.paused():  # all at once: steps of several chunks take the compiled step itself
        handles = [engine.add_request(p, o) for p, o in zip(prompts, options)]
    assert [h.result(timeout=600).token_ids for h in handles] == want[:5]
    engine.shutdown()
    assert {b for _, b in buckets} >= {16, 32, 64} and all(n < b for n, b in buckets)
    assert counters["stats"]["unique_graphs"] - graphs == 1
    assert engine.pool.num_free == engine.pool.num_pages - 1  # the scratch page stays held
    with pytest.raises(ValueError, match="replays the compiled prefill step; add compile_prefill=True") as info:
        Engine(llm, compile_prefill=False, prefill_graphs=True)
    assert "\n" not in str(info.value)


def test_compiled_prefill_refuses_soft_caps_in_one_line(llm):
    import dataclasses

    capped = LLM(Transformer(dataclasses.replace(llm.model.args, attn_softcap=30.0)), None, "cpu", False)
    with pytest.raises(ValueError, match="no soft-capping yet") as info:
        Engine(capped, max_kv_tokens=256, compile_prefill=True)
    assert "\n" not in str(info.value)


def test_windowed_steps_through_the_attention_ops_give_generate_tokens():
    """The pool's prefill and decode ops take a layer's sliding window: with the ops on the CPU (their references),
    a windowed model's engine gives generate's tokens, prompts longer than the window and chunked included."""
    import dataclasses

    from redline.runner.paged import registered_paged_ops
    from redline.model import ModelArgs

    torch.manual_seed(0)
    args = dataclasses.replace(ModelArgs.from_name("debug-tiny-llama3"), layer_windows=(6, 0))
    model = Transformer(args).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    llm = LLM(model, None, "cpu", False)
    prompts = [torch.randint(0, 512, (n,)).tolist() for n in (3, 11, 20)]
    options = GenerationOptions(max_new_tokens=12, ignore_eos=True)
    want = [llm.generate(p, options).token_ids for p in prompts]
    engine = Engine(llm, max_kv_tokens=512, page_size=4, prefill_chunk=8)
    prefill, decode = registered_paged_ops()
    calls = []
    engine.paged.kv.ops = (lambda *a: calls.append(("prefill", a[-1])) or prefill(*a),
                     lambda *a: calls.append(("decode", a[-1])) or decode(*a))
    with engine.paused():
        handles = [engine.add_request(p, options) for p in prompts]
    assert [h.result(timeout=120).token_ids for h in handles] == want
    assert {("prefill", 6), ("decode", 6), ("prefill", 0), ("decode", 0)} <= set(calls)  # each layer its own
    engine.shutdown()


def greedy_and_sampled(llm: LLM, lengths: tuple[int, ...], new_tokens: int) -> tuple[list, list, list]:
    """Prompts of these lengths, alternately greedy and seeded-sampled (the last greedy), and the tokens
    llm.generate gives each alone."""
    prompts = [list(range(3, 3 + n)) for n in lengths]
    greedy = GenerationOptions(max_new_tokens=new_tokens, ignore_eos=True)
    sampled = GenerationOptions(max_new_tokens=new_tokens, ignore_eos=True, temperature=0.9, seed=7)
    options = [sampled if i % 2 and i < len(lengths) - 1 else greedy for i in range(len(lengths))]
    return prompts, options, [llm.generate(p, o).token_ids for p, o in zip(prompts, options)]


@pytest.mark.gpu
@pytest.mark.parametrize("kernels", [False, True])
def test_gpu_decode_graphs_give_the_static_path_tokens(kernels):
    eager, graphed = random_gpu_llm(False, kernels), random_gpu_llm(True, kernels)
    prompts, options, want = greedy_and_sampled(eager, (5, 40, 17, 2, 90), 30)
    assert [r.token_ids for r in eager.generate_batch(prompts, options)] == want
    engine = Engine(graphed, max_kv_tokens=graphed.max_kv_tokens)
    steps = []
    real = engine.graphs.run
    engine.graphs.run = lambda *args: steps.append(len(args[0])) or real(*args)
    assert [engine.add_request(p, o).result(timeout=120).token_ids for p, o in zip(prompts, options)] == want
    with engine.paused():  # all five arrive before the first step
        handles = [engine.add_request(p, o) for p, o in zip(prompts, options)]
    assert [h.result(timeout=120).token_ids for h in handles] == want
    assert 1 in steps and 5 in steps and len(engine.graphs.graphs) >= 2  # buckets 1 and 8 were captured
    engine.shutdown()
    ready = Engine(graphed, max_kv_tokens=graphed.max_kv_tokens)
    made = ready.capture_graphs(120)  # 120 tokens: 8 pages of 16, widths 2, 4 and 8, buckets up to --max-running
    buckets = [b for b in BATCH_BUCKETS if b <= ready.core.settings.max_running]
    assert made == 3 * len(buckets) and len(ready.graphs.graphs) == made
    with ready.paused():  # all five arrive before the first step
        handles = [ready.add_request(p, o) for p, o in zip(prompts, options)]
    assert [h.result(timeout=120).token_ids for h in handles] == want
    with pytest.raises(RuntimeError, match="before the first request"):
        ready.capture_graphs()
    ready.shutdown()


def test_paged_attention_ops_swap_in_and_give_the_same_tokens(llm):
    from redline.model import paged_decode_attention, paged_prefill_attention

    calls = {"prefill": 0, "decode": 0}

    def prefill(*args):  # ... scale, window (0: this model has none)
        assert len(args) == 8 and args[3].dtype == torch.int32 and args[4].dtype == torch.int32 and args[7] == 0
        calls["prefill"] += 1
        return paged_prefill_attention(*args[:7], window=args[7])

    def decode(*args):  # ... scale, window (0: this model has none)
        assert len(args) == 7 and args[0].dim() == 3 and args[4].dtype == torch.int32 and args[6] == 0
        calls["decode"] += 1
        return paged_decode_attention(*args)

    prompts = token_prompts(llm, 3, 9)
    want = alone(llm, prompts, max_new_tokens=8, ignore_eos=True)
    engine = Engine(llm, prefill_chunk=8)
    engine.paged.kv.ops = (prefill, decode)  # what the GPU's kernels take over, with the same contract
    handles = [engine.add_request(p, GenerationOptions(max_new_tokens=8, ignore_eos=True)) for p in prompts]
    assert [h.result(timeout=60).token_ids for h in handles] == want
    assert calls["prefill"] > 0 and calls["decode"] > 0
    engine.shutdown()


@pytest.mark.gpu
@pytest.mark.parametrize("prefill_graphs", [False, True])
def test_gpu_compiled_prefill_steps_give_the_static_path_tokens(prefill_graphs):
    eager, graphed = random_gpu_llm(False, True), random_gpu_llm(True, True)
    prompts, options, want = greedy_and_sampled(eager, (5, 40, 17, 90, 130), 20)
    engine = Engine(graphed, max_kv_tokens=graphed.max_kv_tokens, prefill_chunk=64, compile_prefill=True,
                    prefill_graphs=prefill_graphs)
    engine.capture_graphs(256)
    engine.warm_up()
    with engine.paused():  # all five arrive before the first step: chunks of 64 tokens, some that sample nothing
        handles = [engine.add_request(p, o) for p, o in zip(prompts, options)]
    assert [h.result(timeout=300).token_ids for h in handles] == want
    # one at a time: each prompt a step of one chunk (a replayed graph with prefill_graphs), then its last chunk
    assert [engine.add_request(p, o).result(timeout=300).token_ids for p, o in zip(prompts, options)] == want
    assert bool(engine.paged.prefill_graphs and engine.paged.prefill_graphs.graphs) == prefill_graphs
    engine.shutdown()



def test_a_bad_item_in_a_batch_is_named_by_its_index(llm):
    with pytest.raises(ValueError, match=r"^prompt 1: .*context") as info:
        llm.generate_batch([PROMPTS[0], list(range(3, 300)), PROMPTS[1]])
    assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match=r"^prompt 2: .*empty"):
        llm.generate_batch(["a", "b", ""])
    with pytest.raises(ValueError, match=r"^prompt 1: .*speculat"):
        llm.generate_batch(["a", "b"], [GenerationOptions(), GenerationOptions(draft="prompt_lookup")])


def test_generate_batch_after_shutdown_gets_a_new_engine(llm):
    want = llm.generate_batch(PROMPTS[:2], max_new_tokens=6, ignore_eos=True)
    old = llm.engine
    old.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        old.add_request("C")
    got = llm.generate_batch(PROMPTS[:2], max_new_tokens=6, ignore_eos=True)
    assert llm.engine is not old and [r.token_ids for r in got] == [r.token_ids for r in want]


EXIT_SCRIPT = """
import os, signal, sys, time
from redline.generate import LLM, GenerationOptions
llm = LLM.load(sys.argv[1], device="cpu", max_kv_tokens=4096)
handles = [llm.engine.add_request("hello there " * 20, GenerationOptions(max_new_tokens=250, ignore_eos=True))
           for _ in range(4)]
next(iter(handles[0]))  # the engine's thread is stepping
if sys.argv[2] == "interrupt":
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(30)
sys.exit(0)
"""


# An uncaught Ctrl-C: Python's own status for it is death by SIGINT (-2); with the engine core stepping at exit it
# is 1 (the traceback printed, the process ended in order); never SIGABRT (-6) from torch torn down under a thread.
@pytest.mark.parametrize("how, statuses", [("exit", (0,)), ("interrupt", (130, -2, 1))])
def test_exit_while_the_engine_runs_is_clean(tiny_llm_checkpoint, how, statuses):
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", EXIT_SCRIPT, str(tiny_llm_checkpoint[0]), how], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode in statuses, (proc.returncode, proc.stderr[-2000:])
    assert "terminate called" not in proc.stderr
    if how == "interrupt":
        assert proc.stderr.rstrip().endswith("KeyboardInterrupt"), proc.stderr[-2000:]
