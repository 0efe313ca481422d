"""Camera images for policies, in plain torch: openpi's resize-with-pad and LeRobot's augmentations.

    image = resize_with_pad(frame, 224, 224)        # uint8 or float32 in [-1, 1], HWC or CHW
    augment = ImageAugmenter(ImageAugment(cameras=("observation.images.top", "observation.images.wrist")))
    images = augment({"observation.images.top": top, "observation.images.wrist": wrist}, generator)

`resize_with_pad` is openpi's `resize_with_pad_torch` (and its leading dims may be any number).
The colour adjustments follow torchvision's `adjust_brightness` / `adjust_contrast` /
`adjust_saturation` / `adjust_hue` / `adjust_sharpness` (themselves PIL's `ImageEnhance`) on float
images in [0, 1] of shape [..., c, h, w]; `crop_resize` and `rotate` are openpi's pi0.5 training
geometry (a 95% crop resized back, a rotation within +-5 degrees, for the non-wrist cameras).

`ImageAugment` configures them as LeRobot's `ImageTransforms` does (each colour transform with a
factor range, at most `max_num_transforms` of them per image, picked at random), plus the
geometric pair; `ImageAugmenter` applies it with parameters drawn from a `torch.Generator`, so the
same generator state gives the same images. One draw serves all of an image's leading dims (a
time window of one camera stays consistent); each camera gets its own draw.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Mapping

import torch
import torch.nn.functional as F
from loongforge.core.errors import UserError

GRAY_WEIGHTS = (0.2989, 0.587, 0.114)  # torchvision's rgb_to_grayscale (ITU-R 601-2 luma)
COLOR_TRANSFORMS = ("brightness", "contrast", "saturation", "hue", "sharpness")


# ---- resize with pad (openpi) -------------------------------------------------------------------


def resize_with_pad(images: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """Resize to fit in (height, width) keeping the aspect ratio, then pad to that size, as openpi's
    `resize_with_pad_torch`: images [*b, h, w, c] (channels last, told by a last dim <= 4) or
    [*b, c, h, w]; the scale is max(w / width, h / height) and the resized size (int(h / scale),
    int(w / scale)); bilinear (`align_corners=False`, on the input's dtype as openpi calls it);
    uint8 is rounded and clamped to 0..255, float32 clamped to [-1, 1] (its expected range), any
    other dtype a ValueError. On a CPU, uint8 goes through torch's uint8 bilinear kernel, as in
    openpi; a device without one (CUDA, where openpi's call fails) interpolates uint8 in float32
    and rounds, which may differ from the CPU kernel by one level. The padding is centred (an odd pixel goes to the bottom / right),
    0 for uint8 and -1.0 for float32. Returns the input's layout and leading dims."""
    if images.dtype not in (torch.uint8, torch.float32):
        raise ValueError(f"resize_with_pad: unsupported image dtype {images.dtype} (uint8, or float32 in [-1, 1])")
    if images.dim() < 3:
        raise ValueError(f"resize_with_pad: expected [*b, h, w, c] or [*b, c, h, w], got shape {list(images.shape)}")
    channels_last = images.shape[-1] <= 4
    lead = images.shape[:-3]
    x = images.reshape(-1, *images.shape[-3:])
    if channels_last:
        x = x.permute(0, 3, 1, 2)
    cur_height, cur_width = x.shape[-2:]
    ratio = max(cur_width / width, cur_height / height)
    resized_height, resized_width = int(cur_height / ratio), int(cur_width / ratio)
    try:
        resized = F.interpolate(x, size=(resized_height, resized_width), mode="bilinear", align_corners=False)
    except NotImplementedError:  # no uint8 bilinear kernel on this device (CUDA): interpolate in float32
        resized = F.interpolate(x.float(), size=(resized_height, resized_width), mode="bilinear", align_corners=False)
    if images.dtype == torch.uint8:
        resized = torch.round(resized).clamp(0, 255).to(torch.uint8)
    else:
        resized = resized.clamp(-1.0, 1.0)
    pad_h0, pad_w0 = (height - resized_height) // 2, (width - resized_width) // 2
    pad = (pad_w0, width - resized_width - pad_w0, pad_h0, height - resized_height - pad_h0)  # left, right, top, bottom
    out = F.pad(resized, pad, mode="constant", value=0 if images.dtype == torch.uint8 else -1.0)
    if channels_last:
        out = out.permute(0, 2, 3, 1)
    return out.reshape(*lead, *out.shape[1:])


# ---- colour adjustments (torchvision / PIL ImageEnhance) -----------------------------------------


def _check_float_image(img: torch.Tensor, what: str, rgb: bool = False) -> int:
    if not img.is_floating_point():
        raise ValueError(f"{what}: expected a float image in [0, 1], got dtype {img.dtype}")
    if img.dim() < 3:
        raise ValueError(f"{what}: expected [..., c, h, w], got shape {list(img.shape)}")
    c = img.shape[-3]
    if c not in (1, 3) or (rgb and c != 3):
        raise ValueError(f"{what}: expected {'3' if rgb else '1 or 3'} channels at dim -3, got shape {list(img.shape)}")
    return c


def _blend(img: torch.Tensor, other: torch.Tensor, ratio: float) -> torch.Tensor:
    """ratio * img + (1 - ratio) * other, clamped to [0, 1] (torchvision's `_blend`)."""
    return (ratio * img + (1.0 - ratio) * other).clamp(0.0, 1.0)


def rgb_to_grayscale(img: torch.Tensor) -> torch.Tensor:
    """[..., 3, h, w] -> [..., 1, h, w] with torchvision's luma weights."""
    r, g, b = img.unbind(dim=-3)
    return (GRAY_WEIGHTS[0] * r + GRAY_WEIGHTS[1] * g + GRAY_WEIGHTS[2] * b).unsqueeze(-3)


def adjust_brightness(img: torch.Tensor, factor: float) -> torch.Tensor:
    """Blend with black: 0 gives black, 1 the image, 2 twice as bright (clamped)."""
    _check_float_image(img, "adjust_brightness")
    if factor < 0:
        raise ValueError(f"brightness factor must be non-negative, got {factor}")
    return _blend(img, torch.zeros_like(img), factor)


def adjust_contrast(img: torch.Tensor, factor: float) -> torch.Tensor:
    """Blend with the mean gray level of the image: 0 gives flat gray, 1 the image."""
    c = _check_float_image(img, "adjust_contrast")
    if factor < 0:
        raise ValueError(f"contrast factor must be non-negative, got {factor}")
    gray = rgb_to_grayscale(img) if c == 3 else img
    return _blend(img, gray.mean(dim=(-3, -2, -1), keepdim=True), factor)


def adjust_saturation(img: torch.Tensor, factor: float) -> torch.Tensor:
    """Blend with the grayscale image: 0 gives gray, 1 the image, 2 twice as saturated."""
    c = _check_float_image(img, "adjust_saturation")
    if factor < 0:
        raise ValueError(f"saturation factor must be non-negative, got {factor}")
    if c == 1:
        return img
    return _blend(img, rgb_to_grayscale(img), factor)


def adjust_sharpness(img: torch.Tensor, factor: float) -> torch.Tensor:
    """Blend with PIL's SMOOTH-filtered image (3x3 kernel [[1,1,1],[1,5,1],[1,1,1]] / 13, the one-
    pixel border left as it is): 0 gives the blurred image, 1 the image, 2 a sharpened one."""
    _check_float_image(img, "adjust_sharpness")
    if factor < 0:
        raise ValueError(f"sharpness factor must be non-negative, got {factor}")
    if img.shape[-1] <= 2 or img.shape[-2] <= 2:
        return img
    c, h, w = img.shape[-3:]
    kernel = torch.ones((3, 3), dtype=img.dtype, device=img.device)
    kernel[1, 1] = 5.0
    kernel = (kernel / kernel.sum()).expand(c, 1, 3, 3)
    flat = img.reshape(-1, c, h, w)
    blurred = flat.clone()
    blurred[..., 1:-1, 1:-1] = F.conv2d(flat, kernel, groups=c)
    return _blend(img, blurred.reshape(img.shape), factor)


def _rgb_to_hsv(img: torch.Tensor) -> torch.Tensor:
    r, g, b = img.unbind(dim=-3)
    maxc, minc = img.amax(dim=-3), img.amin(dim=-3)
    eqc = maxc == minc
    cr = maxc - minc
    ones = torch.ones_like(maxc)
    s = cr / torch.where(eqc, ones, maxc)
    divisor = torch.where(eqc, ones, cr)
    rc, gc, bc = (maxc - r) / divisor, (maxc - g) / divisor, (maxc - b) / divisor
    hr = (maxc == r) * (bc - gc)
    hg = ((maxc == g) & (maxc != r)) * (2.0 + rc - bc)
    hb = ((maxc != g) & (maxc != r)) * (4.0 + gc - rc)
    h = torch.fmod((hr + hg + hb) / 6.0 + 1.0, 1.0)
    return torch.stack((h, s, maxc), dim=-3)


def _hsv_to_rgb(img: torch.Tensor) -> torch.Tensor:
    h, s, v = img.unbind(dim=-3)
    i = torch.floor(h * 6.0)
    f = h * 6.0 - i
    i = i.to(torch.int64) % 6
    p = (v * (1.0 - s)).clamp(0.0, 1.0)
    q = (v * (1.0 - s * f)).clamp(0.0, 1.0)
    t = (v * (1.0 - s * (1.0 - f))).clamp(0.0, 1.0)
    # per hue sector 0..5: (r, g, b) picked from (v, q, p, t)
    r = torch.stack((v, q, p, p, t, v), dim=-1)
    g = torch.stack((t, v, v, q, p, p), dim=-1)
    b = torch.stack((p, p, t, v, v, q), dim=-1)
    index = i.unsqueeze(-1)
    return torch.stack([x.gather(-1, index).squeeze(-1) for x in (r, g, b)], dim=-3)


def adjust_hue(img: torch.Tensor, factor: float) -> torch.Tensor:
    """Rotate the hue by `factor` (in [-0.5, 0.5], a fraction of the colour wheel) in HSV space."""
    c = _check_float_image(img, "adjust_hue")
    if not -0.5 <= factor <= 0.5:
        raise ValueError(f"hue factor must be in [-0.5, 0.5], got {factor}")
    if c == 1 or factor == 0:
        return img
    hsv = _rgb_to_hsv(img)
    h, s, v = hsv.unbind(dim=-3)
    return _hsv_to_rgb(torch.stack(((h + factor) % 1.0, s, v), dim=-3)).to(img.dtype)


# ---- geometry (openpi's pi0.5 training augmentation) ---------------------------------------------


def crop_resize(img: torch.Tensor, top: int, left: int, height: int, width: int) -> torch.Tensor:
    """Crop [..., c, h, w] to rows top..top+height and columns left..left+width, then resize back
    to (h, w) (bilinear, `align_corners=False`)."""
    _check_float_image(img, "crop_resize")
    c, h, w = img.shape[-3:]
    if not (0 <= top and top + height <= h and 0 <= left and left + width <= w and height > 0 and width > 0):
        raise ValueError(f"crop_resize: crop {height}x{width} at ({top}, {left}) does not fit in {h}x{w}")
    if (height, width) == (h, w):
        return img
    crop = img[..., top : top + height, left : left + width].reshape(-1, c, height, width)
    return F.interpolate(crop, size=(h, w), mode="bilinear", align_corners=False).reshape(img.shape)


def rotate(img: torch.Tensor, degrees: float) -> torch.Tensor:
    """Rotate [..., c, h, w] counter-clockwise by `degrees` about the image centre, in pixel space
    (a square stays square for any h, w); bilinear, zeros where the source falls outside."""
    _check_float_image(img, "rotate")
    if degrees == 0:
        return img
    c, h, w = img.shape[-3:]
    a = math.radians(degrees)
    cos, sin = math.cos(a), math.sin(a)
    # output -> input coordinates, normalized to [-1, 1] per axis (h and w differ in pixels)
    theta = torch.tensor([[cos, -sin * h / w, 0.0], [sin * w / h, cos, 0.0]], dtype=img.dtype, device=img.device)
    flat = img.reshape(-1, c, h, w)
    grid = F.affine_grid(theta.expand(flat.shape[0], 2, 3), list(flat.shape), align_corners=False)
    return F.grid_sample(flat, grid, mode="bilinear", padding_mode="zeros", align_corners=False).reshape(img.shape)


# ---- configured random augmentation -------------------------------------------------------------


@dataclass
class ImageAugment:
    """What `ImageAugmenter` does to each camera image (float, [0, 1], [..., c, h, w]).

    Colour: a factor range per transform (None leaves it out), LeRobot's defaults; at most
    `max_num_transforms` of the enabled ones are applied to an image, chosen at random, in the
    order listed (in random order with `random_order`). Geometry (openpi pi0.5): a random crop
    of `crop_scale` of each side resized back, and a rotation by an angle uniform in
    +-`rotate_degrees` (None leaves either out), for each camera whose name contains none of
    `no_geometry`. `cameras`: the keys to augment (None: every key given)."""

    brightness: tuple[float, float] | None = (0.8, 1.2)
    contrast: tuple[float, float] | None = (0.8, 1.2)
    saturation: tuple[float, float] | None = (0.5, 1.5)
    hue: tuple[float, float] | None = (-0.05, 0.05)
    sharpness: tuple[float, float] | None = (0.5, 1.5)
    max_num_transforms: int = 3
    random_order: bool = False
    crop_scale: float | None = 0.95
    rotate_degrees: float | None = 5.0
    no_geometry: tuple[str, ...] = ("wrist",)
    cameras: tuple[str, ...] | None = None

    def __post_init__(self):
        for name in COLOR_TRANSFORMS:
            value = getattr(self, name)
            if value is None:
                continue
            try:
                lo, hi = (float(v) for v in value)
            except (TypeError, ValueError):
                raise UserError(f"image augment: {name} must be a [low, high] factor range or null, got {value!r}") from None
            if not (math.isfinite(lo) and math.isfinite(hi) and lo <= hi):
                raise UserError(f"image augment: {name} range {[lo, hi]} must be finite with low <= high")
            if name == "hue" and not (-0.5 <= lo and hi <= 0.5):
                raise UserError(f"image augment: hue range {[lo, hi]} must lie within [-0.5, 0.5]")
            if name != "hue" and lo < 0:
                raise UserError(f"image augment: {name} range {[lo, hi]} must not be negative")
            setattr(self, name, (lo, hi))
        if isinstance(self.max_num_transforms, bool) or not isinstance(self.max_num_transforms, int) or self.max_num_transforms < 0:
            raise UserError(f"image augment: max_num_transforms must be an integer >= 0, got {self.max_num_transforms!r}")
        if self.crop_scale is not None and not (isinstance(self.crop_scale, (int, float)) and 0 < self.crop_scale <= 1):
            raise UserError(f"image augment: crop_scale must be in (0, 1] or null, got {self.crop_scale!r}")
        if self.rotate_degrees is not None and not (
            isinstance(self.rotate_degrees, (int, float)) and math.isfinite(self.rotate_degrees) and 0 <= self.rotate_degrees <= 180
        ):
            raise UserError(f"image augment: rotate_degrees must be in [0, 180] or null, got {self.rotate_degrees!r}")
        self.no_geometry = (self.no_geometry,) if isinstance(self.no_geometry, str) else tuple(self.no_geometry)
        if self.cameras is not None:
            self.cameras = (self.cameras,) if isinstance(self.cameras, str) else tuple(self.cameras)

    @property
    def color_transforms(self) -> list[str]:
        return [name for name in COLOR_TRANSFORMS if getattr(self, name) is not None]

    def geometric(self, camera: str) -> bool:
        """Whether `camera` gets the crop and rotation."""
        return not any(part in camera for part in self.no_geometry)


_ADJUST = {
    "brightness": adjust_brightness,
    "contrast": adjust_contrast,
    "saturation": adjust_saturation,
    "hue": adjust_hue,
    "sharpness": adjust_sharpness,
}


def _uniform(lo: float, hi: float, generator: torch.Generator) -> float:
    return lo + (hi - lo) * float(torch.rand((), generator=generator))


class ImageAugmenter:
    """Applies an `ImageAugment` with parameters drawn from the generator each call is given."""

    def __init__(self, config: ImageAugment | None = None):
        self.config = ImageAugment() if config is None else config

    def __call__(self, images: Mapping[str, torch.Tensor], generator: torch.Generator) -> dict[str, torch.Tensor]:
        """A copy of `images` ({camera: [..., c, h, w] float in [0, 1]}) with the configured
        cameras augmented (a configured camera missing from `images` is a UserError)."""
        cameras = self.config.cameras
        if cameras is not None:
            missing = [c for c in cameras if c not in images]
            if missing:
                raise UserError(f"image augment: cameras {missing} are not among the images ({', '.join(images)})")
        out = dict(images)
        for key in images if cameras is None else cameras:
            out[key] = self.augment_image(images[key], key, generator)
        return out

    def augment_image(self, image: torch.Tensor, camera: str, generator: torch.Generator) -> torch.Tensor:
        """One camera's image: crop-resize and rotation (unless `camera` is excluded), then the
        chosen colour transforms."""
        cfg = self.config
        _check_float_image(image, f"image augment ({camera})")
        if cfg.geometric(camera):
            if cfg.crop_scale is not None:
                h, w = image.shape[-2:]
                ch, cw = int(h * cfg.crop_scale), int(w * cfg.crop_scale)
                if ch > 0 and cw > 0:
                    top = int(torch.randint(0, h - ch + 1, (), generator=generator))
                    left = int(torch.randint(0, w - cw + 1, (), generator=generator))
                    image = crop_resize(image, top, left, ch, cw)
            if cfg.rotate_degrees is not None:
                image = rotate(image, _uniform(-cfg.rotate_degrees, cfg.rotate_degrees, generator))
        names = cfg.color_transforms
        k = min(cfg.max_num_transforms, len(names))
        if k == 0:
            return image
        picked = torch.randperm(len(names), generator=generator)[:k].tolist()
        if not cfg.random_order:
            picked.sort()
        for i in picked:
            lo, hi = getattr(cfg, names[i])
            image = _ADJUST[names[i]](image, _uniform(lo, hi, generator))
        return image

    def __repr__(self) -> str:
        return f"ImageAugmenter({', '.join(f'{f.name}={getattr(self.config, f.name)!r}' for f in fields(self.config))})"
