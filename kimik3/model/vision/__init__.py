"""Native vision: the MoonViT-V2 tower, its projector, the image-token rule and the multimodal K3.

``num_image_tokens(height, width)``: LM tokens of one image (3584 x 3584 -> 16,384; the resize/pad rule is
in ``tokens.py``). ``K3VLForCausalLM``: the text model with images in its prompt. Configs: ``VisionConfig``,
presets ``k3-vl`` / ``debug-vl`` / ``tiny-vl`` (``kimik3/config/presets.py``). ``contrastive.py``: CLIP-style
pre-training of the tower and its file (``save_tower`` / ``load_tower``, what ``--vision-init`` reads).
"""

from kimik3.model.vision.config import VisionConfig, vision_param_counts
from kimik3.model.vision.contrastive import ContrastiveTower, contrastive_loss, load_tower, save_tower
from kimik3.model.vision.encoder import MoonViT
from kimik3.model.vision.merge import pixel_shuffle, pixel_unshuffle
from kimik3.model.vision.model import K3VLForCausalLM, causal_lm_class, image_token_id
from kimik3.model.vision.projector import VisionProjector
from kimik3.model.vision.tokens import fit_size, image_grid, num_image_tokens, pack_images, preprocess_image

__all__ = [
    "ContrastiveTower", "K3VLForCausalLM", "MoonViT", "VisionConfig", "VisionProjector", "causal_lm_class",
    "contrastive_loss", "fit_size", "image_grid", "image_token_id", "load_tower", "num_image_tokens", "pack_images",
    "pixel_shuffle", "pixel_unshuffle", "preprocess_image", "save_tower", "vision_param_counts",
]
