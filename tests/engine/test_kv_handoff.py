"""Disaggregated prefill and decode between two engines of one process: a prefill engine
(``kv_role="prefill"``) runs prompts and offers their pages on its transfer server, a
decode engine (``kv_role="decode"``) pulls them and decodes. Outputs equal one colocated
engine's, greedy and seeded; blocks are all free on both sides afterwards."""

from __future__ import annotations

import pytest

from jaxpage import LLM, SamplingParams
from jaxpage.runtime.kv_transfer import TransferTicket
from tests.engine.prompts import BASE
from tests.options import TINY


@pytest.fixture(scope="module")
def engines(tiny_checkpoints):
    path = tiny_checkpoints["llama"]
    return (LLM(path, **TINY), LLM(path, kv_role="prefill", **TINY),
            LLM(path, kv_role="decode", swap_space=0.01, **TINY))


def _run(engine, request_ids):
    done = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                done[output.request_id] = output
    return [done[rid] for rid in request_ids]


def _disaggregated(prefill, decode, prompts, params_list):
    pe, de = prefill.llm_engine, decode.llm_engine
    ids = []
    for i, (prompt, params) in enumerate(zip(prompts, params_list)):
        first = SamplingParams(**{**_fields(params), "max_tokens": 1})
        request = pe.make_request(f"p{i}", prompt, first, kv_transfer={"do_remote_decode": True})
        pe.add_validated_request(request)
        ids.append(f"p{i}")
    tickets = [o.kv_transfer_params for o in _run(pe, ids)]
    out_ids = []
    for i, (ticket, params) in enumerate(zip(tickets, params_list)):
        pages = de.pull_kv(TransferTicket.from_dict(ticket))
        request = de.make_request(f"d{i}", None, params, kv_transfer=ticket)
        de.add_prefilled(request, pages, ticket)
        out_ids.append(f"d{i}")
    return _run(de, out_ids)


def _fields(params: SamplingParams) -> dict:
    return {name: getattr(params, name) for name in (
        "temperature", "top_p", "top_k", "seed", "max_tokens", "ignore_eos", "stop")}


def test_greedy_and_seeded_outputs_equal_colocated(engines):
    colocated, prefill, decode = engines
    prompts = BASE[:8]
    params = [SamplingParams(max_tokens=20, temperature=0.0) if i % 2 == 0 else
              SamplingParams(max_tokens=20, temperature=1.0, seed=i, top_p=0.9)
              for i in range(len(prompts))]
    want = colocated.generate(prompts, params, use_tqdm=False)
    keys = ("kv_pulls", "kv_pulled_blocks", "kv_pulled_bytes")
    before = [decode.get_stats()[key] for key in keys]
    offered = prefill.get_stats()["kv_tickets_offered"]
    got = _disaggregated(prefill, decode, prompts, params)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    # One pull per request, bringing its prompt blocks as one K and one V array (the
    # block count padded to a power of two); the counters of the other role are absent.
    engine = decode.llm_engine
    blocks = [engine.kv_cache_manager.num_blocks_for(len(o.prompt_token_ids)) for o in got]
    padded = [1 << (n - 1).bit_length() for n in blocks]
    stats = decode.get_stats()
    assert [stats[key] - b for key, b in zip(keys, before)] == [
        len(prompts), sum(blocks), sum(padded) * engine.kv_bytes_per_block]
    assert prefill.get_stats()["kv_tickets_offered"] - offered == len(prompts)
    assert "kv_tickets_offered" not in stats and "kv_pulls" not in prefill.get_stats()
    assert "kv_pulls" not in colocated.get_stats()
    assert [o.outputs[0].text for o in got] == [o.outputs[0].text for o in want]
    for llm in (prefill, decode):
        stats = llm.get_stats()
        assert stats["num_free_blocks"] == stats["num_kv_blocks"]
    assert decode.llm_engine.kv_cache_manager.host_pool.num_free_blocks == \
        decode.llm_engine.kv_cache_manager.host_pool.num_blocks


def test_tickets_are_checked(engines):
    colocated, prefill, decode = engines
    params = SamplingParams(max_tokens=4)
    with pytest.raises(ValueError, match="kv_role='prefill'"):
        colocated.llm_engine.make_request("x", "hi", params, kv_transfer={"do_remote_decode": True})
    with pytest.raises(ValueError, match="kv_role='decode'"):
        prefill.llm_engine.make_request("x", "hi", params, kv_transfer={"address": "a"})
    with pytest.raises(ValueError, match="not a KV transfer ticket"):
        decode.llm_engine.make_request("x", "hi", params, kv_transfer={"address": "a"})
    with pytest.raises(ValueError, match="swap_space"):
        LLM(colocated.llm_engine.config.model.model, kv_role="decode", swap_space=0, **TINY)


def test_tickets_nobody_pulls_are_released(engines):
    """Offered pages stay on the prefill instance's transfer server until pulled; a ticket
    settled as never pulled, or one left unsettled past its age, is released (pulled by
    the instance itself), and its pages are then gone for any late puller."""
    _, prefill, decode = engines
    pe, de = prefill.llm_engine, decode.llm_engine
    for uuid in list(pe.kv_transfer._offered):  # earlier tests' tickets: all pulled
        pe.settle_kv(uuid, pulled=True)
    for i in range(3):
        pe.add_validated_request(pe.make_request(
            f"r{i}", BASE[i], SamplingParams(max_tokens=1), kv_transfer={"do_remote_decode": True}))
    done = {}
    while pe.has_unfinished_requests():
        done.update((o.request_id, o) for o in pe.step() if o.finished)
    tickets = [TransferTicket.from_dict(done[f"r{i}"].kv_transfer_params) for i in range(3)]
    transfer = pe.kv_transfer
    released_before = transfer.num_released
    assert pe.get_stats()["kv_tickets_pending"] == 3

    de.pull_kv(tickets[1])                       # pulled, then settled as pulled
    assert pe.settle_kv(tickets[1].uuid, pulled=True)
    assert pe.settle_kv(tickets[0].uuid, pulled=False)   # the decode instance refused it
    assert not pe.settle_kv(tickets[0].uuid, pulled=False)  # settled once only
    assert transfer.num_released == released_before + 1
    assert transfer.expire(0.0) == 1             # the third was never settled
    stats = pe.get_stats()
    assert (stats["kv_tickets_pending"], stats["kv_tickets_released"]) == (0, released_before + 2)
    assert transfer.wait_for_releases(30.0) == 0  # the release pulls ran (asynchronous)
    with pytest.raises(TimeoutError):            # released pages are gone
        de.kv_transfer.pull(tickets[0], 1.0)
    with pytest.raises(ValueError, match="kv_role='prefill'"):
        de.settle_kv(tickets[2].uuid, pulled=False)


def test_a_decode_instance_shares_a_prefix_it_already_holds(engines):
    """Two requests whose prompts share three full blocks, handed over one after the
    other: the second's swap-in takes those blocks from the decode engine's prefix cache
    (the first left them there) instead of installing the pulled copies; its tokens still
    equal a colocated engine's, and every block is free afterwards."""
    colocated, prefill, decode = engines
    block = decode.llm_engine.kv_cache_manager.block_size
    shared = [7 + (5 * i) % 200 for i in range(3 * block)]
    prompts = [{"prompt_token_ids": shared + [11, 12, 13]},
               {"prompt_token_ids": shared + [21, 22, 23, 24, 25]}]
    params = [SamplingParams(max_tokens=12, temperature=0.0),
              SamplingParams(max_tokens=12, temperature=1.0, seed=3)]
    want = colocated.generate(prompts, params, use_tqdm=False)
    kv = decode.llm_engine.kv_cache_manager
    got, shared_blocks = [], []
    for i in range(2):
        before = kv.num_swap_in_shared_blocks
        got += _disaggregated(prefill, decode, prompts[i:i + 1], params[i:i + 1])
        shared_blocks.append(kv.num_swap_in_shared_blocks - before)
    assert shared_blocks == [0, 3]
    assert decode.get_stats()["num_swap_in_shared_blocks"] == kv.num_swap_in_shared_blocks
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    stats = decode.get_stats()
    assert stats["num_free_blocks"] == stats["num_kv_blocks"]
    assert kv.host_pool.num_free_blocks == kv.host_pool.num_blocks


def test_int8_pages_travel_with_their_scale_codes(tiny_checkpoints):
    """An int8 cache is four arrays (K, V and their per-token scale codes,
    ``kv_token_scale``): all four are pulled, and decoding equals a colocated int8 engine."""
    path, kw = tiny_checkpoints["llama"], dict(TINY, kv_cache_dtype="int8")
    colocated = LLM(path, **kw)
    prefill = LLM(path, kv_role="prefill", **kw)
    decode = LLM(path, kv_role="decode", swap_space=0.01, **kw)
    assert len(decode.llm_engine.runner.kv_cache) == 4
    prompts, params = BASE[:3], [SamplingParams(max_tokens=12, temperature=0.0)] * 3
    want = colocated.generate(prompts, params, use_tqdm=False)
    got = _disaggregated(prefill, decode, prompts, params)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    engine = decode.llm_engine
    blocks = [engine.kv_cache_manager.num_blocks_for(len(o.prompt_token_ids)) for o in got]
    padded = sum(1 << (n - 1).bit_length() for n in blocks)
    assert decode.get_stats()["kv_pulled_bytes"] == padded * engine.kv_bytes_per_block
    # the ticket names its byte format: refused before anything is pulled (a fused fp8
    # and a fused int8 cache are both one uint8 array, and e4m3 and e5m2 pages look alike)
    with pytest.raises(ValueError, match="holds fp8_e4m3 pages, this decode instance's int8"):
        fp8 = LLM(path, kv_role="prefill", **dict(kw, kv_cache_dtype="fp8"))
        _disaggregated(fp8, decode, prompts[:1], params[:1])
