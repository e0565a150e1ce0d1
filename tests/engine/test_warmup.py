"""The kernel warm-up (dustin/engine/warmup.py): its plan is exactly the set of Triton launches (kernel and
specialization) of a real first decode step, it leaves the models and other threads alone, its placeholders bind
like the tensors they stand for, it is inert on the CPU, and the engine loop prefills while it compiles and
decodes only after waiting for it.

Kernels run in Triton's interpreter here (conftest), which compiles nothing; the launches are recorded all the
same, so the plan is checked against real steps on the CPU (the fused layer kernels, used for CUDA tensors only,
are not in these steps: on a GPU `scripts/gpu_first_step_compile.py` at commit ecedb80 counted what the first
step still compiled)."""
from __future__ import annotations

import os
import random
import threading

import pytest
import torch

from dustin.engine.config import GenerationConfig
from dustin.engine.engine import Engine
from dustin.engine.kv_manager import KVManager
from dustin.engine.warmup import Launch, plan_first_step, record_launches, start_kernel_warmup
from dustin.engine.worker.runner import Runner
from tests.offline import offline

SPARSE = dict(budget=24, draft_window=32)


@pytest.fixture(scope="module")
def triton_pair(tmp_path_factory):
    """A tiny pair with head_dim 16 (the Triton kernels' smallest), on the Triton attention backend."""
    from tests.tiny_models import make_tiny_checkpoint, make_tiny_draft

    root = tmp_path_factory.mktemp("warmup_pair")
    target = make_tiny_checkpoint(root / "t", "qwen2", layers=3, heads=4, kv_heads=2, seed=1)
    draft = make_tiny_draft(target, root / "d", noise=0.1)
    return Engine.from_pretrained(str(target), str(draft), attention="triton")


def _cfg(method: str) -> GenerationConfig:
    return GenerationConfig(method=method,
                            **(SPARSE if method in ("dustin", "dustin-t", "streaming") else {"draft_window": 32}))


PAD = 256  # tokens per packed prefill forward in these sessions


def _real_run(engine, cfg, slots: int, cap: int, steps: int = 2) -> list[set]:
    """The launch signatures of a slot session's first packed prefill forward (prompts of different lengths, as
    the engine loop packs them) and of its first `steps` decode steps (launched a step ahead, as the loop does)."""
    draft = engine.pair.draft if cfg.spec.speculative else None
    kv = KVManager({"target": engine.pair.target} | ({} if draft is None else {"draft": draft}), slots, cap)
    s = Runner(engine.pair.target, draft, cfg, engine.pair.vocab_limit, engine.pair.make_policy(cfg), kv=kv,
               max_new_tokens=cap)
    rng = random.Random(0)
    lens = [40 + 13 * r for r in range(slots)]
    for r, n in enumerate(lens):
        s.admit(r, [rng.randrange(3, 90) for _ in range(n)], 8)
    with record_launches(execute=True) as launches:
        s.prefill(list(enumerate(lens)), pad_to=PAD)
    out = [{x.signature for x in launches}]
    for _ in range(steps):
        with record_launches(execute=True) as launches:
            s.complete(s.launch(overlapped=s.overlappable))
        out.append({x.signature for x in launches})
    return out


def _plan(engine, cfg, slots: int, cap: int):
    return plan_first_step(engine.pair, cfg, slots, cap, prefill_tokens=PAD, prefill_chunk=32)


def _module_attributes(models) -> list[dict]:
    """Every module's attributes and its parameter, buffer and submodule tables, by identity."""
    tables = ("_parameters", "_buffers", "_modules")
    return [{k: id(v) for k, v in vars(m).items() if k not in tables} | {t: {k: id(v) for k, v in getattr(m, t).items()}
                                                                          for t in tables}
            for model in models for m in model.modules()]


@pytest.mark.parametrize("method", ["vanilla", "magicdec", "dustin", "streaming"])
def test_plan_is_the_first_launches(triton_pair, method):
    """Every launch of a real first prefill forward and first decode step is in the plan (the warm-up leaves
    nothing to compile), the prefill's in its prefill part, and the plan holds nothing they and the second step do
    not launch. The plan is the code's own: the dustin step's score estimation (target and draft), selection and
    sparse verify kernels are all there."""
    slots, cap = 3, 200
    cfg = _cfg(method)
    models = [triton_pair.pair.target, triton_pair.pair.draft]
    attributes = _module_attributes(models)
    plan = _plan(triton_pair, cfg, slots, cap)
    assert _module_attributes(models) == attributes  # nothing is restored afterwards: the dry run sets nothing
    planned = {x.signature for x in plan.launches}
    prefill, first, second = _real_run(triton_pair, cfg, slots, cap)
    assert prefill <= {x.signature for x in plan.prefill} and first <= planned
    assert planned <= prefill | first | second
    names = {sig[0] for sig in planned}
    assert "_prefill_attention_kernel" in {sig[0] for sig in prefill}
    if method == "dustin":
        assert {"_score_pass1_kernel", "_score_pass2_kernel", "_mask_scores_kernel", "_assemble_kernel",
                "_sparse_verify_split_kernel", "_verify_attention_split_kernel"} <= names
        assert sum(sig[0] == "_score_pass1_kernel" for sig in planned) == 2  # S_target and S_draft
    elif method == "vanilla":
        assert names == {"_prefill_attention_kernel", "_verify_attention_split_kernel"}


def test_a_plan_for_other_sizes_misses_launches(triton_pair):
    """The comparison above can fail: a plan for another batch size (grid-derived constexprs of the estimation)
    or another capacity (its ints' divisibility by 16) misses launches of the real step."""
    cfg = _cfg("dustin")
    _, first = _real_run(triton_pair, cfg, 3, 200, steps=1)
    assert first <= {x.signature for x in _plan(triton_pair, cfg, 3, 200).launches}
    assert not first <= {x.signature for x in _plan(triton_pair, cfg, 2, 200).launches}
    assert not first <= {x.signature for x in _plan(triton_pair, _cfg("dustin"), 3, 208).launches}


def test_the_dry_run_leaves_models_and_real_sessions_alone(triton_pair):
    """Planning changes nothing of the models (parameters, buffers, every module's attributes: nothing is
    restored afterwards, so the dry run must not touch them) nor what a real session then generates."""
    models = [triton_pair.pair.target, triton_pair.pair.draft]
    before = [{n: t.clone() for n, t in m.state_dict().items()} for m in models]
    attributes = _module_attributes(models)
    cfg, params = offline(method="dustin", max_new_tokens=6, stop_at_eos=False, **SPARSE)
    ref = triton_pair.generate([[5, 6, 7] * 12], cfg, params).sequences[0].token_ids
    attributes_after_run = _module_attributes(models)
    _plan(triton_pair, _cfg("dustin"), 3, 200)  # each method's plan: test_plan_is_the_first_launches
    assert _module_attributes(models) == attributes_after_run
    for m, b in zip(models, before, strict=True):
        after = m.state_dict()
        assert b.keys() == after.keys() and all(torch.equal(b[n], after[n]) for n in b)
    assert attributes == attributes_after_run  # a real run does not set attributes either
    assert triton_pair.generate([[5, 6, 7] * 12], cfg, params).sequences[0].token_ids == ref


def _silu_args(n: int = 40, offset: int = 0):
    from dustin.kernels.fused_ops import _silu_mul_kernel

    g = torch.randn(2, n + offset)[:, offset:]
    u = torch.randn(2, n)
    return _silu_mul_kernel, (g, u, torch.empty(2, n), n, g.stride(0), u.stride(0)), {"BLOCK": 64, "num_warps": 4}


def test_recording_is_per_thread():
    """While one thread records without running, another thread's launch of the same kernel runs as usual; with
    execute=True the recorded launch runs too."""
    kernel, args, kw = _silu_args()
    _, other, _ = _silu_args()
    args[2].fill_(7.0)
    with record_launches(execute=False) as launches:
        kernel[(2, 1)](*args, **kw)
        t = threading.Thread(target=lambda: kernel[(2, 1)](*other, **kw))
        t.start()
        t.join()
    g, u, out = other[:3]
    assert torch.allclose(out, torch.nn.functional.silu(g) * u, atol=1e-6)
    assert len(launches) == 1 and launches[0].name == "_silu_mul_kernel" and bool((args[2] == 7.0).all())
    with record_launches(execute=True) as ran:
        kernel[(2, 1)](*args, **kw)
    assert torch.allclose(args[2], torch.nn.functional.silu(args[0]) * args[1], atol=1e-6) and len(ran) == 1


def test_placeholders_bind_like_the_tensors():
    """Triton's own binder (that of the sm_90 backend) specializes the recorded placeholders exactly as it
    specializes the tensors they replace: dtype, and 16-byte alignment (an unaligned view stays unaligned)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import JITFunction, create_function_from_signature

    backend = make_backend(GPUTarget("cuda", 90, 32))
    for offset in (0, 1):  # 1: g starts 4 bytes into its storage
        kernel, args, kw = _silu_args(offset=offset)
        jit = JITFunction(kernel.jit.fn)
        binder = create_function_from_signature(jit.signature, jit.params, backend)
        with record_launches(execute=False) as launches:
            kernel[(2, 1)](*args, **kw)
        (launch,) = launches
        assert isinstance(launch, Launch)
        spec_real = binder(*args, **kw)[1]
        spec_plan = binder(*launch.args, **dict(launch.kwargs))[1]
        assert spec_real == spec_plan
        assert ("D" in str(spec_real[0])) == (offset == 0)  # the gate pointer's alignment attribute


def test_the_warmup_is_on_unless_switched_off(monkeypatch):
    from dustin.engine.warmup import warmup_enabled

    monkeypatch.delenv("DUSTIN_KERNEL_WARMUP", raising=False)
    assert warmup_enabled()
    monkeypatch.setenv("DUSTIN_KERNEL_WARMUP", "0")
    assert not warmup_enabled()


def test_the_warmup_is_inert_on_the_cpu(triton_pair):
    assert start_kernel_warmup(triton_pair.pair, _cfg("dustin"), 3, 200) is None
    from dustin.engine.core import EngineCore

    llm = EngineCore(triton_pair.pair, GenerationConfig(method="dustin", max_slots=2, max_context=128, **SPARSE))
    assert llm.executor.kernel_warmup is None


def first_decode_index(plans) -> int:
    return next(i for i, p in enumerate(plans) if p.decode)


class _FakeWarmup:
    """Stands in for a KernelWarmup still compiling for the first `busy` looks at it."""

    def __init__(self, busy: int) -> None:
        self.busy, self.held, self.waited, self.prefill_waits = busy, 0, 0, 0

    def wait_prefill(self) -> None:
        self.prefill_waits += 1

    @property
    def running(self) -> bool:
        self.held += self.busy > 0
        self.busy -= 1
        return self.busy >= 0

    def wait(self) -> dict:
        self.waited += 1
        return {"wait_s": 0.25}


@pytest.fixture(scope="module")
def plain_pair(tmp_path_factory):
    """The loop test's pair: the loop's order does not depend on the attention backend, so the PyTorch one (the
    Triton interpreter would multiply the test's time)."""
    from tests.tiny_models import make_tiny_checkpoint, make_tiny_draft

    root = tmp_path_factory.mktemp("loop_pair")
    target = make_tiny_checkpoint(root / "t", "qwen2", layers=3, heads=4, kv_heads=2, seed=1)
    return Engine.from_pretrained(str(target), str(make_tiny_draft(target, root / "d", noise=0.1)))


@pytest.fixture(scope="module")
def loop_reference(plain_pair):
    """The loop test's prompts, settings and the tokens of a run without a warm-up (one run for both cases)."""
    from dustin.engine.core import EngineCore
    from dustin.engine.request import SamplingParams

    prompts = [[random.Random(i).randrange(3, 90) for _ in range(44 + 9 * i)] for i in range(3)]
    cfg = GenerationConfig(method="dustin", max_slots=3, max_context=200, prefill_chunk=32, prefill_tokens=64, **SPARSE)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    return prompts, cfg, params, EngineCore(plain_pair.pair, cfg).generate(prompts, params)


@pytest.mark.parametrize("busy", [2, 1000])
def test_the_loop_prefills_while_kernels_compile_and_waits_before_decoding(plain_pair, loop_reference, busy):
    """While the warm-up compiles, steps that prefill launch no decode step even when a row is ready to decode;
    the first decode step waits for it, once (the wait counted with the one-time capture time, not as decode
    time), and every request gets the tokens of a run without a warm-up."""
    from dustin.engine.core import EngineCore
    from dustin.engine.request import Request

    prompts, cfg, params, ref = loop_reference
    llm = EngineCore(plain_pair.pair, cfg)
    fake = llm.executor.kernel_warmup = _FakeWarmup(busy)
    plans = []
    schedule = llm.schedule
    llm.schedule = lambda: plans.append(schedule()) or plans[-1]
    for i, p in enumerate(prompts):
        llm.add_request(Request(f"r{i}", p, params))
    out: dict[str, list[int]] = {}
    while llm.has_unfinished():
        for o in llm.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
    assert [out[f"r{i}"] for i in range(3)] == ref
    assert fake.waited == 1 and llm.executor.kernel_warmup is None and llm.executor.warmup_stats == {"wait_s": 0.25}
    # each prefill until the first decode step waited for the prefill's kernels first
    assert fake.prefill_waits == sum(1 for p in plans[:first_decode_index(plans) + 1] if p.prefill) > 0
    assert fake.held == min(busy, 2 if busy == 2 else fake.held) and fake.held >= 1
    first_decode = first_decode_index(plans)
    assert all(p.prefill and not p.decode for p in plans[:first_decode])
    if busy > 2:  # still compiling throughout the prefill: no decode step before the last prefill chunk
        assert not any(p.prefill for p in plans[first_decode:])
    assert llm.runner.warmup_s >= 0.25


class _Cache:
    """Global caches of the kind code run by the dry run must not leave a fake tensor in (cf. per-device buffers
    made on first use)."""
    by_device: dict = {}
    held: list = []


@pytest.mark.parametrize("holder", ["dict", "list", "module"])
def test_a_fake_tensor_that_outlives_the_dry_run_fails_the_plan(triton_pair, monkeypatch, holder):
    """A fake tensor kept beyond the dry run anywhere (a global dict or list, an attribute of a model's module)
    fails the plan with FakeTensorLeak: the engine must not run then, since a real launch would read the fake
    tensor's address, 0. A dry run that keeps none plans as usual, and a failed dry run is reported as such."""
    from dustin.engine.warmup import FakeTensorLeak

    original = Runner.dry_step
    module = triton_pair.pair.target.layers[0]

    def keeping_step(self):
        t = torch.zeros(4, device=self.device)
        if holder == "dict":
            _Cache.by_device.setdefault(str(self.device), t)
        elif holder == "list":
            _Cache.held.append(t)
        else:
            module.lazy = t
        return original(self)

    assert _plan(triton_pair, _cfg("vanilla"), 3, 200).step  # without a keeper
    monkeypatch.setattr(Runner, "dry_step", keeping_step)
    try:
        with pytest.raises(FakeTensorLeak, match="fake tensor alive"):
            _plan(triton_pair, _cfg("vanilla"), 3, 200)
    finally:
        _Cache.by_device.clear()
        _Cache.held.clear()
        vars(module).pop("lazy", None)

    def failing_step(self):
        raise ValueError("no such shape")

    monkeypatch.setattr(Runner, "dry_step", failing_step)
    with pytest.raises(RuntimeError, match="dry run failed: ValueError: no such shape"):
        _plan(triton_pair, _cfg("vanilla"), 3, 200)


def test_per_device_buffers_keep_no_fake_tensor():
    """The arrival counters' per-device cache (dustin/kernels/arrival.py) hands the dry run a fake buffer and keeps
    none: the next real call gets (and keeps) a real, zeroed one."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from dustin.kernels import arrival
    from dustin.kernels.dispatch import is_fake

    purpose = "test-per-device-buffers"
    with FakeTensorMode():
        fake = arrival.zeroed_int32(purpose, "cpu", 8)
    assert is_fake(fake) and not any(k[0] == purpose for k in arrival._BUFFERS)
    real = arrival.zeroed_int32(purpose, "cpu", 8)
    assert not is_fake(real) and int(real.abs().sum()) == 0 and arrival.zeroed_int32(purpose, "cpu", 4) is real
    arrival._BUFFERS.pop((purpose, torch.device("cpu")))


def test_the_compile_queue_compiles_a_kernels_first_launch_alone():
    """Compile threads take launches in plan order, the prefill's first, and never start a kernel's second
    specialization while its first compiles (Triton makes the kernel's per-device state on that first compile);
    other kernels go on meanwhile, and every launch is compiled once."""
    from dustin.engine.warmup import LaunchQueue

    class K:  # a kernel object; the queue needs only its identity
        pass

    a, b = K(), K()
    plan = [Launch(a, (i,), ()) for i in range(3)] + [Launch(b, (i,), ()) for i in range(3)]
    queue = LaunchQueue(plan)
    lock, started, done = threading.Lock(), [], []
    release_a = threading.Event()

    def compile_one(item):
        i, _ = item
        with lock:
            started.append((i, tuple(done)))  # what had finished when this one started
        if i == 0:
            release_a.wait(10)  # a's first compile is slow: a's others wait, b goes on
        with lock:
            done.append(i)
            if {3, 4, 5} <= set(done):
                release_a.set()

    threads = [threading.Thread(target=queue.drain, args=(compile_one,)) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert sorted(done) == list(range(6)) and release_a.is_set()
    after = dict(started)
    assert all(0 in after[i] for i in (1, 2)) and all(3 in after[i] for i in (4, 5))  # a first compiles alone
    assert done.index(0) > max(done.index(3), done.index(4), done.index(5))  # b did not wait for a
    assert started[0][0] == 0  # plan order: the first launch is taken first


def test_dustin_warmup_needs_a_gpu(capsys):
    """`dustin warmup` compiles for a GPU: on the CPU it says so in one line, before any model loads; a method
    that runs on a whole-batch session is refused."""
    from dustin.cli.main import main

    assert main(["warmup", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--device cuda" in err
    assert main(["warmup", "--device", "cpu", "--methods", "quest"]) == 2
    assert "whole-batch" in capsys.readouterr().err


@pytest.mark.skipif(not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
                    reason="compiles for a CUDA GPU (run with TRITON_INTERPRET=0)")
def test_on_a_gpu_the_first_steps_compile_nothing_on_the_main_thread(tmp_path):
    """The GPU claim of the warm-up: a new engine core compiles its plan on background threads without an error,
    and its first prefill and first decode steps then compile no kernel on the main thread. The pair's shapes
    (6 heads of 16, 3 layers) are this test's own, so no earlier test of the process compiled its kernels."""
    from dustin.engine.core import EngineCore
    from dustin.engine.request import Request, SamplingParams
    from dustin.engine.warmup import watch_compiles
    from tests.tiny_models import make_tiny_checkpoint, make_tiny_draft

    target = make_tiny_checkpoint(tmp_path / "t", "qwen2", layers=3, dim=96, heads=6, kv_heads=2, seed=3)
    pair = Engine.from_pretrained(str(target), str(make_tiny_draft(target, tmp_path / "d", noise=0.1)),
                                  attention="triton", device="cuda").pair
    main = []
    unwatch = watch_compiles(lambda thread, name, hit, s: main.append(name) if thread == "MainThread" else None)
    try:
        core = EngineCore(pair, GenerationConfig(method="dustin", max_slots=3, max_context=256, **SPARSE))
        assert core.executor.kernel_warmup is not None
        params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
        for i in range(3):
            core.add_request(Request(f"r{i}", [random.Random(i).randrange(3, 90) for _ in range(60 + 7 * i)], params))
        decoded = 0
        while core.has_unfinished() and decoded == 0:
            decoded += sum(len(o.new_token_ids) for o in core.step() if o.new_token_ids)
    finally:
        unwatch()
    stats = core.executor.warmup_stats
    assert stats is not None and stats["errors"] == 0, stats
    assert stats["kernels"] > 5 and decoded > 0
    assert main == [], f"compiled on the main thread during the first steps: {main}"
