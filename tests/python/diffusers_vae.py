"""halocp.diffusers: diffusers' own video VAEs (tiny random configurations)
converted by parallelize_vae on gloo groups of 1 to 4 local processes,
against the unpatched VAE on the whole clip (tests/python/ranks_diffusers.py
holds what each rank checks). Named outside pytest's test_*.py pattern: ctest's
python_diffusers runs it, and skips it when diffusers is not installed.

    python3 -m pytest -p no:cacheprovider tests/python/diffusers_vae.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from launcher import REPO, expect_scenario, launch

pytest.importorskip("diffusers")
sys.path.insert(0, str(REPO / "python"))

import halocp.diffusers as hd  # noqa: E402

HERE = Path(__file__).resolve().parent
SCENARIOS = ["ltx", "ltx_shipped", "ltx095", "ltx2", "ltx2_errors", "cogvideox", "ltx_cogvideox_bad_split", "reduced", "mochi", "mochi_shipped", "mochi_errors",
             "hunyuan_video", "hunyuan_video_bad_split", "hunyuan_video15",
             "wan", "wan22", "wan_bad_shard", "allegro", "allegro_errors", "reduced_more"]


@pytest.fixture(scope="module", params=[1, 2, 3, 4], ids=lambda w: f"W{w}")
def ranks(request):
    """One launch of W ranks per world size, running every scenario."""
    return launch(HERE / "ranks_diffusers.py", request.param, SCENARIOS, timeout=240,
                  env={"OMP_NUM_THREADS": "1"})


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_ranks(ranks, scenario):
    expect_scenario(ranks, scenario)


def test_refuses_unknown_class():
    from diffusers import AutoencoderKL

    with pytest.raises(TypeError, match="AutoencoderKL is not supported; supported: ") as e:
        hd.parallelize_vae(AutoencoderKL(block_out_channels=(4,), norm_num_groups=2, latent_channels=2))
    named = str(e.value).split("supported: ")[-1].split(", ")
    assert named == list(hd.supported_classes())
    assert {"AutoencoderKLLTXVideo", "AutoencoderKLLTX2Video", "AutoencoderKLCogVideoX", "AutoencoderKLWan",
            "AutoencoderKLAllegro"} <= set(named)


def test_split():
    s = hd.split_clip(1 + 8 * 7, 3, 8)
    assert s.groups == (2, 2, 3) and s.lengths == (17, 16, 24) and s.latent_lengths == (3, 2, 3)
    assert [(p.offset, p.length, p.latent_offset, p.latent_length) for p in s.shards] == \
        [(0, 17, 0, 3), (17, 16, 3, 2), (33, 24, 5, 3)]
    assert hd.split_clip(1, 2, 4).lengths == (1, 0)
    assert hd.split_clip(9, 3, 4, groups=[0, 2, 0]).lengths == (1, 8, 0)
    for bad in [(8, 2, 4, None), (9, 2, 4, [1, 0]), (9, 2, 4, [3, -1])]:
        with pytest.raises(ValueError):
            hd.split_clip(*bad)
    # a VAE that treats no frame apart (Allegro): every rank r*k frames, rank 0 empty allowed
    s = hd.split_clip(12, 3, 4, groups=[0, 2, 1], first_frame=False)
    assert s.lengths == (0, 8, 4) and s.latent_lengths == (0, 2, 1) and s.shards[2].offset == 8
    assert hd.split_clip(16, 3, 4, first_frame=False).groups == (1, 1, 2)
    with pytest.raises(ValueError, match="a clip of 13 frames is not 4 \\* k frames"):
        hd.split_clip(13, 2, 4, first_frame=False)
    clip = torch.arange(9.0).reshape(1, 1, 9, 1, 1)
    assert hd.shard_clip(clip, hd.split_clip(9, 1, 4)).flatten().tolist() == list(range(9))


def test_imports_without_diffusers():
    """halocp (and halocp.diffusers) import with diffusers unavailable."""
    import subprocess

    code = "import sys; sys.modules['diffusers'] = None; import halocp.diffusers; print('ok')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env={"PYTHONPATH": str(REPO / "python"), "PATH": "/usr/bin:/bin"})
    assert out.stdout.strip() == "ok", out.stderr


def test_same_module_and_parameters():
    """parallelize_vae returns the model itself, its Parameters the same
    objects under the same names; a second call is refused."""
    from diffusers import AutoencoderKLCogVideoX

    vae = AutoencoderKLCogVideoX(block_out_channels=(4, 8, 8, 8), latent_channels=2, layers_per_block=1,
                                 norm_num_groups=2)
    before = {name: p for name, p in vae.named_parameters()}
    keys = list(vae.state_dict())
    assert hd.parallelize_vae(vae) is vae
    assert {name: p for name, p in vae.named_parameters()} == before
    assert all(before[name] is p for name, p in vae.named_parameters())
    assert list(vae.state_dict()) == keys
    with pytest.raises(ValueError, match="already parallelized"):
        hd.parallelize_vae(vae)


def test_first_frame():
    """Every supported model treats the clip's first frame apart but
    Allegro (split_clip's first_frame)."""
    from diffusers import AutoencoderKLAllegro, AutoencoderKLCogVideoX

    assert hd.first_frame(AutoencoderKLCogVideoX(block_out_channels=(4,), latent_channels=2, layers_per_block=1,
                                                 down_block_types=("CogVideoXDownBlock3D",),
                                                 up_block_types=("CogVideoXUpBlock3D",), norm_num_groups=2))
    assert not hd.first_frame(AutoencoderKLAllegro(block_out_channels=(8,), down_block_types=("AllegroDownBlock3D",),
                                                   up_block_types=("AllegroUpBlock3D",), layers_per_block=1,
                                                   temporal_downsample_blocks=(False,),
                                                   temporal_upsample_blocks=(False,), norm_num_groups=2))


def test_mochi_refuses_framewise_padding():
    """Mochi's framewise encoding/decoding switches its convolutions to the
    conv caches' padding for good: such a model is refused, unchanged."""
    from diffusers import AutoencoderKLMochi

    vae = AutoencoderKLMochi(encoder_block_out_channels=(32,) * 4, decoder_block_out_channels=(32,) * 4,
                             latent_channels=4, layers_per_block=(1,) * 5)
    vae._enable_framewise_decoding()
    with pytest.raises(NotImplementedError, match="framewise encoding or decoding"):
        hd.parallelize_vae(vae)
    assert not hasattr(vae, "_halocp_group") and vae.use_framewise_decoding


def test_hunyuan_video_deepcopy():
    """A deepcopy of a parallelized HunyuanVideo runs its own modules: the
    frame check and the blocks' forwards are bound to the copy."""
    import copy

    from diffusers import AutoencoderKLHunyuanVideo

    vae = hd.parallelize_vae(AutoencoderKLHunyuanVideo(
        latent_channels=4, block_out_channels=(4, 8, 8), layers_per_block=1, norm_num_groups=2,
        down_block_types=("HunyuanVideoDownBlock3D",) * 3, up_block_types=("HunyuanVideoUpBlock3D",) * 3,
        spatial_compression_ratio=4).double())
    twin = copy.deepcopy(vae)
    assert twin._encode.__self__ is twin and twin._decode.__self__ is twin
    assert twin.encoder.mid_block.forward.__self__ is twin.encoder.mid_block
    x = torch.randn(1, 3, 5, 8, 8, dtype=torch.float64)
    with torch.no_grad():
        assert torch.equal(twin.encode(x).latent_dist.mode(), vae.encode(x).latent_dist.mode())
    with pytest.raises(ValueError, match="rank 0 holds 4 frames"):
        twin.encode(x[:, :, :4])


def test_tiled_calls_refused():
    """Every converted model refuses its tiled calls (a tile's norms and the
    first-frame rules would see the tile alone), spatial and temporal."""
    from diffusers import AutoencoderKLAllegro, AutoencoderKLCogVideoX, AutoencoderKLLTXVideo

    for vae in (AutoencoderKLCogVideoX(block_out_channels=(4, 8, 8, 8), latent_channels=2, layers_per_block=1,
                                       norm_num_groups=2),
                AutoencoderKLLTXVideo(in_channels=3, out_channels=3, latent_channels=4, patch_size=1,
                                      block_out_channels=(4, 8, 8, 8), decoder_block_out_channels=(4, 8, 8, 8)),
                AutoencoderKLAllegro(block_out_channels=(8, 8), down_block_types=("AllegroDownBlock3D",) * 2,
                                     up_block_types=("AllegroUpBlock3D",) * 2, temporal_downsample_blocks=(True, True),
                                     temporal_upsample_blocks=(True, True), layers_per_block=1, norm_num_groups=2)):
        hd.parallelize_vae(vae)
        assert not vae.use_tiling
        for method in ("tiled_encode", "tiled_decode", "_temporal_tiled_encode", "_temporal_tiled_decode"):
            if hasattr(vae, method):
                with pytest.raises(RuntimeError, match=f"parallelized {type(vae).__name__} .*leave tiling off"):
                    getattr(vae, method)(torch.zeros(1, 3, 1, 8, 8))
