"""Adapters on first use (`serve --lora-search-dirs`): a request whose `model` is no registered
name but names a directory <search dir>/<model> holding a PEFT adapter registers it, then is
served.

The directory passes the checks of /v1/load_lora_adapter (`check_adapter_path`: inside
--allowed-adapter-dirs after resolving symlinks, no file linking out), and the load runs on the
engine thread through `LLM.load_adapter`, which registers all or nothing. Concurrent first
requests for one name share one load: the first starts it, the others await it.
"""

from __future__ import annotations

import asyncio
import logging
import os

from slora_jax.serve.async_engine import EngineError
from slora_jax.serve.errors import APIError, bad, from_engine_error, hide_paths
from slora_jax.serve.protocol import check_adapter_path
from slora_jax.serve.schema import ADAPTER_NAME

log = logging.getLogger(__name__)


def not_found(name: str) -> APIError:
    return APIError(404, f"The model `{name}` does not exist.", "model", "model_not_found")


class FirstUseLoader:
    """`allowed`: the real paths of --allowed-adapter-dirs; `search_dirs`: --lora-search-dirs,
    each inside one of them (ValueError otherwise)."""

    def __init__(self, llm, engine, allowed: list[str], search_dirs: list[str]):
        self.llm, self.engine, self.allowed = llm, engine, allowed
        self.search_dirs = [os.path.realpath(d) for d in search_dirs]
        for given, real in zip(search_dirs, self.search_dirs):
            if not any(os.path.commonpath([real, root]) == root for root in allowed):
                raise ValueError(f"--lora-search-dirs: {given} is not inside --allowed-adapter-dirs")
        self.loads: dict[str, asyncio.Future] = {}  # adapter name -> its load in progress

    def path(self, name: str) -> str | None:
        """<search dir>/<name> in the first search directory that has it; None if none does, or
        if `name` could leave its search directory ('..' or '.' components, an absolute path)."""
        if not ADAPTER_NAME.match(name) or any(p in ("", ".", "..") for p in name.split("/")):
            return None
        for root in self.search_dirs:
            path = os.path.join(root, name)
            if os.path.isdir(path):
                return path
        return None

    async def load(self, name: str) -> None:
        """Register adapter `name` from a search directory, or wait for the load already under
        way; 404 if no search directory has it, 400 naming `model` if it cannot be loaded."""
        pending = self.loads.get(name)
        if pending is None:
            path = self.path(name)
            if path is None:
                raise not_found(name)
            pending = asyncio.ensure_future(self._load(name, path))
            self.loads[name] = pending
            pending.add_done_callback(lambda _: self.loads.pop(name, None))
        await asyncio.shield(pending)  # a client that goes away does not cancel the others' load

    async def _load(self, name: str, path: str) -> None:
        try:
            real = check_adapter_path(path, self.allowed)
        except APIError as e:  # a symlink out of the allowed directories
            raise APIError(e.status, f"model `{name}`: {hide_paths(e.message, self.allowed)}", "model",
                           e.code) from None

        def load():  # on the engine thread; a name registered meanwhile (load endpoint) is kept
            if name not in self.llm.store.entries:
                self.llm.load_adapter(name, real)
        try:
            await self.engine.call(load)
        except EngineError as e:
            raise from_engine_error(e) from None
        except (ValueError, OSError) as e:
            raise bad(hide_paths(f"model `{name}` names an adapter directory that cannot be loaded: {e}",
                                 self.allowed), "model", "invalid_adapter") from None
        log.info("adapter %s loaded on first use", name)
