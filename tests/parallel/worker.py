"""Runs one sharding scenario in a fresh process and prints its result as JSON.

JAX fixes its device count when it first touches a device, and the rest of the suite runs
with one CPU device; so every multi-device check runs here, in a subprocess started by
``tests/parallel/helpers.py`` with ``--xla_force_host_platform_device_count`` set.

    python -m tests.parallel.worker SCENARIO JSON_ARGS
"""

from __future__ import annotations

import json
import os
import sys
import time


def _setup(num_devices: int) -> None:
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_force_host_platform_device_count={num_devices}")
    import jax

    cache = os.environ.get("JAXPAGE_TEST_XLA_CACHE",
                           os.path.join(os.path.expanduser("~"), ".cache", "jaxpage", "xla-tests"))
    jax.config.update("jax_compilation_cache_dir", cache)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


def _generate(llm, prompts, params_list):
    prompts = [p if isinstance(p, dict) else {"prompt_token_ids": p} for p in prompts]
    outs = llm.generate(prompts, params_list, use_tqdm=False)
    stats = llm.get_stats()
    assert stats["num_free_blocks"] == stats["num_kv_blocks"], stats
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0, stats
    return [[c.token_ids for c in o.outputs] for o in outs]


def _shard_report(llm) -> dict:
    """Per parameter: global shape, and the shapes of the shards each device holds."""
    from flax import nnx

    engine = getattr(llm.llm_engine, "engines", [llm.llm_engine])[0]
    runner = engine.runner
    report = {}
    flat = nnx.to_pure_dict(runner.state)

    def walk(prefix, node):
        if isinstance(node, dict):
            for key, value in node.items():
                walk(prefix + (str(key),), value)
            return
        report["/".join(prefix)] = {
            "shape": list(node.shape),
            "spec": [None if s is None else str(s) for s in node.sharding.spec],
            "shards": sorted([[d.id, list(s.data.shape)] for s in node.addressable_shards
                              for d in [s.device]]),
            "bytes_per_device": [s.data.nbytes for s in node.addressable_shards]}
    walk((), flat)
    k = runner.kv_cache[0]
    report["kv_cache"] = {"shape": list(k.shape),
                          "shards": sorted([[s.device.id, list(s.data.shape)]
                                            for s in k.addressable_shards])}
    return report


def tensor_parallel(args: dict) -> dict:
    _setup(8)
    from jaxpage import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=args["max_tokens"])
    result = {}
    for tp in args["tp_sizes"]:
        llm = LLM(args["model"], tensor_parallel_size=tp, **args["engine"])
        tokens = _generate(llm, args["prompts"], [params] * len(args["prompts"]))
        result[str(tp)] = {"tokens": tokens, "shards": _shard_report(llm) if tp > 1 else None,
                           "num_kv_blocks": llm.get_stats()["num_kv_blocks"],
                           "num_kv_heads": llm.llm_engine.arch.num_kv_heads}
    return result


def lora_tensor_parallel(args: dict) -> dict:
    """Greedy tokens of prompts each with its own adapter (or none), per TP size."""
    _setup(8)
    from jaxpage import LLM, LoRARequest, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=args["max_tokens"])
    loras = [None if path is None else LoRARequest(f"a{i}", i + 1, path)
             for i, path in enumerate(args["adapters"])]
    prompts = [{"prompt_token_ids": p} for p in args["prompts"]]
    result = {}
    for tp in args["tp_sizes"]:
        llm = LLM(args["model"], tensor_parallel_size=tp, enable_lora=True,
                  max_loras=len(loras), max_lora_rank=8, **args["engine"])
        outs = llm.generate(prompts, params, lora_request=loras, use_tqdm=False)
        result[str(tp)] = [o.outputs[0].token_ids for o in outs]
    return result


def disaggregated_tp(args: dict) -> dict:
    """Prefill and decode engines of one process under tensor parallelism: outputs of a
    request prefilled by one and decoded by the other, beside a colocated engine's."""
    _setup(8)
    from jaxpage import LLM, SamplingParams
    from jaxpage.runtime.kv_transfer import TransferTicket

    tp, engine = args["tp"], args["engine"]
    prompts = [{"prompt_token_ids": p} for p in args["prompts"]]
    params = [SamplingParams(max_tokens=12, temperature=0.0) if i % 2 == 0 else
              SamplingParams(max_tokens=12, temperature=1.0, seed=i, top_p=0.9)
              for i in range(len(prompts))]
    colocated = _generate(LLM(args["model"], tensor_parallel_size=tp, **engine), prompts,
                          params)
    prefill = LLM(args["model"], tensor_parallel_size=tp, kv_role="prefill", **engine)
    decode = LLM(args["model"], tensor_parallel_size=tp, kv_role="decode", swap_space=0.01,
                 **engine)
    pe, de = prefill.llm_engine, decode.llm_engine
    tickets = []
    for i, (prompt, sp) in enumerate(zip(prompts, params)):
        first = SamplingParams(max_tokens=1, temperature=sp.temperature, seed=sp.seed,
                               top_p=sp.top_p)
        pe.add_validated_request(pe.make_request(f"p{i}", prompt, first,
                                                 kv_transfer={"do_remote_decode": True}))
    done = {}
    while pe.has_unfinished_requests():
        done.update((o.request_id, o) for o in pe.step() if o.finished)
    tickets = [done[f"p{i}"].kv_transfer_params for i in range(len(prompts))]
    shards = {TransferTicket.from_dict(t).kv_shards for t in tickets}
    for i, (ticket, sp) in enumerate(zip(tickets, params)):
        pages = de.pull_kv(TransferTicket.from_dict(ticket))
        de.add_prefilled(de.make_request(f"d{i}", None, sp, kv_transfer=ticket), pages, ticket)
    done = {}
    while de.has_unfinished_requests():
        done.update((o.request_id, o) for o in de.step() if o.finished)
    got = [[done[f"d{i}"].outputs[0].token_ids] for i in range(len(prompts))]
    free = [(s["num_free_blocks"], s["num_kv_blocks"]) for s in
            (prefill.get_stats(), decode.get_stats())]
    refused = None
    other = LLM(args["model"], kv_role="decode", swap_space=0.01, **engine)  # one device
    try:
        other.llm_engine.make_request("x", None, params[0], kv_transfer=tickets[0])
    except ValueError as error:
        refused = str(error)
    return {"colocated": colocated, "disaggregated": got, "kv_shards": sorted(shards),
            "free": free, "refused": refused}


def data_parallel(args: dict) -> dict:
    _setup(8)
    from jaxpage import LLM, SamplingParams

    prompts = args["prompts"]
    params = [SamplingParams(temperature=0, max_tokens=8 + i % 5) if i % 3 else
              SamplingParams(temperature=1.0, top_p=0.9, seed=i, n=2, max_tokens=6)
              for i in range(len(prompts))]
    single = LLM(args["model"], **args["engine"])
    expected = _generate(single, prompts, params)
    llm = LLM(args["model"], tensor_parallel_size=4, data_parallel_size=2, **args["engine"])
    got = _generate(llm, prompts, params)
    routed = llm.get_stats()["num_routed"]
    # prefix-aware routing: prompts sharing a long prefix follow the first one's replica
    engine = llm.llm_engine
    shared = args["shared_prefix"]
    owners = []
    heads = [shared + [100 + i] for i in range(3)] + [args["other_prompt"]]
    for ids in heads:  # three sharing a prefix, then an unrelated one
        request_id = engine.add_request(None, {"prompt_token_ids": ids},
                                        SamplingParams(max_tokens=1))
        owners.append(engine._owner[request_id])
    while engine.has_unfinished_requests():
        engine.step()
    stats = engine.get_stats()
    assert stats["num_free_blocks"] == stats["num_kv_blocks"], stats
    devices = [[d.id for d in e.runner.placement.mesh.devices.flat] for e in engine.engines]
    return {"expected": expected, "got": got, "routed": routed, "prefix_owners": owners,
            "devices": devices}


def multi_process(args: dict) -> dict:
    _setup(args["local_devices"])
    from jaxpage import LLM, SamplingParams

    distributed = {}
    if args.get("num_processes", 1) > 1:
        distributed = dict(coordinator_address=args["coordinator_address"],
                           num_processes=args["num_processes"], process_id=args["process_id"])
    llm = LLM(args["model"], tensor_parallel_size=args["tp"], **distributed, **args["engine"])
    import jax  # after LLM(): jax.distributed is up by then

    params = SamplingParams(temperature=0, max_tokens=args["max_tokens"])
    tokens = _generate(llm, args["prompts"], [params] * len(args["prompts"]))
    # n=2 seeded sampling: copy-on-write block copies run on every process too
    forked = _generate(llm, args["prompts"][:2],
                       [SamplingParams(temperature=1.0, seed=5, n=2, max_tokens=6)] * 2)
    return {"tokens": tokens, "forked": forked, "process_count": jax.process_count(),
            "device_count": jax.device_count()}


def checkpoint(args: dict) -> dict:
    _setup(8)
    from jaxpage import LLM, SamplingParams
    from jaxpage.models.loader import load_model
    from jaxpage.parallel.placement import replica_meshes

    tp = args["tp"]
    params = SamplingParams(temperature=0, max_tokens=args["max_tokens"])
    llm = LLM(args["model"], tensor_parallel_size=tp, **args["engine"])
    expected = _generate(llm, args["prompts"], [params] * len(args["prompts"]))
    path = llm.save_sharded_checkpoint(args["path"])
    mesh = replica_meshes(tp, 1)[0]

    def timed(source, **kw):
        best = float("inf")
        for _ in range(args.get("repeats", 2)):
            start = time.perf_counter()
            loaded = load_model(source, mesh=mesh, **kw)
            import jax
            jax.block_until_ready(jax.tree.leaves(__import__("flax").nnx.state(loaded.model)))
            best = min(best, time.perf_counter() - start)
            del loaded
        return best

    load_s = timed(args["model"])
    restore_s = timed(path)
    restored = {}
    for restore_tp in args["restore_tp"]:
        again = LLM(path, tensor_parallel_size=restore_tp, **args["engine"])
        restored[str(restore_tp)] = _generate(again, args["prompts"],
                                              [params] * len(args["prompts"]))
    return {"expected": expected, "restored": restored, "load_s": load_s,
            "restore_s": restore_s, "files": sorted(os.listdir(path))}


SCENARIOS = {"tensor_parallel": tensor_parallel, "lora_tensor_parallel": lora_tensor_parallel,
             "disaggregated_tp": disaggregated_tp,
             "data_parallel": data_parallel,
             "multi_process": multi_process, "checkpoint": checkpoint}

if __name__ == "__main__":
    name, raw = sys.argv[1], sys.argv[2]
    result = SCENARIOS[name](json.loads(raw))
    print("RESULT " + json.dumps(result), flush=True)
