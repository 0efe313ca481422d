"""Every Triton kernel against core's reference on the CPU (TRITON_INTERPRET=1, set by
tools/test.sh before triton is imported): forward and gradients in fp32 on small, odd shapes."""

import os

import pytest
import torch
from conftest import check_adamw_found_inf, decoder_outputs
from loongforge.core.ops import reference as ref

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(), reason="Triton kernels need TRITON_INTERPRET=1 on a CPU"
)
TOL = dict(rtol=1e-5, atol=1e-5)


def _grads(fn, inputs, grad_out):
    inputs = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]
    out = fn(*inputs)
    outs = out if isinstance(out, tuple) else (out,)
    gos = grad_out if isinstance(grad_out, tuple) else (grad_out,)
    torch.autograd.backward(outs, gos)
    return outs, [t.grad for t in inputs if t.is_floating_point()]


def _compare(kernel, reference, inputs, grad_out, tol=TOL):
    got, got_g = _grads(kernel, inputs, grad_out)
    want, want_g = _grads(reference, inputs, grad_out)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and a.shape == b.shape
        torch.testing.assert_close(a, b, **tol)
    for a, b in zip(got_g, want_g):
        torch.testing.assert_close(a, b, **tol)


@pytest.mark.parametrize("shape", [(3, 5, 40), (7, 100), (40, 1000)])
def test_rms_norm(shape):
    from loongforge.kernels.rms_norm import rms_norm

    torch.manual_seed(0)
    x, w = torch.randn(shape), torch.randn(shape[-1])
    _compare(lambda a, b: rms_norm(a, b, 1e-6), lambda a, b: ref.rms_norm(a, b, 1e-6), [x, w], torch.randn(shape))


def test_add_rms_norm():
    from loongforge.kernels.rms_norm import add_rms_norm

    torch.manual_seed(0)
    x, r, w = torch.randn(6, 50), torch.randn(6, 50), torch.randn(50)
    _compare(
        lambda a, b, c: add_rms_norm(a, b, c, 1e-5),
        lambda a, b, c: ref.add_rms_norm(a, b, c, 1e-5),
        [x, r, w],
        (torch.randn(6, 50), torch.randn(6, 50)),
    )


def test_rms_norm_non_contiguous_input():
    from loongforge.kernels.rms_norm import rms_norm

    torch.manual_seed(0)
    x = torch.randn(9, 4, 24).transpose(0, 1)  # rows not contiguous
    w = torch.randn(24)
    _compare(lambda a, b: rms_norm(a, b, 1e-6), lambda a, b: ref.rms_norm(a, b, 1e-6), [x, w], torch.randn(4, 9, 24))


@pytest.mark.parametrize("shape", [(3, 5, 40), (40, 1000)])
def test_gemma_rms_norm(shape):
    from loongforge.kernels.rms_norm import gemma_rms_norm

    torch.manual_seed(0)
    x, w = torch.randn(shape), torch.randn(shape[-1])
    _compare(lambda a, b: gemma_rms_norm(a, b, 1e-6), lambda a, b: ref.gemma_rms_norm(a, b, 1e-6), [x, w], torch.randn(shape))
    xt = torch.randn(shape[-1], *shape[:-1]).movedim(0, -1)  # rows not contiguous
    _compare(lambda a, b: gemma_rms_norm(a, b, 1e-6), lambda a, b: ref.gemma_rms_norm(a, b, 1e-6), [xt, w], torch.randn(shape))


@pytest.mark.parametrize("shape", [(2, 3, 22), (5, 2048 + 6)])
@pytest.mark.parametrize("op", ["swiglu", "geglu"])
def test_gated_activation(shape, op):
    from loongforge.kernels import swiglu

    torch.manual_seed(0)
    x = 3 * torch.randn(shape)  # reaches both tails of the activations
    _compare(getattr(swiglu, op), getattr(ref, op), [x], torch.randn(*shape[:-1], shape[-1] // 2))


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("rot,d", [(16, 16), (8, 24)])
def test_rope(interleaved, rot, d):
    from loongforge.kernels.rope import rope

    torch.manual_seed(0)
    b, s = 2, 7
    for hq, hk in ((3, 1), (4, 4), (2, 5), (18, 3)):  # GQA, MHA, more k heads than q heads, two head blocks
        q = torch.randn(s, b, hq, d).transpose(0, 1)  # [b, s, h, d] strided like the model's q/k
        k = torch.randn(b, s, hk, d)
        inv = ref.rope_inv_freq(
            rot,
            10000.0,
            {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 4},
        )
        for pos in (torch.arange(s), torch.tensor([[0, 1, 2, 0, 1, 0, 1], [0, 1, 2, 3, 4, 5, 6]])):
            _compare(
                lambda a, c: rope(a, c, pos, inv, interleaved),
                lambda a, c: ref.rope(a, c, pos, inv, interleaved),
                [q, k],
                (torch.randn(b, s, hq, d), torch.randn(b, s, hk, d)),
            )


@pytest.mark.parametrize("grad_layout", ["sbhd", "bshd"])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize(
    "groups,r,rot,d,packed", [(3, 1, 16, 16, False), (2, 3, 8, 24, False), (2, 2, 16, 16, True), (5, 2, 16, 16, False)]
)
def test_qkv_rope(grad_layout, interleaved, groups, r, rot, d, packed):
    """Split + rotation of megatron's fused projection (MHA, GQA with partial rotary, packed
    positions that restart per sample) against the reference: values, and the projection's
    gradient assembled from all three outputs' gradients, which arrive seq-major or batch-major
    (attention's backward picks the layout)."""
    from loongforge.kernels import qkv_rope as kernel

    torch.manual_seed(0)
    s, b = 7, (1 if packed else 2)
    mixed = torch.randn(s, b, groups, (r + 2) * d)
    pos = torch.tensor([0, 1, 2, 0, 1, 2, 3]) if packed else torch.arange(s)
    inv = ref.rope_inv_freq(rot, 10000.0)
    grads = tuple(
        torch.randn(s, b, n, d) if grad_layout == "sbhd" else torch.randn(b, s, n, d).transpose(0, 1) for n in (groups * r, groups, groups)
    )
    _compare(lambda m: kernel.qkv_rope(m, pos, inv, r, interleaved), lambda m: ref.qkv_rope(m, pos, inv, r, interleaved), [mixed], grads)


def test_qkv_rope_reference_matches_megatron_split():
    """The reference's layout contract: group g holds [q heads of g | k_g | v_g]."""
    torch.manual_seed(0)
    s, b, g, r, d = 3, 2, 2, 2, 4
    mixed = torch.randn(s, b, g, (r + 2) * d)
    q, k, v = ref.qkv_rope(mixed, torch.zeros(s, dtype=torch.long), ref.rope_inv_freq(d, 10000.0), r)  # position 0: no rotation
    torch.testing.assert_close(q[:, :, 3], mixed[:, :, 1, d : 2 * d])  # second q head of group 1
    torch.testing.assert_close(k[:, :, 1], mixed[:, :, 1, r * d : (r + 1) * d])
    torch.testing.assert_close(v[:, :, 0], mixed[:, :, 0, (r + 1) * d :])


def test_rope_interleaved_reference_pairs_adjacent_channels():
    torch.manual_seed(0)
    x = torch.randn(1, 3, 1, 4)
    inv = ref.rope_inv_freq(4, 10000.0)
    want = ref.rope(x[..., [0, 2, 1, 3]], x[..., [0, 2, 1, 3]], torch.arange(3), inv)[0][..., [0, 2, 1, 3]]
    torch.testing.assert_close(ref.rope(x, x, torch.arange(3), inv, interleaved=True)[0], want)


# bf16: one bf16 step apart at most (2^-7 relative): the interpreter rounds fp32 -> bf16 toward zero where torch
# (and Triton on a GPU) round to nearest
BF16_TOL = dict(rtol=1e-2, atol=1e-5)


def _rotary_layout(layout, t, hq, hk, d, dtype):
    """(inputs, split: inputs -> (q, k), the tables' leading dims) for q / k laid out as callers
    lay them out; `t` tokens."""
    if layout == "thd":  # [tokens, heads, d] (Wan, Qwen-Image)
        return [torch.randn(t, hq, d, dtype=dtype), torch.randn(t, hk, d, dtype=dtype)], lambda a, b: (a, b), (t,)
    if layout == "1thd":  # [1, tokens, heads, d] with [tokens, 1, rot/2] tables (the LLM's M-RoPE path)
        return [torch.randn(1, t, hq, d, dtype=dtype), torch.randn(1, t, hk, d, dtype=dtype)], lambda a, b: (a, b), (t,)
    if layout == "htd":  # [tokens, heads, d] stored head-major (strided heads, read in place)
        q, k = (torch.randn(h, t, d, dtype=dtype).transpose(0, 1) for h in (hq, hk))
        return [q, k], lambda a, b: (a, b), (t,)
    if layout == "bshd":  # [2, tokens/2, heads, d] stored seq-major: token dims that do not merge (copied)
        q = torch.randn(t // 2, 2, hq, d, dtype=dtype).transpose(0, 1)
        return [q, torch.randn(2, t // 2, hk, d, dtype=dtype)], lambda a, b: (a, b), (2, t // 2)
    # q / k: strided views of one fused [tokens, hq + 2 hk, d] projection (the vision tower's), read in place
    return [torch.randn(t, hq + 2 * hk, d, dtype=dtype)], lambda m: (m[:, :hq], m[:, hq : hq + hk]), (t,)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("rot,d", [(16, 16), (8, 24)])
def test_rotary(dtype, interleaved, rot, d):
    """Op `rotary` (angle tables) against the reference, values and q / k gradients: GQA, MHA,
    more k heads than q heads, two head blocks; 3-D and 4-D inputs, strided tokens or heads read in
    place, token dims that do not merge; partial rotary (8 of 24 channels). fp32 to 1e-5, bf16 to one bf16 rounding (the
    tables in the input dtype, so bf16 tables are read too)."""
    from loongforge.kernels.rotary import rotary

    torch.manual_seed(0)
    t = 8
    for layout, hq, hk in (("thd", 3, 1), ("thd", 18, 3), ("1thd", 4, 4), ("1thd", 2, 5), ("htd", 2, 5), ("bshd", 3, 1), ("fused", 4, 2)):
        inputs, split, lead = _rotary_layout(layout, t, hq, hk, d, dtype)
        ang = torch.randn(*lead, 1, rot // 2) * 3
        cos, sin = ang.cos().to(dtype), ang.sin().to(dtype)
        ran = []

        def kernel(*xs):
            out = rotary(*split(*xs), cos, sin, interleaved)
            ran.append(type(out[0].grad_fn).__name__)
            return out

        q_shape = split(*inputs)[0].shape
        grads = (torch.randn(*q_shape[:-2], hq, d, dtype=dtype), torch.randn(*q_shape[:-2], hk, d, dtype=dtype))
        _compare(
            kernel,
            lambda *xs: ref.rotary(*split(*xs), cos, sin, interleaved),
            inputs,
            grads,
            TOL if dtype == torch.float32 else BF16_TOL,
        )
        assert ran == ["RotationBackward"], (layout, ran)  # the kernel ran, not the reference fallback


def test_rotary_backward_is_rotation_by_the_negative_angle():
    """The gradient of a rotation by a table is the output gradient rotated by its negative angle
    (sin -> -sin), checked on the kernel directly."""
    from loongforge.kernels.rotary import rotary

    torch.manual_seed(0)
    q, k = torch.randn(5, 3, 16, requires_grad=True), torch.randn(5, 1, 16, requires_grad=True)
    ang = torch.randn(5, 1, 8)
    gq, gk = torch.randn(5, 3, 16), torch.randn(5, 1, 16)
    torch.autograd.backward(rotary(q, k, ang.cos(), ang.sin(), False), (gq, gk))
    want_q, want_k = ref.rotary(gq, gk, ang.cos(), -ang.sin(), False)
    torch.testing.assert_close(q.grad, want_q, **TOL)
    torch.testing.assert_close(k.grad, want_k, **TOL)


def test_rotary_tables_per_token():
    """The kernel takes tables whose leading dims are q's token dims (missing leading dims where q
    has size 1); others broadcast rows over tokens or grow the output, and go to the reference."""
    from loongforge.kernels.rotary import per_token_tables

    def fits(q_shape, table_shape):
        return per_token_tables(torch.empty(table_shape), torch.empty(q_shape))

    assert fits((7, 4, 16), (7, 1, 8)) and fits((1, 7, 4, 16), (7, 1, 8)) and fits((2, 7, 4, 16), (2, 7, 1, 8))
    assert not fits((2, 7, 4, 16), (7, 1, 8))  # one row for both sequences
    assert not fits((7, 4, 16), (1, 7, 1, 8))  # the reference's output would be 4-D
    assert not fits((7, 4, 16), (1, 1, 8)) and not fits((7, 4, 16), (7, 4, 8))  # one row for all tokens; per head


def test_rotary_falls_back_to_the_reference():
    """What the kernel does not take runs the reference (same values; tables that require grad
    get their gradient)."""
    from loongforge.kernels.rotary import rotary

    torch.manual_seed(0)
    q, k = torch.randn(6, 3, 16, requires_grad=True), torch.randn(6, 1, 16, requires_grad=True)
    ang = torch.randn(6, 1, 8)
    cases = [
        (q, k, ang.cos(), ang.sin()),  # control: the kernel's case
        (q, k, ang[:1].cos(), ang[:1].sin()),  # one row for every token
        (q[None].expand(2, -1, -1, -1), k[None].expand(2, -1, -1, -1), ang.cos(), ang.sin()),  # rows repeated over a batch
        (q.double(), k.double(), ang.cos(), ang.sin()),  # no fp64 kernel
        (q, k.bfloat16(), ang.cos(), ang.sin()),  # q and k of different dtypes
        (q, k[..., :8], ang[..., :4].cos(), ang[..., :4].sin()),  # k of another head_dim
    ]
    for i, (a, b, c, s) in enumerate(cases):
        out = rotary(a, b, c, s, False)
        assert (type(out[0].grad_fn).__name__ == "RotationBackward") == (i == 0), i
        for x, y in zip(out, ref.rotary(a, b, c, s, False)):
            torch.testing.assert_close(x, y, **(TOL if i == 0 else dict(rtol=0, atol=0)))
    cos, sin = ang.cos().requires_grad_(), ang.sin().requires_grad_()
    qo, ko = rotary(q, k, cos, sin, False)
    assert type(qo.grad_fn).__name__ != "RotationBackward"
    (qo.sum() + ko.sum()).backward()
    assert cos.grad is not None and sin.grad is not None


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_linear_cross_entropy(smoothing, monkeypatch):
    from loongforge.kernels import linear_cross_entropy as lce

    monkeypatch.setattr(lce, "BLOCK_V", 16)  # several vocab blocks per row
    torch.manual_seed(0)
    n, h, v = 13, 12, 37
    hid, w = torch.randn(n, h), torch.randn(v, h)
    labels = torch.randint(0, v, (n,))
    labels[[2, 7]] = -100
    tw = torch.rand(n)
    for go, budget in ((torch.tensor(1.0), None), (torch.tensor(0.37), None), (torch.tensor(0.37), 5 * v * 4)):  # one chunk; chunks of 5
        _compare(
            lambda a, b: lce.linear_cross_entropy(a, b, labels, tw, label_smoothing=smoothing, logits_budget=budget),
            lambda a, b: ref.linear_cross_entropy(a, b, labels, tw, label_smoothing=smoothing),
            [hid, w],
            go,
        )


def test_linear_cross_entropy_second_backward_is_refused():
    """Its gradients are made in the forward and scaled in place by the backward: a second
    backward through the same graph would scale them twice, so it fails with a message."""
    from loongforge.kernels.linear_cross_entropy import linear_cross_entropy

    torch.manual_seed(0)
    hid, w = torch.randn(5, 8, requires_grad=True), torch.randn(11, 8, requires_grad=True)
    loss = linear_cross_entropy(hid, w, torch.randint(0, 11, (5,)), torch.full((5,), 0.2))
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="retain_graph is not supported"):
        loss.backward()


# 2100 with k=3: three column blocks in every kernel's loop and a [4, 1024] tile with a masked row
@pytest.mark.parametrize("h,k,e", [(20, 2, 4), (2100, 3, 5), (37, 1, 3)])
def test_moe_permute_unpermute(h, k, e):
    from loongforge.kernels.moe_permute import moe_permute, moe_unpermute

    torch.manual_seed(0)
    n = 9
    tokens = torch.randn(n, h)
    experts = torch.stack([torch.randperm(e)[:k] for _ in range(n)])
    probs = torch.rand(n, k)
    got_p, rows, counts = moe_permute(tokens, experts, e)
    want_p, want_rows, want_counts = ref.moe_permute(tokens, experts, e)
    assert torch.equal(rows, want_rows) and torch.equal(counts, want_counts) and counts.sum() == n * k
    torch.testing.assert_close(got_p, want_p, rtol=0, atol=0)
    # expert-major order: each expert's rows are contiguous
    assert torch.equal(experts.reshape(-1)[rows], torch.sort(experts.reshape(-1)).values)

    def roundtrip(kernel_p, kernel_u):
        def f(t, p):
            perm, r, _ = kernel_p(t, experts, e)
            return kernel_u(perm * 2.0, r, p)

        return f

    _compare(roundtrip(moe_permute, moe_unpermute), roundtrip(ref.moe_permute, ref.moe_unpermute), [tokens, probs], torch.randn(n, h))
    # permute then unpermute with probabilities summing to 1 gives the tokens back
    back = moe_unpermute(got_p, rows, probs / probs.sum(1, keepdim=True))
    torch.testing.assert_close(back, tokens)


@pytest.mark.parametrize("packed", [False, True])
def test_model_with_fused_qkv_rope_matches_megatron_split(packed):
    """The decoder through the fused attention path (kernel `qkv_rope`) against megatron's own
    split with the reference rotary op (a Qwen3-like q/k-norm layer takes megatron's path;
    checked by forcing the fused flag off): logits and every gradient, fp32, GQA, packed THD
    sequences included."""
    from loongforge.core.foundation.families import LLAMA
    from loongforge.core.foundation.spec import ModelConfig, build_gpt_model
    from loongforge.core.ops import OpTable
    from loongforge.core.parallel import init_parallel
    from loongforge.kernels.qkv_rope import qkv_rope

    ctx = init_parallel(1, 1, "gloo", "cpu")
    cfg = LLAMA.resolve(
        ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=96, vocab_size=128)
    )
    torch.manual_seed(0)
    fused = build_gpt_model(cfg, ctx, OpTable({**OpTable().impls, "qkv_rope": qkv_rope}))
    split = build_gpt_model(cfg, ctx, OpTable())
    split.load_state_dict(fused.state_dict())
    for layer in split.decoder.layers:
        layer.self_attention.fused = False  # megatron's forward: split views, rope in core attention
    assert all(layer.self_attention.fused for layer in fused.decoder.layers)
    (la, ga), (lb, gb) = decoder_outputs([fused, split], packed)
    torch.testing.assert_close(la, lb, **TOL)
    for n in ga:
        torch.testing.assert_close(ga[n], gb[n], **TOL, msg=n)


def test_model_with_fused_add_rms_norm_matches_megatron_layer():
    """The decoder whose attention residual add and MLP norm run as the `add_rms_norm` kernel
    against megatron's own layer (add, then the reference norm): logits and every gradient, fp32."""
    from loongforge.core.foundation.families import LLAMA
    from loongforge.core.foundation.spec import ModelConfig, build_gpt_model
    from loongforge.core.ops import OpTable
    from loongforge.core.parallel import init_parallel
    from loongforge.kernels.rms_norm import add_rms_norm

    ctx = init_parallel(1, 1, "gloo", "cpu")
    cfg = LLAMA.resolve(
        ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=96, vocab_size=128)
    )
    torch.manual_seed(0)
    fused = build_gpt_model(cfg, ctx, OpTable({**OpTable().impls, "add_rms_norm": add_rms_norm}))
    plain = build_gpt_model(cfg, ctx, OpTable())
    for layer in plain.decoder.layers:
        layer.fused = False
    for p in fused.parameters():  # norm weights away from 1, so their gradients are checked
        if p.dim() == 1:
            p.data.uniform_(0.5, 1.5)
    plain.load_state_dict(fused.state_dict())
    (la, ga), (lb, gb) = decoder_outputs([fused, plain])
    torch.testing.assert_close(la, lb, **TOL)
    for n in ga:
        torch.testing.assert_close(ga[n], gb[n], **TOL, msg=n)


def test_adamw_matches_exact_update(compare_adamw):
    """The AdamW kernel and torch's fused AdamW (core's reference) against the exact float64
    update within fp32 rounding (`compare_adamw` in tests/conftest.py has the bounds): tensors
    large enough for their own launch (odd sizes, several blocks) and small ones (which go to the
    reference), one tensor's step count ahead of the others. The interpreter does scalar
    arithmetic in fp64, so the fp32 rounding of 1 - beta2 that a GPU launch would add (110 eps)
    shows only in the GPU test."""
    from loongforge.kernels import adamw as kernel

    torch.manual_seed(0)
    params = [torch.randn(s) for s in [(3, 5), (kernel.MIN_NUMEL + 7,), (2, kernel.MIN_NUMEL // 2 + 1), (1,)]]
    assert [kernel._own_launch(p, p, p, p) for p in params] == [False, True, True, False]
    for name, update in (("kernel", kernel.adamw), ("torch fused", ref.adamw)):
        print(name, {k: round(v, 3) for k, v in compare_adamw(update, params, [0, 0, 4, 0], "cpu").items()})


def test_adamw_without_grad_scale():
    """Without a gradient scale both read the gradient as it is."""
    from loongforge.kernels import adamw as kernel

    torch.manual_seed(0)
    states = [[torch.randn(kernel.MIN_NUMEL + 3)] for _ in range(2)]
    states[1][0].copy_(states[0][0])
    grads = [torch.randn(kernel.MIN_NUMEL + 3)]
    for fn, ps in zip((kernel.adamw, ref.adamw), states):
        fn(
            ps,
            [grads[0].clone()],
            [torch.zeros_like(ps[0])],
            [torch.zeros_like(ps[0])],
            [torch.ones(())],
            lr=1e-2,
            beta1=0.9,
            beta2=0.999,
            weight_decay=0.1,
            eps=1e-8,
        )
    torch.testing.assert_close(states[0][0], states[1][0], rtol=1e-6, atol=1e-7)


def test_adamw_found_inf_skips():
    from loongforge.kernels import adamw as kernel

    for update in (kernel.adamw, ref.adamw):
        check_adamw_found_inf(update, "cpu", torch.float32, kernel.MIN_NUMEL + 5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sum_squares_matches_float64(dtype):
    """The gradient norm's sum of squares against the float64 sum: tensors with their own launch
    (one short of a chunk, several chunks with a ragged end) and ones that go to the reference (a
    small one, a transposed large one). Every term is positive, so fp32 accumulation over chunks
    of 8192 then a pairwise sum stays within ~40 fp32 eps of the exact value: 1e-5 relative."""
    from loongforge.kernels import sum_squares as kernel

    torch.manual_seed(0)
    n = kernel.MIN_NUMEL
    tensors = [t.to(dtype) for t in (torch.randn(3, 5), torch.randn(n + 7), torch.randn(3, n // 2 + 1), torch.randn(1000, 70).t())]
    assert [kernel._own_launch(t) for t in tensors] == [False, True, True, False]
    for name, fn, ts in (
        ("kernel", kernel.sum_squares, tensors),
        ("kernel, own launches only", kernel.sum_squares, tensors[1:3]),
        ("kernel, reference only", kernel.sum_squares, tensors[::3]),
        ("reference", ref.sum_squares, tensors),
    ):
        got = fn(ts)
        want = sum(t.double().square().sum() for t in ts)
        assert got.dtype == torch.float32 and got.dim() == 0, name
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=0, msg=name)


def test_packed_attention_routes_by_pack_shape(monkeypatch):
    """One-sample packs (causal or not) and bidirectional packs of at most 16 samples with one of
    8192+ tokens run SDPA (cuDNN's attention on Hopper), never the flash varlen kernel; packs of
    shorter or more samples reach it. Every route gives the reference's result."""
    from loongforge.kernels import varlen_attention as va

    calls = []
    monkeypatch.setattr(va, "_flash", lambda *a, **k: calls.append(a[3].shape[0]))  # returns None: the reference runs
    torch.manual_seed(0)
    q, k, v = (torch.randn(10, 2, 8) for _ in range(3))
    one, two = torch.tensor([0, 10]), torch.tensor([0, 4, 10])
    torch.testing.assert_close(va.packed_attention(q, k, v, one, one), ref.packed_attention(q, k, v, one, one), **TOL)
    torch.testing.assert_close(va.varlen_attention(q, k, v, one), ref.varlen_attention(q, k, v, one), **TOL)
    assert calls == []
    torch.testing.assert_close(va.packed_attention(q, k, v, two, two), ref.packed_attention(q, k, v, two, two), **TOL)
    torch.testing.assert_close(va.varlen_attention(q, k, v, two), ref.varlen_attention(q, k, v, two), **TOL)
    assert calls == [3, 3]
    # the longest sample's length decides (the max_seqlen hint, or the bounds where none is given)
    calls.clear()
    long = va.PER_SAMPLE_MIN_LEN
    for n, hint, routed in ((2, long, False), (2, long - 1, True), (va.PER_SAMPLE_MAX_SAMPLES + 1, long, True)):
        cu = torch.tensor([0, 4, 10] if n == 2 else [0] * n + [10])  # (empty samples are valid bounds)
        va.packed_attention(q, k, v, cu, cu, None, hint, hint)
        assert bool(calls) == routed, (n, hint)
        calls.clear()
    t = 2 * long + 3
    q2, k2, v2 = (torch.randn(t, 1, 8) for _ in range(3))
    cu = torch.tensor([0, long + 3, t])
    torch.testing.assert_close(va.packed_attention(q2, k2, v2, cu, cu), ref.packed_attention(q2, k2, v2, cu, cu), **TOL)
    assert calls == []


def test_gemma_with_kernel_ops_matches_reference_ops():
    """A Gemma decoder whose norms and gated MLP run as the `gemma_rms_norm` and `geglu` kernels
    against the same weights on core's reference ops: final states and every gradient, fp32."""
    from loongforge.core.foundation.gemma import GemmaConfig, GemmaModel
    from loongforge.core.ops import OpTable
    from loongforge.kernels.rms_norm import gemma_rms_norm
    from loongforge.kernels.swiglu import geglu

    cfg = GemmaConfig(num_layers=2, hidden_size=48, num_attention_heads=4, num_query_groups=2, head_dim=16, ffn_hidden_size=80)
    calls = {"gemma_rms_norm": 0, "geglu": 0}

    def counted(name, fn):
        def wrapper(*a):
            calls[name] += 1
            return fn(*a)

        return wrapper

    torch.manual_seed(0)
    kernels = {"gemma_rms_norm": counted("gemma_rms_norm", gemma_rms_norm), "geglu": counted("geglu", geglu)}
    fused = GemmaModel(cfg, OpTable({**OpTable().impls, **kernels}))
    plain = GemmaModel(cfg, OpTable())
    for p in fused.parameters():  # norm weights away from 0, so their gradients are checked
        if p.dim() == 1:
            p.data.uniform_(-0.5, 0.5)
    plain.load_state_dict(fused.state_dict())
    ids = torch.randint(0, cfg.vocab_size, (2, 7))
    outs, grads = [], []
    for m in (fused, plain):
        out = m(m.embed(ids))
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        outs.append(out)
        grads.append({n: p.grad for n, p in m.named_parameters()})
    assert calls == {"gemma_rms_norm": 2 * 2 + 1, "geglu": 2}  # two norms and one MLP per layer, the final norm
    torch.testing.assert_close(outs[0], outs[1], **TOL)
    for n in grads[1]:
        torch.testing.assert_close(grads[0][n], grads[1][n], **TOL, msg=n)
