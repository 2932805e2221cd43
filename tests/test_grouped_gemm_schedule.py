"""The grouped GEMMs' persistent tile schedule on the CPU.

``grouped_gemm_schedule.tile_schedule`` is the executable model of the arithmetic both kernels
run (both with clusters of 2 CTAs along N sharing the A tile by TMA multicast):
for routings drawn like the GPU tests' (ragged, empty experts, one hot expert, decode sizes, no
rows), the launched grid visits every output tile below ``expert_offsets[-1]`` exactly once,
inside its expert's segment, in increasing order per CTA, and a cluster's CTAs visit tiles in
lockstep (a multicast needs both)."""
import random

import pytest
import torch

from cute_moe.kernels import grouped_gemm_schedule as gs


def _padded_offsets(counts):
    offsets = [0]
    for c in counts:
        offsets.append(offsets[-1] + -(-c // gs.TILE_M) * gs.TILE_M)
    return offsets


def _routings(rng):
    """(name, counts, spare rows past the last segment)."""
    E = rng.choice([1, 8, 32, 256])
    ragged = [int(rng.choice([96, 512, 4096]) * rng.uniform(0.7, 1.3)) for _ in range(E)]
    yield "ragged", ragged, rng.choice([0, 128, 1024])
    yield "empty_experts", [0 if e in (0, E - 1) or rng.random() < 0.5 else c for e, c in enumerate(ragged)], 128
    hot = rng.randrange(E)
    yield "one_hot_expert", [rng.randint(1, 9000) if e == hot else 0 for e in range(E)], rng.choice([0, 256])
    yield "decode", [0 if rng.random() < 0.25 else rng.randint(1, 16) for _ in range(E)], 128
    yield "zero_rows", [0] * E, rng.choice([0, 128, 4096])


@pytest.mark.parametrize("tile_n", [gs.TILE_N, gs.WIDE_TILE_N])
@pytest.mark.parametrize("cluster_n", [1, 2])
@pytest.mark.parametrize("seed", range(30))
def test_schedule_covers_every_tile_once(seed, cluster_n, tile_n):
    rng = random.Random(seed)
    for name, counts, spare in _routings(rng):
        offsets = _padded_offsets(counts)
        m_cap = offsets[-1] + spare
        if m_cap == 0:
            continue  # the launchers return before any launch
        n = rng.choice([128, 256, 384, 512, 2112, 4096, 7168, 8, 200])
        num_sms = rng.choice([148, 132, 16, 2])
        plan = gs.tile_schedule(offsets, m_cap, n, num_sms, cluster_n, tile_n)
        n_tiles = -(-n // tile_n)
        n_groups = -(-n_tiles // cluster_n)
        grid = gs.launch_grid(m_cap, n, num_sms, cluster_n, tile_n)
        assert len(plan) == grid == cluster_n * min(num_sms // cluster_n, m_cap // gs.TILE_M * n_groups), name

        seen = {}
        for cta, visits in enumerate(plan):
            assert len(visits) == len(plan[cta - cta % cluster_n]), f"{name}: a cluster's CTAs out of step"
            linear = [m * n_groups + nt // cluster_n for m, nt, _ in visits]
            assert linear == sorted(linear) and all(t % (grid // cluster_n) == cta // cluster_n for t in linear)
            for m_tile, n_tile, expert in visits:
                assert n_tile % cluster_n == cta % cluster_n
                if n_tile >= n_tiles:  # a multicast-only visit: only in the last, partial group
                    assert cluster_n > 1 and n_tiles % cluster_n and n_tile == n_groups * cluster_n - 1
                    continue
                assert (m_tile, n_tile) not in seen, f"{name}: tile {(m_tile, n_tile)} visited twice"
                seen[(m_tile, n_tile)] = expert
        want = {(m, nt) for m in range(offsets[-1] // gs.TILE_M) for nt in range(n_tiles)}
        assert set(seen) == want, f"{name}: {len(want - set(seen))} tiles missed, {len(set(seen) - want)} extra"
        for (m_tile, _), expert in seen.items():
            lo, hi = offsets[expert], offsets[expert + 1]
            assert lo <= m_tile * gs.TILE_M and (m_tile + 1) * gs.TILE_M <= hi, f"{name}: tile {m_tile} not in {expert}"


def test_schedule_balances_ctas():
    # 40 M tiles x 17 N tiles over 148 CTAs: every CTA gets 4 or 5 tiles, N fastest.
    offsets = _padded_offsets([40 * 128 - 5])
    plan = gs.tile_schedule(offsets, 40 * 128 + 256, 2112, 148)
    assert {len(v) for v in plan} == {4, 5}
    assert plan[0][:2] == [(0, 0, 0), (8, 12, 0)]  # tile 0, then tile 148 = 8 * 17 + 12


def test_prepare_a_scale_takes_only_mn_major():
    """The kernels copy a_scale columns in 16-byte pieces: MN-major only (K = 128 included, where
    the column stride is free but the row stride is not)."""
    m = 256
    mn_major = torch.empty(2, m).t()
    assert gs.prepare_a_scale(mn_major).stride() == (1, m)
    k128 = torch.empty(1, m).t()  # [M, 1], strides (1, M)
    assert gs.prepare_a_scale(k128).stride() == (1, m)
    for bad in (torch.empty(m, 2), torch.arange(2.0 * m).reshape(m, 2)[:, :1], torch.ones(1, 1).expand(m, 1)):
        with pytest.raises(ValueError, match="a_scale must be MN-major"):
            gs.prepare_a_scale(bad)


@pytest.mark.parametrize("tile_n", [gs.TILE_N, gs.WIDE_TILE_N])
@pytest.mark.parametrize("band_pairs", [1, gs.PAIRS_PER_BAND])
@pytest.mark.parametrize("seed", range(30))
def test_pair_schedule_covers_every_tile_once(seed, band_pairs, tile_n):
    """The sm90 schedule: clusters of 2 CTAs on M tiles 2i, 2i + 1 of one N tile, in lockstep; every
    tile below expert_offsets[-1] visited once, inside its expert's segment; a pair of one expert
    shares its weight tile; the only tile past the end is an odd count's last, with its partner's
    expert."""
    rng = random.Random(seed)
    for name, counts, spare in _routings(rng):
        offsets = _padded_offsets(counts)
        m_cap = offsets[-1] + spare
        if m_cap == 0:
            continue
        n = rng.choice([128, 256, 384, 2112, 4096, 7168, 8, 200])
        num_sms = rng.choice([132, 148, 16, 2])
        plan = gs.pair_tile_schedule(offsets, m_cap, n, num_sms, band_pairs, tile_n)
        grid = gs.pair_launch_grid(m_cap, n, num_sms, tile_n)
        n_tiles = -(-n // tile_n)
        m_tiles = offsets[-1] // gs.TILE_M
        assert len(plan) == grid == 2 * min(num_sms // 2, max(1, -(-(m_cap // gs.TILE_M) // 2) * n_tiles)), name
        seen = {}
        for cta in range(0, grid, 2):
            first, second = plan[cta], plan[cta + 1]
            assert [(m // 2, nt, s) for m, nt, _, s in first] == [(m // 2, nt, s) for m, nt, _, s in second], name
            for (m0, nt, e0, shared), (m1, _, e1, _) in zip(first, second):
                assert (m0 % 2, m1) == (0, m0 + 1) and shared == (e0 == e1), name
        for visits in plan:
            for m_tile, n_tile, expert, _ in visits:
                assert n_tile < n_tiles
                if m_tile >= m_tiles:  # the odd count's last pair: partner's expert, nothing to compute
                    assert m_tile == m_tiles and m_tiles % 2 == 1
                    continue
                assert (m_tile, n_tile) not in seen, f"{name}: tile {(m_tile, n_tile)} visited twice"
                seen[(m_tile, n_tile)] = expert
                lo, hi = offsets[expert], offsets[expert + 1]
                assert lo <= m_tile * gs.TILE_M and (m_tile + 1) * gs.TILE_M <= hi, f"{name}: tile {m_tile} not in {expert}"
        assert set(seen) == {(m, nt) for m in range(m_tiles) for nt in range(n_tiles)}, name


def test_pair_band_order():
    """Inside a band of pairs the cluster after a cluster takes the next pair of the same N tile (so
    an expert's M tiles read each weight tile together); bands of one pair walk N first."""
    assert [gs.pair_band_coords(v, 3, 10, 4) for v in range(6)] == [(0, 0), (1, 0), (2, 0), (3, 0), (0, 1), (1, 1)]
    assert [gs.pair_band_coords(v, 3, 10, 1) for v in range(4)] == [(0, 0), (0, 1), (0, 2), (1, 0)]
    # the last, shorter band (pairs 8 and 9)
    assert [gs.pair_band_coords(v, 3, 10, 4) for v in range(24, 30)] == [(8, 0), (9, 0), (8, 1), (9, 1), (8, 2), (9, 2)]


def test_cluster_direction_heuristic():
    """Pairs along M (sharing weight tiles) only for a few M tiles per expert, many experts and a
    long K: the DeepSeek-V3 w13 GEMM at T = 8192 and 16384 (align's M_cap), not its w2 (K =
    2048), not T <= 4096 (at most one real tile per expert), not EP8 slices (32 local experts), not
    long contiguous segments (G4 x M8192)."""
    def m_cap(t, experts=256):
        return -(-(8 * t + experts * 127) // 128) * 128

    assert gs.cluster_along_m(m_cap(8192), 256, 7168) and gs.cluster_along_m(m_cap(16384), 256, 7168)
    assert not gs.cluster_along_m(m_cap(8192), 256, 2048)
    assert not any(gs.cluster_along_m(m_cap(t), 256, 7168) for t in (1, 128, 2048, 4096, 65536))
    assert not any(gs.cluster_along_m(m_cap(t, 32), 32, 7168) for t in (2048, 8192))
    assert not gs.cluster_along_m(4 * 8192, 4, 7168) and not gs.cluster_along_m(0, 0, 7168)


def test_tile_width_heuristic():
    """The 256-wide tile for prefill (experts averaging >= 1 real M tile): DeepSeek-V3's routed
    GEMMs from T = 4096 and long contiguous segments at K = 7168; 128 wide at decode sizes, and on
    contiguous segments at K <= 2048 (the store-behind epilogue)."""
    def m_cap(t, experts=256):
        return -(-(8 * t + experts * 127) // 128) * 128

    for k in (7168, 2048):
        assert all(gs.wide_tile(m_cap(t), 256, k, True) for t in (4096, 8192, 16384))
        assert not any(gs.wide_tile(m_cap(t), 256, k, True) for t in (1, 16, 128, 1024, 2048))
    assert gs.wide_tile(4 * 8192, 4, 7168, False) and gs.wide_tile(32 * 512, 32, 7168, False)
    # Contiguous K <= 2048: wide where it stores behind (1.5 real M tiles per expert), not below.
    assert gs.wide_tile(4 * 8192, 4, 2048, False) and gs.wide_tile(32 * 512, 32, 2048, False)
    assert not gs.wide_tile(32 * 256, 32, 2048, False) and gs.wide_tile(32 * 256, 32, 7168, False)
    assert not gs.wide_tile(0, 0, 7168, True) and not gs.wide_tile(128, 1, 7168, False)
    # With counts, under 64 experts M_cap may be an EP slice's (every routed row): 128 wide.
    assert not any(gs.wide_tile(m_cap(t, 32), 32, k, True) for t in (512, 4096, 8192) for k in (7168, 2048))


def test_sm90_launch_config():
    """Forced choices are kept, the rest follow the shape rules, and a width the kernel does not have
    is refused, whatever the shapes (``test_compile_grouped_gemm_sm90``: before the launch's early
    return at M_cap = 0 or E = 0)."""
    def m_cap(t, experts=256):
        return -(-(8 * t + experts * 127) // 128) * 128

    m_cap_8192 = m_cap(8192)
    assert gs.sm90_launch_config(m_cap_8192, 256, 7168, True) == (True, False, 256)
    # DeepSeek-V3's w2 (K = 2048) 256 wide stores behind from 1.5 real M tiles per expert (T = 8192), not at T = 4096.
    assert gs.sm90_launch_config(m_cap_8192, 256, 2048, True) == (False, True, 256)
    assert gs.sm90_launch_config(m_cap(16384), 256, 2048, True) == (False, True, 256)
    assert gs.sm90_launch_config(m_cap(4096), 256, 2048, True) == (False, False, 256)
    assert gs.sm90_launch_config(4 * 8192, 4, 2048, False) == (False, True, 256)
    assert gs.sm90_launch_config(128 + 128 * 127, 256, 7168, True) == (False, False, 128)  # decode, T = 16
    assert gs.sm90_launch_config(m_cap(4096), 256, 2048, True, store_behind=True) == (False, True, 256)
    assert gs.sm90_launch_config(m_cap_8192, 256, 2048, True, store_behind=False) == (False, False, 256)
    assert gs.sm90_launch_config(m_cap_8192, 256, 7168, True, along_m=False, tile_n=128) == (False, False, 128)
    for kw in ({"tile_n": 192}, {"tile_n": 64}, {"tile_n": 256.0}):
        for rows in (0, m_cap_8192):
            with pytest.raises(ValueError, match="tile_n"):
                gs.sm90_launch_config(rows, 256, 7168, True, **kw)


def test_store_behind_rule_of_the_wide_tile():
    """K <= 2048 only; the 256-wide tile from 1.5 real M tiles per expert (DeepSeek-V3's w2 from T = 6144);
    with expert counts, neither width under half a real M tile per expert (decode)."""
    def m_cap(t, experts=256):
        return -(-(8 * t + experts * 127) // 128) * 128

    assert gs.store_behind_epilogue(2048, False, 0.0) and gs.store_behind_epilogue(2048, True, 1.5)
    assert not gs.store_behind_epilogue(2048, True, 1.49) and not gs.store_behind_epilogue(2048 + 128, False, 9.0)
    assert not gs.store_behind_epilogue(7168, True, 9.0)
    # with expert counts, decode sizes (under half a real tile per expert) keep their stage and A boxes
    assert not gs.store_behind_epilogue(2048, False, 0.49, has_counts=True)
    assert gs.store_behind_epilogue(2048, False, 0.5, has_counts=True)
    assert gs.store_behind_epilogue(2048, False, 0.25, has_counts=False)
    assert gs.sm90_launch_config(m_cap(6144), 256, 2048, True) == (False, True, 256)
    assert gs.sm90_launch_config(m_cap(6080), 256, 2048, True) == (False, False, 256)
    # A forced width takes the rule for that width: 256 at K = 7168 never stores behind, 128 at K = 2048
    # from half a real tile per expert with counts, at any size without.
    assert gs.sm90_launch_config(m_cap(16384), 256, 7168, True, tile_n=256)[1:] == (False, 256)
    assert gs.sm90_launch_config(m_cap(4096), 256, 2048, True, tile_n=128)[1:] == (True, 128)
    # Decode (DeepSeek-V3's w2 at T = 1 / 1024: 128 wide) with align's counts does not store behind;
    # from T = 2048 (64 rows per expert) it does, as without counts.
    assert gs.sm90_launch_config(m_cap(1), 256, 2048, True) == (False, False, 128)
    assert gs.sm90_launch_config(m_cap(1024), 256, 2048, True) == (False, False, 128)
    assert gs.sm90_launch_config(m_cap(1024), 256, 2048, True, expected_m=32) == (False, False, 128)
    assert gs.sm90_launch_config(m_cap(2048), 256, 2048, True, expected_m=64) == (False, True, 128)
    assert gs.sm90_launch_config(m_cap(1024), 256, 2048, False) == (False, True, 128)


def test_cluster_direction_of_the_wide_tile():
    """256 wide, pairs along M from one real M tile per expert (DeepSeek-V3's w13 at T = 4096)."""
    def m_cap(t, experts=256):
        return -(-(8 * t + experts * 127) // 128) * 128

    assert gs.cluster_along_m(m_cap(4096), 256, 7168, True) and not gs.cluster_along_m(m_cap(4096), 256, 7168)
    assert gs.cluster_along_m(m_cap(8192), 256, 7168, True) and not gs.cluster_along_m(m_cap(4096), 256, 2048, True)
    assert not gs.cluster_along_m(m_cap(2048), 256, 7168, True)
    # Contiguous segments (no counts) of a few M tiles each pair along M at any expert count; long
    # ones (G4 x 8192 rows) and expert-parallel slices' estimates (counts, 32 experts) do not.
    assert gs.cluster_along_m(32 * 512, 32, 7168, True, has_counts=False)
    assert not gs.cluster_along_m(32 * 512, 32, 7168, True) and not gs.cluster_along_m(32 * 512, 32, 7168)
    assert not gs.cluster_along_m(4 * 8192, 4, 7168, True, has_counts=False)
    assert gs.sm90_launch_config(32 * 512, 32, 7168, False) == (True, False, 256)
    # Contiguous K = 2048 (256 wide, store-behind) too, from K = 2048 only; G4 x 8192 rows stays along N.
    assert gs.sm90_launch_config(32 * 512, 32, 2048, False) == (True, True, 256)
    assert gs.sm90_launch_config(4 * 8192, 4, 2048, False) == (False, True, 256)
    assert not gs.cluster_along_m(32 * 512, 32, 1536, True, has_counts=False)
    assert not gs.cluster_along_m(32 * 512, 32, 2048, False, has_counts=False)


def test_launch_errors_name_the_calling_op():
    """grouped_gemm_fp8_swiglu runs the GEMM's launch: its refusals (before any kernel) name it."""
    a, a_scale = torch.empty(100, 256, dtype=torch.float8_e4m3fn), torch.empty(2, 100).t()
    b, b_scale = torch.empty(1, 256, 256, dtype=torch.float8_e4m3fn), torch.empty(1, 2, 2)
    with pytest.raises(NotImplementedError, match=r"^cute_moe\.grouped_gemm_fp8_swiglu: .*M_cap must be a multiple"):
        gs.launch("sm_90a", None, 2, a, a_scale, b, b_scale, None, op="grouped_gemm_fp8_swiglu")
    with pytest.raises(NotImplementedError, match=r"^cute_moe\.grouped_gemm_fp8: "):
        gs.launch("sm_90a", None, 2, a, a_scale, b, b_scale, None)
    with pytest.raises(ValueError, match=r"^cute_moe\.grouped_gemm_fp8_swiglu: a_scale must be MN-major"):
        gs.prepare_a_scale(torch.empty(128, 2), "grouped_gemm_fp8_swiglu")


def test_swiglu_is_one_kernel_where_the_gemm_is_256_wide_or_pairs_n_tiles():
    """DeepSeek-V3's w13 at prefill takes the 256-wide kernel; at decode sizes, and on expert-parallel
    slices under 64 experts (their M_cap counts every routed row), the 128-wide one, where the GEMM
    pairs N tiles, with or without the store-behind epilogue (the fused kernel has none) up to two
    real tiles per expert; two kernels where the 128-wide GEMM stores behind dense tiles, or pairs
    M tiles."""
    dsv3_t8192, dsv3_t1, ep8_t8192 = 8192 * 8 + 256 * 127, 1 * 8 + 8 * 127, 8192 * 8 + 32 * 127  # align's M_cap
    assert gs.sm90_swiglu_tile(dsv3_t8192, 256, 7168, True) == gs.WIDE_TILE_N
    assert gs.sm90_swiglu_tile(dsv3_t1, 256, 7168, True) == gs.TILE_N
    assert gs.sm90_swiglu_tile(ep8_t8192, 32, 7168, True) == gs.TILE_N
    assert gs.sm90_swiglu_tile(4 * 8192, 4, 7168, False) == gs.WIDE_TILE_N  # contiguous segments, any expert count
    # Where the plain GEMM stores behind (K <= 2048 from half a real tile per expert with counts,
    # any size on contiguous segments under the wide tile's 1.5), the 128-wide kernel too (session
    # 30: Qwen3-30B-A3B's w13 at T = 1024 and 1536, half and 3/4 of a tile per expert, -12% / -10%
    # against the two kernels).
    def m_cap(t, e):  # align's static M_cap
        return -(-(t * 8 + min(t * 8, e) * 127) // 128) * 128

    assert gs.sm90_launch_config(32 * 128, 32, 2048, False) == (False, True, gs.TILE_N)
    assert gs.sm90_swiglu_tile(32 * 128, 32, 2048, False) == gs.TILE_N
    assert gs.sm90_swiglu_tile(m_cap(512, 128), 128, 2048, True) == gs.TILE_N
    assert gs.sm90_launch_config(m_cap(1024, 128), 128, 2048, True)[1]  # the plain GEMM stores behind
    assert gs.sm90_swiglu_tile(m_cap(1024, 128), 128, 2048, True) == gs.TILE_N
    # From SWIGLU_TWO_KERNEL_TILES = 2.25 tiles per expert there it is two kernels (H100, 16 experts
    # without expected_m, the one kernel against the two: session 31 at 1 / 4 / 16 tiles -0.8 / +4.9
    # / +4.0%, session 32 at 2 / 2.5 / 3 tiles -2.1 / +0.8 / +1.9%): only under 64 experts without
    # expected_m, which with it take the 256-wide kernel.
    assert gs.SWIGLU_TWO_KERNEL_TILES == 2.25
    tiles = {t: gs.real_tiles_per_expert(m_cap(t, 16), 16) for t in (256, 384, 512, 640, 1024)}
    assert [round(tiles[t], 2) for t in tiles] == [1.01, 1.51, 2.01, 2.51, 4.01]
    assert gs.sm90_swiglu_tile(m_cap(256, 16), 16, 2048, True) == gs.TILE_N
    assert gs.sm90_swiglu_tile(m_cap(384, 16), 16, 2048, True) == gs.TILE_N
    assert gs.sm90_swiglu_tile(m_cap(512, 16), 16, 2048, True) == gs.TILE_N
    assert gs.sm90_swiglu_tile(m_cap(576, 16), 16, 2048, True) is None  # 2.26
    assert gs.sm90_swiglu_tile(m_cap(640, 16), 16, 2048, True) is None
    assert gs.sm90_swiglu_tile(m_cap(1024, 16), 16, 2048, True) is None
    assert gs.sm90_swiglu_tile(m_cap(1024, 16), 16, 2048, True, 1024 * 8 // 16) == gs.WIDE_TILE_N
    assert gs.sm90_swiglu_tile(m_cap(1024, 16), 16, 4096, True) == gs.TILE_N  # no store-behind at K = 4096
    # A slice's expected_m replaces the estimate: Qwen3-30B-A3B's EP8 slice (16 of 128 experts) at
    # T = 1024, half a real tile per expert against an estimated 4, runs the one kernel.
    assert gs.sm90_swiglu_tile(m_cap(1024, 16), 16, 2048, True, 1024 * 8 // 128) == gs.TILE_N
    # Everywhere else the kernel of the GEMM's width: the rules pair M tiles only 256 wide, so the
    # other None (two kernels), for a 128-wide launch paired along M, is a guard.
    for e in (4, 8, 16, 32, 64, 128, 256, 384):
        for k in (1024, 2048, 4096, 7168):
            for t in (1, 16, 128, 512, 1024, 2048, 4096, 8192, 16384):
                for has_counts, expected_m in ((True, None), (True, t * 8 // e), (False, None)):
                    cap = m_cap(t, e) if has_counts else max(1, t * 8 // e) * e
                    along_m, behind, width = gs.sm90_launch_config(cap, e, k, has_counts, expected_m=expected_m)
                    assert not along_m or width == gs.WIDE_TILE_N, (e, k, t, has_counts)
                    estimate = gs.real_tiles_per_expert(cap, e, expected_m)
                    dense = width == gs.TILE_N and behind and estimate >= gs.SWIGLU_TWO_KERNEL_TILES
                    assert not dense or (e < 64 and expected_m is None and has_counts), (e, k, t, has_counts)
                    want = None if dense else width
                    assert gs.sm90_swiglu_tile(cap, e, k, has_counts, expected_m) == want, (e, k, t, has_counts)


def test_expected_m_replaces_the_estimate():
    """With ``expected_m`` (fused_moe: T * k // E over all experts) the rules read the real rows per
    expert instead of M_cap's estimate, which overcounts an expert-parallel slice by its factor;
    and the guard against fewer than 64 experts, which exists for that overcount, is lifted."""
    def m_cap(t, e_local):  # align's static M_cap: every routed row may be local
        return -(-(t * 8 + min(t * 8, e_local) * 127) // 128) * 128

    # DeepSeek-V3's EP8 slice (32 of 256 experts) at T = 8192: two real M tiles per expert.
    ep8 = m_cap(8192, 32)
    assert gs.sm90_launch_config(ep8, 32, 7168, True) == (False, False, 128)
    assert gs.sm90_launch_config(ep8, 32, 7168, True, expected_m=256) == (True, False, 256)
    assert gs.sm90_launch_config(ep8, 32, 2048, True, expected_m=256) == (False, True, 256)
    assert gs.sm90_swiglu_tile(ep8, 32, 7168, True, 256) == 256 and gs.sm90_swiglu_tile(ep8, 32, 7168, True) == 128
    # EP4 (64 experts) at T = 1024: a quarter tile; the estimate reads one and takes the wide tile.
    ep4 = m_cap(1024, 64)
    assert gs.wide_tile(ep4, 64, 7168, True) and not gs.wide_tile(ep4, 64, 7168, True, 32)
    assert gs.sm90_launch_config(ep4, 64, 7168, True, expected_m=32) == (False, False, 128)
    assert gs.real_tiles_per_expert(ep4, 64, 0) == 0.0
    # A whole model: the hint and the estimate agree, so do the choices.
    for t in (1, 128, 1024, 2048, 4096, 8192, 16384):
        for k in (7168, 2048):
            assert gs.sm90_launch_config(m_cap(t, 256), 256, k, True) == \
                gs.sm90_launch_config(m_cap(t, 256), 256, k, True, expected_m=t * 8 // 256), (t, k)


def test_sm90_launchers_pass_expected_m_to_the_rule(monkeypatch):
    """Both sm90 launch functions choose their variant with the hint: on an EP8-like slice (32
    experts, M_cap for 8x the real rows, K = 4096) the launch key goes from 128 wide along N to
    256 wide along M.  ``_launch`` stubbed, so this runs on the CPU."""
    pytest.importorskip("cutlass")
    from cute_moe.kernels import grouped_gemm_sm90 as g90  # noqa: PLC0415

    keys = []
    monkeypatch.setattr(g90, "_launch", lambda key, *a, **kw: keys.append(key[4:7]))
    E, K, T = 32, 4096, 8192
    m_cap = -(-(T * 8 + E * 127) // 128) * 128
    a, a_scale = torch.empty(m_cap, K, dtype=torch.float8_e4m3fn), torch.empty(m_cap, K // 128)
    b, b_scale = torch.empty(E, 512, K, dtype=torch.float8_e4m3fn), torch.empty(E, 4, K // 128)
    off, counts = torch.zeros(E + 1, dtype=torch.int32), torch.zeros(E, dtype=torch.int32)
    g90.grouped_gemm_fp8_cuda(a, a_scale, b, b_scale, off, counts)
    g90.grouped_gemm_fp8_cuda(a, a_scale, b, b_scale, off, counts, expected_m=256)
    g90.grouped_gemm_fp8_swiglu_cuda(a, a_scale, b, b_scale, off, counts, True, None, 256)
    g90.grouped_gemm_fp8_swiglu_cuda(a, a_scale, b, b_scale, off, counts, True, None)
    assert keys == [(False, False, 128), (True, False, 256), (True, False, 256), (False, False, 128)]
