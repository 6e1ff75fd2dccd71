"""One rank of the tests of halocp.diffusers: real diffusers video VAEs, built
from tiny random configurations (no download), converted by parallelize_vae
and run on this rank's frames, against the unpatched VAE run by every rank
on the whole clip in one process. tests/python/diffusers_vae.py starts W of
them (helpers: ranks.py).

    ranks_diffusers.py SCENARIO...

Checked in float64 within 1e-9 absolute: the latents (the posterior's mode),
the decoded frames, the input gradient and every parameter's gradient
summed over the ranks, for a loss over both latents and frames.
"""

from __future__ import annotations

import contextlib
import copy

import torch
import torch.distributed as dist

import halocp
import halocp.diffusers as hd
import ranks
from ranks import expect

TOL = 1e-9
# diffusers' RMSNorm (LTX-Video's norms) computes its variance in float32
# whatever the input's dtype, and torch's float32 mean rounds differently for
# tensors of different lengths (1.2e-7 relative on the same values, a
# shard's against the whole clip's): the model as shipped agrees to float32's
# rounding only, which these tolerances (relative to the largest value) check.
# Measured: up to 7.2e-5 on 4 ranks (a norm's bias gradient, summed over
# every position of the clip, each carrying its shard's rounding), 1.2e-5 on
# 2 and 3; the float64 variance (float64_rms_norm) agrees to 1e-11.
SHIPPED_TOL = 2e-4
# Parameters upstream of diffusers' timestep embedding, which casts to float32
# (get_timestep_embedding): their gradients are float32 sums over frames,
# which shards add in another order; checked as the shipped model is.
# check_reduced's floors, beside 4x the unsharded model's own error in the
# same precision against float64. Measured (W = 1..4): float32 up to 5.2e-5
# relative (a parameter gradient; the unsharded float32 model itself is off
# by up to 4.1e-5), bf16 autocast at most 3.5x the unsharded model's error.
F32_TOL, BF16_TOL = 5e-5, 1e-3
REALIZATIONS = 3  # extra bf16 draws of the whole model's error (check_reduced)
FLOAT32_BOUND = ("decoder.timestep_scale_multiplier",)

# Each world size's splits, as the groups of `compression` frames per rank:
# uneven, an empty rank (0 frames), and rank 0 with the clip's first frame
# alone (the fewest frames either kind of rank may hold).
GROUPS = {1: [[2], [0]], 2: [[1, 2], [0, 1]], 3: [[2, 0, 1], [0, 1, 1]], 4: [[1, 0, 2, 1], [0, 1, 1, 1]]}
# CogVideoX's decoder doubles every latent frame but the first only when the
# clip's latent count is odd (as 13 latents of 49 frames are): even totals.
EVEN_GROUPS = {1: [[2], [0]], 2: [[1, 1], [0, 2]], 3: [[2, 0, 2], [0, 1, 1]], 4: [[1, 0, 2, 1], [0, 1, 1, 2]]}


def close(got, want, what, relative=None):
    """The largest absolute error; within TOL, or within ``relative`` times
    the largest value."""
    if got.shape != want.shape:
        raise ranks.Failure(f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}")
    err = (got - want).abs().max().item() if got.numel() else 0.0
    scale = want.abs().max().item() if want.numel() else 0.0
    tol = TOL if relative is None else relative * max(scale, 1e-30)
    expect(err <= tol, f"{what}: max error {err:.3g} > {tol:.3g} (largest value {scale:.3g})")
    return err if relative is None else err / max(scale, 1e-30)


def summed(t):
    t = t.clone()
    dist.all_reduce(t)
    return t


class float64_rms_norm:
    """diffusers' RMSNorm with its variance in the input's dtype (float64
    here), in the reference and the sharded model alike, for the exact
    checks; the float32 variance is restored on exit."""

    def __enter__(self):
        from diffusers.models import normalization

        self.cls, self.forward = normalization.RMSNorm, normalization.RMSNorm.forward

        def forward(norm, x):
            if x.dtype != torch.float64:
                return self.forward(norm, x)
            x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps)
            x = x if norm.weight is None else x * norm.weight
            return x if norm.bias is None else x + norm.bias

        self.cls.forward = forward
        return self

    def __exit__(self, *exc):
        self.cls.forward = self.forward


def check(build, shape_hw, decode_args=lambda z: (), shipped=False, splits=GROUPS, whole_clip=lambda vae: None,
          checkpointing=False, float32_input=False, frames_dim=2):
    """For each split of this world size: the sharded encode + decode of a
    clip against the whole one, forward and backward (``frames_dim``: the
    decoded sample's time axis; Allegro's is 1). ``shipped``: the first
    split only, the model's RMSNorm as diffusers ships it (see SHIPPED_TOL).
    ``float32_input``: the first split only, the input gradient alone
    within SHIPPED_TOL (it comes back through a cast to float32)."""
    worst = {"absolute": 0.0, "relative": 0.0}
    rel = SHIPPED_TOL if shipped else None
    rel_x = SHIPPED_TOL if shipped or float32_input else None
    shipped = shipped or float32_input

    def keep(err, relative):
        key = "absolute" if relative is None else "relative"
        worst[key] = max(worst[key], err)
    for i, groups in enumerate(splits[ranks.WORLD][:1] if shipped else splits[ranks.WORLD]):
        torch.manual_seed(1000 + i)
        whole = build().double()
        sharded = hd.parallelize_vae(copy.deepcopy(whole))
        if checkpointing:  # the blocks' forwards run again, exchanges included, in the backward
            sharded.enable_gradient_checkpointing()
        whole_clip(whole)
        r = hd.temporal_compression(sharded)
        first = hd.first_frame(sharded)
        split = hd.split_clip(first + r * sum(groups), ranks.WORLD, r, groups=groups, first_frame=first)
        x = torch.randn(1, 3, split.num_frames, *shape_hw, dtype=torch.float64, requires_grad=True)
        z = whole.encode(x).latent_dist.mode()
        y = whole.decode(z, *decode_args(z)).sample
        gz, gy = torch.randn_like(z), torch.randn_like(y)
        torch.autograd.backward((z, y), (gz, gy))

        x_local = hd.shard_clip(x.detach(), split).clone().requires_grad_()
        z_local = sharded.encode(x_local).latent_dist.mode()
        y_local = sharded.decode(z_local, *decode_args(z_local)).sample
        convs = [m for m in sharded.modules() if isinstance(m, (halocp.nn.CausalConv3d, halocp.nn.CenteredConv3d))]
        rerun = []
        hooks = [m.register_forward_hook(lambda *_: rerun.append(1)) for m in convs]
        torch.autograd.backward((z_local, y_local), (hd.shard_clip(gz, split, latent=True),
                                                     hd.shard_clip(gy, split, dim=frames_dim)))
        for h in hooks:
            h.remove()
        expect(bool(rerun) == checkpointing, f"{len(rerun)} convolutions ran again in the backward")

        what = f"{type(whole).__name__} groups {groups} ({split.num_frames} frames{', checkpointed' * checkpointing})"
        keep(close(z_local, hd.shard_clip(z.detach(), split, latent=True), what + ": latents", rel), rel)
        keep(close(y_local, hd.shard_clip(y.detach(), split, dim=frames_dim), what + ": decoded", rel), rel)
        keep(close(x_local.grad, hd.shard_clip(x.grad, split), what + ": input grad", rel_x), rel_x)
        expect(torch.equal(hd.gather_clip(y_local, split, dim=frames_dim), torch.cat(gathered(y_local), frames_dim)),
               what + ": gather_clip")
        with torch.no_grad():  # serving: the same frames, no graph
            y_served = sharded.decode(z_local.detach(), *decode_args(z_local)).sample
        expect(y_served.grad_fn is None, what + ": decode under no_grad kept a graph")
        keep(close(y_served, hd.shard_clip(y.detach(), split, dim=frames_dim), what + ": decoded under no_grad", rel),
             rel)
        named = dict(whole.named_parameters())
        for name, p in sharded.named_parameters():
            g = p.grad if p.grad is not None else torch.zeros_like(p)
            want = named[name].grad if named[name].grad is not None else torch.zeros_like(p)
            tol = SHIPPED_TOL if name in FLOAT32_BOUND else rel
            keep(close(summed(g), want, f"{what}: grad of {name}", tol), tol)
    print("max error: " + ", ".join(f"{k} {v:.3g}" for k, v in worst.items() if v), flush=True)


def gathered(t):
    """Every rank's t, by all_gather_object (a plain oracle for gather_clip)."""
    parts = [None] * ranks.WORLD
    dist.all_gather_object(parts, t.detach())
    return parts


def check_reduced(build, shape_hw, tol, splits=GROUPS, whole_clip=lambda vae: None, autocast=False,
                  decode_args=lambda z: (), frames_dim=2):
    """The first split of this world size in float32 (``autocast``: under
    bfloat16 autocast over float32 weights, as a bf16 training step runs),
    forward and backward. Shards round differently from the whole clip
    (other lengths, other summation orders), so the sharded model is held to
    the precision's own error: against the whole model in float64, its
    error (relative to each tensor's largest value) within 4 times the
    whole model's in the same precision, plus ``tol``; and the same dtypes."""
    groups = splits[ranks.WORLD][0]
    torch.manual_seed(2000)
    whole = build().float()
    sharded = hd.parallelize_vae(copy.deepcopy(whole))
    exact = copy.deepcopy(whole).double()
    whole_clip(whole)  # on each model: a hook may hold its own model (one_tile)
    whole_clip(exact)
    r, first = hd.temporal_compression(sharded), hd.first_frame(sharded)
    split = hd.split_clip(first + r * sum(groups), ranks.WORLD, r, groups=groups, first_frame=first)
    x = torch.randn(1, 3, split.num_frames, *shape_hw, dtype=torch.float64)
    gz = gy = None

    def run(model, inp):
        nonlocal gz, gy
        inp = inp.detach().to(next(model.parameters()).dtype).requires_grad_()
        lowered = autocast and model is not exact
        with torch.autocast("cpu", dtype=torch.bfloat16) if lowered else contextlib.nullcontext():
            zz = model.encode(inp).latent_dist.mode()
            yy = model.decode(zz, *[a.to(zz.dtype) for a in decode_args(zz)]).sample
        if gz is None:
            gz, gy = torch.randn(zz.shape, dtype=torch.float64), torch.randn(yy.shape, dtype=torch.float64)
        grads = (gz, gy) if model is not sharded else (hd.shard_clip(gz, split, latent=True),
                                                       hd.shard_clip(gy, split, dim=frames_dim))
        torch.autograd.backward((zz, yy), (grads[0].to(zz.dtype), grads[1].to(yy.dtype)))
        out = {"latents": zz.detach(), "decoded": yy.detach(), "input grad": inp.grad}
        for name, p in model.named_parameters():
            g = p.grad if p.grad is not None else torch.zeros_like(p)
            out["grad of " + name] = summed(g) if model is sharded else g
            if model is sharded:
                spread["grad of " + name] = summed(g.abs()).abs().max().item()
        return out

    # A parameter's gradient is each rank's part rounded (under autocast, to
    # bfloat16: the gradient of the weight autocast cast) before the parts
    # are summed, as under any data parallelism; where the parts cancel, that
    # rounding, of about eps times the parts' magnitudes, is the error the
    # whole model's single rounding does not have.
    spread = {}
    eps = torch.finfo(torch.bfloat16 if autocast else torch.float32).eps

    def local(key, t):
        if key not in ("latents", "decoded", "input grad"):
            return t
        return hd.shard_clip(t, split, latent=key == "latents", dim=frames_dim if key == "decoded" else 2)

    def error(got, want):
        got, want = got.double(), want.double()
        return (got - want).abs().max().item() / max(want.abs().max().item(), 1e-30) if want.numel() else 0.0

    reference, own = run(exact, x), run(whole, x)
    # Under autocast the whole model's own error is itself a draw: two bf16
    # runs on inputs a relative 1e-4 apart (the same answer to 1e-4, other
    # roundings) differ in it by up to 10x on the gradients that cancel
    # (HunyuanVideo's first conv bias: 0.05 to 0.60 over ten such runs). So
    # the base is the worst of REALIZATIONS draws, not one.
    draws = []
    if autocast:
        gen = torch.Generator().manual_seed(7)
        for _ in range(REALIZATIONS):
            whole.zero_grad(set_to_none=True)  # new grad tensors: own's stay as they were
            draws.append(run(whole, x * (1 + 1e-4 * torch.randn(x.shape, generator=gen, dtype=x.dtype))))
    got = run(sharded, hd.shard_clip(x, split))
    what = f"{type(whole).__name__} {'bf16 autocast' if autocast else 'float32'} groups {groups}"
    worst = ratio = 0.0
    for key, want in reference.items():
        expect(got[key].dtype == own[key].dtype, f"{what}: {key}: dtype {got[key].dtype}, {own[key].dtype} unsharded")
        err = error(got[key], local(key, want))
        base = max(error(local(key, o[key]), local(key, want)) for o in [own, *draws])
        parts = 2 * eps * spread.get(key, 0.0) / max(want.abs().max().item(), 1e-30) if want.numel() else 0.0
        if base > 1:  # zero within the precision (a key bias's gradient): its value is rounding,
            parts += 12 * base  # which the split changes (the ranks' parts cancel only once summed)
        expect(err <= 4 * base + parts + tol,
               f"{what}: {key}: error {err:.3g} relative > 4 x {base:.3g} + {parts:.3g} (rounded parts) + {tol:.3g}")
        worst, ratio = max(worst, err), max(ratio, err / max(base, 1e-30))
    print(f"max error: relative {worst:.3g}, at most {ratio:.2f}x the whole model's ({what})", flush=True)


def ltx(**config):
    from diffusers import AutoencoderKLLTXVideo

    return lambda: AutoencoderKLLTXVideo(in_channels=3, out_channels=3, latent_channels=4, patch_size=1, **config)


LTX090 = dict(block_out_channels=(4, 8, 8, 8), decoder_block_out_channels=(4, 8, 8, 8),
              layers_per_block=(1, 1, 1, 1, 1), decoder_layers_per_block=(1, 1, 1, 1, 1),
              spatio_temporal_scaling=(True, True, True, False),
              decoder_spatio_temporal_scaling=(True, True, True, False))


def scenario_ltx():
    """LTX-Video 0.9.0's layout: causal encoder, centred decoder, strided
    down-sampling convs, depth-to-space up-sampling."""
    with float64_rms_norm():
        check(ltx(**LTX090), (8, 8))
        check(ltx(**LTX090), (8, 8), splits={w: g[:1] for w, g in GROUPS.items()}, checkpointing=True)


def scenario_ltx_shipped():
    """The same, diffusers' RMSNorm as shipped (its variance in float32)."""
    check(ltx(**LTX090), (8, 8), shipped=True)


def scenario_ltx095():
    """LTX-Video 0.9.5's layout: space-to-depth down-samplers (spatial,
    temporal, spatio-temporal), residual up-samplers with an upscale factor,
    a timestep-conditioned decoder."""
    with float64_rms_norm():
        check(ltx(block_out_channels=(4, 8, 8, 16, 16), down_block_types=("LTXVideo095DownBlock3D",) * 4,
              downsample_type=("spatial", "temporal", "spatiotemporal", "spatiotemporal"),
              spatio_temporal_scaling=(True, True, True, True), layers_per_block=(1, 1, 1, 1, 1),
              decoder_block_out_channels=(8, 16, 32), decoder_layers_per_block=(1, 1, 1, 1),
              decoder_spatio_temporal_scaling=(True, True, True), decoder_inject_noise=(False,) * 4,
              upsample_residual=(True, True, True), upsample_factor=(2, 2, 2), timestep_conditioning=True,
              spatial_compression_ratio=16, temporal_compression_ratio=8),
          (16, 16), decode_args=lambda z: (torch.full((z.shape[0],), 0.05, dtype=z.dtype),))



def ltx2(**config):
    from diffusers import AutoencoderKLLTX2Video

    # Three down blocks of each kind that compresses time (space-to-depth in
    # time and space, in time alone, a strided conv) and three up blocks
    # (depth-to-space in time and space, in time alone): 8 in time, 4 in
    # space, so 8x8 frames keep 2x2 latents (the decoder's reflect padding
    # wants more than one pixel).
    kw = dict(in_channels=3, out_channels=3, latent_channels=4, patch_size=1, block_out_channels=(8, 8, 8),
              down_block_types=("LTX2VideoDownBlock3D",) * 3, layers_per_block=(1, 1, 1, 1),
              spatio_temporal_scaling=(True, True, True), downsample_type=("spatiotemporal", "temporal", "conv"),
              decoder_block_out_channels=(8, 16, 32), decoder_layers_per_block=(1, 1, 1, 1),
              decoder_spatio_temporal_scaling=(True, True, True), decoder_inject_noise=(False,) * 4,
              upsample_type=("spatiotemporal", "temporal", "spatiotemporal"), upsample_residual=(True,) * 3,
              upsample_factor=(2, 2, 2), timestep_conditioning=True, temporal_compression_ratio=8,
              spatial_compression_ratio=4)
    return lambda: AutoencoderKLLTX2Video(**{**kw, **config})


def ltx2_temb(z):
    return (torch.full((z.shape[0],), 0.05, dtype=z.dtype),)


def scenario_ltx2():
    """LTX-2 (AutoencoderKLLTX2Video): LTX's blocks with their causality a
    call's argument, per-position RMS norms (in the input's dtype: no
    float32 rounding), reflect padding in the decoder's space, a
    timestep-conditioned decoder; the decoder centred on one split of this
    world size, causal (the class's default) with activation checkpointing
    on the other."""
    check(ltx2(decoder_causal=False), (8, 8), decode_args=ltx2_temb, splits={w: g[1:] for w, g in GROUPS.items()})
    check(ltx2(decoder_causal=True), (8, 8), decode_args=ltx2_temb, splits={w: g[:1] for w, g in GROUPS.items()},
          checkpointing=True)


def scenario_ltx2_errors():
    """A shard the split does not allow (the last rank one frame short) is
    refused on every rank alike, naming the rank and its length; so is a
    rank 0 without latent frames, and a decode asking a non-causal decoder
    for causal frames."""
    import pytest

    vae = hd.parallelize_vae(ltx2(decoder_causal=False)().double())
    last = ranks.WORLD - 1
    frames = (1 if ranks.RANK == 0 else 0) + 8 - (ranks.RANK == last)
    # a HaloError, as halocp's layers refuse a bad shard (and a ValueError, as before)
    with pytest.raises(halocp.HaloError, match=f"AutoencoderKLLTX2Video.encode: rank {last} holds {8 + (last == 0) - 1} "
                                         "frames: the split wants rank 0 holds 1 "):
        vae.encode(torch.zeros(1, 3, frames, 8, 8, dtype=torch.float64))
    temb = ltx2_temb(torch.zeros(1, dtype=torch.float64))
    with pytest.raises(ValueError, match="rank 0 holds 0 latent frames"):
        vae.decode(torch.zeros(1, 4, 0 if ranks.RANK == 0 else 1, 2, 2, dtype=torch.float64), *temb)
    with pytest.raises(NotImplementedError, match="non-causal part as configured; causal=True asks for the other"):
        vae.decode(torch.zeros(1, 4, 1, 2, 2, dtype=torch.float64), *temb, causal=True)
    # diffusers' default ratio counts the scaling blocks (8), whatever they scale (4 here)
    with pytest.raises(ValueError, match="temporal_compression_ratio \\(8\\) is not its down-samplers'.*=4$"):
        hd.parallelize_vae(ltx2(temporal_compression_ratio=None, downsample_type=("spatial", "temporal", "conv"))())


def allegro(**config):
    from diffusers import AutoencoderKLAllegro

    # Three levels, time halved at the first two (decoder: doubled at the
    # last two), space at the first two: 8x8 frames keep 2x2 latents.
    kw = dict(block_out_channels=(8, 8, 8), down_block_types=("AllegroDownBlock3D",) * 3,
              up_block_types=("AllegroUpBlock3D",) * 3, temporal_downsample_blocks=(True, True, False),
              temporal_upsample_blocks=(False, True, True), latent_channels=4, layers_per_block=1,
              norm_num_groups=2, temporal_compression_ratio=4)
    # eval(): its temporal layers hold dropout of 0.1 whatever the config, whose
    # masks no two runs draw alike (the sharded model draws its own per shard)
    return lambda: AutoencoderKLAllegro(**{**kw, **config}).eval()


def one_tile(vae):
    """Allegro as shipped encodes and decodes in tiles only (24 frames of
    320x320 pixels, overlapping, blended; without tiling it raises): with
    one tile the size of the clip there is nothing to blend, and the tiled
    calls are the model on the whole clip in one call, as the sharded model
    computes it."""
    vae.enable_tiling()
    encode, decode = vae.tiled_encode, vae.tiled_decode
    r, s = vae.config.temporal_compression_ratio, vae.spatial_compression_ratio

    def tiled_encode(x):
        vae.kernel = vae.stride = tuple(x.shape[2:])
        return encode(x)

    def tiled_decode(z):
        vae.kernel = vae.stride = (z.shape[2] * r, z.shape[3] * s, z.shape[4] * s)
        return decode(z)

    vae.tiled_encode, vae.tiled_decode = tiled_encode, tiled_decode


def scenario_allegro():
    """Allegro (AutoencoderKLAllegro): per-frame 2-d blocks and their
    GroupNorms, temporal conv layers with GroupNorm over time and centred
    convs replicating the clip's ends, zero-padded temporal convs, the
    kernel-2 stride-2 halving of time and the depth-to-space doubling; no
    frame apart (every rank 4*k frames: an empty rank 0 included); one split
    of this world size plain, the other with activation checkpointing. Against the model as shipped, one tile the
    size of the clip (one_tile)."""
    check(allegro(), (8, 8), whole_clip=one_tile, frames_dim=1, splits={w: g[1:] for w, g in ALLEGRO_GROUPS.items()})
    check(allegro(), (8, 8), whole_clip=one_tile, frames_dim=1, splits={w: g[:1] for w, g in ALLEGRO_GROUPS.items()},
          checkpointing=True)


# GROUPS, but for one rank a clip of 4 frames: without a first frame apart,
# [0] would be no clip at all (the others' [0, ...] are an empty rank 0).
ALLEGRO_GROUPS = {**GROUPS, 1: [[2], [1]]}


def scenario_allegro_errors():
    """A shard the split does not allow (the last rank two frames short:
    pairs would straddle shards) is refused on every rank alike, naming the
    rank and its length; a tiled call is refused."""
    import pytest

    vae = hd.parallelize_vae(allegro()().double())
    last = ranks.WORLD - 1
    frames = 4 - 2 * (ranks.RANK == last)
    with pytest.raises(halocp.HaloError, match=f"AutoencoderKLAllegro.encode: rank {last} holds 2 frames: the split wants "
                                         "every rank holds 4\\*k frames"):
        vae.encode(torch.zeros(1, 3, frames, 8, 8, dtype=torch.float64))
    vae.enable_tiling()
    with pytest.raises(RuntimeError, match="leave tiling off"):
        vae.decode(torch.zeros(1, 4, 1, 2, 2, dtype=torch.float64))
    with pytest.raises(ValueError, match="temporal_compression_ratio \\(4\\) is not its encoder's 2"):
        hd.parallelize_vae(allegro(temporal_downsample_blocks=(True, False, False))())


def scenario_cogvideox():
    """CogVideoX: causal convs with the first frame repeated, GroupNorm over
    time, the temporal average of pairs after the first frame, the decoder's
    spatial norm over the latents and its temporal doubling but for the
    first frame; and with activation checkpointing."""
    from diffusers import AutoencoderKLCogVideoX

    def build():
        return AutoencoderKLCogVideoX(block_out_channels=(4, 8, 8, 8), latent_channels=4, layers_per_block=1,
                                      norm_num_groups=2, temporal_compression_ratio=4)

    check(build, (8, 8), splits=EVEN_GROUPS, whole_clip=one_frame_batch)
    check(build, (8, 8), splits={w: g[:1] for w, g in EVEN_GROUPS.items()}, whole_clip=one_frame_batch,
          checkpointing=True)


def one_frame_batch(vae):
    """CogVideoX encodes 8 frames (decodes 2 latent frames) a call, carrying
    conv caches between calls and normalising each batch on its own: the
    reference is the model in one call over the whole clip, as the sharded
    model computes it."""
    vae.num_sample_frames_batch_size = vae.num_latent_frames_batch_size = 1 << 30


def _cogvideox():
    from diffusers import AutoencoderKLCogVideoX

    return AutoencoderKLCogVideoX(block_out_channels=(4, 8, 8, 8), latent_channels=4, layers_per_block=1,
                                  norm_num_groups=2, temporal_compression_ratio=4)


def scenario_reduced():
    """float32 and bf16 autocast, LTX-Video 0.9.0 (RMSNorm as shipped) and
    CogVideoX (GroupNorm over time)."""
    check_reduced(ltx(**LTX090), (8, 8), F32_TOL)
    check_reduced(_cogvideox, (8, 8), F32_TOL, splits=EVEN_GROUPS, whole_clip=one_frame_batch)
    check_reduced(ltx(**LTX090), (8, 8), BF16_TOL, autocast=True)
    check_reduced(_cogvideox, (8, 8), BF16_TOL, splits=EVEN_GROUPS, whole_clip=one_frame_batch, autocast=True)


def scenario_reduced_more():
    """float32 for every other model (the first split of each world size);
    bf16 autocast for Wan (its zero-padded convs take the fused path, whose
    backward failed under autocast: float32 weights beside a bfloat16
    gradient) and every other model."""
    check_reduced(mochi(), (8, 8), F32_TOL)
    check_reduced(hunyuan_video(), (8, 8), F32_TOL, splits=SHORT_GROUPS)
    check_reduced(hunyuan_video15(), (8, 8), F32_TOL)
    check_reduced(wan(), (8, 8), F32_TOL)
    check_reduced(ltx2(decoder_causal=False), (8, 8), F32_TOL, decode_args=ltx2_temb)
    check_reduced(allegro(), (8, 8), F32_TOL, whole_clip=one_tile, frames_dim=1, splits=ALLEGRO_GROUPS)
    check_reduced(wan(), (8, 8), BF16_TOL, autocast=True)
    check_reduced(mochi(), (8, 8), BF16_TOL, autocast=True)
    check_reduced(hunyuan_video(), (8, 8), BF16_TOL, splits=SHORT_GROUPS, autocast=True)
    check_reduced(hunyuan_video15(), (8, 8), BF16_TOL, autocast=True)
    check_reduced(ltx2(decoder_causal=False), (8, 8), BF16_TOL, decode_args=ltx2_temb, autocast=True)
    check_reduced(allegro(), (8, 8), BF16_TOL, whole_clip=one_tile, frames_dim=1, splits=ALLEGRO_GROUPS, autocast=True)


def mochi(**config):
    from diffusers import AutoencoderKLMochi

    # Mochi's norms have 32 groups and its attentions heads of 32 channels:
    # 32 channels throughout; (2, 2, 1) in space keeps 2x2 latents of 8x8
    # frames (a GroupNorm of one value per group is refused); (1, 2, 3) in
    # time, the model's own: a compression of 6.
    kw = dict(encoder_block_out_channels=(32, 32, 32, 32), decoder_block_out_channels=(32, 32, 32, 32),
              latent_channels=4, layers_per_block=(1, 1, 1, 1, 1), spatial_expansions=(2, 1, 1))
    return lambda: AutoencoderKLMochi(**{**kw, **config})


class float64_fourier_features:
    """Mochi's FourierFeatures in the input's dtype (float64 here) instead of
    float32, in the reference and the sharded model alike, for the exact
    checks: the features are per position, so their values agree bit for
    bit either way, but the input gradient comes back through float32, which
    rounds the float64 gradients of the two runs (equal to 1e-12) apart by a
    float32 step."""

    def __enter__(self):
        from diffusers.models.autoencoders import autoencoder_kl_mochi as m

        self.cls, self.forward = m.FourierFeatures, m.FourierFeatures.forward

        def forward(ff, x):
            w = torch.pow(2.0, torch.arange(ff.start, ff.stop, ff.step, dtype=x.dtype)) * (2 * torch.pi)
            h = x.repeat_interleave(len(w), dim=1) * w.repeat(x.shape[1])[None, :, None, None, None]
            return torch.cat([x, torch.sin(h), torch.cos(h)], dim=1)

        self.cls.forward = forward
        return self

    def __exit__(self, *exc):
        self.cls.forward = self.forward


def scenario_mochi():
    """Mochi: CogVideoX's causal convs with replicate padding (strided in
    time in the encoder's down blocks), per-frame GroupNorm, causal attention
    over time in the encoder, depth-to-space in time in the decoder and its
    first r-1 frames dropped; and with activation checkpointing. diffusers
    ships Mochi computing the whole clip in one call (framewise encoding
    raises, framewise decoding and tiling are off by default), so the
    reference is the model as shipped, but for FourierFeatures in float64
    (see float64_fourier_features; scenario_mochi_shipped runs it as
    shipped)."""
    with float64_fourier_features():
        check(mochi(), (8, 8))
        check(mochi(), (8, 8), splits={w: g[:1] for w, g in GROUPS.items()}, checkpointing=True)
        encode_served(mochi(), (8, 8))


def encode_served(build, shape_hw):
    """The sharded encode under torch.no_grad (check serves the decode
    alone): Mochi's attention over time is in its encoder."""
    for groups in GROUPS[ranks.WORLD]:
        torch.manual_seed(2000)
        whole = build().double()
        sharded = hd.parallelize_vae(copy.deepcopy(whole))
        r = hd.temporal_compression(sharded)
        split = hd.split_clip(1 + r * sum(groups), ranks.WORLD, r, groups=groups)
        x = torch.randn(1, 3, split.num_frames, *shape_hw, dtype=torch.float64)
        with torch.no_grad():
            z = whole.encode(x).latent_dist.mode()
            z_local = sharded.encode(hd.shard_clip(x, split)).latent_dist.mode()
        what = f"{type(whole).__name__} groups {groups}"
        close(z_local, hd.shard_clip(z, split, latent=True), what + ": latents encoded under no_grad")
        # diffusers' other frame count: every decoded frame kept, rank 0's r-1 extra ones included
        whole.drop_last_temporal_frames = sharded.drop_last_temporal_frames = False
        with torch.no_grad():
            y = whole.decode(z).sample
            y_local = sharded.decode(z_local).sample
        expect(y_local.shape[2] == r * z_local.shape[2], f"{what}: {y_local.shape[2]} frames kept")
        close(torch.cat(gathered(y_local), 2), y, what + ": decoded, no frame dropped")


def scenario_mochi_shipped():
    """Mochi as shipped, its FourierFeatures in float32: the latents, frames
    and parameter gradients agree to 1e-9 all the same; the input gradient to
    float32's rounding (see SHIPPED_TOL)."""
    check(mochi(), (8, 8), float32_input=True)


def scenario_mochi_errors():
    """A shard the split does not allow is refused on every rank alike,
    naming the rank and its length, before any exchange (no rank is left
    waiting): the last rank one frame short; rank 0 without latents."""
    torch.manual_seed(7)
    vae = hd.parallelize_vae(mochi()().double())
    bad = ranks.WORLD - 1
    frames = (1 if ranks.RANK == 0 else 0) + 6 - (ranks.RANK == bad)
    for call, arg, want in [
            (vae.encode, torch.randn(1, 3, frames, 8, 8, dtype=torch.float64), f"rank {bad} holds {5 + (bad == 0)} frames"),
            (vae.decode, torch.randn(1, 4, 1 - (ranks.RANK == 0), 4, 4, dtype=torch.float64),
             "rank 0 holds 0 latent frames")]:
        try:
            call(arg)
        except ValueError as e:
            expect(want in str(e) and "split_clip" in str(e), f"{call.__name__}: {e}")
        else:
            raise ranks.Failure(f"{call.__name__} took a shard the split does not allow")
    vae.enable_tiling()
    try:
        vae.decode(torch.randn(1, 4, 1, 4, 4, dtype=torch.float64))
    except RuntimeError as e:
        expect("leave tiling off" in str(e), str(e))
    else:
        raise ranks.Failure("decode tiled a parallelized Mochi")

def hunyuan_video(**config):
    from diffusers import AutoencoderKLHunyuanVideo

    return lambda: AutoencoderKLHunyuanVideo(
        in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(4, 8, 8), layers_per_block=1,
        down_block_types=("HunyuanVideoDownBlock3D",) * 3, up_block_types=("HunyuanVideoUpBlock3D",) * 3,
        norm_num_groups=2, spatial_compression_ratio=4, temporal_compression_ratio=4, **config)


def scenario_hunyuan_video():
    """HunyuanVideo: causal convs with replicate padding in time and space,
    strided causal down-sampling, up-sampling of every frame but the clip's
    first in time, GroupNorm over time, and the mid-blocks' attention over
    every (frame, h, w) token, causal by frame, on
    halocp.cp_attention (causal by frame). Against the model as shipped: its
    temporal tiling starts past 16 frames (4 latent frames), beyond these
    clips, so the shipped call is the whole-sequence one; once more with
    activation checkpointing; then a clip past the tiling (no_framewise)."""
    check(hunyuan_video(), (8, 8), splits=SHORT_GROUPS)
    check(hunyuan_video(), (8, 8), splits={w: g[:1] for w, g in SHORT_GROUPS.items()}, checkpointing=True)
    check(hunyuan_video(), (8, 8), splits=LONG_GROUPS, whole_clip=no_framewise)


# At most 16 frames (4 latent frames), within HunyuanVideo's tiling
# threshold: GROUPS, but for 4 ranks (17 frames there) 13 frames as uneven.
SHORT_GROUPS = {**GROUPS, 4: [[1, 0, 1, 1], [0, 1, 1, 1]]}
# 21 frames (6 latent frames): past HunyuanVideo's temporal tiling threshold.
LONG_GROUPS = {1: [[5]], 2: [[1, 4]], 3: [[3, 0, 2]], 4: [[2, 1, 0, 2]]}


def no_framewise(vae):
    """HunyuanVideo as shipped encodes a clip of more than 16 frames (decodes
    more than 4 latent frames) in overlapping temporal tiles, 17 frames (5
    latent frames) each, every 12 (3), blended linearly where they overlap:
    each tile's GroupNorm statistics and attention see that tile alone, so
    the result is not the whole-sequence computation. The reference is the
    model in one call over the whole clip (use_framewise_* off), as the
    sharded model computes it."""
    vae.use_framewise_encoding = vae.use_framewise_decoding = False


def scenario_hunyuan_video_bad_split():
    """A shard the split does not allow (here the last rank's, one frame
    too many) is refused on every rank alike, naming the rank and its
    length, in encode and in decode (rank 0 without a latent frame); by
    HunyuanVideo 1.5 too."""
    import pytest

    vae = hd.parallelize_vae(hunyuan_video(mid_block_add_attention=False)().double())
    last = ranks.WORLD - 1
    frames = (1 if ranks.RANK == 0 else 4) + (ranks.RANK == last)
    wrong = (1 if last == 0 else 4) + 1
    with pytest.raises(ValueError, match=f"rank {last} holds {wrong} frames: the split wants rank 0 holds 1 "):
        vae.encode(torch.zeros(1, 3, frames, 8, 8, dtype=torch.float64))
    latents = 0 if ranks.RANK == 0 else 1
    with pytest.raises(ValueError, match="rank 0 holds 0 latent frames"):
        vae.decode(torch.zeros(1, 4, latents, 2, 2, dtype=torch.float64))
    from diffusers import AutoencoderKLHunyuanVideo15

    vae = hd.parallelize_vae(AutoencoderKLHunyuanVideo15(latent_channels=4, block_out_channels=(8, 16, 16),
                                                         layers_per_block=1, spatial_compression_ratio=4).double())
    with pytest.raises(ValueError, match=f"AutoencoderKLHunyuanVideo15.encode: rank {last} holds {wrong} frames"):
        vae.encode(torch.zeros(1, 3, frames, 8, 8, dtype=torch.float64))


def scenario_ltx_cogvideox_bad_split():
    """LTX-Video and CogVideoX check the split too (they gave latents of a
    wrong length, silently): the last rank's shard one frame too long is
    refused on every rank alike, naming it, in encode; a rank 0 without a
    latent frame, in decode."""
    import pytest

    last = ranks.WORLD - 1
    for build, r, name in ((ltx(**LTX090), 8, "AutoencoderKLLTXVideo"), (_cogvideox, 4, "AutoencoderKLCogVideoX")):
        vae = hd.parallelize_vae(build().double())
        frames = (1 if ranks.RANK == 0 else r) + (ranks.RANK == last)
        wrong = (1 if last == 0 else r) + 1
        with pytest.raises(hd.FrameCountError, match=f"{name}.encode: rank {last} holds {wrong} frames: the split "
                                                     "wants rank 0 holds 1 "):
            vae.encode(torch.zeros(1, 3, frames, 8, 8, dtype=torch.float64))
        with pytest.raises(hd.FrameCountError, match=f"{name}.decode: rank 0 holds 0 latent frames"):
            vae.decode(torch.zeros(1, 4, 0 if ranks.RANK == 0 else 1, 2, 2, dtype=torch.float64))


def scenario_hunyuan_video15():
    """HunyuanVideo 1.5: the same causal convs, space-to-depth down-sampling
    and depth-to-space up-sampling that fold the clip's first frame in space
    only, per-frame RMS norms, the mid-blocks' causal frame attention; and
    with activation checkpointing. It has no temporal tiling: against the
    model as shipped."""
    build = hunyuan_video15()
    check(build, (8, 8))
    check(build, (8, 8), splits={w: g[:1] for w, g in GROUPS.items()}, checkpointing=True)


def hunyuan_video15(**config):
    from diffusers import AutoencoderKLHunyuanVideo15

    return lambda: AutoencoderKLHunyuanVideo15(in_channels=3, out_channels=3, latent_channels=4,
                                               block_out_channels=(8, 16, 16), layers_per_block=1,
                                               spatial_compression_ratio=4, temporal_compression_ratio=4, **config)


def wan(**config):
    from diffusers import AutoencoderKLWan

    return lambda: AutoencoderKLWan(base_dim=4, z_dim=4, dim_mult=[1, 2, 4, 4], num_res_blocks=1,
                                    temperal_downsample=[False, True, True], **config)


# Wan 2.2's layout: residual down and up blocks with their average and
# repeat shortcuts, 2x2 patches of 3 channels in and out, a decoder wider
# than the encoder (as Wan 2.2 ships: 256 and 160 channels).
WAN22 = dict(is_residual=True, patch_size=2, in_channels=12, out_channels=12, scale_factor_spatial=16,
             decoder_base_dim=6)


def scenario_wan():
    """Wan 2.1 (AutoencoderKLWan): causal convs padded with zeros, the
    down-sampler's strided time conv keeping the first frame, the
    up-sampler's time conv doubling every frame but the first, attention
    within each frame. Against the model as shipped: its chunked encode
    (the first frame, then 4 frames a call) and frame-by-frame decode with
    feat_cache are exactly the whole clip's causal computation (see
    halocp.diffusers.wan). The model has no gradient checkpointing."""
    check(wan(), (8, 8))


# One split per world size, each with rank 0 holding the first frame alone
# and (W > 2) an empty rank: what Wan 2.2's shortcuts treat apart.
WAN22_GROUPS = {1: [[2]], 2: [[0, 2]], 3: [[0, 0, 2]], 4: [[0, 1, 0, 2]]}


def scenario_wan22():
    """Wan 2.2's layout: the residual blocks' zero-padded average shortcut
    (AvgDown3D) and repeat shortcut (DupUp3D), the first frame apart on
    rank 0; patches of 2x2 pixels. Against the model as shipped."""
    check(wan(**WAN22), (16, 16), splits=WAN22_GROUPS)


def scenario_wan_bad_shard():
    """A shard length that the split does not allow raises the same error,
    naming the rank and its length, on every rank (no rank is left waiting
    in an exchange); so does a rank 0 with no latent frames."""
    vae = hd.parallelize_vae(wan()().double())
    bad = ranks.WORLD - 1
    frames = [1 + 4] + [4] * (ranks.WORLD - 1)
    frames[bad] += 2
    x = torch.randn(1, 3, frames[ranks.RANK], 8, 8, dtype=torch.float64)
    try:
        vae.encode(x)
    except ValueError as e:
        expect(f"rank {bad} holds {frames[bad]}" in str(e), f"the error does not name rank {bad}: {e}")
    else:
        raise ranks.Failure(f"a shard of {frames[bad]} frames on rank {bad} was taken")
    z = torch.randn(1, 4, 0 if ranks.RANK == 0 else 1, 1, 1, dtype=torch.float64)
    try:
        vae.decode(z)
    except ValueError as e:
        expect("rank 0 holds 0" in str(e), f"the error does not name rank 0: {e}")
    else:
        raise ranks.Failure("a rank 0 with no latent frames was taken")


if __name__ == "__main__":
    ranks.main(globals())
