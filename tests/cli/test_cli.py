"""The command line: clear one-line errors with a non-zero exit, and `generate --json` end to end."""
from __future__ import annotations

import json

import pytest

from dustin.cli.main import main
from dustin.errors import CheckpointError


def _error(capsys, argv) -> tuple[int, str]:
    code = main(argv)
    err = capsys.readouterr().err
    return code, err


def test_missing_checkpoint(capsys, tmp_path):
    code, err = _error(capsys, ["generate", "--target", str(tmp_path / "nope"), "--prompt", "x"])
    assert code == 2 and err.startswith("dustin: error:") and "does not exist" in err and "Traceback" not in err


def test_corrupt_checkpoint(capsys, tmp_path, tiny_qwen2):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(tiny_qwen2, bad)
    (bad / "config.json").write_text("{ not json")
    code, err = _error(capsys, ["generate", "--target", str(bad), "--method", "vanilla", "--prompt", "x"])
    assert code == 2 and "not valid JSON" in err


@pytest.mark.parametrize("argv,needle", [
    (["--gamma", "0"], "--gamma must be >= 1"),
    (["--budget", "5", "--method", "dustin"], "--budget must be >= 21"),
    (["--top-p", "1.5"], "--top-p"),
    (["--temperature", "nan"], "--temperature must be a finite number >= 0"),
    (["--temperature", "inf"], "--temperature must be a finite number >= 0"),
])
def test_bad_generation_flags(capsys, argv, needle):
    code, err = _error(capsys, ["generate", "--prompt", "x", *argv])
    assert code == 2 and needle in err


def test_bad_prompts_file(capsys, tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "ok"}\n{"text": "no prompt field"}\n')
    code, err = _error(capsys, ["generate", "--prompts-jsonl", str(f), "--method", "vanilla"])
    assert code == 2 and "p.jsonl:2" in err
    code, err = _error(capsys, ["generate", "--prompt-file", str(tmp_path / "missing.txt")])
    assert code == 2 and "does not exist" in err
    code, err = _error(capsys, ["generate", "--prompts-jsonl", str(tmp_path)])
    assert code == 2 and "is a directory" in err and err.count("\n") == 1


@pytest.mark.parametrize("line", ['{"prompt": 5}', '{"prompt": null}', '{"prompt": {"a": 1}}', '[1, 2]', '"text"',
                                  '{"prompt": [1.5]}', '{"prompt": []}', '{"prompt": [true]}'])
def test_a_prompts_line_that_is_not_text_or_token_ids_is_one_error(capsys, tmp_path, line):
    """Valid JSON that is not an object with a text or a list of token ids as "prompt" is refused before any model
    loads, in one line naming the line (it was a traceback, or used as text)."""
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": [3, 4]}\n' + line + "\n")
    code, err = _error(capsys, ["generate", "--prompts-jsonl", str(f), "--method", "vanilla"])
    assert code == 2 and "p.jsonl:2" in err and "text or a list of token ids" in err and err.count("\n") == 1



def test_unreadable_prompt_file(capsys, tmp_path, monkeypatch):
    """An OSError while reading (here a PermissionError, which root would never get from chmod) is one line."""
    import pathlib

    f = tmp_path / "p.txt"
    f.write_text("x")

    def denied(self, *a, **k):
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(pathlib.Path, "read_text", denied)
    code, err = _error(capsys, ["generate", "--prompt-file", str(f)])
    assert code == 2 and "cannot read prompt file" in err and "Permission denied" in err and err.count("\n") == 1


@pytest.mark.parametrize("device,needle", [("tpu", "--device must be auto, cpu or cuda"), ("", "--device must be"),
                                           ("cuda:notanumber", "--device must be")])
def test_bad_device_is_one_line(capsys, device, needle):
    code, err = _error(capsys, ["generate", "--prompt", "x", "--method", "vanilla", "--device", device])
    assert code == 2 and needle in err and err.count("\n") == 1


def test_one_default_method_everywhere():
    """generate, serve, LLM and the engine's config decode with the same method when none is named."""
    import inspect

    from dustin.cli.main import build_parser
    from dustin.engine.config import GenerationConfig
    from dustin.llm import LLM

    defaults = {"generate": build_parser(["generate"]).parse_args(["generate", "--prompt", "x"]).method,
                "serve": build_parser(["serve"]).parse_args(["serve"]).method,
                "LLM": inspect.signature(LLM).parameters["method"].default,
                "GenerationConfig": GenerationConfig().method}
    assert defaults == dict.fromkeys(defaults, "dustin")

def test_every_method_flag_says_which_methods_are_lossy():
    """Each command's --method help names every method as lossless or lossy, by what the method does: the lossless
    ones verify against the whole cache."""
    from dustin.cli.docs import options, subparsers
    from dustin.cli.main import build_parser
    from dustin.engine.config import FULL_METHODS, LOSSY_METHODS, METHODS

    assert set(FULL_METHODS) | set(LOSSY_METHODS) == set(METHODS) and not set(FULL_METHODS) & set(LOSSY_METHODS)
    assert set(FULL_METHODS) == {"vanilla", "classic", "magicdec"} and "dustin" in LOSSY_METHODS
    seen = []

    def walk(path, parser):
        subs = subparsers(parser)
        for name, sub in subs.items():
            walk(path + [name], sub)
        action = options(parser).get("--method")
        if not subs and action is not None:
            seen.append(" ".join(path))
            lossless, lossy = action.help.split("Lossless")[1].split("Lossy")
            assert sorted(m.strip(" .") for m in lossless.split("):", 1)[1].split(",")) == sorted(FULL_METHODS)
            named = lossy.split("):", 1)[1].split(".")[0]
            assert [m.strip() for m in named.split(",")] == list(LOSSY_METHODS), path

    walk(["dustin"], build_parser())
    assert {"dustin generate", "dustin serve", "dustin bench sampling"} <= set(seen)


@pytest.mark.parametrize("gpu", [True, False])
def test_device_auto_is_the_gpu_when_there_is_one(monkeypatch, capsys, gpu):
    """`dustin demo` without flags loads on the GPU when torch sees one, else on the CPU; `dustin warmup` (whose
    default was cuda) too; Engine.from_pretrained and LLM accept `auto` through the same resolver."""
    import torch

    from dustin.engine import engine as engine_module
    from dustin.engine import pair as pair_module
    from dustin.errors import InputError

    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpu)
    loads = []

    def load(cls, target, draft=None, *, device="cpu", **kw):
        loads.append(device)
        raise InputError("stop before loading")
    monkeypatch.setattr(engine_module.Engine, "from_pretrained", classmethod(load))
    assert main(["demo"]) == 2 and capsys.readouterr().err == "dustin: error: stop before loading\n"
    assert loads == ["cuda" if gpu else "cpu"]
    code, err = _error(capsys, ["warmup", "--methods", "vanilla"])
    if gpu:
        assert code == 2 and loads[-1] == "cuda"  # planned for the GPU (the fake one stops at the load)
    else:
        assert code == 2 and "not for --device cpu" in err and len(loads) == 1
    assert pair_module.parse_device("auto") == torch.device("cuda" if gpu else "cpu")

@pytest.mark.parametrize("flag", [["--config", "x.json"], ["--budget", "64"]])
def test_sparse_flags_on_a_full_verification_method(capsys, flag):
    code, err = _error(capsys, ["generate", "--prompt", "x", "--method", "classic", *flag])
    assert code == 2 and f"{flag[0]} applies to sparse verification" in err


@pytest.mark.realmodels
def test_generate_json_on_the_default_pair(capsys, real_pair_cli):
    code = main(["generate", "--method", "classic", "--prompt", "def fibonacci(n):", "--max-new-tokens", "12",
                 "--ignore-eos", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0
    seq = out["sequences"][0]
    assert len(seq["token_ids"]) == 12 and seq["prompt_len"] > 3 and seq["text"]
    assert out["method"] == "classic" and out["tau"] >= 1.0 and set(out["time_split_s"]) >= {"draft", "verify"}
    # the phases split decode_s: the decode step launched with the prompt's last chunk is in prefill_s, not in them
    assert sum(v for k, v in out["time_split_s"].items() if k != "other") <= out["decode_s"] + 1e-3, out


@pytest.mark.parametrize("argv,needle", [
    (["--pairs", "qwen2.5-72b"], "target:draft"),
    (["--pairs", "qwen9-1t:qwen2.5-0.5b"], "unknown named config"),
    (["--methods", "vanilla,fastest"], "unknown methods"),
    (["--tau", "7"], "tau must be in"),
    (["--accept-prob", "1.5"], "--accept-prob must be in"),
    (["--contexts", "8k"], "--contexts wants"),
])
def test_bench_e2e_bad_flags(capsys, argv, needle):
    code, err = _error(capsys, ["bench", "e2e", "--device", "cpu", *argv])
    assert code == 2 and needle in err and "Traceback" not in err


@pytest.mark.realmodels
@pytest.mark.parametrize("prompt,needle", [("", "prompt 0 is empty"), ("word " * 40000, "more than the model context")])
def test_bad_prompt_is_rejected_before_the_models_load(capsys, monkeypatch, prompt, needle):
    """An empty or over-long prompt fails from config.json and the tokenizer alone (no weights read)."""
    from dustin.engine import engine as engine_module
    from dustin.models.fetch import resolve_model_path

    try:
        resolve_model_path("default", "target")
    except CheckpointError as e:
        pytest.skip(f"default pair not fetched: {e}")

    def no_load(*a, **k):
        raise AssertionError("the models were loaded before the prompt was checked")

    monkeypatch.setattr(engine_module.Engine, "from_pretrained", no_load)
    code, err = _error(capsys, ["generate", "--prompt", prompt])
    assert code == 2 and needle in err and err.count("\n") == 1, err


@pytest.mark.parametrize("native, dtype", [("0", "float32"), ("1", "bfloat16")])
def test_generate_json_reports_the_dtype_auto_chose(tiny_pair, capsys, monkeypatch, tmp_path, native, dtype):
    """`--dtype auto` (the default) on a CPU: fp32 where bf16 is not native (the suite's pinned answer, as on an
    AVX2-only machine), bf16 where it is; `--json` says which."""
    monkeypatch.setenv("DUSTIN_CPU_BF16", native)
    target, draft = tiny_pair
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": [5, 6, 7, 8]}) + "\n")
    code = main(["generate", "--target", str(target), "--draft", str(draft), "--method", "classic",
                 "--prompts-jsonl", str(prompts), "--max-new-tokens", "3", "--json"])
    assert code == 0
    assert json.loads(capsys.readouterr().out)["dtype"] == dtype


@pytest.mark.parametrize("argv, needle", [
    (["eval", "tasks", "--tasks", "code", "--json-out", "{tmp}/missing/r.json"],
     "--json-out {tmp}/missing/r.json: the folder {tmp}/missing does not exist"),
    (["eval", "needles", "--json-out", "{tmp}"], "--json-out {tmp} is a folder, not a file"),
    (["bench", "e2e", "--plot-out", "{tmp}/missing/p.png"],
     "--plot-out {tmp}/missing/p.png: the folder {tmp}/missing does not exist"),
    (["profile", "trace", "--out", "{tmp}/a-file/prof"], "--out {tmp}/a-file/prof: {tmp}/a-file is not a folder"),
])
def test_unwritable_outputs_are_refused_before_the_models_load(capsys, tmp_path, argv, needle):
    """The output paths are checked first (the target does not even exist here): a run is not spent on a result
    it cannot write."""
    (tmp_path / "a-file").write_text("")
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv] + ["--target", str(tmp_path / "no-model")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err == f"dustin: error: {needle.replace('{tmp}', str(tmp_path))}\n"


def test_an_io_error_is_one_line(capsys, monkeypatch):
    """An OSError no command turned into its own message (here: disk full while fetching) is one line, exit 1."""
    from dustin.models import fetch

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device", "/models/x")
    monkeypatch.setattr(fetch, "fetch_default_pair", full)
    assert main(["models", "fetch", "--quiet"]) == 1
    assert capsys.readouterr().err == "dustin: error: No space left on device: /models/x\n"


_NO_TORCH = """
import sys
from dustin.cli.main import main
try:
    main(sys.argv[1:])
except SystemExit as e:
    code = e.code
print("torch imported" if "torch" in sys.modules else "no torch", file=sys.stderr)
"""


@pytest.mark.parametrize("argv, shown", [
    (["--help"], "generate"),
    (["generate", "--help"], "--prompts-jsonl"),
    (["generate", "--max-new-tokens", "x", "--prompt", "a"], "invalid int value: 'x'"),
    (["bench", "--help"], "e2e"),
    (["eval", "--help"], "needles"),
    (["serve", "--help"], "--port"),
    (["bench", "e2e", "--help"], "--real"),
    (["bench", "attention", "--help"], "--contexts"),
    (["bench", "sampling", "--help"], "--sampler-only"),
    (["bench", "e2e", "--steps", "x"], "invalid int value: 'x'"),
    (["eval", "tasks", "--help"], "--samples"),
    (["eval", "needles", "--help"], "--depths"),
    (["eval", "fidelity", "--help"], "--methods"),
])
def test_help_and_flag_errors_do_not_import_torch(argv, shown):
    """`dustin --help`, a command's --help and a mistyped flag answer without importing torch (~2 s): only the
    subcommand that argv names gets its flags, and those of generate / serve / bench / eval are torch-free
    (but bench decode and eval arr-kl, whose modules use torch throughout)."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", _NO_TORCH, *argv], capture_output=True, text=True, timeout=120)
    assert shown in proc.stdout + proc.stderr, proc.stdout + proc.stderr
    assert proc.stderr.rstrip().endswith("no torch"), proc.stderr[-2000:]


def test_every_subcommand_keeps_its_flags():
    """Building the parser for one command leaves the others' flags out; each command, named, still gets all of
    its own (the same as the full parser's)."""
    from dustin.cli.docs import options, subparsers
    from dustin.cli.main import build_parser

    def flags(parser, path):
        for name in path:
            parser = subparsers(parser)[name]
        return sorted(options(parser))

    full = build_parser()
    for path in (["generate"], ["bench", "e2e"], ["bench", "serve"], ["bench", "sampling"], ["eval", "tasks"],
                 ["eval", "needles"], ["serve"], ["profile"], ["warmup"], ["demo"]):
        own = flags(build_parser(path), path)
        assert own == flags(full, path) and len(own) > 3, path
    assert flags(build_parser(["generate"]), ["bench", "e2e"]) == ["--help", "-h"]


@pytest.mark.parametrize("flag, on", [([], None), (["--draft-kernel"], True), (["--no-draft-kernel"], False)])
def test_the_draft_kernel_switch_reaches_every_engine_it_names(flag, on, tiny_pair, monkeypatch, tmp_path):
    """--draft-kernel / --no-draft-kernel (default: defaults.DRAFT_KERNEL) become ExecutionOptions.draft_kernel of
    the config that `dustin generate`, `dustin serve`, `dustin bench e2e` and `dustin bench serve` run."""
    from dustin.bench import e2e
    from dustin.bench import serve as bench_serve
    from dustin.cli.main import build_parser
    from dustin.defaults import DRAFT_KERNEL
    from dustin.engine.core import EngineCore
    from dustin.engine.engine import Engine
    from dustin.serve import cli as serve_cli

    want = DRAFT_KERNEL if on is None else on
    seen = {}
    monkeypatch.setattr(EngineCore, "from_pretrained", lambda *a, config, **k: seen.setdefault("serve", config))
    serve_cli.build_engine(build_parser(["serve"]).parse_args(["serve", *flag]))
    seen["bench serve"] = bench_serve._serve_config(
        build_parser(["bench", "serve"]).parse_args(["bench", "serve", *flag]), "dustin", 4)
    seen["bench e2e"] = e2e._config("dustin", build_parser(["bench", "e2e"]).parse_args(["bench", "e2e", *flag]), 4)
    real_generate = Engine.generate

    def generate(self, prompts, cfg, **kw):
        seen["generate"] = cfg
        return real_generate(self, prompts, cfg, **kw)

    monkeypatch.setattr(Engine, "generate", generate)
    target, draft = tiny_pair
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": [5, 6, 7, 8]}) + "\n")
    assert main(["generate", "--target", str(target), "--draft", str(draft), "--method", "classic",
                 "--prompts-jsonl", str(prompts), "--max-new-tokens", "2", *flag]) == 0
    assert {name: cfg.options.draft_kernel for name, cfg in seen.items()} == dict.fromkeys(
        ["serve", "bench serve", "bench e2e", "generate"], want)
