"""The two steps that run the target with SGLang 0.5.17 in-process (`sglang.Engine`, SGLang's public
offline API, as a user serving the drafter would; no HTTP server): generating the training responses,
and serving the held-out prompts with and without a drafter.

Serving runs without CUDA graphs, the target alone as with a drafter: with decode graphs on, SGLang
0.5.17's EAGLE-3 start-up captures the draft's graphs, which imports `deep_gemm` (through
`speculative/eagle_worker_v2.py:417`, `layers/attention/dsa_backend.py:89`), absent from the GPU machine's
SGLang bundle. The responses need not match serving's settings and take decode graphs: the plain decode
graph path imports no module that start-up has not already imported.
"""

from __future__ import annotations

import json
import os
import time
from contextlib import contextmanager
from pathlib import Path

from benchmarks.drafter import layout as lay
from benchmarks.drafter.prompts import dump_jsonl_gz, load_jsonl_gz

# SGLang 0.5.17's EAGLE-3 settings the issue measures at: 3 draft steps, top-1, 4 draft tokens.
SPECULATIVE = {
    "speculative_algorithm": "EAGLE3",
    "speculative_num_steps": 3,
    "speculative_eagle_topk": 1,
    "speculative_num_draft_tokens": 4,
}
ROLES = {"system": "system", "human": "user", "gpt": "assistant"}
# The engine on CPU, for the tests on the embedded model: SGLang's CPU path takes the native attention and
# sampler, and a KV pool sized by hand (it would otherwise take a share of the host's memory).
CPU_ENGINE = {
    "device": "cpu",
    "attention_backend": "torch_native",
    "sampling_backend": "pytorch",
    "dtype": "float32",
    "max_total_tokens": 8192,
    "mem_fraction_static": 0.5,
}


def messages(record: dict) -> list[dict]:
    """A record's turns as the tokenizer's chat template takes them."""
    return [{"role": ROLES[t["from"]], "content": t["value"]} for t in record["conversations"]]


def prompt_ids(tokenizer, record: dict) -> list[int]:
    """The prompt as the target sees it when asked to answer: the chat template with the generation
    prompt, tokenized without added special tokens (the template writes its own)."""
    text = tokenizer.apply_chat_template(messages(record), tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


# The responses' engine: a part's prompts admitted RESPONSES_BATCH at a time (an explicit bound, not
# SGLang's estimate from the pool, mem_cache/kv_cache_configurator.py:1723), decoded under CUDA graphs up to
# that batch (eager, a decode step of this 135M model is bound by its kernel launches: 18.5 ms at batch 1
# on the H200); prefill stays eager, its graphs would be captured for every bucket up to the prefill chunk.
RESPONSES_BATCH = 512
RESPONSES_ENGINE = {
    "disable_cuda_graph": False,
    "disable_prefill_cuda_graph": True,
    "max_running_requests": RESPONSES_BATCH,
    "cuda_graph_max_bs_decode": RESPONSES_BATCH,
}


def engine(model: str, device: str, *, log: Path | None = None, **extra):
    """sglang.Engine for `model`; with `log`, SGLang's own info lines (the scheduler's settings as resolved,
    each prefill batch, and every 40th decode batch with its running requests and throughput) go there."""
    import sglang

    options = {"dtype": "bfloat16", "disable_cuda_graph": True, **(CPU_ENGINE if device == "cpu" else {}), **extra}
    with _logging_to(log):
        return sglang.Engine(model_path=model, random_seed=0, log_level="error", **options)


@contextmanager
def _logging_to(log: Path | None):
    """SGLang reads a logging config from SGLANG_LOGGING_CONFIG_PATH in each of its processes (in place of
    `log_level`, utils/common.py:2161); the processes it starts take the environment when they start."""
    if log is None:
        yield
        return
    log.parent.mkdir(parents=True, exist_ok=True)
    config = log.with_suffix(".logging.json")
    handlers = {
        "file": {"class": "logging.FileHandler", "filename": str(log), "formatter": "plain", "level": "INFO"},
        "console": {"class": "logging.StreamHandler", "formatter": "plain", "level": "ERROR"},
    }
    formatter = {"format": "[%(asctime)s %(processName)s] %(message)s", "datefmt": "%H:%M:%S"}
    root = {"level": "INFO", "handlers": list(handlers)}
    config.write_text(
        json.dumps(
            {
                "version": 1,
                "disable_existing_loggers": False,
                "formatters": {"plain": formatter},
                "handlers": handlers,
                "root": root,
            }
        )
    )
    before = os.environ.get("SGLANG_LOGGING_CONFIG_PATH")
    os.environ["SGLANG_LOGGING_CONFIG_PATH"] = str(config)
    try:
        yield
    finally:
        if before is None:
            del os.environ["SGLANG_LOGGING_CONFIG_PATH"]
        else:
            os.environ["SGLANG_LOGGING_CONFIG_PATH"] = before


def greedy(max_new_tokens: int, tokenizer) -> dict:
    return {"temperature": 0.0, "max_new_tokens": max_new_tokens, "stop_token_ids": [tokenizer.eos_token_id]}


def part_path(layout: lay.Layout, k: int) -> Path:
    return layout.responses / f"part_{k:04d}.jsonl.gz"


def responses(
    layout: lay.Layout, model: str, *, chunk: int, max_new_tokens: int, deadline: float, device: str = "cuda"
) -> dict:
    """Greedy responses of the target to every training prompt, `chunk` prompts a part file; parts already
    written are kept. Stops before a part that would start after `deadline` (time.time()), leaving the
    step to be resumed; returns what it did."""
    from transformers import AutoTokenizer

    prompts = load_jsonl_gz(layout.prompts / "train.jsonl.gz")
    parts = range((len(prompts) + chunk - 1) // chunk)
    todo = [k for k in parts if not part_path(layout, k).exists()]
    done = {
        "parts": len(parts),
        "written": 0,
        "kept": len(parts) - len(todo),
        "chunk": chunk,
        "max_new_tokens": max_new_tokens,
    }
    if todo:
        tokenizer = AutoTokenizer.from_pretrained(model)
        llm = engine(model, device, log=layout.logs / "responses.log", **RESPONSES_ENGINE)
        try:
            for k in todo:
                if time.time() > deadline:
                    break
                batch = prompts[k * chunk : (k + 1) * chunk]
                start = time.time()
                outs = llm.generate(
                    input_ids=[prompt_ids(tokenizer, r) for r in batch],
                    sampling_params=greedy(max_new_tokens, tokenizer),
                )
                rows = [
                    {
                        "id": r["id"],
                        "text": o["text"],
                        "completion_tokens": o["meta_info"]["completion_tokens"],
                        "finish_reason": _finish(o),
                    }
                    for r, o in zip(batch, outs, strict=True)
                ]
                data = dump_jsonl_gz(rows)
                layout.responses.mkdir(parents=True, exist_ok=True)
                lay.atomic_write(part_path(layout, k), lambda tmp, data=data: Path(tmp).write_bytes(data))
                done["written"] += 1
                tokens, wall = sum(r["completion_tokens"] for r in rows), time.time() - start
                print(
                    f"responses: part {k + 1}/{len(parts)}, {tokens:,} tokens in {wall:.1f} s ({tokens / wall:,.0f} tok/s)",
                    flush=True,
                )
        finally:
            llm.shutdown()
    if all(part_path(layout, k).exists() for k in parts):
        tokens = sum(r["completion_tokens"] for k in parts for r in load_jsonl_gz(part_path(layout, k)))
        lay.mark_done(layout.responses, prompts=len(prompts), completion_tokens=tokens, **done)
    return done


def _finish(output: dict) -> str | None:
    reason = output["meta_info"].get("finish_reason")
    return reason.get("type") if isinstance(reason, dict) else reason


def load_responses(layout: lay.Layout) -> dict[str, str]:
    if not lay.is_done(layout.responses):
        raise RuntimeError(f"{layout.responses} is not complete: run the responses step first")
    out = {}
    for path in sorted(layout.responses.glob("part_*.jsonl.gz")):
        out.update((r["id"], r["text"]) for r in load_jsonl_gz(path))
    return out


def acceptance(metas: list[dict]) -> dict:
    """Acceptance over a set of requests from SGLang's meta_info: tokens per verify step (the length,
    its bonus token included) and the share of verify steps whose first draft token was accepted (from
    the histogram of accepted drafts a step)."""
    tokens = sum(m["completion_tokens"] for m in metas)
    verify = sum(m.get("spec_verify_ct", 0) for m in metas)
    hist: list[int] = []
    for m in metas:
        for k, n in enumerate(m.get("spec_accept_histogram") or []):
            hist.extend([0] * (k + 1 - len(hist)))
            hist[k] += n
    steps = sum(hist)
    return {
        "completion_tokens": tokens,
        "verify_steps": verify,
        "accept_length": tokens / verify if verify else None,
        "first_position_accept_rate": (steps - hist[0]) / steps if steps else None,
        "accept_histogram": hist,
    }


def serve(
    model: str,
    drafter: str | None,
    heldout: list[dict],
    *,
    max_new_tokens: int,
    speed_prompts: int,
    log: Path | None = None,
    device: str = "cuda",
    mem_fraction_static: float | None = None,
) -> dict:
    """The held-out prompts served greedily, all at once for acceptance, then the first `speed_prompts`
    one at a time for decode tokens/s at batch 1 (each request's wall time, its short prefill included);
    SGLang's info lines to `log`."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    ids = [prompt_ids(tokenizer, r) for r in heldout]
    params = greedy(max_new_tokens, tokenizer)
    extra = {**SPECULATIVE, "speculative_draft_model_path": drafter} if drafter else {}
    if mem_fraction_static is not None:
        extra["mem_fraction_static"] = mem_fraction_static
    start = time.time()
    llm = engine(model, device, log=log, **extra)
    started = time.time() - start
    try:
        llm.generate(input_ids=ids[:1], sampling_params=params)  # warm-up
        outs = llm.generate(input_ids=ids, sampling_params=params)
        timed, tokens = 0.0, 0
        for one in ids[:speed_prompts]:
            t = time.perf_counter()
            out = llm.generate(input_ids=[one], sampling_params=params)[0]
            timed += time.perf_counter() - t
            tokens += out["meta_info"]["completion_tokens"]
    finally:
        llm.shutdown()
    result = {
        "drafter": drafter,
        "prompts": len(ids),
        "max_new_tokens": max_new_tokens,
        "engine_start_s": round(started, 1),
        "batch1_prompts": min(speed_prompts, len(ids)),
        "batch1_tokens": tokens,
        "batch1_decode_tok_s": tokens / timed if timed else None,
        "mem_fraction_static": mem_fraction_static,
        "outputs_sha256": _digest([o["output_ids"] for o in outs]),
    }
    if drafter:
        result.update(acceptance([o["meta_info"] for o in outs]), speculative=SPECULATIVE)
    return result


def _digest(outputs: list[list[int]]) -> str:
    import hashlib

    return hashlib.sha256(repr(outputs).encode()).hexdigest()
