"""Compile the Triton kernels of a new engine's first prefill forward and first decode step before they run, off
the main thread.

Why: Triton compiles a kernel for each new specialization the first time it is launched, and builds a small C
launcher for each argument signature (with the host's C compiler, ~0.3 s each). A fresh process launches every
kernel of the decode step (both models' layer kernels, dense and sparse verify attention, the score estimation
and selection of the sparse methods) for the first time in its first step, which runs eagerly before the step's
CUDA graph is captured: on the one-shot H200 run (16 prompts of ~29.5k tokens, `dustin`) that step took 10.6 s,
most of it compiling on the main thread while the GPU waited; the first prefill forward likewise compiles its own.

How:
1. Plan (`plan_first_step`). A twin of the engine's runner is built under PyTorch's FakeTensorMode: the same
   models (their weights enter as fake copies: no memory), a fresh policy of the same method and sparse config,
   caches and buffers of the real shapes that allocate nothing. One packed prefill forward of each model (its
   host-side plan and tokens built for real, small) and one decode step run on it with every Triton launch
   recorded instead of run (`record_launches`): the kernel, its arguments with each tensor replaced by a
   placeholder of its dtype and 16-byte alignment (all that Triton specializes a pointer on; a fake tensor's
   alignment is that of its storage offset, storages being allocated aligned), ints and constexprs as given.
   The prefill also gives the policy's observers the state the first step reads (S_target's last prompt query).
   So the plan is the code's own launches at the real sizes, not a list kept by hand: a kernel added to the
   forward is planned too. The launches are seen through dustin's own launch seam (every kernel is `@watched`,
   dustin/kernels/launch.py), not by replacing anything of Triton's. Nothing runs on the device and the real
   runner and policy are not touched. The code the dry run runs keeps no fake tensor beyond the call (a cache of
   per-device buffers, e.g. the arrival counters, keeps only real ones); should one survive, a real launch would
   read its address, 0, so the plan then fails with `FakeTensorLeak`. The check needs no search of the heap: every
   fake tensor holds its FakeTensorMode, so the dry run's mode outliving the call means a fake tensor did.
2. Compile (`KernelWarmup`). Threads hand each planned launch, the prefill's first, to the kernel's public
   `warmup(...)`: Triton binds and specializes the arguments exactly as for a launch, compiles the kernel (or loads
   it from its on-disk cache, ~/.triton/cache or $TRITON_CACHE_DIR) and stores it in the JIT's per-device cache,
   launching nothing; the thread then builds the kernel's launcher and loads its binary, as the first launch would
   (reading the compiled kernel's `run`, a public property that does both once). The real forwards then find every
   kernel ready. Compiling is CPU work (Python, MLIR, LLVM, ptxas, the C compiler), mostly outside the GIL; the
   main thread meanwhile prefills, releasing the GIL in every CUDA call. No thread but the main one launches
   kernels. All specializations of one kernel compile on one thread, in order: a kernel's per-device JIT state is
   made on its first compile, and two threads making it at once could each keep their own.
3. The engine loop (`EngineCore`) waits for the prefill's kernels before its first prefill, prefills while the
   rest compile, holds decode steps back until they are done, and waits for them before its first decode step
   (the waits are reported: `prefill_wait_s`, and `wait_s` with the one-time costs).

On the CPU (Triton's interpreter, or no Triton) nothing is compiled: `start_kernel_warmup` returns None. The
plan itself runs on the CPU too, which is how tests/engine/test_warmup.py checks it against the launches of a real
prefill and first step. The background warm-up is on by default (`DUSTIN_KERNEL_WARMUP=0` turns it off). Measured
on one H200 (2026-12-02, scripts/gpu_first_step_compile.py at commit ecedb80, random weights of the default pair's
shapes, 16 x 16k random prompts, 8 new tokens, each case a fresh process with an empty Triton cache): dustin's
process 41.9 -> 24.3 s (32 kernels compiled on 4 threads while the prompts prefilled, none on the main thread,
no errors), vanilla's 23.3 -> 16.3 s. `dustin warmup` fills Triton's on-disk cache with the same plan, which a
later process reads instead of compiling (dustin 21.6 s). `DUSTIN_COMPILE_THREADS` sets the thread count.
"""
from __future__ import annotations

import contextlib
import dataclasses
import gc
import inspect
import os
import threading
import time
import warnings
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from dustin.engine.kv_manager import KVManager
from dustin.engine.sampling import GREEDY
from dustin.engine.timing import NullTimer
from dustin.engine.worker.runner import Runner
from dustin.kernels.dispatch import interpreting, is_fake

_SPEC_INT32 = (-(2 ** 31), 2 ** 31 - 1)


# ------------------------------------------------------------------------------------------------ recording
class _KernelParams:
    """Per parameter of a kernel: name, constexpr, and Triton's do_not_specialize(_on_alignment) flags."""

    def __init__(self, kernel) -> None:
        fn = kernel.fn
        sig = inspect.signature(fn)
        opts = getattr(kernel, "kwargs", {}) or {}  # the interpreter keeps jit's keywords here

        def named(attr: str) -> set:
            given = getattr(kernel, attr, None)
            given = given if given is not None else opts.get(attr) or []
            names = list(sig.parameters)
            return {names[x] if isinstance(x, int) else x for x in given}

        no_spec, no_align = named("do_not_specialize"), named("do_not_specialize_on_alignment")
        self.names = list(sig.parameters)
        self.constexpr = {n for n, p in sig.parameters.items() if "constexpr" in str(p.annotation)}
        self.no_spec, self.no_align = no_spec, no_align


_PARAMS: dict[int, _KernelParams] = {}


def _params(kernel) -> _KernelParams:
    p = _PARAMS.get(id(kernel))
    if p is None:
        p = _PARAMS[id(kernel)] = _KernelParams(kernel)
    return p


def _is_tensor_like(x) -> bool:
    return hasattr(x, "data_ptr") and hasattr(x, "dtype") and not isinstance(x, type)


def _aligned(t) -> bool:
    """Whether a tensor argument's address is a multiple of 16 bytes. A fake tensor has no address: its storage
    is taken as aligned (PyTorch's allocators align every block to at least 64 bytes) and its offset decides."""
    if is_fake(t):
        return t.storage_offset() * t.element_size() % 16 == 0
    return t.data_ptr() % 16 == 0


_POINTER_CLASS = None


def _pointer(dtype, aligned: bool):
    """A stand-in for a tensor argument that Triton binds like the tensor: its dtype, and an address that is or
    is not a multiple of 16 (Triton's public MockTensor, which `warmup` makes of a bare dtype, is always aligned)."""
    global _POINTER_CLASS
    if _POINTER_CLASS is None:
        from triton import MockTensor

        class Pointer(MockTensor):
            def __init__(self, dtype, ptr: int) -> None:
                super().__init__(dtype)
                self._ptr = ptr

            def data_ptr(self) -> int:
                return self._ptr

            def __repr__(self) -> str:
                return f"*{str(self.dtype).removeprefix('torch.')}{'' if self._ptr % 16 == 0 else ' (unaligned)'}"

        _POINTER_CLASS = Pointer
    return _POINTER_CLASS(dtype, 0 if aligned else 8)


def _int_spec(v: int, specialize: bool) -> tuple:
    kind = "i32" if _SPEC_INT32[0] <= v <= _SPEC_INT32[1] else "i64" if v < 2 ** 63 else "u64"
    if not specialize:
        return (kind,)
    return (kind, "1" if v == 1 else "D" if v % 16 == 0 else "")


def _plain(v):
    """A constexpr or option value in a comparable, printable form."""
    if isinstance(v, (bool, int, float, str)) or v is None:
        return v
    return str(v)


@dataclasses.dataclass(frozen=True)
class Launch:
    """One kernel launch, as Triton will specialize it: `kernel` (a JITFunction, or the interpreter's function),
    `args` (tensors replaced by placeholders of their dtype and alignment) and `kwargs` (constexprs, options)."""

    kernel: Any
    args: tuple
    kwargs: tuple

    @property
    def name(self) -> str:
        return self.kernel.fn.__name__

    @property
    def signature(self) -> tuple:
        """What Triton's specialization depends on, per argument: a pointer's dtype and 16-byte alignment; an int's
        width and whether it is 1 or a multiple of 16 (unless do_not_specialize); a constexpr's or an option's value.
        Equal signatures compile to the same kernel."""
        p = _params(self.kernel)
        out = [self.name]
        bound = list(zip(p.names, self.args, strict=False)) + list(self.kwargs)
        for name, v in bound:
            if name in p.constexpr or name not in p.names:
                out.append((name, "=", _plain(v)))
            elif _is_tensor_like(v):
                aligned = name in p.no_align or v.data_ptr() % 16 == 0
                out.append((name, "*", str(v.dtype).removeprefix("torch."), "D" if aligned else ""))
            elif isinstance(v, bool):
                out.append((name, "u1"))
            elif isinstance(v, int):
                out.append((name,) + _int_spec(v, name not in p.no_spec))
            elif isinstance(v, float):
                out.append((name, "fp32"))
            else:
                out.append((name, "=", _plain(v)))
        return tuple(out)

    @property
    def key(self) -> tuple:
        """Equal for launches Triton compiles to the same kernel: the kernel object and the signature."""
        return (id(self.kernel), self.signature)

    def compile(self):
        """Compile (or load from Triton's disk cache) into the JIT's cache of the calling thread's current device,
        launching nothing (Triton's public `warmup`); the compiled kernel."""
        kernel = self.kernel.warmup(*self.args, grid=None, **dict(self.kwargs))
        return kernel.result() if hasattr(kernel, "result") else kernel  # a future under async compilation


class _Recorder:
    def __init__(self, execute: bool) -> None:
        self.execute = execute
        self.launches: list[Launch] = []
        self._seen: set = set()

    def add(self, kernel, args, kwargs) -> None:
        placeholder = lambda v: _pointer(v.dtype, _aligned(v)) if _is_tensor_like(v) else v  # noqa: E731
        launch = Launch(kernel, tuple(placeholder(a) for a in args),
                        tuple((k, placeholder(v)) for k, v in kwargs.items()))
        if launch.key not in self._seen:
            self._seen.add(launch.key)
            self.launches.append(launch)


@contextlib.contextmanager
def record_launches(execute: bool = False):
    """Within the block, this thread's Triton kernel launches are recorded (`Launch`, one per distinct
    specialization, in order) and, unless `execute`, not run. Yields the list. Other threads' launches are not
    affected (dustin/kernels/launch.py `watch_launches`)."""
    from dustin.kernels.launch import watch_launches  # lazy: Triton

    rec = _Recorder(execute)
    with watch_launches(rec.add, execute):
        yield rec.launches


# ------------------------------------------------------------------------------------------------ planning
class FakeTensorLeak(RuntimeError):
    """The dry run left a fake tensor where the engine may later use it (a real launch would read address 0)."""


@dataclasses.dataclass
class Plan:
    """The launches of a runner's first packed prefill forward (`prefill`, target and draft) and of its first
    decode step (`step`, what the prefill launched left out), one per specialization; what the dry run cost."""

    prefill: list[Launch]
    step: list[Launch]
    dry_run_s: float = 0.0

    @property
    def launches(self) -> list[Launch]:
        return self.prefill + self.step


def plan_first_step(pair, cfg, slots: int, capacity: int, prefill_tokens: int = 512,
                    prefill_chunk: int = 512, shared=None) -> Plan:
    """The Triton launches of the first prefill forward (`prefill_tokens` tokens of `prefill_chunk`-token chunks, as
    the engine loop packs them) and first decode step of a `Runner` of `slots` rows and `capacity` positions running
    `cfg` on `pair`'s models, found by running them on a fake twin (module docstring): one specialization each.
    shared: the runner's shared sampling rule (`BatchState`; None: greedy), which picks the first step's code path.
    Raises RuntimeError if the dry run failed, or FakeTensorLeak if a fake tensor outlived it (module docstring)."""
    error, t0 = None, time.perf_counter()
    prefill: list[Launch] = []
    step: list[Launch] = []
    mode = FakeTensorModeRef()
    try:
        prefill, step = _dry_run(pair, cfg, slots, capacity, prefill_tokens, prefill_chunk, shared, mode)
    except Exception as e:  # kept as text: the traceback's frames would keep the fake tensors alive
        error = f"{type(e).__name__}: {e}"
    if mode.alive():
        raise FakeTensorLeak("the warm-up's dry run left a fake tensor alive beyond it: code it ran stored one "
                             "where a real launch may read it (address 0); DUSTIN_KERNEL_WARMUP=0 runs without "
                             "the warm-up")
    if error is not None:
        raise RuntimeError(f"the warm-up's dry run failed: {error}")
    return Plan(prefill, step, round(time.perf_counter() - t0, 4))


class FakeTensorModeRef:
    """A weak reference to the dry run's FakeTensorMode. Every fake tensor holds its mode (`FakeTensor.fake_mode`),
    so once the dry run has returned and a collection has run, the mode is alive only if a fake tensor is."""

    def __init__(self) -> None:
        self._ref = None

    def make(self):
        from torch._subclasses.fake_tensor import FakeTensorMode

        mode = FakeTensorMode(allow_non_fake_inputs=True)
        self._ref = weakref.ref(mode)
        return mode

    def alive(self) -> bool:
        gc.collect()  # the twin's reference cycles (modules, runners) go with the collection
        return self._ref is not None and self._ref() is not None


def _dry_run(pair, cfg, slots: int, capacity: int, prefill_tokens: int, prefill_chunk: int, shared,
             mode_ref: FakeTensorModeRef) -> tuple[list[Launch], list[Launch]]:
    """`plan_first_step`'s twin and its recorded launches (prefill's, then the step's others). Everything fake it
    makes is local to this call."""

    draft = pair.draft if cfg.spec.speculative else None
    policy = pair.make_policy(cfg)  # fresh, outside the fake mode (the config's fingerprint reads real weights)
    mode = mode_ref.make()
    with mode, torch.inference_mode():
        models = {"target": pair.target} | ({} if draft is None else {"draft": draft})
        twin = Runner(pair.target, draft, cfg, pair.vocab_limit, policy, kv=KVManager(models, slots, capacity),
                      max_new_tokens=capacity, shared=shared or GREEDY)
        twin.batch.timer = NullTimer()
    # one packed prefill forward of each model, its host side (plan, tokens) real and small; row 0's prompt also
    # gives the policy's observers the state the first step reads (e.g. S_target's last query)
    n = min(prefill_chunk, prefill_tokens, capacity - 1)
    packed = {name: r.pack([(0, 0, [0] * n)], prefill_tokens, slots) for name, r in twin.models.items()}
    with mode, torch.inference_mode(), warnings.catch_warnings():
        # estimators.stacked_cache compares storage addresses, which fake tensors share (all 0): views of one fake
        # cache are recognised as such, as the real ones are
        warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor")
        with record_launches(execute=False) as prefill:
            observers = policy.target_observers(twin.batch)
            for name, runner in twin.models.items():
                runner.forward_packed(packed[name], observers if name == "target" else ())
        with record_launches(execute=False) as launched:
            twin.dry_step()
    seen = {x.key for x in prefill}
    return prefill, [x for x in launched if x.key not in seen]


# ------------------------------------------------------------------------------------------------ compiling
_sinks: list = []
_tap_lock = threading.Lock()


def watch_compiles(sink):
    """Call `sink(thread_name, kernel_name, cache_hit, seconds)` after each Triton compile in this process
    (cache_hit: loaded from Triton's on-disk cache instead of compiled; seconds: Triton's own timing of it), through
    Triton's compilation listener (any listener already set keeps being called). Returns a function that removes
    the sink."""
    from triton import knobs

    with _tap_lock:
        current = knobs.compilation.listener
        if not getattr(current, "_dustin_tap", False):
            def tap(*, src, metadata, metadata_group, times, cache_hit, _previous=current) -> None:
                name = getattr(src, "name", "?")
                us = times.ir_initialization + sum(t for _, t in times.lowering_stages) + times.store_results
                for fn in list(_sinks):
                    fn(threading.current_thread().name, name, cache_hit, us / 1e6)
                if _previous is not None:
                    _previous(src=src, metadata=metadata, metadata_group=metadata_group, times=times,
                              cache_hit=cache_hit)

            tap._dustin_tap = True
            knobs.compilation.listener = tap
        _sinks.append(sink)
    return lambda: _sinks.remove(sink) if sink in _sinks else None


def compiles_here(device: torch.device) -> bool:
    """Whether kernels are compiled on this device: a CUDA GPU with Triton's compiler (not its interpreter)."""
    if device.type != "cuda" or interpreting():
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def default_threads() -> int:
    """Compile threads: DUSTIN_COMPILE_THREADS, else 4 (at most the CPU count less one for the main thread)."""
    env = os.environ.get("DUSTIN_COMPILE_THREADS")
    if env:
        return max(1, int(env))
    return max(1, min(4, (os.cpu_count() or 2) - 1))


class LaunchQueue:
    """The plan's launches in order (the prefill's first), handed to compile threads so that a kernel's first
    specialization compiles alone: Triton makes a kernel's per-device JIT state (its binder and kernel cache) on
    the kernel's first compile, and two threads making it at once could each keep their own. A kernel's other
    specializations then compile on any thread, in parallel. A thread takes the earliest launch it may start."""

    def __init__(self, launches: list[Launch]) -> None:
        self._items = list(enumerate(launches))
        self._state: dict[int, str] = {}  # id(kernel) -> "compiling" (its first) or "made"
        self._cond = threading.Condition()

    def _take(self) -> tuple[int, Launch] | None:
        with self._cond:
            while self._items:
                for pos, (_, launch) in enumerate(self._items):
                    state = self._state.get(id(launch.kernel))
                    if state != "compiling":
                        if state is None:
                            self._state[id(launch.kernel)] = "compiling"
                        return self._items.pop(pos)
                self._cond.wait()  # every launch left waits for its kernel's first compile
            return None

    def _made(self, launch: Launch) -> None:
        with self._cond:
            if self._state.get(id(launch.kernel)) == "compiling":
                self._state[id(launch.kernel)] = "made"
                self._cond.notify_all()

    def drain(self, compile_one) -> None:
        """Run `compile_one((index, launch))` on each launch this thread takes, until none is left."""
        while (item := self._take()) is not None:
            try:
                compile_one(item)
            finally:
                self._made(item[1])


class KernelWarmup:
    """Compiles a plan's launches on background threads (`start`), the prefill's first; `wait_prefill` and `wait`
    block until those, or all, are ready, and `wait` returns the stats. Each kernel is compiled (or loaded from
    Triton's disk cache) and then made launchable: its launcher (a small C module Triton builds with the host's C
    compiler per argument signature, ~0.3 s each, cached on disk too) built and its binary loaded into the CUDA
    context. Without that, the first launch on the main thread does both."""

    def __init__(self, plan: Plan, device: torch.device, threads: int | None = None, plan_s: float = 0.0) -> None:
        self.plan, self.device = plan, torch.device(device)
        self.threads = threads or default_threads()
        self.started = self.finished = None  # perf_counter of the compile pool's start and end
        self.stats = {"kernels": len(plan.launches), "prefill_kernels": len(plan.prefill), "threads": self.threads,
                      "plan_s": round(plan_s, 4), "dry_run_s": plan.dry_run_s,
                      "compiled": 0, "from_disk_cache": 0, "compile_s": 0.0, "prefill_wait_s": 0.0, "wait_s": 0.0,
                      "errors": 0, "first_error": None}
        self._thread: threading.Thread | None = None
        self._done = threading.Event()
        self._prefill_done = threading.Event()
        self._prefill_left = len(plan.prefill)
        self._lock = threading.Lock()
        if not plan.prefill:
            self._prefill_done.set()

    def start(self) -> "KernelWarmup":
        """Compile on background threads; returns at once."""
        self._index = self.device.index if self.device.index is not None else torch.cuda.current_device()
        self._thread = threading.Thread(target=self._run, name="dustin-kernel-warmup", daemon=True)
        self._thread.start()
        return self

    def _bind(self) -> None:
        torch.cuda.set_device(self._index)

    def _compile_one(self, item: tuple[int, Launch]) -> None:
        i, launch = item
        try:
            launch.compile().run  # noqa: B018  (the property builds the launcher and loads the binary, once)
        except Exception as e:  # the real launch compiles it again and raises there if it is broken
            with self._lock:
                self.stats["errors"] += 1
                if self.stats["first_error"] is None:
                    self.stats["first_error"] = f"{launch.name}: {type(e).__name__}: {str(e)[:300]}"
        finally:
            if i < len(self.plan.prefill):
                with self._lock:
                    self._prefill_left -= 1
                    if self._prefill_left == 0:
                        self._prefill_done.set()

    def _count(self, thread: str, kernel: str, cache_hit: bool, seconds: float) -> None:
        if thread.startswith("dustin-compile"):
            with self._lock:
                self.stats["from_disk_cache" if cache_hit else "compiled"] += 1

    def _run(self) -> None:
        t0 = self.started = time.perf_counter()
        unwatch = watch_compiles(self._count)
        try:
            queue = LaunchQueue(self.plan.launches)
            with ThreadPoolExecutor(self.threads, thread_name_prefix="dustin-compile",
                                    initializer=self._bind) as pool:
                for _ in range(self.threads):
                    pool.submit(queue.drain, self._compile_one)
        except Exception as e:  # pragma: no cover - e.g. a thread that cannot be started
            self.stats["errors"] += 1
            self.stats["first_error"] = self.stats["first_error"] or f"{type(e).__name__}: {e}"
        finally:
            unwatch()
            self.finished = time.perf_counter()
            self.stats["compile_s"] = round(self.finished - t0, 4)
            self._prefill_done.set()
            self._done.set()

    @property
    def running(self) -> bool:
        return self._thread is not None and not self._done.is_set()

    def wait_prefill(self) -> None:
        """Block until the prefill forward's kernels are ready (the first call waits; `prefill_wait_s`)."""
        if not self._prefill_done.is_set():
            t0 = time.perf_counter()
            self._prefill_done.wait()
            self.stats["prefill_wait_s"] = round(self.stats["prefill_wait_s"] + time.perf_counter() - t0, 4)

    def wait(self) -> dict:
        """Block until every planned kernel is ready; the stats (the wait itself in `wait_s`)."""
        t0 = time.perf_counter()
        if self._thread is not None:
            self._thread.join()
        self.stats["wait_s"] = round(self.stats["wait_s"] + time.perf_counter() - t0, 4)
        return self.stats


def warmup_enabled() -> bool:
    """The background warm-up of a new engine: on unless DUSTIN_KERNEL_WARMUP=0."""
    return os.environ.get("DUSTIN_KERNEL_WARMUP", "1") != "0"


def start_kernel_warmup(pair, cfg, slots: int, capacity: int, prefill_tokens: int = 512,
                        prefill_chunk: int = 512, shared=None) -> KernelWarmup | None:
    """Plan a runner's first prefill forward and decode step (`plan_first_step`) and start compiling them in the
    background, when kernels are compiled on the engine's device (a GPU without Triton's interpreter) and the
    warm-up is on; else, or if the plan fails (the steps then compile their kernels themselves, as without a
    warm-up), None. A plan that left a fake tensor where the engine may use it raises (`FakeTensorLeak`)."""
    if not warmup_enabled() or not compiles_here(pair.device) or pair.parallel is not None:
        return None
    t0 = time.perf_counter()
    try:
        plan = plan_first_step(pair, cfg, slots, capacity, prefill_tokens, prefill_chunk, shared)
        return KernelWarmup(plan, pair.device, plan_s=time.perf_counter() - t0).start()
    except FakeTensorLeak:
        raise
    except Exception:  # e.g. a dry run the fake tensors cannot follow: no warm-up, nothing else changes
        return None
