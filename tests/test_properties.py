"""Property-based tests (hypothesis): random shapes, strides, empty dimensions and values against
independent float64 formulas (CPU, in CI) and the CUDA kernels against the references (GPU), and a
state machine of the cache manager (allocate / append / free, failed appends and rolled-back
transactions change nothing, no two sequences share a slot)."""

from __future__ import annotations

import pytest
import torch

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule  # noqa: E402

import qops  # noqa: E402
from qops.attention import decode_attention_reference  # noqa: E402

CPU = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
# GPU examples: the active profile's count (default 100; tools/sanitize.sh loads "sanitize": 4)
GPU = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])
HALF = st.sampled_from([torch.float16, torch.bfloat16])


@st.composite
def rows_of(draw, dtype=HALF, max_rows=9, max_h=300, h_multiple=1):
    """A ``[*lead, H]`` tensor, possibly with an empty leading dimension, possibly a slice of a
    wider tensor (a row stride larger than H), values of several magnitudes."""
    lead = draw(st.lists(st.integers(0, max_rows), min_size=1, max_size=2))
    h = draw(st.integers(1, max_h // h_multiple)) * h_multiple
    pad = draw(st.sampled_from([0, 0, 8, 13]))
    scale = draw(st.sampled_from([1e-3, 1.0, 30.0]))
    seed = draw(st.integers(0, 2**31 - 1))
    dt = draw(dtype)
    g = torch.Generator().manual_seed(seed)
    wide = (torch.randn(*lead, h + pad, generator=g) * scale).to(dt)
    return wide[..., :h]


def _step_bound(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor) -> None:
    """q is x / s rounded and saturated: within half a step of x / s (float64; plus the float32
    rounding of the quotient, which can turn k + 0.5 + tiny into a tie), inside [-128, 127]."""
    if q.numel() == 0:
        return
    exact = x.double() / s.double()
    want = exact.clamp(-128, 127)
    assert bool(((q.double() - want).abs() <= 0.5 + 1e-5 * want.abs() + 1e-6).all())


# ---- CPU: the references against float64 formulas ---------------------------------------------
@CPU
@given(x=rows_of(dtype=st.sampled_from([torch.float16, torch.bfloat16, torch.float32])))
def test_quant_per_token_property(x):
    q, s = qops.quant_per_token(x)
    assert q.shape == x.shape and s.shape == x.shape[:-1] and q.is_contiguous()
    amax = x.double().abs().amax(-1) if x.numel() else torch.zeros(x.shape[:-1], dtype=torch.float64)
    assert torch.allclose(s.double(), (amax / 127).clamp(min=1e-10), rtol=1e-6, atol=0)
    _step_bound(x, q, s.unsqueeze(-1))


@CPU
@given(x=rows_of(), static=st.booleans(), residual=st.booleans(), data=st.data())
def test_rms_norm_quant_property(x, static, residual, data):
    h = x.shape[-1]
    w = (torch.rand(h, generator=torch.Generator().manual_seed(h)) + 0.5).to(x.dtype)
    scale = torch.tensor([data.draw(st.floats(1e-3, 1.0))]) if static else None
    r = torch.randn(x.shape).to(x.dtype) if residual else None
    z = (x.double() + r.double()).to(x.dtype) if residual else x
    y = z.double() * torch.rsqrt(z.double().pow(2).mean(-1, keepdim=True) + 1e-5) * w.double()
    if residual:
        q, s = qops.fused_add_rms_norm_quant(x, r, w, 1e-5, scale)
        assert torch.equal(r, z)
    else:
        q, s = qops.rms_norm_quant(x, w, 1e-5, scale)
    assert q.shape == x.shape and q.dtype == torch.int8
    if static:
        assert torch.equal(s, scale)
        _step_bound(y.float(), q, scale)
    else:
        assert s.shape == x.shape[:-1]
        _step_bound(y.float(), q, s.unsqueeze(-1))


@CPU
@given(x=rows_of(h_multiple=2))
def test_silu_and_mul_quant_property(x):
    q, s = qops.silu_and_mul_quant(x)
    i = x.shape[-1] // 2
    g, u = x[..., :i].double(), x[..., i:].double()
    y = g / (1 + torch.exp(-g)) * u
    assert q.shape == (*x.shape[:-1], i)
    _step_bound(y.float(), q, s.unsqueeze(-1))


@CPU
@given(
    m=st.integers(0, 20),
    n16=st.integers(1, 6),
    k16=st.integers(0, 8),
    per_token=st.booleans(),
    bias=st.booleans(),
    out=HALF,
    seed=st.integers(0, 2**31 - 1),
)
def test_w8a8_gemm_property(m, n16, k16, per_token, bias, out, seed):
    n, k = 16 * n16, 16 * k16
    g = torch.Generator().manual_seed(seed)
    a = torch.randint(-128, 128, (m, k), generator=g, dtype=torch.int8)
    b = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    sa = torch.rand(m if per_token else 1, generator=g) * 0.01 + 1e-4
    sb = torch.rand(n if per_token else 1, generator=g) * 0.01 + 1e-4
    bz = torch.randn(n, generator=g).to(out) if bias else None
    d = qops.w8a8_gemm(a, b, sa, sb, out, bz)
    acc = (a.long() @ b.long().T).float()  # exact in int64, then one rounding to float32
    want = acc * sa.reshape(-1, 1) * sb.reshape(1, -1) + (bz.float() if bias else 0.0)
    assert d.shape == (m, n) and torch.equal(d, want.to(out))


@st.composite
def decode_problems(draw, device="cpu"):
    d = draw(st.sampled_from([64, 128]))
    hkv = draw(st.integers(1, 3))
    g = draw(st.sampled_from([1, 2, 3, 4, 7, 8]))
    bs = draw(st.sampled_from([16, 32]))
    lens = draw(st.lists(st.integers(0, 100), min_size=0, max_size=4))
    static = draw(st.booleans())
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    b = len(lens)
    max_blocks = max([1] + [-(-n // bs) for n in lens])
    nb = b * max_blocks + 2
    kc = torch.randint(-127, 128, (nb, hkv, bs, d), generator=gen, dtype=torch.int8)
    vc = torch.randint(-127, 128, (nb, hkv, bs, d), generator=gen, dtype=torch.int8)
    if static:
        ks, vs = torch.tensor([0.02]), torch.tensor([0.03])
    else:
        ks = torch.rand(nb, hkv, bs, generator=gen) * 0.02 + 1e-3
        vs = torch.rand(nb, hkv, bs, generator=gen) * 0.02 + 1e-3
    bt = torch.randperm(nb, generator=gen)[: b * max_blocks].to(torch.int32).reshape(b, max_blocks)
    q = torch.randn(b, hkv * g, d, generator=gen).to(torch.float16)
    sl = torch.tensor(lens, dtype=torch.int32)
    return [t.to(device) for t in (q, kc, vc, ks, vs, bt, sl)]


@CPU
@given(p=decode_problems())
def test_paged_decode_attention_property(p):
    q, kc, vc, ks, vs, bt, sl = p
    sm = q.shape[-1] ** -0.5
    out = qops.paged_decode_attention_int8(q, kc, vc, ks, vs, bt, sl, sm)
    want = decode_attention_reference(q, kc, vc, ks, vs, bt, sl, sm, dtype=torch.float64)
    assert out.shape == q.shape
    assert torch.allclose(out.double(), want, atol=2e-3, rtol=2e-3)


@CPU
@given(
    t=st.integers(0, 12),
    hkv=st.integers(1, 3),
    d=st.sampled_from([16, 64]),
    static=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_reshape_and_cache_int8_property(t, hkv, d, static, seed):
    g = torch.Generator().manual_seed(seed)
    nb, bs = 3, 16
    kc = torch.zeros(nb, hkv, bs, d, dtype=torch.int8)
    ks = torch.tensor([0.05]) if static else torch.zeros(nb, hkv, bs)
    key = torch.randn(t, hkv, d, generator=g).to(torch.float16)
    slots = torch.randperm(nb * bs + 1, generator=g)[:t] - 1  # distinct slots, -1 (padding) included
    kc2, ks2 = kc.clone(), ks.clone()
    qops.reshape_and_cache_int8(key, key, kc, kc2, ks, ks2, slots)
    assert torch.equal(kc, kc2) and torch.equal(ks, ks2)
    for i, s in enumerate(slots.tolist()):
        if s < 0:
            continue
        row, scale = kc[s // bs, :, s % bs], (ks.reshape(()) if static else ks[s // bs, :, s % bs, None])
        _step_bound(key[i].float(), row, scale)


# ---- fakes: the shapes the real ops return ------------------------------------------------------
@CPU
@given(x=rows_of(h_multiple=2))
def test_fakes_match_real_shapes(x):
    from torch._subclasses.fake_tensor import FakeTensorMode

    w = torch.ones(x.shape[-1], dtype=x.dtype)
    calls = [
        lambda a, b: qops.quant_per_token(a),
        lambda a, b: qops.rms_norm_quant(a, b, 1e-5),
        lambda a, b: qops.silu_and_mul_quant(a),
    ]
    real = [c(x, w) for c in calls]
    with FakeTensorMode() as mode:
        fx, fw = mode.from_tensor(x), mode.from_tensor(w)
        fake = [c(fx, fw) for c in calls]
    for r, f in zip(real, fake):
        assert [t.shape for t in r] == [t.shape for t in f] and [t.dtype for t in r] == [t.dtype for t in f]


# ---- GPU: the CUDA kernels against the references -----------------------------------------------
gpu = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.gpu
@GPU
@given(x=rows_of(dtype=st.sampled_from([torch.float16, torch.bfloat16, torch.float32]), max_rows=70, max_h=5000))
def test_cuda_quant_per_token_matches_reference(x):
    q, s = qops.quant_per_token(x.cuda())
    rq, rs = qops.quant_per_token(x)
    assert torch.equal(q.cpu(), rq) and torch.equal(s.cpu(), rs)


@pytest.mark.gpu
@GPU
@given(x=rows_of(max_rows=70, max_h=9000), residual=st.booleans())
def test_cuda_rms_norm_quant_matches_reference(x, residual):
    w = (torch.rand(x.shape[-1]) + 0.5).to(x.dtype)
    if residual:
        r = torch.randn(x.shape).to(x.dtype)
        rc = r.cuda()
        q, s = qops.fused_add_rms_norm_quant(x.cuda(), rc, w.cuda(), 1e-5)
        rq, rs = qops.fused_add_rms_norm_quant(x, r, w, 1e-5)
        assert torch.equal(rc.cpu(), r)
    else:
        q, s = qops.rms_norm_quant(x.cuda(), w.cuda(), 1e-5)
        rq, rs = qops.rms_norm_quant(x, w, 1e-5)
    # the kernel sums x^2 in another float32 order: one quantization step at most
    assert (q.cpu().int() - rq.int()).abs().max() <= 1 if q.numel() else True
    assert torch.allclose(s.cpu(), rs, rtol=1e-5, atol=0)


@pytest.mark.gpu
@GPU
@given(x=rows_of(max_rows=70, max_h=9000, h_multiple=2))
def test_cuda_silu_and_mul_quant_matches_reference(x):
    q, s = qops.silu_and_mul_quant(x.cuda())
    rq, rs = qops.silu_and_mul_quant(x)
    assert (q.cpu().int() - rq.int()).abs().max() <= 1 if q.numel() else True  # fast exp
    assert torch.allclose(s.cpu(), rs, rtol=1e-5, atol=0)


@pytest.mark.gpu
@GPU
@given(p=decode_problems())
def test_cuda_paged_decode_attention_matches_reference(p):
    q, kc, vc, ks, vs, bt, sl = p
    sm = q.shape[-1] ** -0.5
    out = qops.paged_decode_attention_int8(*(t.cuda() for t in p), sm)
    want = decode_attention_reference(q, kc, vc, ks, vs, bt, sl, sm, dtype=torch.float64)
    assert torch.allclose(out.cpu().double(), want, atol=2e-3, rtol=2e-3)


# ---- the cache manager as a state machine -------------------------------------------------------
class CacheMachine(RuleBasedStateMachine):
    """Random allocate / append / free / failing appends / rolled-back transactions against a model
    of the lengths; the invariants hold after every step."""

    NUM_BLOCKS, BLOCK = 12, 4

    def __init__(self) -> None:
        super().__init__()
        self.cache = qops.BlockAllocator(self.NUM_BLOCKS, self.BLOCK)
        self.lens: dict[int, int] = {}
        self.slots: dict[int, list[int]] = {}  # every slot each sequence was given, in order
        self.next_id = 0

    def _append(self, ids: list[int], counts: list[int]) -> None:
        slots = self.cache.append_slots(ids, counts).tolist()
        pos = 0
        for sid, n in zip(ids, counts):
            self.slots.setdefault(sid, []).extend(slots[pos : pos + n])
            self.lens[sid] = self.lens.get(sid, 0) + n
            pos += n

    @rule(n=st.integers(0, 9))
    def add(self, n):
        sid, self.next_id = self.next_id, self.next_id + 1
        if self.cache.can_append([sid], [n]):
            self._append([sid], [n])
        else:
            before = self._snapshot()
            with pytest.raises(RuntimeError, match="out of cache blocks"):
                self.cache.append_slots([sid], [n])
            assert self._snapshot() == before

    @precondition(lambda self: self.lens)
    @rule(data=st.data())
    def grow(self, data):
        ids = data.draw(st.lists(st.sampled_from(sorted(self.lens)), min_size=1, unique=True))
        counts = data.draw(st.lists(st.integers(0, 6), min_size=len(ids), max_size=len(ids)))
        if self.cache.can_append(ids, counts):
            self._append(ids, counts)
        else:
            before = self._snapshot()
            with pytest.raises(RuntimeError):
                self.cache.append_slots(ids, counts)
            assert self._snapshot() == before

    @precondition(lambda self: self.lens)
    @rule(data=st.data())
    def free(self, data):
        sid = data.draw(st.sampled_from(sorted(self.lens)))
        self.cache.free(sid)
        del self.lens[sid], self.slots[sid]
        with pytest.raises(KeyError, match="unknown sequence"):
            self.cache.free(sid)

    @rule(data=st.data())
    def failed_transaction(self, data):
        before = self._snapshot()
        with pytest.raises(ZeroDivisionError):
            with self.cache.transaction():
                for sid in data.draw(st.lists(st.sampled_from(sorted(self.lens) or [999]), max_size=3, unique=True)):
                    if sid in self.lens and data.draw(st.booleans()):
                        self.cache.free(sid)
                    elif self.cache.can_append([sid], [3]):
                        self.cache.append_slots([sid], [3])
                raise ZeroDivisionError
        assert self._snapshot() == before

    def _snapshot(self):
        c = self.cache
        return ({s: c.seq_len(s) for s in c.sequences()}, {s: c.blocks(s) for s in c.sequences()}, sorted(c._free))

    @invariant()
    def consistent(self):
        c = self.cache
        assert {s: c.seq_len(s) for s in c.sequences()} == self.lens
        owned = [b for s in c.sequences() for b in c.blocks(s)]
        assert len(owned) == len(set(owned)), "two sequences share a block"
        assert sorted(owned + list(c._free)) == list(range(self.NUM_BLOCKS))
        for s in c.sequences():
            assert len(c.blocks(s)) == -(-self.lens[s] // self.BLOCK)
            blocks = c.blocks(s)
            assert self.slots[s] == [blocks[p // self.BLOCK] * self.BLOCK + p % self.BLOCK for p in range(self.lens[s])]
        all_slots = [x for s in self.slots.values() for x in s]
        assert len(all_slots) == len(set(all_slots)), "two live tokens share a slot"


TestCacheMachine = CacheMachine.TestCase
TestCacheMachine.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)
