"""bench/run.py --http: the trace sent to an OpenAI-compatible server, streamed, in real time."""

from __future__ import annotations

import asyncio
import json
import sys

from bench.serving import Record
from bench.trace import Trace


async def _http_one(client, url: str, rec: Record, prompt: list[int], model: str, t0: float,
                    slo_abort: float | None) -> None:
    loop = asyncio.get_running_loop()
    await asyncio.sleep(max(0.0, rec.arrival_s - (loop.time() - t0)))
    body = {"model": model, "prompt": prompt, "max_tokens": rec.output_len, "temperature": 0.0,
            "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}}
    if slo_abort is not None:
        body["ttft_slo"] = slo_abort
    chunks, usage, reason = 0, None, None
    try:
        async with client.stream("POST", url.rstrip("/") + "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                await resp.aread()
                # 503: the server aborted it (early abort: the first token could not come in time)
                rec.finish_reason = "abort" if resp.status_code == 503 else "rejected"
                rec.finish_s = loop.time() - t0
                print(f"request {rec.index}: HTTP {resp.status_code} {resp.text[:200]}", file=sys.stderr)
                return
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                msg = json.loads(data)
                if msg.get("usage"):
                    usage = msg["usage"]
                for choice in msg.get("choices") or []:
                    if rec.first_token_s is None:
                        rec.first_token_s = loop.time() - t0
                    chunks += 1
                    reason = choice.get("finish_reason") or reason
    except Exception as e:  # noqa: BLE001 - a dropped connection is an aborted request
        rec.finish_reason, rec.finish_s = "abort", loop.time() - t0
        print(f"request {rec.index}: {type(e).__name__}: {e}", file=sys.stderr)
        return
    rec.finish_s = loop.time() - t0
    rec.tokens = int(usage["completion_tokens"]) if usage and "completion_tokens" in usage else chunks
    rec.finish_reason = reason or "length"


async def _http_replay(url: str, trace: Trace, names: list[str] | None, base_model: str | None,
                       vocab: int) -> tuple[list[Record], float]:
    import httpx
    w = trace.workload
    recs = [Record(i, r.arrival_s, names[r.adapter_id] if names else None, r.prompt_len, r.output_len)
            for i, r in enumerate(trace)]
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(None, connect=30.0), limits=limits) as client:
        t0 = asyncio.get_running_loop().time()
        prompts = trace.prompts(vocab)
        await asyncio.gather(*(
            _http_one(client, url, rec, prompts[rec.index], rec.adapter or base_model, t0,
                      w.slo_s if w.early_abort else None)
            for rec in recs))
        wall = asyncio.get_running_loop().time() - t0
    wall = max([r.finish_s for r in recs if r.finish_s is not None] or [wall])
    return recs, wall


def http_register(url: str, paths: dict[str, str]) -> None:
    """Register adapters on the server (vLLM-style POST /v1/load_lora_adapter)."""
    import httpx
    with httpx.Client(timeout=60.0) as c:
        for name, path in paths.items():
            r = c.post(url.rstrip("/") + "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path})
            if r.status_code != 200:
                raise RuntimeError(f"registering {name} on {url}: HTTP {r.status_code} {r.text[:200]}")
