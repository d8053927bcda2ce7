"""`slora-jax serve`: the command line that builds an `LLM` and serves it with uvicorn, and
`ServerThread`, the same app on a background thread (tests, notebooks).

The engine's flags come from `EngineConfig` (slora_jax/config.py): one flag per field in
`ENGINE_FLAGS`, named as the field in kebab case (vLLM's flag names where the meaning is the same),
with the field's type and default. Only the flags given on the command line reach `LLM`, so the
defaults live in EngineConfig alone.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import socket
import threading
import time
from pathlib import Path

from slora_jax.config import ADMISSION_ORDERS, ATTENTION_BACKENDS, LORA_BACKENDS, EngineConfig
from slora_jax.serve.app import build_app

# EngineConfig field -> help text. The flag is "--" + the field's name with "-" for "_".
ENGINE_FLAGS = {
    "max_num_seqs": "requests running at once",
    "max_num_batched_tokens": "prompt tokens a prefill step takes; longer prompts are chunked",
    "max_loras": "distinct adapters in the running batch",
    "max_lora_rank": "the largest adapter rank the pool accepts",
    "max_cpu_loras": "adapters whose weights stay in host memory",
    "max_cpu_lora_gb": "GiB of adapter weights host memory may hold (default none: 40%% of the machine's memory)",
    "gpu_memory_utilization": "share of the device's total memory the engine may use",
    "tensor_parallel_size": "devices the model is split over (Megatron weights, the page pool split along "
                            "its row width, S-LoRA's adapter layout)",
    "page_size": "vectors per page of the unified pool; 1 is S-LoRA's token-granular pool",
    "pool_pages": "an exact pool size in pages; overrides --gpu-memory-utilization",
    "enable_prefix_caching": "share the KV pages of equal prompt prefixes (per adapter version)",
    "lora_backend": "LoRA kernels; auto picks per step",
    "attention_backend": "attention kernels; auto: pallas on a GPU, xla elsewhere",
    "async_scheduling": "schedule step n+1 while step n runs on the device (default none: on for a GPU, off elsewhere)",
    "admission_order": "fcfs, or affinity: requests whose adapters are already in memory go first",
    "max_wait_s": "seconds after which a waiting request goes first, whatever the order",
    "early_abort_ttft": "seconds: a queued request that cannot get its first token in time is aborted (503)",
    "prefetch_adapters": "adapters paged in ahead of use per step; 0: off",
    "compilation_cache_dir": "XLA's persistent compilation cache; '' turns it off",
}
CHOICES = {"lora_backend": LORA_BACKENDS, "attention_backend": ATTENTION_BACKENDS,
           "admission_order": ADMISSION_ORDERS}
DTYPES = ("bfloat16", "float16", "float32")
TYPES = {"int": int, "float": float, "str": lambda v: v or None}

# The embedded default (no --model): the tiny demo model on a CPU, with what fits it.
DEMO_ENGINE = {"max_num_seqs": 16, "pool_pages": 256, "max_lora_rank": 32}
DEMO_ADAPTERS = 32


def engine_flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def flag_message(message: str) -> str:
    """EngineConfig's error message with the flag's name in place of the field's."""
    name = message.split(" ", 1)[0]
    return engine_flag(name) + message[len(name):] if name in ENGINE_FLAGS else message


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    fields = {f.name: f for f in dataclasses.fields(EngineConfig)}
    group = parser.add_argument_group("engine (slora_jax.EngineConfig)")
    for name, help_text in ENGINE_FLAGS.items():
        field = fields[name]
        if field.default is not None:
            help_text += f" (default: {field.default})"
        elif "none:" not in help_text:
            help_text += " (default: none)"
        kind = str(field.type).replace(" | None", "")
        extra = {"action": argparse.BooleanOptionalAction} if kind == "bool" else \
            {"type": TYPES[kind], "choices": CHOICES.get(name)}
        group.add_argument(engine_flag(name), dest=name, default=argparse.SUPPRESS, help=help_text, **extra)


def parse_lora_modules(items: list[str] | None) -> dict[str, str]:
    """--lora-modules: each item name=path, or vLLM's JSON form
    '{"name": ..., "path": ..., "base_model_name": ...}' (base_model_name is accepted and not used:
    every adapter here applies to the one base model)."""
    out = {}
    for item in items or []:
        if item.lstrip().startswith("{"):
            try:
                d = json.loads(item)
            except ValueError as e:
                raise ValueError(f"--lora-modules: {item!r} is not valid JSON ({e})") from None
            if not isinstance(d, dict) or not isinstance(d.get("name"), str) or not isinstance(d.get("path"), str):
                raise ValueError(f"--lora-modules: {item!r} is not a JSON object with string name and path")
            unknown = sorted(set(d) - {"name", "path", "base_model_name"})
            if unknown:
                raise ValueError(f"--lora-modules: {item!r} has unknown keys {', '.join(unknown)} "
                                 "(expected name, path, base_model_name)")
            name, path = d["name"], d["path"]
        elif "=" in item:
            name, path = item.split("=", 1)
        else:
            raise ValueError(f"--lora-modules: expected name=path or a JSON object, got {item!r}")
        if not name or not path:
            raise ValueError(f"--lora-modules: {item!r} needs a non-empty name and path")
        if name in out:
            raise ValueError(f"--lora-modules: adapter {name!r} is given twice")
        out[name] = path
    return out


def auto_dtype(model: str) -> str:
    """--dtype auto: config.json's torch_dtype (or dtype) for a model directory, bfloat16 for a
    configs/models shape or a config without one."""
    cfg = Path(model) / "config.json"
    if not cfg.is_file():
        return "bfloat16"
    try:
        d = json.loads(cfg.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"--dtype auto: cannot read {cfg}: {e}") from None
    dtype = d.get("torch_dtype") or d.get("dtype") if isinstance(d, dict) else None
    if dtype is None:
        return "bfloat16"
    if dtype not in DTYPES:
        raise ValueError(f"--dtype auto: config.json's torch_dtype {dtype!r} is not one of {', '.join(DTYPES)}; "
                         "give --dtype")
    return dtype


def read_chat_template(value: str) -> str:
    """--chat-template: a file's contents, or the value itself when it reads as an inline Jinja
    template (it holds '{' or a newline), as vLLM decides."""
    path = Path(value).expanduser()
    if path.is_file():
        try:
            return path.read_text()
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"--chat-template: cannot read {value}: {e}") from None
    if any(c in value for c in "{}\n"):
        return value
    raise ValueError(f"--chat-template: {value!r} is neither a file nor a Jinja template")


def at_least(lo: int):
    def parse(v: str) -> int:
        n = int(v)
        if n < lo:
            raise argparse.ArgumentTypeError(f"must be >= {lo}, got {n}")
        return n
    parse.__name__ = "integer"
    return parse


def float_at_least(lo: float, open_interval: bool):
    def parse(v: str) -> float:
        x = float(v)
        if not (x > lo if open_interval else x >= lo) or x != x or x == float("inf"):
            raise argparse.ArgumentTypeError(f"must be a finite number {'>' if open_interval else '>='} {lo:g}, "
                                             f"got {v}")
        return x
    parse.__name__ = "number"
    return parse


positive_float = float_at_least(0.0, True)
non_negative_float = float_at_least(0.0, False)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="slora-jax serve", description="OpenAI-compatible server for one base "
                                 "model and many LoRA adapters. Without --model: the embedded default (the "
                                 "tiny demo model with generated adapters).")
    ap.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                    help="HF model directory or a configs/models shape name (as `vllm serve MODEL`)")
    ap.add_argument("--model", default=None, help="the same as MODEL; give one of them")
    ap.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                    help="the base model's names in the API: the first is the name reported, every one is "
                    "accepted as `model` (default: the model as given; 'tiny' for the embedded default)")
    ap.add_argument("--enable-lora", action="store_true",
                    help="accepted for vLLM compatibility and changes nothing: LoRA adapters are always on")
    ap.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                    help="adapters registered at start-up: name=path or vLLM's "
                    "'{\"name\": ..., \"path\": ..., \"base_model_name\": ...}'")
    ap.add_argument("--dtype", default=None, choices=["auto", *DTYPES],
                    help="auto: config.json's torch_dtype (bfloat16 for a configs/models shape); "
                    "default bfloat16 (float32 for the embedded default)")
    ap.add_argument("--chat-template", default=None, metavar="FILE_OR_TEMPLATE",
                    help="the chat template for /v1/chat/completions, in place of the tokenizer's: a file, "
                    "or an inline Jinja template")
    ap.add_argument("--quantization", default=None, choices=["int8"],
                    help="int8: the base model's projection weights in int8 with per-row scales (half their "
                    "memory, which goes to the page pool); default: the model's dtype")
    ap.add_argument("--max-model-len", type=at_least(1), default=None,
                    help="the longest prompt + completion (default: the model's context length)")
    ap.add_argument("--seed", type=int, default=0, help="seed of dummy weights and of unseeded sampling")
    add_engine_flags(ap)
    http = ap.add_argument_group("HTTP")
    http.add_argument("--host", default="127.0.0.1")
    http.add_argument("--port", type=at_least(0), default=8000)
    key = os.environ.get("SLORA_API_KEY")
    http.add_argument("--api-key", nargs="+", default=[key] if key else None, metavar="KEY",
                      help="require Authorization: Bearer <key> (any of the keys given) on every route except "
                      "/health and /metrics, which stay open for probes and scrapers as in vLLM "
                      "(env SLORA_API_KEY)")
    http.add_argument("--allowed-adapter-dirs", nargs="+", default=None, metavar="DIR",
                      help="directories that /v1/load_lora_adapter and --lora-search-dirs may load from "
                      "(default: none, loading at run time is off)")
    http.add_argument("--lora-search-dirs", nargs="+", default=None, metavar="DIR",
                      help="a request whose model is no registered name but a directory <DIR>/<model> holding a "
                      "PEFT adapter loads it on first use; each DIR must lie inside --allowed-adapter-dirs")
    http.add_argument("--max-queued-requests", type=at_least(0), default=4096,
                      help="requests in flight beyond --max-num-seqs before new ones get 429")
    http.add_argument("--request-timeout", type=positive_float, default=30.0,
                      help="seconds a client has to send its request body, then 408 (default: 30)")
    http.add_argument("--shutdown-timeout", type=non_negative_float, default=30.0,
                      help="on SIGTERM: new requests get 503, running ones get this many seconds to finish, "
                      "then streams end with an error event and others get 503 (default: 30)")
    http.add_argument("--log-level", default="warning", help="uvicorn's log level (info shows each request)")
    start = ap.add_argument_group("start-up")
    start.add_argument("--warmup", choices=("background", "before-serving", "off"), default="background",
                       help="compile the step shapes on a thread while serving (default: the port opens at once "
                       "and a step whose shape is not compiled yet compiles on first use), all before the port "
                       "opens, or not at all (each compiles on first use)")
    start.add_argument("--warmup-workers", type=at_least(1), default=1, help="threads compiling the step shapes")
    start.add_argument("--replicas", type=at_least(1), default=None, help="serve N replicas of the engine on a "
                       "local Ray instance (Ray Serve, adapter-affinity routing; docs/scale-out.md)")
    return ap


def check_args(args: argparse.Namespace) -> None:
    """Flag checks argparse cannot make; a ValueError names the flag. Fills args.model from MODEL,
    and replaces args.chat_template with the template's text."""
    if args.model_tag is not None and args.model is not None and args.model_tag != args.model:
        raise ValueError(f"MODEL {args.model_tag!r} and --model {args.model!r} differ; give one of them")
    args.model = args.model or args.model_tag
    for flag, values in (("--served-model-name", args.served_model_name), ("--api-key", args.api_key)):
        if values is not None and not all(values):
            raise ValueError(f"{flag} values must be non-empty")
    if args.chat_template is not None:
        args.chat_template = read_chat_template(args.chat_template)
        import jinja2
        from slora_jax.serve.chat import ChatFormatter
        try:
            ChatFormatter.compile_template(args.chat_template)
        except jinja2.TemplateError as e:
            raise ValueError(f"--chat-template: not a valid Jinja template: {e}") from None
        if args.model is not None and not (Path(args.model) / "tokenizer.json").is_file():
            raise ValueError("--chat-template: the model has no tokenizer.json, so it cannot chat")
    if args.lora_search_dirs:
        allowed = [os.path.realpath(d) for d in args.allowed_adapter_dirs or []]
        for d in args.lora_search_dirs:
            real = os.path.realpath(d)
            if not any(os.path.commonpath([real, root]) == root for root in allowed):
                raise ValueError(f"--lora-search-dirs: {d} is not inside --allowed-adapter-dirs")
            if not os.path.isdir(real):
                raise ValueError(f"--lora-search-dirs: {d} is not a directory")
    if args.replicas:
        if len(args.served_model_name or []) > 1 or len(args.api_key or []) > 1:
            raise ValueError("--replicas takes one --served-model-name and one --api-key")
        if args.lora_search_dirs or args.chat_template is not None:
            raise ValueError("--lora-search-dirs and --chat-template are not available with --replicas")
    if args.dtype == "auto":
        args.dtype = auto_dtype(args.model) if args.model is not None else None


def engine_options(args: argparse.Namespace) -> dict:
    """The EngineConfig fields given on the command line, by field name."""
    return {name: getattr(args, name) for name in ENGINE_FLAGS if hasattr(args, name)}


def main(argv: list[str] | None = None) -> None:
    ap = build_parser()
    args = ap.parse_args(argv)
    try:
        check_args(args)
        engine = engine_options(args)
        if args.model is None:
            engine = {**DEMO_ENGINE, **engine}
        adapters = parse_lora_modules(args.lora_modules)
        config = EngineConfig(**engine)
    except ValueError as e:
        ap.error(flag_message(str(e)))
    names = args.served_model_name or []
    model, name, dtype = args.model, names[0] if names else None, args.dtype
    if model is None:  # the embedded default: the tiny model on dummy weights, up in seconds
        from slora_jax.demo import prepare
        model_dir, demo_adapters = prepare(Path.home() / ".cache" / "slora_jax" / "demo", DEMO_ADAPTERS, 0)
        model, name, dtype = str(model_dir), name or "tiny", dtype or "float32"
        adapters = {**demo_adapters, **adapters}

    if args.replicas:
        from slora_jax.serve.replicas import from_cli, serve_forever
        return serve_forever(from_cli(args, model, name, dtype or "bfloat16", adapters, engine), args.host,
                             args.port, args.replicas, name or args.model)
    import slora_jax
    try:
        llm = slora_jax.LLM(model, adapters=adapters, dtype=dtype or "bfloat16", seed=args.seed,
                            quantization=args.quantization, max_model_len=args.max_model_len, **engine)
    except (ValueError, OSError) as e:  # a missing model or adapter, a bad config: no traceback
        ap.error(f"cannot start: {e}".replace("\n", " "))
    # Every step bucket up to max_model_len. The embedded default's adapters target mixed module
    # sets, so few of its batches would meet the union's LoRA buckets: its warm-up compiles the
    # base model's only.
    warmup = dict(max_context=llm.max_model_len, workers=args.warmup_workers, lora=args.model is not None)
    if args.warmup == "before-serving":
        llm.warmup(**warmup)
    elif args.warmup == "background":  # listed here, before the engine thread runs steps
        from slora_jax.engine import warmup as warmup_mod
        shapes = llm.engine.warmup_shapes(warmup["max_context"], warmup["lora"])
    try:
        app = build_app(llm, [name or args.model, *names[1:]], api_key=args.api_key,
                        allowed_adapter_dirs=args.allowed_adapter_dirs, lora_search_dirs=args.lora_search_dirs,
                        chat_template=args.chat_template, max_in_flight=config.max_num_seqs + args.max_queued_requests,
                        request_timeout=args.request_timeout)
    except ValueError as e:
        ap.error(str(e))

    import uvicorn
    sock = bind(args.host, args.port)
    host, port = sock.getsockname()[:2]
    server = draining_server(uvicorn.Config(app, log_level=args.log_level, timeout_graceful_shutdown=5),
                             args.shutdown_timeout)

    async def run():
        task = asyncio.ensure_future(server.serve(sockets=[sock]))
        while not server.started and not task.done():
            await asyncio.sleep(0.02)
        if server.started:
            shown = f"[{host}]" if ":" in host else host
            print(f"slora-jax: serving {app.state.server.base} + {len(llm.store.entries)} adapters on "
                  f"http://{shown}:{port} (OpenAI API at /v1, metrics at /metrics)", flush=True)
            if args.warmup == "background":
                print(f"slora-jax: compiling {len(shapes)} step buckets in the background", flush=True)
                warmup_mod.compile_in_background(
                    llm.engine, shapes, warmup["workers"],
                    on_done=lambda n, sec: print(f"slora-jax: every step bucket compiled ({n} in {sec:.0f} s)",
                                                 flush=True))
        await task

    asyncio.run(run())


def draining_server(config, shutdown_timeout: float):
    """A uvicorn.Server whose first SIGTERM or SIGINT drains the app (`Server.drain`) before uvicorn
    stops; a second signal stops at once, as plain uvicorn does."""
    import uvicorn

    class DrainingServer(uvicorn.Server):
        loop: asyncio.AbstractEventLoop | None = None
        drain_task: asyncio.Task | None = None

        async def serve(self, sockets=None):
            self.loop = asyncio.get_running_loop()
            await super().serve(sockets=sockets)

        def handle_exit(self, sig, frame):
            if self.loop is None or self.drain_task is not None or not self.started:
                return super().handle_exit(sig, frame)
            self.loop.call_soon_threadsafe(self.start_drain)

        def start_drain(self):
            if self.drain_task is None:
                self.drain_task = self.loop.create_task(self.drain_then_exit())

        async def drain_then_exit(self):
            try:
                await config.app.state.server.drain(shutdown_timeout)
            finally:
                self.should_exit = True

    return DrainingServer(config)


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.set_inheritable(True)
    return sock


class ServerThread:
    """Run an app with uvicorn on a background thread (tests, notebooks). port 0: a free port."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"):
        import uvicorn
        self.sock = bind(host, port)
        self.host, self.port = host, self.sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=5,
                                                    timeout_keep_alive=30))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       name="slora-http", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 60.0) -> "ServerThread":
        self.thread.start()
        t0 = time.monotonic()
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() - t0 > timeout:
                raise RuntimeError("the server did not start")
            time.sleep(0.02)
        return self

    def stop(self, timeout: float = 30.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)
        self.sock.close()
