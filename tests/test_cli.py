"""`slora-jax serve`'s vLLM-compatible flags, parsed without loading a model: what reaches `LLM`
and `build_app` (both stood in for), and the one-line error (exit code 2, no traceback) for every
bad value. The server's side of these flags (names, keys, template, adapters on first use) is in
test_server_first_use.py."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi")

import slora_jax  # noqa: E402
from slora_jax.serve import cli  # noqa: E402


class Built(Exception):
    pass


class FakeLLM:
    max_model_len = 64

    def __init__(self, model, **kwargs):
        self.model, self.kwargs = model, kwargs


@pytest.fixture
def built(monkeypatch):
    """cli.main(argv) -> (LLM's model, LLM's kwargs, build_app's kwargs): what the command line
    builds, stopped before anything loads or listens."""
    monkeypatch.setattr(slora_jax, "LLM", FakeLLM)

    def build_app(llm, names, **kwargs):
        raise Built(llm, names, kwargs)

    monkeypatch.setattr(cli, "build_app", build_app)

    def run(argv):
        with pytest.raises(Built) as b:
            cli.main([*argv, "--warmup", "off"])
        llm, names, kwargs = b.value.args
        return llm.model, llm.kwargs, {"served_model_name": names, **kwargs}
    return run


def refused(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    assert exit_.value.code == 2, argv
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("slora-jax serve: error: ") and message in last, (argv, err)


def test_positional_model(built, capsys):
    assert built(["tiny"])[0] == "tiny"
    assert built(["--model", "tiny"])[0] == "tiny"
    assert built(["tiny", "--model", "tiny"])[0] == "tiny"
    assert built(["tiny", "--max-loras", "3"])[1]["max_loras"] == 3
    refused(capsys, ["tiny", "--model", "llama-7b"], "MODEL 'tiny' and --model 'llama-7b' differ")
    refused(capsys, ["tiny", "llama-7b"], "unrecognized arguments: llama-7b")


def test_enable_lora_is_accepted_and_changes_nothing(built):
    assert "always on" in cli.build_parser().format_help()
    assert built(["tiny", "--enable-lora"])[:2] == built(["tiny"])[:2]


def test_lora_modules_both_forms(built, capsys, tmp_path):
    a, b, c = (tmp_path / n for n in "abc")
    for d in (a, b, c):
        d.mkdir()
    _, kwargs, _ = built(["tiny", "--lora-modules", f"a={a}",
                          json.dumps({"name": "b", "path": str(b), "base_model_name": "tiny"}),
                          json.dumps({"name": "c", "path": str(c)})])
    assert kwargs["adapters"] == {"a": str(a), "b": str(b), "c": str(c)}
    for item, message in [('{"name": "x", "path": ', "is not valid JSON"),
                          ('{"name": "x"}', "JSON object with string name and path"),
                          ('{"name": "x", "path": 3}', "JSON object with string name and path"),
                          ('{"name": "x", "path": "p", "rank": 8}', "unknown keys rank"),
                          ("nameonly", "expected name=path or a JSON object"),
                          ("=path", "needs a non-empty name and path")]:
        refused(capsys, ["tiny", "--lora-modules", item], message)
    refused(capsys, ["tiny", "--lora-modules", f"a={a}", f"a={b}"], "adapter 'a' is given twice")


def test_dtype_auto(built, capsys, tmp_path):
    def model_dir(name, **config):
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text(json.dumps({"model_type": "llama", **config}))
        return str(d)

    assert built(["tiny", "--dtype", "auto"])[1]["dtype"] == "bfloat16"
    assert built([model_dir("f32", torch_dtype="float32"), "--dtype", "auto"])[1]["dtype"] == "float32"
    assert built([model_dir("f16", torch_dtype="float16"), "--dtype", "auto"])[1]["dtype"] == "float16"
    assert built([model_dir("new", dtype="float32"), "--dtype", "auto"])[1]["dtype"] == "float32"
    assert built([model_dir("none"), "--dtype", "auto"])[1]["dtype"] == "bfloat16"
    assert built(["tiny"])[1]["dtype"] == "bfloat16"
    refused(capsys, [model_dir("f64", torch_dtype="float64"), "--dtype", "auto"],
            "torch_dtype 'float64' is not one of bfloat16, float16, float32")
    refused(capsys, ["tiny", "--dtype", "int4"], "invalid choice: 'int4'")


def test_chat_template(built, capsys, tmp_path):
    template = "{% for m in messages %}<{{ m['content'] }}>{% endfor %}"
    f = tmp_path / "t.jinja"
    f.write_text(template)
    model = tmp_path / "model"
    model.mkdir()
    (model / "tokenizer.json").write_text("{}")  # only looked for: FakeLLM loads nothing
    assert built([str(model), "--chat-template", str(f)])[2]["chat_template"] == template
    assert built([str(model), "--chat-template", template])[2]["chat_template"] == template
    assert built([str(model)])[2]["chat_template"] is None
    refused(capsys, [str(model), "--chat-template", str(tmp_path / "missing.jinja")],
            "is neither a file nor a Jinja template")
    refused(capsys, [str(model), "--chat-template", "{% for m in messages %}"], "not a valid Jinja template")
    refused(capsys, ["tiny", "--chat-template", template], "the model has no tokenizer.json")


def test_several_names_and_keys(built, capsys, monkeypatch):
    got = built(["tiny", "--served-model-name", "base", "alias", "--api-key", "k1", "k2"])[2]
    assert got["served_model_name"] == ["base", "alias"] and got["api_key"] == ["k1", "k2"]
    got = built(["tiny"])[2]
    assert got["served_model_name"] == ["tiny"] and got["api_key"] is None
    refused(capsys, ["tiny", "--served-model-name", ""], "--served-model-name values must be non-empty")
    refused(capsys, ["tiny", "--api-key", ""], "--api-key values must be non-empty")
    refused(capsys, ["tiny", "--replicas", "2", "--api-key", "k1", "k2"], "--replicas takes one")
    monkeypatch.setenv("SLORA_API_KEY", "from-env")
    assert built(["tiny"])[2]["api_key"] == ["from-env"]


def test_lora_search_dirs(built, capsys, tmp_path):
    allowed, outside = tmp_path / "allowed", tmp_path / "outside"
    (allowed / "search").mkdir(parents=True)
    outside.mkdir()
    (allowed / "link-out").symlink_to(outside, target_is_directory=True)
    got = built(["tiny", "--allowed-adapter-dirs", str(allowed), "--lora-search-dirs", str(allowed / "search"),
                 str(allowed)])[2]
    assert got["lora_search_dirs"] == [str(allowed / "search"), str(allowed)]
    assert got["allowed_adapter_dirs"] == [str(allowed)]
    refused(capsys, ["tiny", "--lora-search-dirs", str(allowed)], "is not inside --allowed-adapter-dirs")
    refused(capsys, ["tiny", "--allowed-adapter-dirs", str(allowed), "--lora-search-dirs", str(outside)],
            "is not inside --allowed-adapter-dirs")
    refused(capsys, ["tiny", "--allowed-adapter-dirs", str(allowed), "--lora-search-dirs", f"{allowed}/../outside"],
            "is not inside --allowed-adapter-dirs")
    refused(capsys, ["tiny", "--allowed-adapter-dirs", str(allowed), "--lora-search-dirs", str(allowed / "link-out")],
            "is not inside --allowed-adapter-dirs")
    refused(capsys, ["tiny", "--allowed-adapter-dirs", str(allowed), "--lora-search-dirs", str(allowed / "nope")],
            "is not a directory")


def test_a_model_that_cannot_load_is_one_line(capsys, tmp_path):
    refused(capsys, [str(tmp_path / "no-such-model"), "--warmup", "off"], "cannot start:")
    refused(capsys, ["tiny", "--lora-modules", f"a={tmp_path / 'no-such-adapter'}", "--warmup", "off",
                     "--pool-pages", "16", "--dtype", "float32"], "cannot start:")
