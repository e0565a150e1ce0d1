"""Packed chunked prefill attention (dustin/kernels/prefill_attention.py): the Triton kernel (CPU interpreter) and
the SDPA path against the fp32 reference at odd shapes, and the kernel's chunking invariance bit for bit."""
import pytest
import torch

from dustin.kernels.prefill_attention import (
    PrefillPlan,
    prefill_attention,
    prefill_attention_reference,
    prefill_attention_sdpa,
)


def _setup(chunks, B, Hq, Hkv, D, S, dtype, pad=0, seed=0):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(B, Hkv, S, D, generator=g).to(dtype)
    v = torch.randn(B, Hkv, S, D, generator=g).to(dtype)
    n = sum(c[2] for c in chunks)
    q = torch.randn(Hq, n + pad, D, generator=g).to(dtype)
    return q, k, v, PrefillPlan.build(chunks, "cpu")


# (row, cached prefix, chunk tokens): ragged, non-power-of-two, a 1-token chunk, a chunk past one query block
CASES = [
    ([(0, 0, 37)], 1, 6, 1, 64),  # one fresh prompt, GQA 6 (Qwen2.5-1.5B's ratio)
    ([(2, 77, 1), (0, 0, 130), (1, 200, 19)], 3, 7, 1, 32),  # GQA 7, a 1-token chunk, prefix 200
    ([(1, 63, 66), (0, 129, 5)], 2, 4, 4, 16),  # MHA, prefixes around the key-block edge
    ([(3, 5, 70), (2, 0, 3), (0, 31, 33), (1, 0, 64)], 4, 12, 2, 64),  # many heads, 4 rows
]


@pytest.mark.parametrize("chunks,B,Hq,Hkv,D", CASES)
def test_kernel_matches_reference(chunks, B, Hq, Hkv, D):
    q, k, v, plan = _setup(chunks, B, Hq, Hkv, D, 300, torch.float32, pad=5)
    ref = prefill_attention_reference(q, k, v, plan)
    out = prefill_attention(q, k, v, plan)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
    assert torch.all(out[:, plan.n_tokens:] == 0)  # padding rows stay zero
    torch.testing.assert_close(prefill_attention_sdpa(q, k, v, plan), ref, atol=2e-5, rtol=2e-5)


def test_kernel_bf16_close_to_reference():
    chunks = [(0, 40, 50), (1, 0, 27)]
    q, k, v, plan = _setup(chunks, 2, 6, 2, 32, 128, torch.bfloat16)
    torch.testing.assert_close(prefill_attention(q, k, v, plan).float(),
                               prefill_attention_reference(q, k, v, plan).float(), atol=2e-2, rtol=2e-2)


@pytest.fixture
def blas_free_dots(monkeypatch):
    """The interpreter's tl.dot without BLAS. It computes a dot with np.matmul, i.e. the machine's BLAS, whose
    kernels may round a row's products differently by the row's position in the tile (OpenBLAS's Haswell kernels on
    an AMD EPYC: 9,537 of 61,440 elements of a [64, 32] x [32, 64] product changed when its rows were rolled). A
    bit-level test of the kernel's own arithmetic then fails or passes by CPU. np.einsum without BLAS sums each
    element's products in one order wherever the row sits."""
    import numpy as np
    from triton.runtime import interpreter

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        assert a.data.dtype.itemsize >= 2 and b.data.dtype.itemsize >= 2  # no fp8 in these tests
        acc = d.data.dtype
        product = np.einsum("...ik,...kj->...ij", a.data.astype(acc), b.data.astype(acc), optimize=False)
        return interpreter.TensorHandle(product + d.data, d.dtype.scalar)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", create_dot)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunking_does_not_change_a_rows_result(dtype, blas_free_dots):
    """A prompt's queries get the same bits whether its 150 tokens come in one chunk or in chunks of 70 / 1 / 79,
    and whatever other chunks share the launch (the batch-invariance the server's greedy output relies on)."""
    B, Hq, Hkv, D, S = 3, 6, 2, 32, 200
    g = torch.Generator().manual_seed(3)
    k = torch.randn(B, Hkv, S, D, generator=g).to(dtype)
    v = torch.randn(B, Hkv, S, D, generator=g).to(dtype)
    q_row = torch.randn(Hq, 150, D, generator=g).to(dtype)
    whole = prefill_attention(q_row, k, v, PrefillPlan.build([(1, 0, 150)], "cpu"))
    # the same row in three pieces, each beside other rows' chunks
    other = torch.randn(Hq, 41, D, generator=g).to(dtype)
    pieces = []
    for p0, n in ((0, 70), (70, 1), (71, 79)):
        q = torch.cat([other[:, :17], q_row[:, p0:p0 + n], other[:, 17:]], dim=1)
        out = prefill_attention(q, k, v, PrefillPlan.build([(0, 9, 17), (1, p0, n), (2, 100, 24)], "cpu"))
        pieces.append(out[:, 17:17 + n])
    assert torch.equal(torch.cat(pieces, dim=1), whole)


def test_bad_plans_and_shapes_raise():
    with pytest.raises(ValueError, match="chunks"):
        PrefillPlan.build([], "cpu")
    with pytest.raises(ValueError, match="chunks"):
        PrefillPlan.build([(0, 0, 0)], "cpu")
    q, k, v, plan = _setup([(0, 0, 8)], 1, 6, 4, 32, 16, torch.float32)
    with pytest.raises(ValueError, match="Hq % Hkv"):
        prefill_attention(q, k, v, plan)


def test_plan_gives_each_row_its_last_token_once():
    """A row with two consecutive chunks in one forward: the per-row "last prompt token" (what S_target's query
    is taken from) is its second chunk's last token, and the row appears once (a GPU scatter of one row from two
    chunks keeps either value: the H200 showed a request's S_target depend on how its prompt was packed)."""
    plan = PrefillPlan.build([(1, 0, 5), (0, 0, 4), (1, 5, 3)], "cpu")
    assert plan.row_ids.tolist() == [1, 0] and plan.row_last.tolist() == [11, 8]
    from dustin.attention.context import ForwardContext

    ctx = ForwardContext(None, torch.zeros(1, 12, dtype=torch.long), torch.zeros(1, dtype=torch.int32), 0, packed=plan)
    q = torch.arange(12.0).view(1, 1, 12, 1)
    rows, last = ctx.last_prompt_queries(q)
    assert rows.tolist() == [1, 0] and last.flatten().tolist() == [11.0, 8.0]
