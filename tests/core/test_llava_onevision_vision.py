"""LLaVA-OneVision's vision side in core's foundation against HF transformers (the oracle) on a tiny
random config (SigLIP of 3 layers, 28-pixel tiles of 4 x 4 patches, a 2 x 2 tile grid at most):
the packed image features within 1e-5 relative (fp32, CPU) of HF's `get_image_features` for
pixels from HF's slow (PIL) image processor, images that need unpadding in either direction, a
grid shrunk by `anyres_max_N`, several feature layers, samples of several images and videos;
the `<image>` token count equal to `LlavaOnevisionProcessor`'s; HF -> LoongForge -> HF every
tensor bit-identical under each naming of the checkpoint."""

import json

import numpy as np
import pytest
import torch
import transformers
from conftest import perturbed
from loongforge.core.errors import UserError
from loongforge.core.foundation import llava_onevision as lov
from loongforge.core.foundation.hf_mapping import hf_to_lf, lf_to_hf
from loongforge.core.foundation.llava_onevision import (
    LLAVA_ONEVISION_VISION_TABLE,
    LlavaOnevisionConfig,
    LlavaOnevisionVision,
    image_token_count,
    llava_onevision_vision_table,
    video_token_count,
)
from loongforge.core.foundation.siglip import SiglipVisionConfig
from PIL import Image

VISION = SiglipVisionConfig(num_layers=3, hidden_size=32, num_attention_heads=4, ffn_hidden_size=48, image_size=28, patch_size=7)
PINPOINTS = [[28, 28], [28, 56], [56, 28], [56, 56]]
TEXT = {
    "model_type": "qwen2",
    "intermediate_size": 48,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "vocab_size": 8,
}
IMAGE_ID, VIDEO_ID = 0, 1


def config(**kw) -> LlavaOnevisionConfig:
    return LlavaOnevisionConfig(vision_config=VISION, text_hidden_size=24, image_grid_pinpoints=PINPOINTS, **kw)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def hf_model(cfg: LlavaOnevisionConfig):
    d = cfg.hf_config()
    hc = transformers.LlavaOnevisionConfig(
        **{**d, "text_config": {**TEXT, **d["text_config"]}}, image_token_index=IMAGE_ID, video_token_index=VIDEO_ID
    )
    return perturbed(lambda: transformers.LlavaOnevisionModel(hc))


def vision_state(model) -> dict:
    return {k: v for k, v in model.state_dict().items() if not k.startswith("language_model.")}


def ours_from(model, cfg) -> LlavaOnevisionVision:
    ours = LlavaOnevisionVision(cfg).eval()
    ours.load_state_dict(hf_to_lf(LLAVA_ONEVISION_VISION_TABLE, vision_state(model), cfg), strict=True)
    return ours


class _Processor(transformers.LlavaOnevisionProcessor):
    """HF's processor without a video processor (those need torchvision, which is not installed)."""

    def check_argument_for_proper_class(self, name, arg):
        if name == "video_processor" and arg is None:
            return None
        return super().check_argument_for_proper_class(name, arg)


def processor(cfg: LlavaOnevisionConfig):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<image>": IMAGE_ID, "<video>": VIDEO_ID, "[UNK]": 2, "[PAD]": 3, "hi": 4}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", extra_special_tokens=["<image>", "<video>"]
    )
    size = cfg.vision_config.image_size
    images = transformers.LlavaOnevisionImageProcessorPil(
        size={"height": size, "width": size}, image_grid_pinpoints=cfg.image_grid_pinpoints
    )
    return _Processor(
        image_processor=images,
        tokenizer=tokenizer,
        num_image_tokens=cfg.tile_side**2,
        vision_feature_select_strategy=cfg.vision_feature_select_strategy,
        vision_aspect_ratio=cfg.vision_aspect_ratio,
    )


def images(sizes, seed=0):
    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in sizes]


def hf_image_features(model, inputs) -> list[torch.Tensor]:
    with torch.no_grad():
        out = model.get_image_features(inputs["pixel_values"], inputs["image_sizes"], batch_num_images=inputs["batch_num_images"])
    return list(out.pooler_output)


# (30, 100): a 1 x 2 grid, padding rows cut; (100, 30): 2 x 1, padding columns cut; (50, 60): 2 x 2,
# padding rows cut; (60, 60): 2 x 2, nothing cut. anyres_max_1 / _2 shrink the 2 x 2 grids' maps.
CASES = [
    (-1, "anyres_max_9", [(30, 100), (100, 30), (50, 60)], [34, 40, 70]),
    (1, "anyres_max_9", [(100, 30), (60, 60)], [40, 88]),
    ([0, -2], "anyres_max_1", [(60, 60), (50, 60), (30, 100)], [36, 31, 34]),
    (-1, "anyres_max_2", [(50, 60), (60, 60)], [16 + 4 * 6 + 4, 16 + 5 * 5 + 5]),
]


@pytest.mark.parametrize("layer,aspect,sizes,counts", CASES)
def test_image_features_and_counts_match_hf(layer, aspect, sizes, counts):
    cfg = config(vision_feature_layer=layer, vision_aspect_ratio=aspect)
    model = hf_model(cfg)
    ours = ours_from(model, cfg)
    proc = processor(cfg)
    inputs = proc(text=["hi <image>"] * len(sizes), images=images(sizes), return_tensors="pt", padding=True)
    assert inputs["pixel_values"].shape[:2] == (len(sizes), 5) and inputs["image_sizes"].tolist() == [list(s) for s in sizes]
    want = hf_image_features(model, inputs)
    with torch.no_grad():
        got = ours(inputs["pixel_values"], inputs["image_sizes"], inputs["batch_num_images"])
    assert got.shape == (sum(counts), 24)
    assert rel_err(got, torch.cat(want)) < 1e-5
    expanded = (inputs["input_ids"] == IMAGE_ID).sum(1).tolist()
    assert [image_token_count(cfg, h, w) for h, w in sizes] == expanded == [len(f) for f in want] == counts
    # the same tiles back to back (4-D), as HF also takes them
    flat = torch.cat(
        [p[: 1 + lov.image_grid_shape(cfg, *s)[0] * lov.image_grid_shape(cfg, *s)[1]] for p, s in zip(inputs["pixel_values"], sizes)]
    )
    with torch.no_grad():
        assert torch.equal(ours(flat, sizes), got)


def test_multi_image_samples_and_default_strategy_match_hf():
    sizes = [(30, 100), (100, 30), (50, 60)]
    for strategy in ("full", "default"):
        cfg = config(vision_feature_select_strategy=strategy)
        model = hf_model(cfg)
        ours = ours_from(model, cfg)
        proc = processor(cfg)
        if strategy == "full":  # a sample of two images (one tile each) beside a sample of one
            inputs = proc(
                text=["<image> hi <image>", "<image>"], images=[images(sizes[:2]), images(sizes[2:])], return_tensors="pt", padding=True
            )
            multi = [True, True, False]
        else:  # 'default' drops each tile's first patch: only one-tile images can be packed
            inputs = proc(text=["<image> hi <image>"], images=[images(sizes[:2])], return_tensors="pt", padding=True)
            multi, sizes = [True, True], sizes[:2]
        want = hf_image_features(model, inputs)
        with torch.no_grad():
            got = ours(inputs["pixel_values"], inputs["image_sizes"], inputs["batch_num_images"])
        assert rel_err(got, torch.cat(want)) < 1e-5
        counts = [image_token_count(cfg, h, w, m) for (h, w), m in zip(sizes, multi)]
        assert counts == [len(f) for f in want]
        per_sample = (inputs["input_ids"] == IMAGE_ID).sum(1).tolist()
        assert per_sample == ([counts[0] + counts[1], counts[2]] if strategy == "full" else [counts[0] + counts[1]])
    # 'default' with an anyres image: HF fails, and so do ours and the count
    single = proc(text=["<image>"], images=images(sizes[:1]), return_tensors="pt", padding=True)
    with pytest.raises(ValueError):
        hf_image_features(model, single)
    with pytest.raises(ValueError, match="SigLIP has no CLS token"):
        ours(single["pixel_values"], single["image_sizes"])
    with pytest.raises(ValueError, match="SigLIP has no CLS token"):
        image_token_count(cfg, *sizes[0])


def test_video_features_match_hf():
    cfg = config(vision_feature_layer=-2)
    model = hf_model(cfg)
    ours = ours_from(model, cfg)
    torch.manual_seed(1)
    videos = torch.randn(2, 3, 3, 28, 28)
    with torch.no_grad():
        want = model.get_video_features(videos).pooler_output
        got = ours.video_features(videos)
    assert want.shape == (2, video_token_count(cfg, 3), 24) == (2, 3 * 4 + 1, 24)
    assert rel_err(got, want.flatten(0, 1)) < 1e-5
    counted = processor(cfg)._get_num_multimodal_tokens(video_sizes=[(3, 28, 28)])["num_video_tokens"]
    assert counted == [video_token_count(cfg, 3)]


def test_negative_controls():
    """Features before SigLIP's post_layernorm, the unpadding and the newline all matter."""
    cfg = config()
    model = hf_model(cfg)
    ours = ours_from(model, cfg)
    sizes = [(30, 100), (100, 30)]
    inputs = processor(cfg)(text=["<image>"] * 2, images=images(sizes), return_tensors="pt", padding=True)
    want = torch.cat(hf_image_features(model, inputs))
    tiles = inputs["pixel_values"][0, :3]
    with torch.no_grad():
        normed = ours.projector_fc2(torch.nn.functional.gelu(ours.projector_fc1(ours.tower(tiles))))
        assert rel_err(normed, ours.tile_features(tiles)) > 1e-2
        saved = ours.image_newline.clone()
        ours.image_newline.zero_()
        assert rel_err(ours(inputs["pixel_values"], inputs["image_sizes"]), want) > 1e-2
        ours.image_newline.copy_(saved)
    # without unpadding: more tokens than the processor's count and than HF's features
    no_unpad = [16 + r * 4 * (c * 4 + 1) for r, c in (lov.image_grid_shape(cfg, *s) for s in sizes)]
    assert no_unpad != [image_token_count(cfg, *s) for s in sizes]
    real = lov._unpadded
    try:
        lov._unpadded = lambda *a: (0, 0)
        with torch.no_grad():
            assert ours(inputs["pixel_values"], inputs["image_sizes"]).shape[0] == sum(no_unpad) != want.shape[0]
    finally:
        lov._unpadded = real
    with pytest.raises(ValueError, match="do not hold the tiles"):
        ours(inputs["pixel_values"][:, :2], inputs["image_sizes"])


@pytest.mark.parametrize("bias", [True, False])
def test_round_trip_under_each_naming(bias):
    cfg = config(vision_feature_layer=[1, -1], multimodal_projector_bias=bias)
    model = hf_model(cfg)
    sd = vision_state(model)
    assert "vision_tower.encoder.layers.0.self_attn.q_proj.weight" in sd and "multi_modal_projector.linear_1.weight" in sd
    assert ("multi_modal_projector.linear_1.bias" in sd) == bias and "image_newline" in sd
    lf = hf_to_lf(LLAVA_ONEVISION_VISION_TABLE, sd, cfg)
    LlavaOnevisionVision(cfg).load_state_dict(lf, strict=True)
    back = lf_to_hf(LLAVA_ONEVISION_VISION_TABLE, lf, cfg)
    assert set(back) == set(sd) and all(torch.equal(back[k], sd[k]) for k in sd)
    # LlavaOnevisionForConditionalGeneration in memory: `model.` before every name
    outer = {"model." + k: v for k, v in sd.items()}
    table = llava_onevision_vision_table(hf_prefix="model.")
    back = lf_to_hf(table, hf_to_lf(table, outer, cfg), cfg)
    assert set(back) == set(outer) and all(torch.equal(back[k], outer[k]) for k in outer)
    # files written by transformers 4 (the llava-hf hub checkpoints): `vision_tower.vision_model.`
    v4 = {k.replace("vision_tower.", "vision_tower.vision_model.", 1): v for k, v in sd.items()}
    table = llava_onevision_vision_table(tower_prefix="vision_tower.vision_model.")
    lf4 = hf_to_lf(table, v4, cfg)
    assert all(torch.equal(lf4[k], lf[k]) for k in lf) and set(lf4) == set(lf)
    back = lf_to_hf(table, lf4, cfg)
    assert set(back) == set(v4) and all(torch.equal(back[k], v4[k]) for k in v4)


def test_config_from_hf_and_refusals():
    cfg = config(vision_feature_layer=[0, -2], vision_aspect_ratio="anyres_max_4", multimodal_projector_bias=False)
    hc = hf_model(cfg).config
    assert LlavaOnevisionConfig.from_hf(hc.to_dict()) == cfg
    assert LlavaOnevisionConfig.from_hf(json.loads(hc.to_json_string(use_diff=True))) == cfg  # a saved config.json
    bare = LlavaOnevisionConfig.from_hf({})  # HF's defaults: LLaVA-OV's SigLIP (so400m) and 384-pixel pinpoints
    assert (bare.vision_config.num_layers, bare.vision_config.hidden_size, bare.tile_side, bare.text_hidden_size) == (26, 1152, 27, 4096)
    assert bare.image_grid_pinpoints == transformers.LlavaOnevisionConfig().image_grid_pinpoints
    assert image_token_count(bare, 384, 384) == 729 * 2 + 27  # 729 base, the 1 x 1 grid, 27 newlines
    d = hc.to_dict()
    bad = [
        ({"projector_hidden_act": "relu"}, "projector_hidden_act='relu' is not supported"),
        ({"vision_feature_select_strategy": "cls"}, "vision_feature_select_strategy='cls' is not supported"),
        ({"vision_aspect_ratio": "anyres"}, "vision_aspect_ratio='anyres' is not supported"),
        ({"vision_feature_layer": 4}, "vision_feature_layer=4 is not supported"),
        ({"vision_feature_layer": [-5]}, r"vision_feature_layer=\[-5\] is not supported"),
        ({"image_grid_pinpoints": [[28, 30]]}, r"image_grid_pinpoints=\[\[28, 30\]\] is not supported"),
        ({"vision_config": {**d["vision_config"], "vision_use_head": True}}, "vision_config.vision_use_head=True is not supported"),
        ({"vision_config": {**d["vision_config"], "model_type": "clip_vision_model"}}, "vision_config.model_type='clip_vision_model'"),
        ({"vision_config": {**d["vision_config"], "hidden_act": "gelu"}}, "hidden_act='gelu' is not supported"),
    ]
    for change, message in bad:
        with pytest.raises(UserError, match=message) as e:
            LlavaOnevisionConfig.from_hf({**d, **change})
        assert "\n" not in str(e.value)
