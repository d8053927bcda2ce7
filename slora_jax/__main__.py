"""`slora-jax` / `python -m slora_jax`: subcommands."""

from __future__ import annotations

import sys

COMMANDS = {
    "demo": "run the main job on the embedded default (tiny model, generated adapters)",
    "serve": "OpenAI-compatible HTTP server (see `slora-jax serve --help`)",
}


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in COMMANDS:
        print("usage: slora-jax {" + ",".join(COMMANDS) + "} [options]")
        for name, what in COMMANDS.items():
            print(f"  {name:8s} {what}")
        sys.exit(0 if argv and argv[0] in ("-h", "--help") else 2)
    if argv[0] == "demo":
        from slora_jax.demo import main as demo
        demo(argv[1:])
    elif argv[0] == "serve":
        from slora_jax.serve.cli import main as serve
        serve(argv[1:])


if __name__ == "__main__":
    main()
