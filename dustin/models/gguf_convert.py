"""GGUF (qwen2 architecture) -> Hugging Face folder: config.json, bf16 model.safetensors, tokenizer files.

Why it is built this way (conversion used to take ~140 s for the default pair on a 16-core machine). Profiling
the serial converter on a 2-core CPU showed the time in: `gguf.GGUFReader` parsing the metadata (~6 s per
model: it builds a numpy memmap view per vocabulary string), the same parse again inside `AutoTokenizer`
(only to learn which tokenizer class a qwen2 model uses), `gguf`'s numpy dequantization in 16-row groups
(slow on the embedding, whose short rows make ~9500 tiny groups), and torch's `isfinite` on bf16. So:
  * the metadata is parsed once with `struct` over an mmap of the file (~0.2 s), never with `GGUFReader`;
  * a Qwen2 tokenizer is built from those parsed fields (`_qwen2_tokenizer`: 1.0 s instead of 4.9 s per model,
    the same files as transformers' GGUF loader writes); other tokenizers go through that loader;
  * worker processes (default: one per usable CPU) convert the tensors, largest first, tensors over 16M values
    cut into several jobs (`jobs_of`); each reads its job's bytes with `pread`, converts them in chunks of 4M
    values and `pwrite`s the bf16 bytes into the tensor's slot of the pre-sized safetensors file, so no tensor
    data crosses a pipe and a worker's memory does not grow with the tensor (~90 MB peak RSS each, measured);
  * fp32 -> bf16 rounding (nearest even, as torch does) and the NaN/inf check are plain numpy;
  * while the workers run, this process imports transformers, writes config.json and builds the tokenizer.
Every output file is byte-identical to the serial converter's (sha256 of all six files, both default models;
tests/models/test_fetch.py compares workers=1 with workers=2). The folder is still written under a temporary name
and renamed into place; a failing, killed or interrupted worker stops the others and the folder is removed.

Measured 2026-12-01 on a 2-core CPU (no GPU, shared with other jobs, so wall times vary by ~20%):
`convert_gguf(gguf, tmp, progress=False)` timed in a fresh `python3`, the serial converter imported from a
copy of the previous version of this file, 2 workers; CPU = user + sys of all processes; peak RSS summed over
the parent and its workers (sampled every 50 ms):
    qwen2.5-coder-1.5b-instruct  wall 42-50 s -> 9.9-11.8 s   CPU 51 s -> 18-22 s   peak RSS 4.3 GB -> 0.6 GB
    qwen2.5-coder-0.5b-instruct  wall 26-27 s -> 5.5-6.3 s    CPU 28 s -> 10-12 s   peak RSS 2.9 GB -> 0.6 GB
(the new peak is the parent, 0.44 GB, mostly torch and transformers, plus ~90 MB per worker). The whole
`python3 -m dustin models fetch --home <folder holding only the two GGUFs>` (re-hash both, convert both) took
16.2 s on a quiet machine, 25 s beside another job's test run. With one worker, in this process: 17.9 s and 8.6 s.
On the 16-core H200 machine the same command took 44.8-64.1 s over three runs (2026-12-02). Its last "ready" lines
(conversion 25.7 s + 12.5 s) said the tensors were done no later than this process's files: the critical path was
transformers' import and the tokenizer, not the 16 workers. So (2026-12-02, 2-core CPU, `dustin models fetch
--home <folder holding only the two GGUFs>`): this process's files are done at 6.2-6.4 s instead of 8.7 s (1.5B,
transformers' import included) and 2.4-3.0 s instead of 5.7 s (0.5B), and the tensors' longest job is 0.4 s
(16-worker makespan from single-process job times: 1.2 s for the 1.5B instead of 2.8 s, 0.8 s for the 0.5B
instead of 1.8 s). On 2 cores the tensors side still dominates (31-33 s in all, 35 s before, on an AVX2 2-core
CPU slower than the one that measured 16.2 s above).
"""
from __future__ import annotations

import contextlib
import json
import math
import mmap
import os
import re
import shutil
import struct
import sys
import tempfile
from pathlib import Path
from typing import NamedTuple

from dustin.errors import CheckpointError, DustinError
from dustin.models.progress import bar, spinner

MARKER = "dustin-source.json"  # written last into a finished folder (see fetch.py)
WORKERS_ENV = "DUSTIN_CONVERT_WORKERS"  # overrides the default worker count (the number of usable CPUs)

_GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLOCK_TENSORS = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
                  "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                  "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                  "ffn_down": "mlp.down_proj"}
_REQUIRED = object()

# Chunking of one tensor. gguf's `dequantize` works over rows in groups of 16; we hand it rows of ~16K
# elements (a whole number of blocks) instead of the tensor's own rows, so each group is big enough for
# numpy to beat Python overhead (the 1.5B embedding: 1.9 s -> 1.0 s). Every block dequantizes on its own,
# so the values do not depend on how blocks are grouped. A chunk is 256 such rows: 4M elements, 16 MB fp32.
_ROW_ELEMENTS = 1 << 14
_ROWS_PER_CHUNK = 256
_JOB_VALUES = 1 << 24  # a tensor larger than this is converted as several jobs (see `jobs_of`)
_MAX_PARALLEL_JOBS = 4096  # 4-byte job records that fit any pipe buffer (16 KB), written before a worker reads


class ConversionTimes(NamedTuple):
    """Where a conversion's wall time went (seconds from its start): the files this process writes beside the
    workers (config, generation config, tokenizer: transformers' import included) were done at `files_s`, every
    tensor at `tensors_s`; `workers` processes converted the tensors (1: this process, after the files)."""
    files_s: float
    tensors_s: float
    workers: int

    def describe(self) -> str:
        where = f"{self.workers} worker processes" if self.workers > 1 else "this process"
        return f"tensors done at {self.tensors_s:.1f} s on {where}, config and tokenizer at {self.files_s:.1f} s"


def convert_gguf(gguf_path: Path, out_dir: Path, progress: bool = True, marker: dict | None = None,
                 workers: int | None = None, times: list | None = None) -> Path:
    """Convert a Qwen2 GGUF into a Hugging Face folder (bf16 safetensors), written atomically to `out_dir`.

    We dequantize ourselves rather than use transformers' GGUF loader (it needs `accelerate` and holds the
    whole model in memory). `workers` processes (default: $DUSTIN_CONVERT_WORKERS, else one per usable CPU)
    convert tensors in parallel in bounded chunks; `workers=1` converts in this process, with the same bytes.
    `times`: a list that gets this conversion's `ConversionTimes` appended (what `dustin models fetch` prints).
    """
    import time
    t0 = time.perf_counter()
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    header = read_gguf(gguf_path)
    config_args, plan = plan_conversion(header, gguf_path)
    workers = worker_count(workers, len(plan))
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f"{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        with _TensorWriter(plan, tmp / "model.safetensors", gguf_path, workers) as weights:
            # the workers are busy with the weights; transformers (~1.5 s to import) and the small files meanwhile
            from transformers import Qwen2Config
            config = Qwen2Config(**config_args)
            config.save_pretrained(tmp)
            from transformers import GenerationConfig
            GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id,
                             pad_token_id=config.pad_token_id).save_pretrained(tmp)
            write_tokenizer(gguf_path, header.fields, config, tmp, progress)
            files_s = time.perf_counter() - t0
            weights.finish(progress)
            if times is not None:
                times.append(ConversionTimes(files_s, time.perf_counter() - t0, len(weights.procs) or 1))
        if marker is not None:  # written last: its presence means the folder is complete
            (tmp / MARKER).write_text(json.dumps(marker, indent=2) + "\n")
        _replace_dir(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def check_gguf(gguf_path: Path) -> dict:
    """The metadata fields of a GGUF file that `convert_gguf` can convert (its header read and its conversion
    planned, nothing written); else one CheckpointError line."""
    header = read_gguf(Path(gguf_path))
    plan_conversion(header, Path(gguf_path))
    return header.fields


_CGROUP = Path("/sys/fs/cgroup")


def cpu_quota(root: Path | None = None) -> float | None:
    """CPUs' worth of time the container's cgroup allows (v2 `cpu.max`, v1 `cpu/cpu.cfs_quota_us` over
    `cpu.cfs_period_us`), or None without a quota. A container may see 16 CPUs in its affinity mask and be
    allowed the time of fewer; one worker per visible CPU would then oversubscribe it (as Go's and Java's runtimes
    also read these files)."""
    root = root or _CGROUP
    try:
        quota, period = (root / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period = int((root / "cpu" / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return quota / period if quota > 0 and period > 0 else None


def worker_count(workers: int | None, tensors: int) -> int:
    """The argument, else $DUSTIN_CONVERT_WORKERS, else the CPUs this process may run on (os.cpu_count()
    where the OS cannot say) within its cgroup's CPU quota; never more than there are tensors."""
    if workers is None:
        env = os.environ.get(WORKERS_ENV, "").strip()
        if env:
            try:
                workers = int(env)
            except ValueError:
                raise DustinError(f"{WORKERS_ENV} must be a whole number of processes, got {env!r}") from None
        else:
            workers = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
            quota = cpu_quota()
            if quota is not None:
                workers = min(workers, max(1, math.ceil(quota)))
    if workers < 1:
        raise DustinError(f"the conversion needs at least 1 worker process, got {workers}")
    return max(1, min(workers, tensors))


# --- reading the GGUF header ------------------------------------------------------------------------------

class _Tensor(NamedTuple):
    name: str
    dims: tuple[int, ...]  # as GGUF lists them: the fastest-varying dimension first
    ggml_type: int
    start: int  # absolute offset of its data in the file
    nbytes: int


class _GGUFHeader(NamedTuple):
    fields: dict  # metadata key -> Python value (str, int, float, bool, or list of those)
    tensors: list[_Tensor]


_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q",
            12: "<d"}  # GGUF metadata value types with a fixed size; 8 is a string, 9 an array


def read_gguf(path: Path) -> _GGUFHeader:
    """Parse the metadata and tensor table (GGUF v2/v3, little-endian) without touching the tensor data.

    Not `gguf.GGUFReader`: it takes ~6 s on a 150K-token vocabulary because it makes a numpy view per string;
    plain `struct` over an mmap reads the same values (as `ReaderField.contents()` would return them) in ~0.3 s.
    Every way a damaged file can fail here becomes one CheckpointError line.
    """
    if not path.is_file():
        raise CheckpointError(f"GGUF file {path} does not exist")
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as blob:
            return _parse_header(blob, len(blob))
    except (ValueError, struct.error, UnicodeDecodeError, OverflowError, MemoryError, RecursionError) as e:
        raise CheckpointError(f"{path} is not a readable GGUF file (corrupt or truncated?): {e}") from None


def _parse_header(blob, size: int) -> _GGUFHeader:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    pos = 0

    def unpack(fmt: str) -> tuple:
        nonlocal pos
        values = struct.unpack_from(fmt, blob, pos)
        pos += struct.calcsize(fmt)
        return values

    def one(fmt: str):
        return unpack(fmt)[0]

    def string() -> str:
        nonlocal pos
        length = one("<Q")
        if pos + length > size:
            raise ValueError(f"a string of {length} bytes at offset {pos} runs past the end of the file")
        pos += length
        return blob[pos - length:pos].decode("utf-8")

    def value(kind: int):
        if kind in _SCALARS:
            return one(_SCALARS[kind])
        if kind == 8:
            return string()
        if kind == 9:
            item_kind, count = unpack("<IQ")
            if item_kind in _SCALARS:
                return list(unpack(f"<{count}{_SCALARS[item_kind][1]}"))
            return [value(item_kind) for _ in range(count)]
        raise ValueError(f"unknown metadata value type {kind}")

    if blob[:4] != b"GGUF":
        raise ValueError("it does not start with the GGUF magic bytes")
    pos = 4
    version = one("<I")
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version} (big-endian or too old/new: dustin reads v2 and v3)")
    tensor_count, kv_count = unpack("<QQ")
    fields = {}
    for _ in range(kv_count):
        key = string()
        if key in fields:
            raise ValueError(f"the metadata key {key} appears twice")
        fields[key] = value(one("<I"))
    table = []
    for _ in range(tensor_count):
        name = string()
        dims = unpack(f"<{one('<I')}Q")
        table.append((name, dims) + unpack("<IQ"))
    alignment = fields.get("general.alignment", 32)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(f"general.alignment is {alignment!r}, not a power of two")
    data_start = -(-pos // alignment) * alignment
    tensors, names = [], set()
    for name, dims, kind, offset in table:
        if name in names:
            raise ValueError(f"the tensor {name} appears twice")
        names.add(name)
        try:
            block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
        except (ValueError, KeyError):
            raise ValueError(f"tensor {name} has unknown ggml type {kind}") from None
        elements = math.prod(dims)
        if elements % block:
            raise ValueError(f"tensor {name} has {elements} values, not a whole number of {block}-value blocks")
        start, nbytes = data_start + offset, elements // block * type_size
        if start + nbytes > size:
            raise ValueError(f"tensor {name} ends at byte {start + nbytes} but the file has {size} bytes")
        tensors.append(_Tensor(name, dims, kind, start, nbytes))
    return _GGUFHeader(fields, tensors)


def _meta(fields: dict, key: str, path: Path, default=_REQUIRED):
    if key not in fields:
        if default is _REQUIRED:
            raise CheckpointError(f"{path}: the GGUF metadata lacks {key}")
        return default
    return fields[key]


# --- planning ---------------------------------------------------------------------------------------------

def plan_conversion(header: _GGUFHeader, path: Path):
    """The Qwen2Config arguments, and (hf_name, tensor, shape) for every weight, checked before writing anything.

    Arguments rather than the config itself: building it imports transformers, which the caller does while
    the workers already convert.
    """
    arch = _meta(header.fields, "general.architecture", path)
    if arch != "qwen2":
        raise CheckpointError(f"{path}: GGUF architecture {arch!r} is not supported (dustin converts qwen2)")

    def meta(key, default=_REQUIRED):
        return _meta(header.fields, key, path, default)
    tokens = meta("tokenizer.ggml.tokens")
    hidden, layers = int(meta("qwen2.embedding_length")), int(meta("qwen2.block_count"))
    heads, inter = int(meta("qwen2.attention.head_count")), int(meta("qwen2.feed_forward_length"))
    kv_heads = int(meta("qwen2.attention.head_count_kv", heads))
    tensors = {t.name: t for t in header.tensors}
    tie = "output.weight" not in tensors  # llama.cpp writes output.weight only when the head is untied
    eos = [int(meta("tokenizer.ggml.eos_token_id"))]
    if "<|endoftext|>" in tokens and tokens.index("<|endoftext|>") not in eos:
        eos.append(tokens.index("<|endoftext|>"))  # upstream Qwen generation_config stops on both
    config_args = dict(
        architectures=["Qwen2ForCausalLM"], vocab_size=len(tokens), hidden_size=hidden, intermediate_size=inter,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        max_position_embeddings=int(meta("qwen2.context_length", 32768)),
        # GGUF stores float32: 9.99999997e-07 back to the 1e-06 of the upstream config
        rms_norm_eps=float(f'{meta("qwen2.attention.layer_norm_rms_epsilon", 1e-6):.7g}'),
        rope_parameters={"rope_type": "default", "rope_theta": float(meta("qwen2.rope.freq_base", 1e6))},
        tie_word_embeddings=tie, use_sliding_window=False, max_window_layers=layers, dtype="bfloat16",
        bos_token_id=meta("tokenizer.ggml.bos_token_id", None), eos_token_id=eos if len(eos) > 1 else eos[0],
        pad_token_id=meta("tokenizer.ggml.padding_token_id", None))
    q, kv = heads * (hidden // heads), kv_heads * (hidden // heads)
    shapes = {"model.embed_tokens.weight": (len(tokens), hidden), "model.norm.weight": (hidden,)}
    if not tie:
        shapes["lm_head.weight"] = (len(tokens), hidden)
    for i in range(layers):
        block = {"input_layernorm.weight": (hidden,), "post_attention_layernorm.weight": (hidden,),
                 "self_attn.q_proj.weight": (q, hidden), "self_attn.q_proj.bias": (q,),
                 "self_attn.k_proj.weight": (kv, hidden), "self_attn.k_proj.bias": (kv,),
                 "self_attn.v_proj.weight": (kv, hidden), "self_attn.v_proj.bias": (kv,),
                 "self_attn.o_proj.weight": (hidden, q), "mlp.gate_proj.weight": (inter, hidden),
                 "mlp.up_proj.weight": (inter, hidden), "mlp.down_proj.weight": (hidden, inter)}
        shapes.update({f"model.layers.{i}.{name}": shape for name, shape in block.items()})
    plan = []
    for name, tensor in tensors.items():
        hf_name = _hf_tensor_name(name)
        shape = tuple(int(d) for d in reversed(tensor.dims))  # GGUF lists the fastest-varying dim first
        if hf_name not in shapes:
            raise CheckpointError(f"{path}: unexpected tensor {name} for a qwen2 model")
        if shape != shapes[hf_name]:
            raise CheckpointError(f"{path}: tensor {name} has shape {shape}, expected {shapes[hf_name]}")
        plan.append((hf_name, tensor, shape))
    missing = sorted(shapes.keys() - {hf_name for hf_name, _, _ in plan})
    if missing:
        raise CheckpointError(f"{path}: {len(missing)} weights are missing, e.g. {missing[0]}")
    return config_args, plan


def _hf_tensor_name(name: str) -> str | None:
    module, _, kind = name.rpartition(".")
    if module in _GLOBAL_TENSORS:
        return f"{_GLOBAL_TENSORS[module]}.{kind}"
    block = re.fullmatch(r"blk\.(\d+)\.(\w+)", module)
    if block and block.group(2) in _BLOCK_TENSORS:
        return f"model.layers.{block.group(1)}.{_BLOCK_TENSORS[block.group(2)]}.{kind}"
    return None


# --- writing the weights ----------------------------------------------------------------------------------

class _Job(NamedTuple):
    """A run of whole blocks of one tensor (all of a small one): where its GGUF bytes are, and where its bf16
    bytes go in the output file."""
    name: str
    ggml_type: int
    start: int
    nbytes: int
    out_offset: int


def jobs_of(tensor: _Tensor, out_offset: int) -> list[_Job]:
    """The tensor as jobs of at most ~`_JOB_VALUES` values, each a whole number of `_convert_tensor`'s chunks.

    Why: one job per tensor left the two vocabulary-sized tensors (embedding and lm head, 2.8 s and 2.5 s of
    the 1.5B's 19.6 CPU-s on our CPU) as the critical path on 16 workers: a makespan of 2.8 s against 1.2 s of
    evenly shared work. A job's blocks are a whole number of the tensor's chunks, so each is dequantized in the
    same row groups, and the last (partial) job in groups at least as long as the whole tensor's.
    """
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(tensor.ggml_type)]
    blocks = tensor.nbytes // type_size
    chunk_blocks = math.gcd(blocks, max(1, _ROW_ELEMENTS // block)) * _ROWS_PER_CHUNK
    job_blocks = chunk_blocks * max(1, _JOB_VALUES // (chunk_blocks * block))
    return [_Job(tensor.name, tensor.ggml_type, tensor.start + first * type_size,
                 min(job_blocks, blocks - first) * type_size, out_offset + 2 * first * block)
            for first in range(0, blocks, job_blocks)]


class _TensorWriter:
    """Writes model.safetensors: the header here, the tensors by `workers` processes (or here when 1).

    The safetensors header only needs names, shapes and offsets, so we write it first, size the file, and let
    each worker `pwrite` its tensors into their slots: no tensor data goes through a pipe, and the file's
    bytes do not depend on which worker converts what. Entering starts the workers; `finish` waits for them
    behind the progress bar; leaving, however it happens, stops and reaps every worker, so the caller can
    then delete the half-written file.

    The workers are plain `python -c` subprocesses, not multiprocessing: spawn/forkserver re-import the
    caller's main script (a script without an `if __name__ == "__main__"` guard would run again), and fork
    copies our threads and locks (torch's, rich's) in whatever state they are in. They share two pipes: one
    holding every job index as a 4-byte record, all written before any worker starts, so each 4-byte read
    takes one whole record (a worker takes the next job when it is free, so the big tensors do not pile up
    on one worker); and one they report on, one line per job, each shorter than PIPE_BUF, so lines never
    interleave. They run in their own session: Ctrl-C reaches only us, and we terminate them.
    """

    def __init__(self, plan, dest: Path, path: Path, workers: int):
        import numpy as np
        self.dest, self.path, self.procs, self.results = dest, path, [], None
        header, offset, jobs = {"__metadata__": {"format": "pt"}}, 0, []
        for hf_name, tensor, shape in plan:
            nbytes = 2 * int(np.prod(shape))
            header[hf_name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            jobs += jobs_of(tensor, offset)
            offset += nbytes
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)  # like safetensors itself: keep the tensor data 8-byte aligned
        self.jobs = [job._replace(out_offset=job.out_offset + 8 + len(blob)) for job in jobs]
        self.jobs.sort(key=lambda job: -job.nbytes)  # largest first, so no worker ends long after the others
        self.workers = workers if len(self.jobs) <= _MAX_PARALLEL_JOBS else 1
        with open(dest, "wb") as out:
            out.write(struct.pack("<Q", len(blob)) + blob)
            out.truncate(8 + len(blob) + offset)  # the slots the workers fill

    def __enter__(self) -> "_TensorWriter":
        if self.workers == 1 or not sys.executable:  # no interpreter to start (embedded Python): convert here
            return self
        import subprocess
        jobs_r, jobs_w = os.pipe()
        self.results, results_w = os.pipe()
        self.buffer = b""
        try:
            # every record is in the pipe before any worker reads, so no read can return part of one
            os.write(jobs_w, b"".join(struct.pack("<I", i) for i in range(len(self.jobs))))
            root = str(Path(__file__).resolve().parents[2])  # so the workers import this very copy of dustin
            code = ("import sys; sys.path.insert(0, sys.argv[1]); "
                    "from dustin.models.gguf_convert import _worker_main; _worker_main(*sys.argv[2:])")
            for _ in range(self.workers):
                self.procs.append(subprocess.Popen(
                    [sys.executable, "-c", code, root, str(self.path), str(self.dest), str(jobs_r), str(results_w)],
                    stdin=subprocess.PIPE, pass_fds=(jobs_r, results_w), start_new_session=True))
            table = json.dumps([list(job) for job in self.jobs]).encode()
            for proc in self.procs:  # all started first: each reads its copy as soon as it is up
                try:
                    proc.stdin.write(table)
                    proc.stdin.close()
                except BrokenPipeError:  # it died already: `finish` reports that, with its exit code
                    with contextlib.suppress(OSError):
                        proc.stdin.close()
        except BaseException:
            self.__exit__()
            raise
        finally:  # the workers hold their own copies; ours would keep EOF from ever coming
            os.close(jobs_r)
            os.close(jobs_w)
            os.close(results_w)
        return self

    def finish(self, progress: bool) -> None:
        with bar(progress, f"converting {self.path.name}", len(self.jobs)) as advance:
            if not self.procs:
                with open(self.path, "rb") as src, open(self.dest, "r+b") as out:
                    for job in self.jobs:
                        _convert_tensor(src.fileno(), out.fileno(), job, str(self.path))
                        advance()
                return
            for _ in self.jobs:
                report = self._next_report()
                if "error" in report:
                    raise rebuild_error(report)
                advance()

    def _next_report(self) -> dict:
        import select
        while b"\n" not in self.buffer:
            # looked at before reading: a worker that exited before the pipe turned out empty left no report
            codes = [proc.poll() for proc in self.procs]
            if select.select([self.results], [], [], 0.5)[0]:
                chunk = os.read(self.results, 1 << 16)
                if chunk:
                    self.buffer += chunk
                    continue
            crashed = [code for code in codes if code not in (None, 0)]
            if crashed or None not in codes:
                raise DustinError(
                    f"converting {self.path.name}: a worker process stopped (exit code "
                    f"{crashed[0] if crashed else 0}) before converting every tensor (out of memory?). "
                    f"Retry with fewer workers, e.g. {WORKERS_ENV}=1")
        line, self.buffer = self.buffer.split(b"\n", 1)
        return json.loads(line)

    def __exit__(self, *exc) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs:
            proc.wait()
        self.procs = []
        if self.results is not None:
            os.close(self.results)
            self.results = None


def _worker_main(path: str, dest: str, jobs_fd: str, results_fd: str) -> None:
    """A worker process: convert the job the next record of the job pipe names, until the pipe is empty."""
    jobs = [_Job(*job) for job in json.load(sys.stdin)]
    jobs_fd, results_fd = int(jobs_fd), int(results_fd)
    src, out = os.open(path, os.O_RDONLY), os.open(dest, os.O_WRONLY)
    while (record := os.read(jobs_fd, 4)):
        index = struct.unpack("<I", record)[0]
        try:
            _convert_tensor(src, out, jobs[index], path)
        except Exception as e:  # reported, and this worker stops: the parent is about to stop them all
            os.write(results_fd, error_report(index, e).encode() + b"\n")
            return
        os.write(results_fd, json.dumps({"index": index}).encode() + b"\n")


def error_report(index: int, error: Exception) -> str:
    """One JSON line under PIPE_BUF (4096 bytes), so that it reaches the parent in one piece."""
    message = str(error)
    while True:
        line = json.dumps({"index": index, "error": type(error).__name__, "message": message,
                           "errno": getattr(error, "errno", None), "strerror": getattr(error, "strerror", None),
                           "filename": str(getattr(error, "filename", None) or "")[:1000]})
        if len(line) < 4000:
            return line
        message = message[:len(message) // 2] + "..."


def rebuild_error(report: dict) -> Exception:
    """A worker's exception, as the type the callers handle: CheckpointError, OSError (disk full...), else any."""
    if report["error"] == "CheckpointError":
        return CheckpointError(report["message"])
    if report["errno"] is not None:
        return OSError(report["errno"], report["strerror"], report["filename"] or None)
    return RuntimeError(f"converting a tensor failed: {report['error']}: {report['message']}")


def _convert_tensor(src: int, out: int, job: _Job, path: str) -> None:
    """Dequantize one tensor chunk by chunk and write its bf16 bytes at `job.out_offset`."""
    import numpy as np
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, dequantize
    qtype = GGMLQuantizationType(job.ggml_type)
    block, type_size = GGML_QUANT_SIZES[qtype]
    blocks = job.nbytes // type_size
    row_blocks = math.gcd(blocks, max(1, _ROW_ELEMENTS // block))  # rows must tile the tensor exactly
    chunk_blocks = row_blocks * _ROWS_PER_CHUNK
    for first in range(0, blocks, chunk_blocks):
        count = min(chunk_blocks, blocks - first)
        raw = os.pread(src, count * type_size, job.start + first * type_size)
        if len(raw) != count * type_size:
            raise CheckpointError(f"{path}: the data of {job.name} is cut short: the GGUF is truncated")
        rows = np.frombuffer(raw, np.uint8).reshape(-1, row_blocks * type_size)
        try:
            values = np.ascontiguousarray(dequantize(rows, qtype), np.float32).reshape(-1)
        except Exception as e:
            raise CheckpointError(f"{path}: cannot dequantize {job.name} (corrupt?): {e}") from None
        _pwrite_all(out, to_bf16(values, job.name, path), job.out_offset + 2 * first * block)


def to_bf16(values, name: str, path: str):
    """fp32 -> bf16 bits (little-endian uint16), rounding to nearest even exactly as torch's `.to(bfloat16)`.

    numpy rather than torch keeps torch out of the workers (import time, threads). A NaN, an inf, or a value
    that would round past the largest bf16 (to inf) is an error, as before; min/max see all three (NaN
    propagates) without a temporary array. The rounding runs over 256K-value slices that stay in the CPU
    cache, which halves its time compared with whole-chunk numpy expressions.
    """
    import numpy as np
    limit = np.uint32(0x7F7F8000).view(np.float32)  # the smallest float that rounds to the bf16 inf
    if values.size and not (-limit < values.min() and values.max() < limit):
        raise CheckpointError(f"{path}: tensor {name} holds NaN/inf values: the GGUF is corrupt")
    bits = values.view(np.uint32)
    half = np.empty(values.size, "<u2")
    step = 1 << 18
    scratch = np.empty(min(step, values.size), np.uint32)
    for first in range(0, values.size, step):
        src = bits[first:first + step]
        rounded = scratch[:src.size]
        np.right_shift(src, 16, out=rounded)
        rounded &= 1
        rounded += 0x7FFF
        rounded += src  # bits + 0x7FFF + (lowest kept bit): no wrap-around, finite values are < 0xFF800000
        rounded >>= 16
        half[first:first + step] = rounded
    return half


def _pwrite_all(fd: int, data, offset: int) -> None:
    view = memoryview(data).cast("B")
    while view:
        written = os.pwrite(fd, view, offset)
        view, offset = view[written:], offset + written


# --- tokenizer and folder ---------------------------------------------------------------------------------

def write_tokenizer(path: Path, fields: dict, config, out: Path, progress: bool) -> None:
    """The tokenizer files of the GGUF at `path` (its parsed `fields`) into the folder `out`: tokenizer.json,
    tokenizer_config.json (with the chat template and `config`'s context length), chat_template.jinja."""
    from transformers.utils import logging as hf_logging
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        with spinner(progress, f"building the tokenizer of {path.name}"):
            if is_qwen2_bpe(fields):
                tokenizer = _qwen2_tokenizer(fields)
            else:
                tokenizer = tokenizer_from_gguf(path, fields)
    except Exception as e:
        raise CheckpointError(f"{path}: cannot build a tokenizer from the GGUF metadata: {e}") from None
    finally:
        hf_logging.set_verbosity(verbosity)
    tokenizer.model_max_length = config.max_position_embeddings
    tokenizer.save_pretrained(out)
    # transformers 5 saves the template as chat_template.jinja; keep a copy in tokenizer_config.json
    # for readers that only look there (transformers 4, other tools)
    config_file = out / "tokenizer_config.json"
    tokenizer_config = json.loads(config_file.read_text())
    for key in ("is_local", "local_files_only"):  # describe this load, not the model
        tokenizer_config.pop(key, None)
    template = _meta(fields, "tokenizer.chat_template", path, None)
    if template:
        tokenizer_config["chat_template"] = template
    config_file.write_text(json.dumps(tokenizer_config, indent=2, ensure_ascii=False) + "\n")


# the GGUF tokenizer keys transformers' loader turns into tokenizer_config arguments, and their names there
_TOKENIZER_FLAGS = {"tokenizer.ggml.add_bos_token": "add_bos_token", "tokenizer.ggml.add_eos_token": "add_eos_token"}
_SPECIAL_IDS = {"bos_token": "tokenizer.ggml.bos_token_id", "eos_token": "tokenizer.ggml.eos_token_id",
                "pad_token": "tokenizer.ggml.padding_token_id", "unk_token": "tokenizer.ggml.unknown_token_id"}


def is_qwen2_bpe(fields: dict) -> bool:
    """A byte-level BPE vocabulary with Qwen2's pre-tokenizer and its merges: what `_qwen2_tokenizer` builds."""
    return (fields.get("tokenizer.ggml.model") == "gpt2" and fields.get("tokenizer.ggml.pre") == "qwen2"
            and "tokenizer.ggml.merges" in fields and "tokenizer.ggml.add_space_prefix" not in fields)


def _qwen2_tokenizer(fields: dict):
    """transformers' `Qwen2Tokenizer` from the vocabulary and merges we already parsed.

    What transformers' GGUF loader builds for such a file, step for step (the vocabulary in the byte alphabet,
    the file's merges, CONTROL tokens (type 3) added as special, USER_DEFINED (type 4) as plain added tokens,
    both on the backend tokenizer; the special tokens named by their ids), without its own pass over the
    metadata: that pass makes a numpy view per vocabulary string and took 3.5 of the 4.9 s the tokenizer cost
    per model (2-core CPU), on the conversion's critical path. For both default GGUFs, tokenizer.json,
    tokenizer_config.json and chat_template.jinja came out byte-identical to the loader's under transformers 5.24
    (and the same under 5.17, whose loader differs: `tokenizer_from_gguf`); tests/models/test_fetch.py checks the files
    against the GGUF's fields and the encodings against the loader's.
    """
    from tokenizers import AddedToken
    from transformers import Qwen2Tokenizer
    from transformers.convert_slow_tokenizer import bytes_to_unicode
    tokens = fields["tokenizer.ggml.tokens"]
    types = fields.get("tokenizer.ggml.token_type") or [1] * len(tokens)  # 1: NORMAL
    spelling = bytes_to_unicode()
    alphabet = set(spelling.values())
    vocab = {token if set(token) <= alphabet else "".join(spelling[b] for b in token.encode("utf-8")): index
             for index, token in enumerate(tokens)}
    merges = [tuple(merge.split(" ")) for merge in fields["tokenizer.ggml.merges"]]
    specials = {name: tokens[fields[key]] if key in fields else None for name, key in _SPECIAL_IDS.items()}
    flags = {name: fields[key] for key, name in _TOKENIZER_FLAGS.items() if key in fields}
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=merges, **specials, **flags)
    backend = tokenizer.backend_tokenizer
    # a CONTROL token spelled outside the byte alphabet is a mislabel of the file; the loader skips those too
    kinds = list(zip(tokens, types, strict=True))
    backend.add_special_tokens([AddedToken(token, normalized=False, special=True)
                                for token, kind in kinds if kind == 3 and set(token) <= alphabet])
    backend.add_tokens([AddedToken(token, normalized=False, special=False)
                        for token, kind in kinds if kind == 4 and token in vocab])
    template = fields.get("tokenizer.chat_template")
    if template:
        tokenizer.chat_template = template
    return tokenizer


def tokenizer_from_gguf(path: Path, fields: dict):
    """Any other tokenizer: transformers' GGUF loader reads the file's metadata itself.

    What it builds depends on the transformers version: for the default pair, 5.17 keeps 3 of the 22 added
    tokens and names <|endoftext|> as eos (the file says <|im_end|>); 5.24 writes what `_qwen2_tokenizer` writes.
    """
    from tokenizers import normalizers
    from transformers import AutoTokenizer
    # tokenizer_type names the class up front: without it AutoTokenizer parses the whole GGUF metadata
    # a second time with gguf.GGUFReader only to learn that a qwen2 model uses the Qwen2 tokenizer
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, tokenizer_type="qwen2")
    if fields.get("tokenizer.ggml.pre") == "qwen2":
        # upstream Qwen2 tokenizer.json normalizes to NFC; transformers' GGUF converter drops that step
        tokenizer.backend_tokenizer.normalizer = normalizers.NFC()
    return tokenizer


def _replace_dir(tmp: Path, final: Path) -> None:
    old = None
    if final.exists():  # --force or a stale folder: move it aside first, a directory rename can't overwrite
        old = final.with_name(f"{final.name}.old-{os.getpid()}")
        os.replace(final, old)
    os.chmod(tmp, 0o755)  # mkdtemp made it private to us; a model folder is not a secret
    os.replace(tmp, final)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
