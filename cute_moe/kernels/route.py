"""Top-k routing (``cute_moe.route``) as a CuTe DSL kernel: the op's CUDA implementation,
checked on an H200 by tests/test_gpu_route.py (compiled for sm_90a and sm_100a).

Math, per token (``reference.route_ref``; all in f32, ``x`` = the logits as f32,
exact for bf16)::

    sigmoid(x) = 1 / (1 + exp(-x))                       # torch's CUDA sigmoid expression
    softmax        key p = exp(x - max x) / sum exp(x - max x)     w_j = p_j
    renormalize    key x                                 w_j = exp(x_j - x_0) / sum_j exp(x_j - x_0)
    llama4         key x                                 w_j = sigmoid(x_j)
    sigmoid_renorm key s = sigmoid(x)                    w_j = s_j / sum_j s_j
    deepseek_v3    s = sigmoid(x), key c = s + bias (or s); groups of E/n_group experts
                   scored by the sum of their two largest keys (the largest alone for
                   one-expert groups), the topk_group best groups kept (ties: lower
                   group), top_k of the kept keys;   w_j = s_j / sum_j s_j
    out_w_j = w_j * routed_scaling_factor

Output ``j`` is the ``j``-th selection round's pick: the largest remaining key, ties to
the lower expert index, i.e. the reference's stable descending sort.  How the keys
match torch's bit for bit: ``exp`` (softmax, renormalize) is ``cute.math.exp`` with
fastmath off, which lowers to the same instructions as nvcc's ``expf`` (torch's
``std::exp``; seen in the PTX: libdevice's ``fma.rm``/``0f4B400001`` range reduction
and ``ex2.approx.ftz`` with exponent scaling).  sigmoid's ``1 + exp(-x)`` is the PTX
nvcc makes of torch's expression, where the exp's final multiply is contracted into
the ``1 +`` (``silu_mul_quant``'s ``ONE_PLUS_EXP_NEG``, checked on the H200 there).
Every division is the instruction sequence of ``div.rn.f32``'s fast path (``div_rn``:
correctly rounded wherever torch's division takes that path, and no slow-path CALL);
other sums and products are ``add.rn``/``mul.rn``, never contracted into FMAs.  The
weight sums (softmax denominator: lane-local then butterfly; renormalisation: in order
``j``) run in another order than torch's reductions, an ulp or so per term: weights
agree within 1e-5 relative.

Mapping: one warp per token, 4 tokens per CTA of 128 threads, grid ``ceil(T / 4)``.
Lane ``l`` holds the ``V`` contiguous experts ``[l*V, l*V+V)`` (``V >= ceil(E/32)``,
for grouped deepseek_v3 the smallest such ``V`` for which a group covers a
power-of-two run of whole lanes or a lane holds whole groups) in registers, loaded
with vector loads of up to 16 bytes, all issued before any math; experts past ``E``
get ``-inf`` keys.  Keys are turned into order-preserving Int32 (``ordered_key``:
sign-magnitude flip, -0.0 folded onto +0.0 so that they tie as in torch's sort).
One selection round: a lane-local argmax (pairwise tree, strict ``>`` so the lower
position wins), the warp max in one ``redux.sync.max.s32``, a ballot of the lanes
whose best equals it, the lowest such lane wins (lanes own increasing expert
ranges, so it holds the lower expert), one SHFL broadcasts the winner's expert id
(deepseek_v3: a second one its unbiased ``s``; elsewhere the weight source is the
key itself, decoded from the max) and the winner retires that key.  deepseek_v3
groups: each lane's two largest keys of its part of a group, merged over the
group's lanes by butterfly shuffles (values only: a group score does not depend on
which expert holds which value), then ``topk_group`` rounds of the same argmax over
group scores, then keys of experts in dropped groups become ``-inf``.  Lane ``j <
k`` stores output ``j``.  No shared memory, no barriers, no local memory.

Cost (DeepSeek-V3, E=256, k=8, groups 8/4, f32, sm_90a SASS): 43 registers, about
780 instructions per warp, 4 LDG.128, 12 REDUX, 12 VOTE, 24 SHFL; at T=16384 that
is about 12 us of instruction issue on an H200 if latency is hidden, at T=1 a chain
of one load and ~12 dependent rounds.  Measured on the H200 (README): 2.1 µs per call at T=1 and
19.8 µs at T=16384, 100 calls in one CUDA graph.

Constraints (``RouteKernel.can_implement``): logits f32 or bf16; ``1 <= E <= 512``;
``1 <= top_k <= min(E, 32)``, deepseek_v3 ``top_k <= 8``; deepseek_v3: ``E %
n_group == 0``, ``topk_group <= n_group``, ``top_k <= topk_group * E / n_group``,
a lane layout with ``V <= 32``, ``score_bias`` f32 ``[E]``.  Logits and bias must be
finite (a NaN key is taken first, as torch's sort does, but the outputs are then
unspecified).  Corners where keys may differ from torch's: sigmoid of
logits below -87.3 (+0 here, under 1.2e-38 in torch), softmax probabilities in the
subnormal range, and softmax keys whose torch denominator (summed in another order,
possibly with FMAs) differs from ours by an ulp, so that two probabilities tie in
one and not the other.  ``T`` is dynamic; method, E, k, groups, dtype and
the presence of a bias are compiled in; ``routed_scaling_factor`` is a runtime f32
argument.  The logits' row stride and base (and the bias's base) must allow the
chosen vector width: checked on the host, otherwise a contiguous copy is routed.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import torch
from cutlass import Float32, Int32

from ..compiler import arch_of_device, cached_compile, compile_kernel, fake_tensor, torch_to_cutlass_dtype
from ..reference import ROUTING_METHODS
from .reduce_common import add_rn, mul_rn
from .silu_mul_quant import F32_MAX, ONE_PLUS_EXP_NEG

METHODS = ROUTING_METHODS
MAX_EXPERTS = 512
MAX_K = 32
MAX_K_DEEPSEEK = 8
WARP = 32
_NEG_INF = float("-inf")
_REMOVED = -(2**31)  # below every ordered key, -inf included


# ----------------------------------------------------------------------------- static shape


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _is_grouped(method: str, n_group: int, topk_group: int) -> bool:
    """Grouping only matters when some group can be dropped."""
    return method == "deepseek_v3" and 1 < n_group and topk_group < n_group


def lanes_layout(num_experts: int, n_group: int, grouped: bool) -> int:
    """V: experts per lane (>= ceil(E/32)); with groups, a group spans a power-of-two
    run of whole lanes (``gsz % V == 0``) or a lane holds whole groups (``V % gsz == 0``)."""
    v = -(-num_experts // WARP)
    if not grouped:
        return v
    gsz = num_experts // n_group
    while not ((gsz % v == 0 and _pow2(gsz // v)) or v % gsz == 0):
        v += 1
    return v


def vector_width(experts_per_lane: int, num_experts: int, elem_bytes: int) -> int:
    """Elements per load: the largest power of two dividing V and E within 16 bytes."""
    p = 16 // elem_bytes
    while experts_per_lane % p or num_experts % p:
        p //= 2
    return p


class RouteKernel:
    """Static configuration: method, E, k, groups, logits dtype, bias or not."""

    num_warps = 4
    num_threads = num_warps * WARP

    def __init__(self, method: str, num_experts: int, top_k: int, n_group: int, topk_group: int, dtype, has_bias: bool):
        self.method = method
        self.E = num_experts
        self.k = top_k
        self.dtype = dtype
        self.has_bias = has_bias
        self.grouped = _is_grouped(method, n_group, topk_group)
        self.n_group = n_group
        self.topk_group = topk_group
        self.V = lanes_layout(num_experts, n_group, self.grouped)
        self.vec = vector_width(self.V, num_experts, dtype.width // 8)
        self.bias_vec = vector_width(self.V, num_experts, 4)
        if self.grouped:
            self.gsz = num_experts // n_group
            self.lanes_per_group = self.gsz // self.V if self.gsz >= self.V else 1
            self.groups_per_lane = self.V // self.gsz if self.gsz < self.V else 1

    @staticmethod
    def can_implement(method: str, num_experts: int, top_k: int, n_group: int, topk_group: int,
                      dtype: torch.dtype, has_bias: bool) -> str | None:  # fmt: skip
        """None when the kernel supports the configuration, else the reason."""
        if method not in METHODS:
            return f"method must be one of {METHODS}, got {method!r}"
        if dtype not in (torch.float32, torch.bfloat16):
            return f"router_logits dtype must be float32 or bfloat16, got {dtype}"
        if not 1 <= num_experts <= MAX_EXPERTS:
            return f"E must be in [1, {MAX_EXPERTS}], got {num_experts}"
        max_k = MAX_K_DEEPSEEK if method == "deepseek_v3" else MAX_K
        if not 1 <= top_k <= min(num_experts, max_k):
            return f"top_k must be in [1, {min(num_experts, max_k)}] for {method}, got {top_k}"
        if method != "deepseek_v3":
            if has_bias or n_group != 1 or topk_group != 1:
                return "score_bias / n_group / topk_group are only for deepseek_v3"
            return None
        if n_group < 1 or num_experts % n_group:
            return f"E={num_experts} must be a multiple of n_group={n_group}"
        if not 1 <= topk_group <= n_group:
            return f"topk_group must be in [1, n_group={n_group}], got {topk_group}"
        if top_k > topk_group * (num_experts // n_group):
            return f"top_k={top_k} exceeds topk_group * E / n_group"
        if lanes_layout(num_experts, n_group, _is_grouped(method, n_group, topk_group)) > 32:
            return f"no lane layout for E={num_experts}, n_group={n_group}"
        return None

    @cute.jit
    def __call__(self, mX: cute.Tensor, mBias: cute.Tensor, mIds: cute.Tensor, mW: cute.Tensor,
                 scaling: Float32, stream):  # fmt: skip
        self.kernel(mX, mBias, mIds, mW, scaling).launch(
            grid=[cute.ceil_div(mX.shape[0], self.num_warps), 1, 1],
            block=[self.num_threads, 1, 1],
            stream=stream,
        )

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mBias: cute.Tensor, mIds: cute.Tensor, mW: cute.Tensor, scaling: Float32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        lane = tidx % WARP
        token = bidx * self.num_warps + tidx // WARP
        if token < mX.shape[0]:  # warp-uniform: whole warps leave, the shuffles stay full-warp
            V = self.V
            first = lane * V

            # ---- loads: logits (and bias) of this lane's experts, all before any math
            chunks = V // self.vec
            rX = cute.make_rmem_tensor((V,), self.dtype)
            load = cute.make_copy_atom(
                cute.nvgpu.CopyUniversalOp(), self.dtype, num_bits_per_copy=self.vec * self.dtype.width
            )
            row = mX[token, None]
            for c in cutlass.range_constexpr(chunks):
                if first + c * self.vec < self.E:
                    cute.copy(load, cute.local_tile(row, (self.vec,), (lane * chunks + c,)),
                              cute.local_tile(rX, (self.vec,), (c,)))  # fmt: skip
            rB = cute.make_rmem_tensor((V,), Float32)
            if cutlass.const_expr(self.has_bias):
                bchunks = V // self.bias_vec
                bload = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), Float32, num_bits_per_copy=self.bias_vec * 32)
                for c in cutlass.range_constexpr(bchunks):
                    if first + c * self.bias_vec < self.E:
                        cute.copy(bload, cute.local_tile(mBias, (self.bias_vec,), (lane * bchunks + c,)),
                                  cute.local_tile(rB, (self.bias_vec,), (c,)))  # fmt: skip

            valid = [first + i < self.E for i in range(V)]
            rXf = rX.load().to(Float32)
            xs = [rXf[i] for i in range(V)]
            keys, wsrc = self.scores(xs, rB, valid)

            if cutlass.const_expr(self.grouped):
                keys = self.drop_groups(keys, lane)

            # ---- k selection rounds on order-preserving integer keys
            okeys = [ordered_key(keys[i]) for i in range(V)]
            srcs = wsrc if cutlass.const_expr(self.method == "deepseek_v3") else None
            my_id = Int32(0)
            my_src = Float32(0.0)
            norm = Float32(0.0)
            top = Float32(0.0)
            for j in cutlass.range_constexpr(self.k):
                best, pos, src = lane_best(okeys, srcs)
                win, m = warp_argmax_lane(best)
                idx = cute.arch.shuffle_sync(first + pos, win)
                # The weight source is the key itself except for deepseek_v3 (key s + bias, weight s).
                w = cute.arch.shuffle_sync(src, win) if cutlass.const_expr(srcs is not None) else key_value(m)
                is_win = lane == win
                for i in cutlass.range_constexpr(V):
                    okeys[i] = cutlass.select_(is_win & (pos == i), Int32(_REMOVED), okeys[i])
                if cutlass.const_expr(j == 0):
                    top = w
                if cutlass.const_expr(self.method == "renormalize"):
                    w = exp_f32(w - top)  # exp(x_j - x_0), in every lane (uniform)
                if cutlass.const_expr(self.method in ("renormalize", "sigmoid_renorm", "deepseek_v3")):
                    norm = add_rn(norm, w) if j > 0 else w
                my_id = cutlass.select_(lane == j, idx, my_id)
                my_src = cutlass.select_(lane == j, w, my_src)

            # ---- weights of this lane's output entry
            if cutlass.const_expr(self.method == "llama4"):
                wt = sigmoid_f32(my_src)
            elif cutlass.const_expr(self.method == "softmax"):
                wt = my_src
            else:
                wt = div_rn(my_src, norm)
            wt = mul_rn(wt, scaling)
            if lane < self.k:
                mIds[token, lane] = my_id
                mW[token, lane] = wt

    @cute.jit
    def scores(self, xs: list, rB: cute.Tensor, valid: list):
        """(selection keys, weight sources) of this lane's V experts; -inf keys past E."""
        V = self.V
        ninf = Float32(_NEG_INF)
        keys = []
        wsrc = []
        if cutlass.const_expr(self.method == "softmax"):
            vx = [cutlass.select_(valid[i], xs[i], ninf) for i in range(V)]
            m = vx[0]
            for i in cutlass.range_constexpr(1, V):
                m = cute.arch.fmax(m, vx[i])
            m = key_value(warp_max(ordered_key(m)))
            es = [exp_f32(vx[i] - m) for i in range(V)]  # exp(-inf) = 0 for experts past E
            total = es[0]
            for i in cutlass.range_constexpr(1, V):
                total = add_rn(total, es[i])
            total = warp_sum(total)
            for i in cutlass.range_constexpr(V):
                p = div_rn(es[i], total)
                keys.append(cutlass.select_(valid[i], p, ninf))
                wsrc.append(p)
        elif cutlass.const_expr(self.method in ("renormalize", "llama4")):
            for i in cutlass.range_constexpr(V):
                keys.append(cutlass.select_(valid[i], xs[i], ninf))
                wsrc.append(xs[i])
        else:  # sigmoid_renorm, deepseek_v3
            for i in cutlass.range_constexpr(V):
                s = sigmoid_f32(xs[i])
                c = s
                if cutlass.const_expr(self.has_bias):
                    c = add_rn(s, rB[i])
                keys.append(cutlass.select_(valid[i], c, ninf))
                wsrc.append(s)
        return keys, wsrc

    @cute.jit
    def drop_groups(self, keys: list, lane):
        """deepseek_v3: keys of experts outside the topk_group best groups become -inf."""
        ninf = Float32(_NEG_INF)
        gpl = self.groups_per_lane
        lpg = self.lanes_per_group
        span = min(self.gsz, self.V)  # experts of one group inside one lane
        # top-2 (values) of each group part this lane holds
        firsts = []
        seconds = []
        for s in cutlass.range_constexpr(gpl):
            t1 = keys[s * span]
            t2 = ninf
            for i in cutlass.range_constexpr(s * span + 1, s * span + span):
                t2 = cute.arch.fmax(t2, cute.arch.fmin(t1, keys[i]))
                t1 = cute.arch.fmax(t1, keys[i])
            firsts.append(t1)
            seconds.append(t2)
        # merge over the group's lanes (lpg > 1 only when gpl == 1)
        for b in cutlass.range_constexpr(lpg.bit_length() - 1):
            offset = 1 << b
            o1 = cute.arch.shuffle_sync_bfly(firsts[0], offset)
            o2 = cute.arch.shuffle_sync_bfly(seconds[0], offset)
            seconds[0] = cute.arch.fmax(cute.arch.fmin(firsts[0], o1), cute.arch.fmax(seconds[0], o2))
            firsts[0] = cute.arch.fmax(firsts[0], o1)
        gkeys = []
        gids = []
        for s in cutlass.range_constexpr(gpl):
            score = firsts[s]
            if cutlass.const_expr(self.gsz >= 2):
                score = add_rn(firsts[s], seconds[s])
            gid = lane * gpl + s if lpg == 1 else lane // lpg
            ok = gid < self.n_group
            if cutlass.const_expr(lpg > 1):
                ok = ok & (lane % lpg == 0)  # one candidate per group: its first lane
            gkeys.append(cutlass.select_(ok, ordered_key(score), Int32(_REMOVED)))
            gids.append(gid)
        kept = [cutlass.Boolean(False) for _ in range(gpl)]
        for _ in cutlass.range_constexpr(self.topk_group):
            best, pos, _ = lane_best(gkeys, None)
            win, _ = warp_argmax_lane(best)
            g = cute.arch.shuffle_sync(lane * gpl + pos if lpg == 1 else lane // lpg, win)
            for s in cutlass.range_constexpr(gpl):
                hit = gids[s] == g
                kept[s] = kept[s] | hit
                gkeys[s] = cutlass.select_(hit, Int32(_REMOVED), gkeys[s])
        return [cutlass.select_(kept[i // span], keys[i], ninf) for i in range(self.V)]


# ----------------------------------------------------------------------------- device helpers


# a / b correctly rounded wherever ptxas' own div.rn.f32 takes its fast path (FCHK passes:
# normal operands, no overflow or underflow of the quotient), which covers every division
# here (see the module docstring): the instructions of that fast path (MUFU.RCP, one Newton
# step, quotient, one FMA residual correction), without the CALL to its slow path.
_DIV_FAST_PATH = """{
.reg .f32 dv_r, dv_t, dv_q, dv_e, dv_n;
rcp.approx.ftz.f32 dv_r, {$r1};
neg.f32 dv_n, {$r1};
fma.rn.f32 dv_t, dv_n, dv_r, 0f3F800000;
fma.rn.f32 dv_r, dv_r, dv_t, dv_r;
mul.rn.f32 dv_q, {$r0}, dv_r;
fma.rn.f32 dv_e, dv_n, dv_q, {$r0};
fma.rn.f32 {$w0}, dv_r, dv_e, dv_q;
}"""


def div_rn(a, b) -> Float32:
    """RN(a / b) by div.rn.f32's fast path (see ``_DIV_FAST_PATH``)."""
    return cute.arch.inline_ptx(_DIV_FAST_PATH, write_only_types=[Float32], read_only_args=[Float32(a), Float32(b)])


@cute.jit
def exp_f32(x: Float32) -> Float32:
    """exp with fastmath off: the same instructions as nvcc's expf (torch's std::exp), whose
    result torch stores before summing it (no contraction to mirror)."""
    return cute.math.exp(x, fastmath=False)


@cute.jit
def sigmoid_f32(x: Float32) -> Float32:
    """torch's CUDA sigmoid, ``1 / (1 + expf(-x))``, bit for bit: the denominator is nvcc's
    compilation of it (libdevice expf with its final multiply contracted into the ``1 +``,
    shared with silu_mul_quant, whose copy is checked on the H200), the quotient div.rn's fast
    path.  Below x = -87.3 (d > 2**126, +inf clamped to FLT_MAX) the reciprocal flushes and
    the result is +0 where torch's is under 1.2e-38."""
    d = cute.arch.inline_ptx(ONE_PLUS_EXP_NEG, write_only_types=[Float32], read_only_args=[x])
    return div_rn(Float32(1.0), cute.arch.fmin(d, Float32(F32_MAX)))


def ordered_key(f: Float32) -> Int32:
    """Int32 whose signed order is f's order (-0.0 taken as +0.0 first, so they tie, as in
    torch's sort); -inf maps above ``_REMOVED``."""
    bits = add_rn(f, Float32(0.0)).bitcast(Int32)
    return bits ^ ((bits >> 31) & Int32(0x7FFFFFFF))


def key_value(o: Int32) -> Float32:
    """Inverse of ordered_key."""
    return (o ^ ((o >> 31) & Int32(0x7FFFFFFF))).bitcast(Float32)


def warp_max(v: Int32) -> Int32:
    """Warp-wide signed max in one ``redux.sync`` (every lane gets it)."""
    return cute.arch.warp_redux_sync(v, "max")


@cute.jit
def warp_sum(v: Float32) -> Float32:
    """Butterfly sum over the warp; every lane gets the same result."""
    for o in cutlass.range_constexpr(5):
        v = add_rn(v, cute.arch.shuffle_sync_bfly(v, 1 << o))
    return v


def lane_best(keys: list, srcs):
    """(largest key, its position, its weight source or None) among this lane's keys, by a
    pairwise tree; ties keep the lower position (the left operand always has the lower ones)."""
    level = [(keys[i], Int32(i), None if srcs is None else srcs[i]) for i in range(len(keys))]
    while len(level) > 1:
        nxt = []
        for a in range(0, len(level) - 1, 2):
            (ka, pa, sa), (kb, pb, sb) = level[a], level[a + 1]
            take_b = kb > ka
            nxt.append((
                cutlass.select_(take_b, kb, ka),
                cutlass.select_(take_b, pb, pa),
                None if sa is None else cutlass.select_(take_b, sb, sa),
            ))  # fmt: skip
        if len(level) % 2:
            nxt.append(level[-1])
        level = nxt
    return level[0]


def warp_argmax_lane(best: Int32):
    """(lowest lane holding the warp's largest ``best``, that key)."""
    m = warp_max(best)
    ballot = cute.arch.vote_ballot_sync(best == m)
    lowest = ballot & (Int32(0) - ballot)  # lowest set bit
    return cute.arch.popc(lowest - Int32(1)), m


# ----------------------------------------------------------------------------- host


@cached_compile
def compile_route(method: str, num_experts: int, top_k: int, n_group: int, topk_group: int,
                  dtype: torch.dtype, has_bias: bool, arch: str, keep_cubin: bool = False):  # fmt: skip
    """Compile for every T (and logits row stride); the key is the scalars above."""
    kernel = RouteKernel(method, num_experts, top_k, n_group, topk_group, torch_to_cutlass_dtype(dtype), has_bias)
    cdtype = kernel.dtype
    tokens = cute.sym_int()
    elem = cdtype.width // 8
    row_stride = cute.sym_int64(divisibility=kernel.vec)
    mX = fake_tensor(cdtype, (tokens, num_experts), (row_stride, 1), align=kernel.vec * elem)
    # Without a bias the kernel never reads this argument; the launch passes the weights buffer.
    mBias = fake_tensor(Float32, (cute.sym_int(),), (1,), align=kernel.bias_vec * 4)
    mIds = fake_tensor(Int32, (tokens, top_k), (top_k, 1), align=4)
    mW = fake_tensor(Float32, (tokens, top_k), (top_k, 1), align=4)
    return compile_kernel(kernel, mX, mBias, mIds, mW, Float32(1.0), arch=arch, keep_cubin=keep_cubin)


def _aligned(t: torch.Tensor, vec: int) -> torch.Tensor:
    """t, or a contiguous copy when its base or strides do not allow ``vec``-element loads."""
    rows_ok = t.dim() == 1 or t.stride(0) % vec == 0
    if t.stride(-1) != 1 or not rows_ok or t.data_ptr() % (vec * t.element_size()):
        return t.clone(memory_format=torch.contiguous_format)
    return t


def route_cuda(
    router_logits: torch.Tensor,
    top_k: int,
    method: str,
    score_bias: torch.Tensor | None,
    n_group: int,
    topk_group: int,
    routed_scaling_factor: float,
):
    """Launch on the logits' device and current stream; inputs already validated by the op layer."""
    T, E = router_logits.shape
    has_bias = score_bias is not None
    reason = RouteKernel.can_implement(method, E, top_k, n_group, topk_group, router_logits.dtype, has_bias)
    if reason is not None:
        raise NotImplementedError(f"cute_moe.route: no CUDA kernel for this input: {reason}")
    ids = torch.empty(T, top_k, dtype=torch.int32, device=router_logits.device)
    weights = torch.empty(T, top_k, dtype=torch.float32, device=router_logits.device)
    if T == 0:
        return ids, weights
    V = lanes_layout(E, n_group, _is_grouped(method, n_group, topk_group))
    x = _aligned(router_logits, vector_width(V, E, router_logits.element_size()))
    # Without a bias the kernel never reads its bias argument: the weights buffer stands in.
    bias = _aligned(score_bias, vector_width(V, E, 4)) if has_bias else weights.view(-1)
    fn = compile_route(method, E, top_k, n_group, topk_group, router_logits.dtype, has_bias,
                       arch_of_device(router_logits.device))  # fmt: skip
    fn(x, bias, ids, weights, float(routed_scaling_factor))
    return ids, weights


def inspect_variants(arch: str):
    """(name, compiled function, dynamic smem bytes) for the SASS checks."""
    cases = [
        ("deepseek_v3", 256, 8, 8, 4, torch.float32, True),
        ("renormalize", 128, 8, 1, 1, torch.bfloat16, False),
        ("softmax", 8, 2, 1, 1, torch.float32, False),
        ("llama4", 16, 1, 1, 1, torch.bfloat16, False),
        ("sigmoid_renorm", 512, 8, 1, 1, torch.float32, False),
    ]
    out = []
    for method, E, k, ng, tg, dtype, bias in cases:
        name = f"route[{method}, E={E}, k={k}, {str(dtype).removeprefix('torch.')}"
        name += f", groups={ng}/{tg}, bias]" if method == "deepseek_v3" else "]"
        out.append((name, compile_route(method, E, k, ng, tg, dtype, bias, arch, True), 0))
    return out
