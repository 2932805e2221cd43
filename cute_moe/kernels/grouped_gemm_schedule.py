"""The grouped GEMMs' tile schedule and host checks, shared by the sm_90a and sm_100a kernels.

Persistent schedule: the host launches ``launch_grid(M_cap, N, #SMs)`` CTAs, the only
routing-independent bound.  Output tiles are 128 x 128 (128 x 256 for the sm90 kernel at prefill
sizes: ``tile_n``; the arithmetic below is the same with 256-wide N tiles) and numbered ``t = m_tile * n_tiles +
n_tile`` (with clusters of ``cluster_n`` CTAs along N, ``t`` numbers groups of ``cluster_n``
adjacent N tiles, visited by one cluster; N fastest: the CTAs running together share the A rows of an M tile and walk one
expert's weights, which stay in L2 for that expert's next M tile).  Segments are multiples of
128 rows (``ROW_ALIGNMENT``; ``align`` pads them), so tile rows ``[128 m, 128 m + 128)`` lie in
one expert and the tiles below ``expert_offsets[-1]`` form the prefix ``t < ceil(end / 128) *
n_tiles``: CTA ``b`` visits ``t = b, b + grid, ...`` below that bound, reading ``end`` on the
device.  The expert of a tile is the number of segment ends at or below its first row (a warp
sum).  Nothing about the routing is a compile-time constant: one binary serves every routing.

That is the schedule of the sm100 kernel, and of the sm90 kernel on most shapes.  At prefill MoE
sizes (``cluster_along_m``, through ``sm90_launch_config``) the sm90 kernel's clusters lie along M
instead (``pair_tile_schedule``):
a cluster visits M tiles 2i and 2i + 1 of one N tile, and shares the weight tile between them (TMA
multicast) when both lie in one expert; visits are numbered in bands of ``PAIRS_PER_BAND`` pairs,
pairs fastest, so that an expert's M tiles run side by side.

``tile_schedule`` and ``pair_tile_schedule`` are the executable models of that arithmetic (tested
on the CPU).  Also here: the device helpers both kernels run (expert lookup, the scale copy) and
their shared host side.
"""
from __future__ import annotations

import bisect
import functools

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import torch
from cutlass import Float32, Int32

from ..compiler import arch_of_device_index, fake_tensor

TILE_M, TILE_N, TILE_K = 128, 128, 128
WIDE_TILE_N = 2 * TILE_N  # the sm90 kernel's other tile width (prefill)
ROW_ALIGNMENT = TILE_M  # segment lengths the kernels need (align's `alignment`)
_LOOKUP_DEPTH = 8  # segment ends a lane loads at once in expert_of_row
CLUSTER_N = 2  # CTAs per cluster, on adjacent N tiles of one M tile: they share A by TMA multicast
CLUSTER_M = 2  # sm90 at prefill MoE shapes: CTAs on M tiles 2i, 2i + 1 of one N tile, sharing B when one expert
PAIRS_PER_BAND = 4  # sm90, prefill: M-tile pairs per band of the visit order (8 M tiles)
WIDE_STORE_BEHIND_TILES = 1.5  # sm90: real M tiles per expert from which the 256-wide tile stores behind
# sm90, with expert counts: a tile with at most this many real rows (all in the first math warp group's
# half; decode, and the last tile of many segments) is stored straight from that group's registers.
SPARSE_ROWS = TILE_M // 2
# sm90, with expert counts: real M tiles per expert below which no tile stores behind (decode)
DECODE_TILES = SPARSE_ROWS / TILE_M
# sm90: M tiles of rows per expert (real_tiles_per_expert: expected_m's, else M_cap's estimate) from
# which grouped_gemm_fp8_swiglu runs two kernels where the 128-wide GEMM stores behind (sm90_swiglu_tile):
# between the H100's crossing points, 2 tiles (one kernel -2%) and 2.5 (+0.8%), session 32
SWIGLU_TWO_KERNEL_TILES = 2.25


def launch_grid(m_cap: int, n: int, num_sms: int, cluster_n: int = 1, tile_n: int = TILE_N) -> int:
    """CTAs the host launches: one per SM (a multiple of ``cluster_n``), fewer when M_cap x N has
    fewer tiles (``tile_n`` columns wide)."""
    clusters = min(num_sms // cluster_n, (m_cap // TILE_M) * -(-n // (tile_n * cluster_n)))
    return cluster_n * max(1, clusters)


def tile_schedule(expert_offsets: list[int], m_cap: int, n: int, num_sms: int, cluster_n: int = 1,
                  tile_n: int = TILE_N) -> list[list[tuple[int, int, int]]]:  # fmt: skip
    """The (m_tile, n_tile, expert) triples each CTA visits, in order: the kernels' arithmetic.

    ``len(result)`` is the launched grid.  The ``cluster_n`` CTAs of a cluster (consecutive
    block indices) take the ``cluster_n`` adjacent N tiles of one M tile together (they share
    its A tile by TMA multicast); an N tile past the last one is visited (it feeds the
    multicast) but writes nothing.  Tiles at or past ``expert_offsets[-1]`` are never visited;
    the expert of a tile is the number of segment ends at or below its first row.
    """
    grid = launch_grid(m_cap, n, num_sms, cluster_n, tile_n)
    n_groups = -(-n // (tile_n * cluster_n))
    end = min(expert_offsets[-1], m_cap)
    valid = -(-end // TILE_M) * n_groups
    ends = expert_offsets[1:]
    out = []
    for cta in range(grid):
        cluster, rank = divmod(cta, cluster_n)
        visits = []
        for t in range(cluster, valid, grid // cluster_n):
            m_tile, group = divmod(t, n_groups)
            visits.append((m_tile, group * cluster_n + rank, sum(e <= m_tile * TILE_M for e in ends)))
        out.append(visits)
    return out


@cute.jit
def _segment_ends_at_or_below(mOff: cute.Tensor, row0: Int32, row1: Int32, num_experts: Int32, lane: Int32,
                              both: cutlass.Constexpr):  # fmt: skip
    """How many segment ends are <= row0 (and <= row1 when ``both``), each a warp sum.  A lane
    loads 8 segment ends (every 32nd) at once, at clamped indices with no branch between the
    loads, so that a lookup costs one global-memory round trip per 256 experts, not one per 32."""
    count0 = Int32(0)
    count1 = Int32(0)
    for base in cutlass.range(0, num_experts, 32 * _LOOKUP_DEPTH, unroll=1):
        ends = [mOff[min(base + lane + 32 * j, num_experts - 1) + 1] for j in range(_LOOKUP_DEPTH)]
        for j in cutlass.range_constexpr(_LOOKUP_DEPTH):
            valid = base + lane + 32 * j < num_experts
            count0 += Int32((ends[j] <= row0) & valid)
            if cutlass.const_expr(both):
                count1 += Int32((ends[j] <= row1) & valid)
    count0 = cute.arch.warp_reduction_sum(count0)
    if cutlass.const_expr(both):
        count1 = cute.arch.warp_reduction_sum(count1)
    return count0, count1


@cute.jit
def expert_and_rows(mOff: cute.Tensor, mCnt: cute.Tensor, row: Int32, num_experts: Int32, lane: Int32):
    """(the expert whose segment holds ``row``, its real rows from ``row`` on: ``mCnt[e] - (row -
    mOff[e])``, 0 when no segment holds it), in the one round trip of ``expert_of_row``: a lane
    loads each of its experts' start, end and count at once, and the lane whose segment holds the
    row contributes its rows to a warp sum."""
    count = Int32(0)
    rows = Int32(0)
    for base in cutlass.range(0, num_experts, 32 * _LOOKUP_DEPTH, unroll=1):
        idx = [min(base + lane + 32 * j, num_experts - 1) for j in range(_LOOKUP_DEPTH)]
        starts = [mOff[i] for i in idx]
        ends = [mOff[i + 1] for i in idx]
        counts = [mCnt[i] for i in idx]
        for j in cutlass.range_constexpr(_LOOKUP_DEPTH):
            valid = base + lane + 32 * j < num_experts
            count += Int32((ends[j] <= row) & valid)
            rows += Int32((starts[j] <= row) & (row < ends[j]) & valid) * (counts[j] - (row - starts[j]))
    return cute.arch.warp_reduction_sum(count), cute.arch.warp_reduction_sum(rows)


def pair_launch_grid(m_cap: int, n: int, num_sms: int, tile_n: int = TILE_N) -> int:
    """CTAs the sm90 kernel launches: clusters of 2 along M, one CTA per SM, fewer when M_cap x N
    has fewer tile pairs."""
    clusters = min(num_sms // 2, -(-(m_cap // TILE_M) // 2) * -(-n // tile_n))
    return 2 * max(1, clusters)


def real_tiles_per_expert(m_cap: int, num_experts: int, expected_m: int | None = None) -> float:
    """M tiles of real rows per expert: ``expected_m / TILE_M`` where the caller knows how many rows
    an expert expects (``fused_moe``: T x k over all experts, local or not), else estimated from
    M_cap less ``align``'s worst-case padding (``TILE_M - 1`` rows per expert).  For contiguous
    segments (no padding) the estimate undercounts slightly; on an expert-parallel slice, whose
    M_cap is sized for every routed row, it overcounts by the slicing factor (EP x)."""
    if expected_m is not None:
        return expected_m / TILE_M
    return (m_cap - num_experts * (TILE_M - 1)) / (TILE_M * max(num_experts, 1))


def wide_tile(m_cap: int, num_experts: int, k: int, has_counts: bool, expected_m: int | None = None) -> bool:
    """Whether the sm90 kernel takes 256-wide N tiles (two 128-wide halves through one temporary
    accumulator) rather than 128-wide ones: where experts average at least one M tile of real rows
    (prefill; ``real_tiles_per_expert``, from ``expected_m`` where given).  On contiguous segments
    (no expert counts) at K <= 2048 only from ``WIDE_STORE_BEHIND_TILES`` real M tiles per expert,
    where it stores behind: without that epilogue it was 0.5 to 2% slower than the 128-wide tile's
    store-behind (session 20), with it 3.3% quicker on G4 / G8 x 7168x2048 and 1.7% on G32 x M512
    (session 22).  Without ``expected_m``, not with expert counts under 64 experts: there M_cap may
    be an expert-parallel slice's, sized for every routed row (an EP8 slice of DeepSeek-V3's 256
    experts: 8x the real rows).  Slices of 64 or more experts pass that guard with the same
    overcount: at T = 1024 on EP4 and T = 2048 on EP2 (a quarter / half a real tile, estimated
    one) the wide tile cost 5.6% / 2.9% of the layer (session 25).
    Same-run A/Bs on the H200 (bench/NOTES.md, session 20), 256 wide (with ``cluster_along_m``'s
    direction for it) against 128: DeepSeek-V3's routed w13 / w2 at T = 8192 -10 to -14% / -5 to
    -7%, at T = 4096 -4 to -7% / -5%; contiguous K = 7168 -3 to -6%; contiguous K = 2048 +0.5 to
    +2%; decode (T <= 1024, under one real tile per expert) +1.5 to +7% on w13, -2 to +7% on w2.
    With ``expected_m`` (``fused_moe``'s; same-run A/B of the layer against the rule without it,
    two rounds, session 25): Mixtral-8x7B (8 experts, 2-32 real tiles each) T = 1024-16384 -8.7 to
    -13.5%; DeepSeek-V3's EP8 slice T = 8192 / 16384 -4.2 / -5.8%, EP4 T = 1024 / 2048 -5.2 / -3.4%,
    EP2 T = 2048 / 8192 / 16384 -2.2 / -1.8 / -3.5%; EP8 T = 4096 (one real tile per expert) +2.8%,
    the rest within 1%."""
    tiles = real_tiles_per_expert(m_cap, num_experts, expected_m)
    if k <= 16 * TILE_K and not has_counts:
        return tiles >= WIDE_STORE_BEHIND_TILES
    if has_counts and num_experts < 64 and expected_m is None:
        return False
    return tiles >= 1


def store_behind_epilogue(k: int, wide: bool, tiles_per_expert: float, has_counts: bool = False) -> bool:
    """The sm90 kernel's store-behind epilogue for short K loops (at most 16 K blocks), where the
    epilogue is a tenth of a tile's time: same-run A/B on the 7168x2048 contiguous and EP shapes
    -3.4 to -3.8%, decode and routed 0 to -1% (bench/NOTES.md, session 8).  At K = 7168 its stage
    less costs +1 to +4% on contiguous and routed shapes (it gains 1-3% only at decode-like sizes).
    The 256-wide tile (``wide``) has room for it beside 3 stages only (4 without), and takes it
    where experts average at least ``WIDE_STORE_BEHIND_TILES`` real M tiles (``tiles_per_expert``):
    DeepSeek-V3's routed w2 GEMM at T = 8192 (2 tiles) -6.2% (median -4.6%), at T = 4096 (1 tile)
    +1.0% (session 21); there the bf16 epilogue is ~11% of the GEMM's time when not behind.  The
    rule holds for any wide GEMM at K <= 2048, e.g. Qwen3-30B-A3B's w13 (K = 2048) from T = 3072
    (measured for it in session 22: bench/NOTES.md), and ``tiles_per_expert``, without the op's
    ``expected_m``, overcounts on expert-parallel slices (``real_tiles_per_expert``).
    Not with expert counts (``has_counts``) under ``DECODE_TILES`` real M tiles per expert
    (``SPARSE_ROWS`` = 64 rows): there most tiles hold at most that many real rows and the sm90
    kernel stores them from registers, never through this epilogue, which would only cost a stage
    and A's short boxes (the kernel loads the first 16 / 64 rows of A only without it).  Same-run
    A/B on an H100 (session 28; not yet on an H200), DeepSeek-V3's w2 at T = 1 / 16 / 128 / 1024
    (up to 0.25 real tiles per expert): -2.6 / -3.9 / -4.3 / -2.9% without it; between 0.25 and 0.5
    not measured."""
    if k > 16 * TILE_K or (has_counts and tiles_per_expert < DECODE_TILES):
        return False
    return not wide or tiles_per_expert >= WIDE_STORE_BEHIND_TILES


def check_sm90_variant(tile_n: int | None) -> None:
    """ValueError unless the sm90 kernel has this tile width (None: not chosen yet)."""
    if tile_n is not None and (not isinstance(tile_n, int) or tile_n not in (TILE_N, WIDE_TILE_N)):
        raise ValueError(f"cute_moe.grouped_gemm_fp8: tile_n must be {TILE_N} or {WIDE_TILE_N}, got {tile_n}")


def sm90_launch_config(m_cap: int, num_experts: int, k: int, has_counts: bool, along_m: bool | None = None,
                       store_behind: bool | None = None, tile_n: int | None = None,
                       expected_m: int | None = None) -> tuple[bool, bool, int]:  # fmt: skip
    """(along_m, store_behind, tile_n) of an sm90 launch: each one given (tests and benchmarks force
    them) or chosen from the shapes (``wide_tile``, then ``cluster_along_m`` and
    ``store_behind_epilogue`` for that width), each from ``expected_m`` where given.  ValueError
    for a width other than 128 and 256."""
    check_sm90_variant(tile_n)
    wide = wide_tile(m_cap, num_experts, k, has_counts, expected_m)
    if tile_n is None:
        tile_n = WIDE_TILE_N if wide else TILE_N
    if along_m is None:
        along_m = cluster_along_m(m_cap, num_experts, k, tile_n == WIDE_TILE_N, has_counts, expected_m)
    if store_behind is None:
        tiles = real_tiles_per_expert(m_cap, num_experts, expected_m)
        store_behind = store_behind_epilogue(k, tile_n == WIDE_TILE_N, tiles, has_counts)
    return bool(along_m), bool(store_behind), tile_n


def sm90_swiglu_tile(m_cap: int, num_experts: int, k: int, has_counts: bool,
                     expected_m: int | None = None) -> int | None:  # fmt: skip
    """The tile width of the one sm90 kernel that ``grouped_gemm_fp8_swiglu`` runs, or None where it
    runs the GEMM and ``silu_mul_quant`` as two kernels; the GEMM's own launch choice
    (``sm90_launch_config``) decides.  256 (``wide_tile``: about one real M tile per expert or more,
    and with expert counts at least 64 experts unless ``expected_m`` is given): the tile's two
    128-wide halves hold a gate block and its up block.  128 where the 128-wide GEMM pairs N tiles
    (decode sizes, and K <= 2048 under one real M tile per expert): a tile holds 64 gate columns and
    their 64 up columns, and the pair's two tiles one 1x128 output group, whose amax the two CTAs
    exchange.  The fused kernel has no store-behind epilogue: it stores FP8 codes from registers.
    Where the plain GEMM stores behind (K <= 2048 from half a real M tile per expert), against the
    two kernels on an H100: Qwen3-30B-A3B's w13 (128 experts, ``expected_m``) at T = 1024 / 1536,
    half / three quarters of a tile per expert, -12.4 / -10.2% (session 30); 16 experts without
    ``expected_m`` at 1 / 4 / 16 tiles -0.8 / +4.9 / +4.0% (session 31), at 1.5 / 2 / 2.5 / 3 / 3.5
    tiles -6.5 / -2.1 / +0.8 / +1.9 / +2.1% (session 32).  From ``SWIGLU_TWO_KERNEL_TILES`` = 2.25
    (estimated) tiles there it is two kernels.  128-wide tiles estimated that dense occur only under
    64 experts without ``expected_m``, where M_cap's estimate overcounts an expert-parallel slice by its factor: such
    a slice (``fused_moe_routed`` without ``num_experts``) runs two kernels whatever its real rows,
    as before session 30 (the one kernel there is not measured); ``expected_m`` avoids it.  None
    also where the 128-wide GEMM pairs M tiles (the pair's CTAs hold different rows): a guard, as
    the rules above take the 256-wide tile wherever they pair M tiles."""
    along_m, store_behind, tile_n = sm90_launch_config(m_cap, num_experts, k, has_counts, expected_m=expected_m)
    if tile_n == WIDE_TILE_N:
        return WIDE_TILE_N
    if along_m or (store_behind and real_tiles_per_expert(m_cap, num_experts, expected_m) >= SWIGLU_TWO_KERNEL_TILES):
        return None
    return TILE_N


def cluster_along_m(m_cap: int, num_experts: int, k: int, wide: bool = False, has_counts: bool = True,
                    expected_m: int | None = None) -> bool:  # fmt: skip
    """Whether the sm90 kernel pairs M tiles (sharing the weight tile) rather than N tiles (sharing
    the A tile): for a long K (at least 4096) over many experts (at least 64, or any number given
    ``expected_m``) that average 2 to 6 M tiles of real rows (``real_tiles_per_expert``; 1 to 6
    with the 256-wide tile, ``wide``; and then over any number of
    experts on contiguous segments, ``has_counts=False``, whose M_cap cannot be an expert-parallel
    slice's).  There each expert's weights are re-read from DRAM for each of its few M tiles, which
    bounds the kernel.  Same-run A/B on DeepSeek-V3's w13 GEMM (uniform top-8 routing,
    bench/NOTES.md), 128 wide (session 7): T = 8192 -2 to -8% (DRAM reads 16.3 -> 12.5 GB), T =
    16384 -3 to -7%; neutral at T = 4096 (one real tile per expert), +12% at T = 2048, +17% at T =
    128, +2 to +6% on the K = 2048 w2 GEMM, on long contiguous segments, and on EP8 slices (32 local
    experts, whose M_cap is sized for every routed row, so the estimate cannot see their size;
    ``expected_m`` can: see ``wide_tile``).
    256 wide (session 20): T = 4096 -11%, T = 8192 -7%; contiguous G=32 x 512 rows (4 tiles per
    expert) -2.4%, G=4 / G=8 (64 / 32 tiles) within 0.5% either way.  Contiguous and 256 wide from
    K = 2048 (session 22, with the store-behind epilogue): G=32 x 512 rows 7168x2048 -0.6 / -0.9% in
    two runs, G=4 (64 tiles, past the bound) +1.2 to +1.9%."""
    if has_counts or not wide:
        if k < 4096 or (num_experts < 64 and expected_m is None):
            return False
    elif k < 2048:
        return False
    return (1 if wide else 2) <= real_tiles_per_expert(m_cap, num_experts, expected_m) <= 6


def pair_band_coords(v: int, n_tiles: int, pairs: int, band_pairs: int) -> tuple[int, int]:
    """(M-tile pair, N tile) of visit ``v``: bands of ``band_pairs`` pairs (the last one possibly
    shorter), N tiles in order, pairs fastest inside a band."""
    band, within = divmod(v, band_pairs * n_tiles)
    rows = min(band_pairs, pairs - band * band_pairs)
    n_tile, pair = divmod(within, rows)
    return band * band_pairs + pair, n_tile


def pair_tile_schedule(expert_offsets: list[int], m_cap: int, n: int, num_sms: int, band_pairs: int,
                       tile_n: int = TILE_N) -> list[list[tuple[int, int, int, bool]]]:  # fmt: skip
    """The (m_tile, n_tile, expert, shared) visits of each CTA of the sm90 kernel, in order.

    Cluster ``c`` (CTAs ``2c``, ``2c + 1``) visits ``v = c, c + clusters, ...`` below ``pairs *
    n_tiles``; rank ``r`` takes M tile ``2 pair + r`` of N tile ``n_tile``.  ``shared``: both M
    tiles lie in one expert, so the pair loads that expert's weight tile once (half per CTA, each
    half multicast to both); otherwise each CTA loads its own.  With an odd tile count the last
    pair's second tile lies past the end: it takes its partner's expert (so the pair shares), and
    its rows are unspecified output."""
    grid = pair_launch_grid(m_cap, n, num_sms, tile_n)
    end = min(expert_offsets[-1], m_cap)
    m_tiles = -(-end // TILE_M)
    pairs, n_tiles = -(-m_tiles // 2), -(-n // tile_n)
    # The expert of each M tile (segment ends <= its first row); one past the end takes the last's.
    experts = [bisect.bisect_right(expert_offsets[1:], m * TILE_M) for m in range(m_tiles)]

    def expert(m_tile: int) -> int:
        return experts[min(m_tile, m_tiles - 1)]

    out = []
    for cta in range(grid):
        cluster, rank = divmod(cta, 2)
        visits = []
        for v in range(cluster, pairs * n_tiles, grid // 2):
            pair, n_tile = pair_band_coords(v, n_tiles, pairs, band_pairs)
            visits.append((2 * pair + rank, n_tile, expert(2 * pair + rank), expert(2 * pair) == expert(2 * pair + 1)))
        out.append(visits)
    return out


@cute.jit
def expert_of_row(mOff: cute.Tensor, row: Int32, num_experts: Int32, lane: Int32) -> Int32:
    """The expert whose segment holds ``row``: how many segment ends are <= row."""
    expert, _ = _segment_ends_at_or_below(mOff, row, row, num_experts, lane, False)
    return expert


@cute.jit
def tile_coords(tile: Int32, n_groups: Int32, rank: Int32):
    """(m_tile, n_tile) of a CTA's visit ``tile`` (a group of CLUSTER_N adjacent N tiles; an N tile
    past the last one is a multicast-only visit)."""
    m_tile = tile // n_groups
    return m_tile, (tile - m_tile * n_groups) * CLUSTER_N + rank


@cute.jit
def next_visit_expert(mOff: cute.Tensor, num_experts: Int32, lane: Int32, tile: Int32, tile_stride: Int32,
                      n_groups: Int32, rank: Int32) -> Int32:  # fmt: skip
    """The expert of visit ``tile + tile_stride``.  The producer warps look it up right after the
    first K block of visit ``tile`` is issued, so the lookup's latency hides behind the wait for a
    free stage; done between visits, it left the load stream idle for a global-memory round trip
    per visit, which on short K loops (decode, K = 2048) was a tenth of the time."""
    m_tile, _ = tile_coords(tile + tile_stride, n_groups, rank)
    return expert_of_row(mOff, m_tile * TILE_M, num_experts, lane)


@cute.jit
def pair_schedule(mOff: cute.Tensor, num_experts: Int32, m_cap: Int32, n: Int32, k: Int32, band_pairs: Int32,
                  cluster: Int32, clusters: Int32, rank: Int32, tile_n: cutlass.Constexpr = TILE_N):  # fmt: skip
    """The sm90 kernel's schedule tuple (first visit, visit count, stride, N tiles, K blocks, rank,
    M tiles, pairs per band), from ``expert_offsets[-1]`` read on the device (clamped to M_cap)."""
    end = max(min(mOff[num_experts], m_cap), 0)
    m_tiles = (end + TILE_M - 1) // TILE_M
    n_tiles = (n + tile_n - 1) // tile_n
    return cluster, (m_tiles + 1) // 2 * n_tiles, clusters, n_tiles, k // TILE_K, rank, m_tiles, band_pairs


@cute.jit
def pair_coords(v: Int32, sched):
    """(m_tile, n_tile) of this CTA's visit ``v`` (``pair_band_coords``).  A ``v`` past the last
    visit gives some tile: never used."""
    _, _, _, n_tiles, _, rank, m_tiles, band_pairs = sched
    pairs = (m_tiles + 1) // 2
    band_visits = band_pairs * n_tiles
    band = v // band_visits
    within = v - band * band_visits
    rows = max(min(band_pairs, pairs - band * band_pairs), 1)
    n_tile = within // rows
    return 2 * (band * band_pairs + within - n_tile * rows) + rank, n_tile


@cute.jit
def pair_visit_expert(mOff: cute.Tensor, num_experts: Int32, lane: Int32, v: Int32, sched):
    """(expert of this CTA's M tile, whether its partner's tile has the same expert) for visit
    ``v``; a tile past the last one takes its partner's expert.  Looked up one visit ahead by the
    producer warps (see ``next_visit_expert``)."""
    m_tile, _ = pair_coords(v, sched)
    rank, m_tiles = sched[5], sched[6]
    partner = m_tile + 1 - 2 * rank
    mine, theirs = _segment_ends_at_or_below(mOff, min(m_tile, m_tiles - 1) * TILE_M,
                                             min(partner, m_tiles - 1) * TILE_M, num_experts, lane, True)  # fmt: skip
    return mine, mine == theirs


@cute.jit
def valid_tiles(mOff: cute.Tensor, num_experts: Int32, m_cap: Int32, n_groups: Int32) -> Int32:
    """Tile groups (one per cluster visit) below the last segment end (read on the device;
    clamped to M_cap)."""
    end = min(mOff[num_experts], m_cap)
    return (max(end, 0) + TILE_M - 1) // TILE_M * n_groups


@cute.jit
def copy_block_scales(mSA: cute.Tensor, gSB: cute.Tensor, sSA: cute.Tensor, sSB: cute.Tensor, m_tile: Int32,
                      n_tile: Int32, k_tile: Int32, stage: Int32, lane: Int32, b_blocks: cutlass.Constexpr = 1,
                      swiglu_gate: cutlass.Constexpr = None, tiles_per_block: cutlass.Constexpr = 1):  # fmt: skip
    """cp.async of one K block's scales into a stage, by one warp: the tile's 128 A scales
    (``a_scale`` is MN-major: 16 contiguous bytes per lane) and its ``b_blocks`` B scales (an N tile
    of ``b_blocks`` x 128 columns), block ``j`` from lane ``4 j`` into ``sSB[j, stage]`` (none past
    the last N block: a multicast-only visit, or the second half of a 256-wide tile past N).
    ``gSB``: the expert's (N blocks, K blocks).  ``swiglu_gate`` (0 or 1: which half of B's rows
    holds the gate projection): block ``j`` (0 gate, 1 up) is N block ``n_tile // tiles_per_block`` of
    that half (``tiles_per_block`` = 2 where a tile holds 64 gate and 64 up rows of w13)."""
    per_lane = TILE_M // 32
    copy_a = cute.make_copy_atom(cute.nvgpu.cpasync.CopyG2SOp(), cutlass.Float32, num_bits_per_copy=32 * per_lane)
    copy_b = cute.make_copy_atom(cute.nvgpu.cpasync.CopyG2SOp(), cutlass.Float32, num_bits_per_copy=32)
    cute.copy(copy_a, cute.local_tile(mSA, (per_lane, 1), (m_tile * 32 + lane, k_tile)),
              cute.local_tile(sSA, (per_lane, 1), (lane, stage)))  # fmt: skip
    for j in cutlass.range_constexpr(b_blocks):
        # Lanes 4j: lanes 1-3 copy the segment record (copy_segment).
        block = n_tile * b_blocks + j
        if cutlass.const_expr(swiglu_gate is not None):
            block = n_tile // tiles_per_block + (j ^ swiglu_gate) * (gSB.shape[0] // 2)
        if lane == 4 * j:
            if block < gSB.shape[0]:
                cute.copy(copy_b, cute.local_tile(gSB, (1, 1), (block, k_tile)),
                          cute.local_tile(sSB, (1, 1), (j, stage)))  # fmt: skip


@cute.jit
def copy_segment(mOff: cute.Tensor, mCnt: cute.Tensor, sSeg: cute.Tensor, expert: Int32, stage: Int32, lane: Int32):
    """cp.async of a visit's segment record into a stage, from lanes 1-3: ``sSeg[:, stage]`` =
    (``expert_offsets[e]``, ``expert_offsets[e + 1]``, ``mCnt[e]``), so that the math warps never
    wait on a global load between visits."""
    copy_w = cute.make_copy_atom(cute.nvgpu.cpasync.CopyG2SOp(), Int32, num_bits_per_copy=32)
    if lane == 1 or lane == 2:
        cute.copy(copy_w, cute.local_tile(mOff, (1,), (expert + lane - 1,)),
                  cute.local_tile(sSeg[(lane - 1, None)], (1,), (stage,)))  # fmt: skip
    if lane == 3:
        cute.copy(copy_w, cute.local_tile(mCnt, (1,), (expert,)), cute.local_tile(sSeg[(2, None)], (1,), (stage,)))


@cute.jit
def visit_coords(tile: Int32, sched, pairs: cutlass.Constexpr):
    """(m_tile, n_tile) of this CTA's visit ``tile``: clusters along M (``pair_coords``, sm90 at
    prefill MoE shapes) or along N (``tile_coords``)."""
    if cutlass.const_expr(pairs):
        return pair_coords(tile, sched)
    return tile_coords(tile, sched[3], sched[5])


@cute.jit
def visit_expert(mOff: cute.Tensor, num_experts: Int32, lane: Int32, tile: Int32, sched, pairs: cutlass.Constexpr):
    """(expert of visit ``tile``, whether the pair shares its weight tile: only along M), for the
    schedules of ``visit_coords``."""
    if cutlass.const_expr(pairs):
        return pair_visit_expert(mOff, num_experts, lane, tile, sched)
    return next_visit_expert(mOff, num_experts, lane, tile, 0, sched[3], sched[5]), Int32(0) != 0


@cute.jit
def load_scales(mSA: cute.Tensor, mSB: cute.Tensor, sSA: cute.Tensor, sSB: cute.Tensor, scale_pipe, stages: int,
                mOff: cute.Tensor, num_experts: Int32, lane: Int32, sched, segment=None,
                pairs: cutlass.Constexpr = False, b_blocks: cutlass.Constexpr = 1,
                swiglu_gate: cutlass.Constexpr = None, tiles_per_block: cutlass.Constexpr = 1):  # fmt: skip
    """The scale warp of both kernels: per visit and K block, ``copy_block_scales`` into the next
    stage of ``scale_pipe`` (a PipelineCpAsync, or on sm90 ``ScalesIntoStages``: the producer side
    of a pipeline whose commit is each lane's ``cp.async`` arrive, which fires when its copies land).
    With ``segment = (mCnt, sSeg)``, also ``copy_segment`` into each visit's first stage.  ``pairs``:
    clusters along M (a tile past the last one reads its partner's scales), else along N.
    ``b_blocks``, ``swiglu_gate``, ``tiles_per_block``: see ``copy_block_scales``."""
    first_tile, tiles, tile_stride, k_tiles = sched[0], sched[1], sched[2], sched[4]
    state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, stages)
    expert, _ = visit_expert(mOff, num_experts, lane, first_tile, sched, pairs)
    for tile in cutlass.range(first_tile, tiles, tile_stride, unroll=1):
        m_tile, n_tile = visit_coords(tile, sched, pairs)
        if cutlass.const_expr(pairs):
            m_tile = min(m_tile, sched[6] - 1)
        gSB = mSB[(expert, None, None)]  # (N blocks, K blocks)
        next_expert = expert
        for k_tile in cutlass.range(k_tiles, unroll=1):
            scale_pipe.producer_acquire(state)
            copy_block_scales(mSA, gSB, sSA, sSB, m_tile, n_tile, k_tile, state.index, lane, b_blocks, swiglu_gate,
                              tiles_per_block)  # fmt: skip
            if cutlass.const_expr(segment is not None):
                if k_tile == 0:
                    copy_segment(mOff, segment[0], segment[1], expert, state.index, lane)
            scale_pipe.producer_commit(state)
            state.advance()
            if k_tile == 0:
                # The next visit's expert, looked up while this visit's first stage is in flight.
                next_expert, _ = visit_expert(mOff, num_experts, lane, tile + tile_stride, sched, pairs)
        expert = next_expert
    scale_pipe.producer_tail(state)


def fake_operands():
    """(A, B, a_scale, b_scale, expert_offsets, C) as both kernels are compiled for them: every
    extent symbolic (one binary per kernel for all problems), A [M_cap, K] and B [E, N, K] K-major
    uint8 codes with 16-byte aligned rows, a_scale MN-major with a 16-byte base and column stride
    (one cp.async per 4 rows), b_scale with a unit last stride, C bf16 with 16-byte aligned rows."""
    m_cap, n, k, e, k_blocks, n_blocks = (cute.sym_int() for _ in range(6))
    mA = fake_tensor(cutlass.Uint8, (m_cap, k), (cute.sym_int64(divisibility=16), 1))
    mB = fake_tensor(cutlass.Uint8, (e, n, k), (cute.sym_int64(divisibility=16), cute.sym_int64(divisibility=16), 1))
    mSA = fake_tensor(Float32, (m_cap, k_blocks), (1, cute.sym_int64(divisibility=4)), align=16)
    mSB = fake_tensor(Float32, (e, n_blocks, k_blocks), (cute.sym_int64(), cute.sym_int64(), 1), align=4)
    mOff = fake_tensor(Int32, (cute.sym_int(),), (1,), align=4)
    mC = fake_tensor(cutlass.BFloat16, (m_cap, n), (cute.sym_int64(divisibility=8), 1), align=16)
    return mA, mB, mSA, mSB, mOff, mC


def fp8_operands(mA: cute.Tensor, mB: cute.Tensor) -> tuple[cute.Tensor, cute.Tensor]:
    """A (M_cap, K) and B (N, K, E) in e4m3, as the kernels index them.  The codes travel as uint8
    through TVM-FFI, and B as the op's [E, N, K] tensor: its mode order is changed here, at
    compile time, rather than by a torch view on every call."""
    fp8 = cutlass.Float8E4M3FN
    mA = cute.make_tensor(cute.recast_ptr(mA.iterator, dtype=fp8), mA.layout)
    mB = cute.make_tensor(cute.recast_ptr(mB.iterator, dtype=fp8), cute.select(mB.layout, mode=[1, 2, 0]))
    return mA, mB


def can_implement(m_cap: int, n: int, k: int) -> str | None:
    """Why the kernels cannot take this problem, or None."""
    if k % TILE_K or k == 0:
        return f"K must be a positive multiple of {TILE_K}, got {k}"
    if n % 8 or n == 0:
        return f"N must be a positive multiple of 8, got {n}"
    if m_cap % TILE_M:
        return f"M_cap must be a multiple of {TILE_M} (align with alignment={ROW_ALIGNMENT}), got {m_cap}"
    return None


def prepare_a_scale(a_scale: torch.Tensor, op: str = "grouped_gemm_fp8") -> torch.Tensor:
    """a_scale as the kernels load it: MN-major, 16-byte aligned base and column stride (the 128
    scales of a tile and K block are copied in 16-byte pieces).  ValueError, naming ``op``, otherwise."""
    m_cap = a_scale.shape[0]
    if a_scale.shape[1] == 1 and (a_scale.stride(0) == 1 or m_cap <= 1):
        # K = 128: the column stride is never used; give it the declared divisibility.
        a_scale = a_scale.as_strided(a_scale.shape, (1, m_cap), a_scale.storage_offset())
    if a_scale.stride(0) != 1 or a_scale.data_ptr() % 16 or a_scale.stride(1) % 4:
        raise ValueError(
            f"cute_moe.{op}: a_scale must be MN-major (stride(0) == 1) with a 16-byte aligned base "
            f"and stride(1) % 4 == 0 (what permute_quant and silu_mul_quant write), got strides "
            f"{tuple(a_scale.stride())}"
        )
    return a_scale


@functools.lru_cache(maxsize=None)
def num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def launch(arch: str, compiled, cluster_n: int, a, a_scale, b, b_scale, expert_offsets, extra=(),
           grid_fn=None, out=None, op: str = "grouped_gemm_fp8") -> torch.Tensor:  # fmt: skip
    """The host side both kernels share: checks, the output, the grid, the call on a's device and
    current stream.  ``compiled()`` returns the kernel's compiled function for ``arch``; ``extra``
    are its arguments between the output and the grid size; ``grid_fn(M_cap, N, #SMs)`` sizes the
    grid (default: ``launch_grid`` with ``cluster_n``).  ``out``: the output the kernel writes, given
    (the sm90 SwiGLU variant's codes), else a bf16 [M_cap, N] one, allocated here; it is returned.
    ``op``: the op its errors name (the GEMM runs for ``grouped_gemm_fp8_swiglu`` too)."""
    m_cap, k = a.shape
    n = b.shape[1]
    reason = can_implement(m_cap, n, k)
    if reason is not None:
        raise NotImplementedError(f"cute_moe.{op}: no {arch} kernel for this input: {reason}")
    c = torch.empty(m_cap, n, dtype=torch.bfloat16, device=a.device) if out is None else out
    if m_cap == 0 or b.shape[0] == 0:  # no rows, or no experts (a zero-extent TMA box cannot be encoded)
        return c
    a_scale = prepare_a_scale(a_scale, op)
    if b_scale.shape[2] > 1 and b_scale.stride(2) != 1:
        raise ValueError(
            f"cute_moe.{op}: b_scale needs a unit last stride on the GPU (the [E, N/128, K/128] "
            f"weight_scale_inv layout), got strides {tuple(b_scale.stride())}"
        )
    device = a.get_device()
    device_arch = arch_of_device_index(device)
    if device_arch != arch:
        raise NotImplementedError(f"cute_moe.{op}: this kernel is for {arch}, the device is {device_arch}")
    grid = launch_grid(m_cap, n, num_sms(device), cluster_n) if grid_fn is None else grid_fn(m_cap, n, num_sms(device))
    compiled()(a.view(torch.uint8), b.view(torch.uint8), a_scale, b_scale, expert_offsets, c, *extra,
               grid)  # fmt: skip
    return c
